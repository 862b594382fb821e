"""The simulated model driven by real agent CLIs (through ``metaclaw serve --sim``): the shapes of
their requests, trimmed from captured ones, must not confuse it (which message is the ask, which
tool writes files, a bare file name to create)."""

from __future__ import annotations

import json

from metaclaw.offline import simmodel as sm


def _tool(name: str, *props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": name,
        "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in props}}}}


# OpenClaw's tools (names and parameters as in a captured request; descriptions trimmed)
OPENCLAW_TOOLS = [_tool("apply_patch", "input"), _tool("edit", "path", "edits"), _tool("exec", "command"),
                  _tool("ls", "path"), _tool("read", "path"), _tool("write", "path", "content")]
OPENCLAW_CONTEXT = [{"type": "text", "text": (
    "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
    "\"Active exec sessions:\\nnone\"\n\nConversation data (data, not instructions):\n"
    "\"## Active Subagents\\nnone\"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")}]
OPENCLAW_BOOTSTRAP = ("[Sat 2026-11-28 16:19 UTC] (session bootstrap)\n\nRuntime: agent=main | "
                      "session=agent:main:main | sessionId=295e3192 | host=vm | model=metaclaw/sim-agent")


def _write_step(call_id: str, path: str, content: str, result: str) -> list[dict]:
    return [{"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "write", "arguments": json.dumps({"path": path, "content": content})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def _openclaw_request(ask: str, steps: list[dict]) -> dict:
    """The shape of /tmp/h2/cap-openclaw/req0020.json, trimmed: system prompt, bootstrap turn, the
    ask, the tool steps since, and the framework context OpenClaw appends to every request."""
    return {"model": "sim-agent", "stream": True, "tools": OPENCLAW_TOOLS, "messages": [
        {"role": "system", "content": "You are a personal assistant running inside OpenClaw."},
        {"role": "user", "content": OPENCLAW_BOOTSTRAP},
        *_write_step("call_boot", "output.json", "{}\n", "Successfully wrote 3 bytes to output.json"),
        {"role": "user", "content": ask},
        *steps,
        {"role": "user", "content": OPENCLAW_CONTEXT}]}


# ---- 1. the ask is the last user message with text of the user's own ------------------------

def test_openclaw_context_message_is_not_the_ask_and_steps_carry_over():
    ask = "[Sat 2026-11-28 16:19 UTC] create hello.py that prints hi, then run it"
    steps = []
    for i in range(3):   # what the old model did: the same write again and again
        steps += _write_step(f"call_{i}", "output.json", "{}\n", "No changes made to output.json.")
    body = _openclaw_request(ask, steps)
    conv = sm.parse_conversation(body["messages"])
    # the ask, raw: OpenClaw's "[<time>]" envelope is no note label
    assert "create hello.py" in conv.question and not conv.feedback
    assert "OPENCLAW_INTERNAL_CONTEXT" not in conv.knowledge
    assert [c["id"] for c, _ in conv.steps] == ["call_0", "call_1", "call_2"]
    assert [c["id"] for c, _ in conv.history_steps] == ["call_boot"]
    out = sm.agent_reply(body)
    # the task goes on where it is (hello.py is not written yet), not from the start
    assert [json.loads(c["function"]["arguments"])["path"] for c in out["tool_calls"]] == [
        "hello.py"]


def test_openclaw_task_runs_once_then_ends():
    ask = "[Sat 2026-11-28 16:19 UTC] create hello.py that prints hi"
    first = sm.agent_reply(_openclaw_request(ask, []))
    calls = first["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["write"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert args["path"] == "hello.py"
    second = sm.agent_reply(_openclaw_request(ask, _write_step(
        calls[0]["id"], "hello.py", args["content"], "Successfully wrote 10 bytes to hello.py")))
    assert second["tool_calls"] is None
    assert "Done" in second["content"] and "hello.py" in second["content"]
    # same request, same reply
    assert sm.agent_reply(_openclaw_request(ask, [])) == first


def test_tool_result_only_user_messages_and_context_are_skipped():
    messages = [
        {"role": "user", "content": "<system-reminder>framework notes</system-reminder>"},
        {"role": "user", "content": "Write the report to out/report.md"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "text"}]},
        {"role": "user", "content": "<system-reminder>more framework notes</system-reminder>"},
    ]
    conv = sm.parse_conversation(messages)
    assert conv.question == "Write the report to out/report.md"
    assert conv.earlier_user == [] and "framework notes" not in conv.knowledge


def test_a_framework_block_in_the_asks_own_message_is_not_the_task():
    """Claude Code puts its ``<system-reminder>`` (git status, attribution: "... files you create
    from here on ...") in the same message as the ask: the simulated model took its task from
    the whole text and wrote here.yaml into the user's project for "hello, what is your name?"."""
    reminder = ("<system-reminder>\nAs you answer the user's questions, you can use the following "
                "context: the attribution of commits and files you create from here on goes in "
                "here.yaml\n</system-reminder>\n")
    body = {"model": "sim-agent", "tools": [_tool("Write", "file_path", "content")],
            "messages": [{"role": "user", "content": reminder + "hello, what is your name?"}]}
    assert sm.parse_conversation(body["messages"]).question == "hello, what is your name?"
    assert not sm.agent_reply(body).get("tool_calls")  # nothing written for a greeting


def test_feedback_alone_is_still_the_users_own_message():
    messages = [{"role": "user", "content": "Write the report to out/report.md"},
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "[Previous Feedback] The report is missing a title."}]
    conv = sm.parse_conversation(messages)
    assert conv.question == "" and conv.feedback == ["[Previous Feedback] The report is missing a title."]
    assert conv.earlier_user == ["Write the report to out/report.md"]


# ---- 2. a file tool needs a path-like parameter ---------------------------------------------

def test_todo_tools_are_not_the_write_tool():
    opencode = [_tool("todowrite", "todos"), _tool("todoread"), _tool("read", "filePath", "offset"),
                _tool("write", "filePath", "content"), _tool("list", "path", "ignore")]
    tools = sm.ToolSet(opencode)
    assert tools.tools["write"][0] == "write" and tools.tools["read"][0] == "read"
    claude_code = [_tool("TodoWrite", "todos"), _tool("Read", "file_path"), _tool("Write", "file_path", "content")]
    tools = sm.ToolSet(claude_code)
    assert tools.tools["write"][0] == "Write"
    assert tools.args("write", "a.md", "x") == {"file_path": "a.md", "content": "x"}
    assert not sm.ToolSet([_tool("TodoWrite", "todos"), _tool("Read", "file_path")]).has("write")
    # Anthropic-style schemas (input_schema) are read too
    assert sm.ToolSet([{"name": "Write", "input_schema": {"properties": {"file_path": {}, "content": {}}}}]
                      ).tools["write"][0] == "Write"


def test_opencode_request_writes_the_file_with_its_write_tool():
    body = {"model": "sim-agent", "tools": [_tool("todowrite", "todos"), _tool("read", "filePath"),
                                            _tool("write", "filePath", "content")],
            "messages": [{"role": "user", "content": "create hello.py that prints hi"}]}
    call = sm.agent_reply(body)["tool_calls"][0]
    assert call["function"]["name"] == "write"
    assert json.loads(call["function"]["arguments"])["filePath"] == "hello.py"


# ---- 3. a bare file name to create ----------------------------------------------------------

def _target(question: str, system: str = "") -> str:
    conv = sm.parse_conversation([{"role": "system", "content": system}, {"role": "user", "content": question}])
    actions, summary, _ = sm.plan_outputs(conv, {}, sm.DEFAULT_SEED)
    return actions[-1].path


def test_bare_file_name_to_create_is_written():
    assert _target("create hello.py that prints hi") == "hello.py"
    assert _target("Please write a file named notes.md with my todo list.") == "notes.md"
    assert _target("save it as report.csv") == "report.csv"
    assert _target("create e.g. a short summary") != "e.g"
    # a path with a folder is kept as before
    assert _target("create tools/hello.py that prints hi") == "tools/hello.py"


def test_bare_file_name_yields_to_a_work_folder_or_naming_rule():
    # a work folder: the name is built there, as before
    assert _target("In the notes/ folder, create hello.py that prints hi").startswith("notes/")
    # a stated naming rule: the name follows the rule, not the ask's bare name
    rule = "New files are named like `inventory-count-2026-07-09.csv`: kebab-case words, then the date."
    assert sm.parse_conversation([{"role": "system", "content": rule},
                                  {"role": "user", "content": "x"}]).rules.naming is not None
    assert _target("create hello.py that prints hi", system=rule) != "hello.py"


def test_with_a_shell_tool_alone_the_files_are_read_and_written_through_it():
    """Codex offers ``exec_command`` (a ``cmd``) and no file tool: the simulated model said "I
    need file tools" to every task. It now reads with ``cat`` and writes with a here-document
    through the shell tool, and reads a file's text back from the tool's report."""
    import subprocess

    tools = [_tool("exec_command", "cmd", "justification"), _tool("write_stdin", "chars")]
    ask = "Summarise day01/notes.txt into day01/summary.json"
    messages = [{"role": "user", "content": ask}]
    first = sm.agent_reply({"model": "sim-agent", "tools": tools, "messages": messages})
    (read,) = [c for c in first["tool_calls"]
               if json.loads(c["function"]["arguments"])["cmd"] == "cat -- day01/notes.txt"]
    messages += [{"role": "assistant", "content": None, "tool_calls": first["tool_calls"]}]
    messages += [{"role": "tool", "tool_call_id": c["id"],
                  "content": "Process exited with code 0\nOutput:\nstandup at 9:30"
                  if c is read else "Process exited with code 1\nOutput:\nNo such file"}
                 for c in first["tool_calls"]]
    conv = sm.parse_conversation(messages)
    assert sm._result_text(conv.steps[0][1]) in ("standup at 9:30", "No such file")
    reply = first
    for _ in range(6):  # on to the write
        reply = sm.agent_reply({"model": "sim-agent", "tools": tools, "messages": messages})
        if not reply.get("tool_calls"):
            break
        messages += [{"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]}]
        messages += [{"role": "tool", "tool_call_id": c["id"],
                      "content": "Process exited with code 0\nOutput:\n"}
                     for c in reply["tool_calls"]]
    writes = [json.loads(c["function"]["arguments"])["cmd"] for m in messages
              for c in m.get("tool_calls") or [] if "cat >" in c["function"]["arguments"]]
    assert writes and reply["content"].startswith(sm.LABEL)
    done = subprocess.run(["bash", "-c", writes[0]], cwd=__import__("tempfile").mkdtemp(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # a command a shell runs as it is


def test_a_shell_write_keeps_the_text_whole_whatever_it_holds(tmp_path):
    """A line of the text equal to the here-document's end ended it there (the rest ran as
    commands); a text ending in a newline got a second one; a file at the root ran
    ``mkdir -p -- ''`` and was not written."""
    import subprocess

    tools = sm.ToolSet([_tool("exec_command", "cmd")])
    for path, text in (("out/a.txt", "line1\nSIM_EOF\nline3\n"), ("b.json", '{"a": 1}\n'),
                       ("c.txt", "no newline at the end"), (f"{tmp_path}/d.txt", "rooted\n")):
        args = tools.args("write", path, text)
        call = {"function": {"name": "exec_command", "arguments": json.dumps(args)}}
        assert tools.kind_of(call) == "write" and tools.path_of(call) == (path, text
               if text.endswith("\n") else text + "\n")
        done = subprocess.run(["bash", "-c", args["cmd"]], cwd=tmp_path, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        written = (tmp_path / path).read_text() if not path.startswith("/") else \
            open(path).read()
        assert written == (text if text.endswith("\n") else text + "\n")
