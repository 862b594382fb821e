"""Finding the user's real ask in the shapes agent frameworks send (captured requests of the real
OpenClaw CLI, Claude-Code-style context blocks, plain SDK calls), and fuzzing the extractor."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaclaw.skills import asks
from metaclaw.skills.asks import Rule, extract_ask
from metaclaw.skills.block import inject

FIXTURES = Path(__file__).parent / "fixtures" / "requests"


def captured(client: str, name: str) -> dict:
    return json.loads((FIXTURES / client / f"{name}.json").read_text())


@pytest.mark.parametrize("name, ask", [
    ("001", "Rename notes.txt to notes-2026.txt in my workspace"),   # first turn of a session
    ("002", "Thanks. Did it work?"),                                 # second turn
    ("003", "What is in notes.txt?"),
    ("004", "What is in notes.txt?"),        # after the read tool's result: the ask is behind it
    ("005", "Rename notes.txt to notes-2026.txt in my workspace"),   # a new session
    ("006", "And now list my workspace files."),
])
def test_openclaw_requests_yield_the_users_ask(name, ask):
    """Real OpenClaw requests: the ask wears a timestamp envelope, the session's first message
    carries a runtime line, and every request ends with an internal-context user message."""
    body = captured("openclaw", name)["body"]
    assert body["messages"][-1]["role"] == "user"  # the last user message is not the ask
    found = extract_ask(body["messages"])
    assert found.ask == ask and found.text == ask
    assert "envelope" in found.rules


def test_claude_code_style_context_blocks_and_slash_commands():
    reminder = "<system-reminder>\nAs you answer, use this context: CLAUDE.md says ...\n</system-reminder>"
    messages = [{"role": "user", "content": [
        {"type": "text", "text": reminder},
        {"type": "text", "text": "Fix the flaky test in tests/test_api.py"},
        {"type": "text", "text": "<system-reminder>todo list is empty</system-reminder>"}]}]
    assert extract_ask(messages).ask == "Fix the flaky test in tests/test_api.py"
    # the tool loop: assistant tool_use, then a user message made only of tool results
    messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                                    "input": {"path": "tests/test_api.py"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                               "content": "def test_x(): ..."}]},
                 {"role": "user", "content": reminder}]
    found = extract_ask(messages)
    assert found.ask == "Fix the flaky test in tests/test_api.py" and found.message_index == 0
    slash = [{"role": "user", "content": "<command-name>/review</command-name>"
                                         "<command-message>review</command-message>"
                                         "<command-args>the retry logic in client.py</command-args>"}]
    assert extract_ask(slash).ask == "the retry logic in client.py"


def test_plain_sdk_shapes_parts_tool_results_and_developer_role():
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "keep a copy"},
                                             {"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "of config.yaml"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "cp", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "1", "content": "copied"}]
    found = extract_ask(messages)
    assert found.ask == "keep a copy of config.yaml" and found.message_index == 1
    injected = inject(messages, "## Skills")
    assert injected[0] == {"role": "developer", "content": "Be terse.\n\n## Skills"}
    assert len(injected) == len(messages)  # no second system message next to the developer one


def test_channel_envelopes_metadata_and_feedback_prefixes():
    message = ("Conversation info (untrusted metadata):\n```json\n{\"chat_id\": 42}\n```\n\n"
               "[Telegram Ann (@ann) id:42 +2m Mon 2026-03-16 09:30 GMT+8] book the room for 3pm")
    assert extract_ask([{"role": "user", "content": message}]).ask == "book the room for 3pm"
    fed = extract_ask([{"role": "user", "content": "[Previous Feedback] incorrect: dates need an "
                                                   "offset.\n\nWrite the standup notes to notes.md"}])
    assert fed.ask == "Write the standup notes to notes.md"
    assert fed.feedback == "incorrect: dates need an offset." and "feedback" in fed.rules
    # feedback on its own (after a task's last round): the ask is the one before it
    alone = extract_ask([{"role": "user", "content": "Export the report as CSV"},
                         {"role": "assistant", "content": "done"},
                         {"role": "user", "content": "[Previous Feedback] correct"}])
    assert alone.ask == "Export the report as CSV" and alone.feedback == "correct"


def test_a_short_follow_up_carries_the_previous_ask_as_context():
    found = extract_ask([{"role": "user", "content": "Deploy the staging branch"},
                         {"role": "assistant", "content": "Shall I run the migrations first?"},
                         {"role": "user", "content": "yes"}])
    assert found.ask == "yes" and found.context == "Deploy the staging branch"
    assert found.text == "Deploy the staging branch\nyes"


def test_a_new_framework_is_one_rule(monkeypatch):
    wrapped = [{"role": "user", "content": "@@ctx: repo=x @@\nsummarise the open pull requests"}]
    assert extract_ask(wrapped).ask.startswith("@@ctx")
    monkeypatch.setattr(asks, "RULES", [*asks.RULES, Rule(
        "at-context", lambda text: text.split("@@\n", 1)[-1])])
    found = extract_ask(wrapped)
    assert found.ask == "summarise the open pull requests" and found.rules == ["at-context"]


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=40),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer",
                                                           "assistant", "tool", "x"]),
                                  "content": _json | st.text(max_size=300)})


@settings(max_examples=300, deadline=None)
@given(st.lists(_message | _json, max_size=8))
def test_the_extractor_never_fails_on_any_message_list(messages):
    found = extract_ask(messages)
    assert isinstance(found.text, str) and len(found.text) <= asks.MAX_QUERY_CHARS
    assert found.message_index is None or messages[found.message_index]["role"] == "user"


@pytest.mark.parametrize("client, name, ask", [
    ("claude-code", "002", "Rename notes.txt to notes-2026.txt in my workspace"),
    ("claude-code", "004", "Thanks. Did it work?"),
    ("claude-code", "007", "What is in notes.txt?"),        # behind the Read tool's result
    ("claude-code-tui", "009", "And now list my workspace files."),   # after /compact
    ("openclaw-anthropic", "001", "Rename notes.txt to notes-2026.txt in my workspace"),
    ("openclaw-anthropic", "004", "What is in notes.txt?"),
    ("openai-python", "005", None),
    ("anthropic-python", "004", None),
])
def test_captured_requests_of_other_clients_yield_the_ask(client, name, ask):
    """Claude Code (Anthropic Messages, system-reminder parts, system messages inside
    `messages`, local-command blocks after /compact), OpenClaw over Anthropic Messages, and
    plain SDK calls, as the real clients sent them."""
    body = captured(client, name)["body"]
    found = extract_ask(body["messages"])
    if ask is None:  # plain SDK calls: exactly what the caller wrote, the last user text
        ask = next(asks.content_text(m["content"]) for m in reversed(body["messages"])
                   if m["role"] == "user" and isinstance(m["content"], str))
    assert found.ask == ask


def test_a_short_follow_up_skips_other_short_ones_for_its_context():
    found = extract_ask([{"role": "user", "content": "Deploy the staging branch"},
                         {"role": "assistant", "content": "Migrations first?"},
                         {"role": "user", "content": "continue"},
                         {"role": "assistant", "content": "Done."},
                         {"role": "user", "content": "ok"}])
    assert found.ask == "ok" and found.text == "Deploy the staging branch\nok"


def test_ten_thousand_short_turns_need_no_recursion_and_one_pass():
    """A long chat of "ok" / "continue" turns: no recursion limit, each message read once."""
    import sys

    from metaclaw.skills import asks

    messages = [{"role": "user", "content": "Rotate the API keys of the billing service"}]
    for i in range(5_000):
        messages += [{"role": "assistant", "content": "Done."},
                     {"role": "user", "content": "ok" if i % 2 else "continue"}]
    assert len(messages) > 10_000 > sys.getrecursionlimit()
    read = []
    original = asks.clean
    try:
        asks.clean = lambda text: (read.append(text), original(text))[1]
        found = extract_ask(messages)
    finally:
        asks.clean = original
    assert found.ask == "ok" and found.text.startswith("Rotate the API keys")
    assert len(read) <= 5_001  # every user message at most once


def test_aiders_edit_format_reminder_is_not_part_of_the_ask():
    """aider appends its edit format's rules to the user's message for some models: they were
    the bulk of the retrieval query."""
    for reminder in ("To suggest changes to a file you MUST return the entire content of the "
                     "updated file.\nYou MUST use this *file listing* format:\n```\n...\n```",
                     "# *SEARCH/REPLACE block* Rules:\n\nEvery *SEARCH/REPLACE block* must use "
                     "this format:\n1. The *FULL* file path"):
        found = extract_ask([{"role": "user", "content": f"Add a --verbose flag to cli.py\n\n"
                                                         f"{reminder}"}])
        assert found.ask == "Add a --verbose flag to cli.py" and "aider-reminder" in found.rules
    kept = "Explain what 'To suggest changes to a file you MUST' means in aider's prompt"
    assert extract_ask([{"role": "user", "content": kept}]).ask == kept  # not at a line start


@pytest.mark.parametrize("name", ["001", "002", "003"])
def test_aiders_own_messages_and_prompt_examples_are_never_the_ask_or_its_context(name):
    """aider sends the files it put in the chat (their contents), its repository map or "I am
    not sharing any files" as user messages, and its prompt's worked examples as user messages
    before "I switched to a new code base". A short ask ("add type hints") took the file
    contents, or an example ("Change the greeting to be more casual"), as its context: three
    skills were injected on that text."""
    messages = captured("aider", name)["body"]["messages"]
    ask = next(i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user")
    messages[ask] = {"role": "user", "content": "add type hints"}
    found = extract_ask(messages)
    earlier = "Add a --verbose flag to cli.py" if name == "003" else ""  # the user's own, kept
    assert found.ask == "add type hints" and found.context == earlier
    assert "Change the greeting" not in found.text and "added these files" not in found.text
    for own in ("I am not sharing any files that you can edit yet.",
                "Here are summaries of some files present in my git repository.\nDo not propose "
                "changes to these files, treat them as *read-only*.\nsrc/app.py:\n  def main()"):
        alone = [{"role": "user", "content": own}, {"role": "assistant", "content": "Ok."},
                 {"role": "user", "content": "say hi"}]
        assert extract_ask(alone).text == "say hi"
    text = "Here are some READ ONLY files is what aider says; explain it"  # not its message
    assert extract_ask([{"role": "user", "content": text}]).ask == text


def test_only_short_asks_before_it_take_the_nearest_as_context():
    found = extract_ask([{"role": "user", "content": "ok"},
                         {"role": "assistant", "content": "Sure."},
                         {"role": "user", "content": "yes please"},
                         {"role": "assistant", "content": "Done."},
                         {"role": "user", "content": "go"}])
    assert found.context == "yes please" and found.text == "yes please\ngo"


@pytest.mark.parametrize("name", ["001", "002"])
def test_codexs_context_messages_are_not_a_short_asks_context(name):
    """Codex sends its environment (``<environment_context>``) and the repository's AGENTS.md
    (``# AGENTS.md instructions for ...`` + ``<INSTRUCTIONS>``) as user messages before the
    ask: a short ask ("list files") must not take them as its task context."""
    from metaclaw.protocols.registry import get_protocol

    messages = get_protocol("responses").to_chat(captured("codex", name)["body"])["messages"]
    messages[-1] = {"role": "user", "content": "list files"}
    found = extract_ask(messages)
    assert found.text == found.ask == "list files" and not found.context
    # a user's own text that merely mentions the words keeps them
    text = "Update AGENTS.md: add <environment> notes for the build"
    assert extract_ask([{"role": "user", "content": text}]).ask == text


CODEX_HANDOFF = ("Another language model started to solve this problem and produced a summary of "
                 "its thinking process. You also have access to the state of the tools that were "
                 "used by that language model. Use this to build on the work that has already "
                 "been done and avoid duplicating work. Here is the summary produced by the "
                 "other language model, use the information in this summary to assist with your "
                 "own analysis:\n")
OPENCODE_CONTINUE = ("Continue if you have next steps, or stop and ask for clarification if you "
                     "are unsure how to proceed.")


def test_after_a_compaction_the_ask_is_the_users_not_the_frameworks_handoff():
    """The ask became Codex's handoff text or opencode's "Continue if you have next steps", so
    no skill was injected for the rest of a compacted conversation."""
    ask = "Write a JSON summary of notes/todo.txt into summary.json"
    codex = [{"role": "user", "content": ask},
             {"role": "user", "content": CODEX_HANDOFF + "I read notes/todo.txt; next: write."}]
    assert extract_ask(codex).ask == ask  # Codex keeps the user's messages
    alone = extract_ask(codex[1:])  # none kept: the summary stands for the ask
    assert alone.ask == "I read notes/todo.txt; next: write." and \
        alone.rules == ["compaction-handoff"]
    opencode = [{"role": "user", "content": "What did we do so far?"},
                {"role": "assistant", "content": "## Objective\n- Turn notes/todo.txt into a "
                 "JSON summary in summary.json.\n\n## Important Details\n- (none)\n\n"
                 "## Work State\n### Completed\n- read the notes"},
                {"role": "user", "content": OPENCODE_CONTINUE}]
    assert extract_ask(opencode).ask == "Turn notes/todo.txt into a JSON summary in summary.json."
    replayed = opencode + [{"role": "user", "content": ask}]  # opencode replays it on overflow
    assert extract_ask(replayed).ask == ask
    claude_code = [{"role": "user", "content": "This session is being continued from a previous "
                    "conversation that ran out of context. The summary below covers the earlier "
                    "portion of the conversation.\n\nSummary:\n1. Primary Request and Intent:\n"
                    "   The user asked for a JSON summary of notes/todo.txt.\n\n2. Key Technical "
                    "Concepts:\n   - JSON"},
                   {"role": "assistant", "content": "Writing it."},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": "ok"}]}]
    assert extract_ask(claude_code).ask == "The user asked for a JSON summary of notes/todo.txt."
    # the user's own question of that wording, with nothing after it, finds no summary
    assert extract_ask([{"role": "user", "content": "What did we do so far?"}]).ask == ""
    # a numbered list inside the objective is part of it, not the next section
    listed = [{"role": "user", "content": "This session is being continued from a previous "
               "conversation that ran out of context.\n\nSummary:\n1. Primary Request and "
               "Intent:\n   The user made two requests:\n   1. Add a --verbose flag to cli.py: "
               "print more\n   2. Fix the tests: they fail\n\n2. Key Technical Concepts:\n   - x"}]
    assert extract_ask(listed).ask == ("The user made two requests: 1. Add a --verbose flag to "
                                       "cli.py: print more 2. Fix the tests: they fail")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "This session is being continued from a previous conversation"
                                 "\nPrimary Request and Intent:x" + "\n" * 1_000_000 + "y"}],
    [{"role": "user", "content": "What did we do so far?"},
     {"role": "assistant", "content": "## Objective\nx" + " \n" * 500_000},
     {"role": "user", "content": OPENCODE_CONTINUE}],
    [{"role": "user", "content": CODEX_HANDOFF + "1. a:\n" * 200_000}],
])
def test_a_megabyte_of_summary_is_read_in_linear_time(messages):
    """The objective's pattern rescanned the whitespace after every line start: a 40,000-line
    summary took 14 s, a megabyte hours, on the proxy's event loop."""
    import time

    started = time.perf_counter()
    extract_ask(messages)
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("client, protocol, ask", [
    ("codex", "responses", "Write a JSON summary of notes/todo.txt into summary.json"),
    ("opencode", "openai", "Write a JSON summary of notes/todo.txt into summary.json."),
    ("claude-code", "anthropic", "Now also count the items in notes/todo.txt"),
])
def test_real_compactions_are_side_calls_and_the_ask_survives_them(client, protocol, ask):
    """Captured from the real CLIs, each compacting once on its own: the summary request is a
    side call, and the next request's ask is the user's (Codex keeps it; opencode keeps only
    its summary, whose objective it is; Claude Code's next prompt follows its summary)."""
    from metaclaw.protocols.registry import get_protocol
    from metaclaw.proxy.sessions import identify

    def chat(name):
        captured_request = captured(client, name)
        body = captured_request["body"]
        return captured_request["headers"], (body if protocol == "openai" else
                                             get_protocol(protocol).to_chat(body))

    headers, compaction = chat("compaction")
    assert identify(headers, compaction).turn_type == "side"
    headers, after = chat("after-compaction")
    assert identify(headers, after).turn_type == "main"
    assert extract_ask(after["messages"]).ask == ask
