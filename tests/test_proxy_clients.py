"""More real clients through the proxy: opencode (npm ``opencode-ai``) with each of its two
OpenAI providers, chat completions (``@ai-sdk/openai-compatible``, what ``metaclaw wire
opencode`` sets) and the Responses API (``@ai-sdk/openai``), and litellm's Responses mode
(``litellm.responses``). The opencode requests captured from the real CLI are checked where it
is not installed; the CLI itself runs where it is (``.ci/run`` installs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from metaclaw import wire
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.skills.block import BLOCK_HEADER
from client_workspace import ASK, BACKUP_CALL, backup_tool, proxy_for, turns_of
from client_workspace import workspace  # noqa: F401  (the fixture)

CAPTURES = Path(__file__).parent / "fixtures" / "requests" / "opencode"
ANSWER = "Back it up first: cp deploy/config.yaml deploy/config.yaml.bak"


@pytest.mark.parametrize("name, protocol", [("001", "openai"), ("002", "responses")])
def test_the_captured_opencode_requests(workspace, name, protocol):
    """opencode 1.18.33's real first request in each mode, sent as captured (headers, body,
    streaming): it names its session in an ``x-session-id`` header, and its ask (``opencode
    run`` quotes an argument with spaces) is the query; the Responses one carries ``store``,
    ``include``, ``prompt_cache_key``, ``reasoning.summary`` and ``text.verbosity``."""
    import httpx

    store, _ = workspace
    captured = json.loads((CAPTURES / f"{name}.json").read_text())
    headers = {k: v for k, v in captured["headers"].items()
               if k.lower() in ("x-session-id", "x-session-affinity", "user-agent")}
    with DoubleServer([Reply(ANSWER)]) as upstream, proxy_for(workspace, upstream) as proxy:
        answer = httpx.post(f"http://127.0.0.1:{proxy.port}{captured['path']}",
                            json=captured["body"], headers=headers, timeout=30)
        (turn,) = turns_of(proxy, store)
    assert answer.status_code == 200 and "Back" in answer.text
    assert turn["protocol"] == protocol and turn["status"] == "ok"
    assert turn["session_id"] == headers["x-session-id"]
    assert turn["identified_by"]["session"] == "header:X-Session-Id"
    assert turn["retrieval_query"] == ASK  # without the quotes opencode put around it
    assert turn["injected_skills"][0] == "backup-before-modify"
    sent = upstream.requests[0]["body"]
    assert sent["messages"][0]["role"] == "system" and "OpenCode" in sent["messages"][0][
        "content"] and BLOCK_HEADER in sent["messages"][0]["content"]
    assert {"bash", "read", "apply_patch"} <= {t["function"]["name"] for t in sent["tools"]}


def _opencode() -> str | None:
    return os.environ.get("METACLAW_OPENCODE") or shutil.which("opencode")


@pytest.mark.skipif(_opencode() is None, reason="opencode is not installed (npm install "
                    "opencode-ai, or set METACLAW_OPENCODE to its binary)")
@pytest.mark.parametrize("provider, protocol", [("@ai-sdk/openai-compatible", "openai"),
                                                ("@ai-sdk/openai", "responses")])
def test_opencode_runs_a_tool_turn_through_the_proxy(workspace, tmp_path, provider, protocol):
    """``opencode run``, offline: the model reads a file with opencode's ``read`` tool, then
    answers. The turn gets the fitting skill, all its requests (its title request too) are
    recorded under opencode's own session, and the file's text reaches the model."""
    store, _ = workspace
    home, work = tmp_path / "home", tmp_path / "work"
    (work / "deploy").mkdir(parents=True)
    (work / "deploy" / "config.yaml").write_text("replicas: 3\n")
    read = {"id": "call_read", "function": {"name": "read", "arguments": json.dumps(
        {"filePath": str(work / "deploy" / "config.yaml")})}}

    def reply(body):
        if "title generator" in json.dumps(body["messages"][:1]):
            return Reply("Config change plan")
        return Reply(ANSWER) if body["messages"][-1]["role"] == "tool" else Reply(
            None, tool_calls=[read])

    with DoubleServer(reply) as upstream, proxy_for(workspace, upstream) as proxy:
        config = home / ".config" / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True)
        wire.apply(wire.plan("opencode", config, f"http://127.0.0.1:{proxy.port}/v1",
                             model="gpt-5.1"))
        if provider != "@ai-sdk/openai-compatible":
            wired = json.loads(config.read_text())
            wired["provider"]["metaclaw"]["npm"] = provider
            config.write_text(json.dumps(wired))
        done = subprocess.run(
            [_opencode(), "run", "--pure", ASK], cwd=work, capture_output=True, text=True,
            timeout=180, env={**os.environ, "HOME": str(home), "PWD": str(work),
                              "XDG_CONFIG_HOME": str(home / ".config"),
                              "XDG_DATA_HOME": str(home / ".local" / "share"),
                              "XDG_CACHE_HOME": str(home / ".cache"),
                              "XDG_STATE_HOME": str(home / ".local" / "state"),
                              "OPENCODE_DISABLE_MODELS_FETCH": "1"})
        turns = turns_of(proxy, store)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert ANSWER in done.stdout
    main = [t for t in turns if t["turn_type"] == "main"]
    assert [t["protocol"] for t in turns] == [protocol] * len(turns)
    assert len(main) == 2 and all(t["status"] == "ok" for t in turns)
    assert main[0]["injected_skills"][0] == "backup-before-modify"
    assert main[0]["retrieval_query"] == ASK
    assert len({t["session_id"] for t in turns}) == 1
    assert turns[0]["session_id"].startswith("ses_")  # opencode's own session id
    assert {t["identified_by"]["session"] for t in turns} == {"header:X-Session-Id"}
    last = upstream.requests[-1]["body"]["messages"]
    assert last[-1]["role"] == "tool" and "replicas: 3" in last[-1]["content"]
    assert BLOCK_HEADER in last[0]["content"]


def test_litellm_responses_mode_through_the_proxy(workspace, monkeypatch):
    """``litellm.responses`` (its Responses mode, ``openai/`` models at an ``api_base``):
    a reply, a stream and a function-tool round trip; the first request gets the fitting skill
    and the tool result continues its conversation's session."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    store, _ = workspace
    tool = {"type": "function", "name": "backup_file", "description": "Copy a file first.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}}
    with DoubleServer([Reply("Make a backup first."), Reply("Streamed: back it up."),
                       Reply(None, tool_calls=[BACKUP_CALL]), Reply(ANSWER)]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        options = {"model": "openai/gpt-5.1", "api_base": f"http://127.0.0.1:{proxy.port}/v1",
                   "api_key": "unused"}
        first = litellm.responses(input=ASK, instructions="You change configs carefully.",
                                  **options)
        stream = litellm.responses(input=ASK, stream=True, **options)
        kinds = [str(getattr(event.type, "value", event.type)) for event in stream]
        asked = litellm.responses(input=ASK, tools=[tool], **options)
        (item,) = asked.output
        assert item.type == "function_call" and item.name == "backup_file"
        final = litellm.responses(tools=[tool], input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": item.call_id, "name": item.name,
             "arguments": item.arguments},
            {"type": "function_call_output", "call_id": item.call_id,
             "output": "copied to deploy/config.yaml.bak"}], **options)
        turns = turns_of(proxy, store)
    assert first.output[0].content[0].text == "Make a backup first."
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.output[0].content[0].text == ANSWER
    assert [t["protocol"] for t in turns] == ["responses"] * 4
    assert [t["status"] for t in turns] == ["ok"] * 4
    assert upstream.requests[1]["body"]["stream"] is True  # streamed for real, not simulated
    assert all(t["injected_skills"][0] == "backup-before-modify" for t in turns)
    assert turns[3]["session_id"] == turns[2]["session_id"]
    assert turns[3]["identified_by"]["session"] == "fingerprint:reply-thread"
    sent = upstream.requests[-1]["body"]["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": "call_b",
                        "content": "copied to deploy/config.yaml.bak"}


def test_the_chat_completions_modes_of_the_agents_sdk_pydantic_ai_and_langchain(workspace):
    """The same libraries in their chat-completions modes: the Agents SDK's
    ``OpenAIChatCompletionsModel`` with a function tool (call, result, answer), pydantic-ai's
    ``OpenAIChatModel`` and langchain-openai's ``ChatOpenAI``; each first request gets the
    fitting skill, and the tool turn continues its conversation's session."""
    agents = pytest.importorskip("agents")
    pydantic_ai = pytest.importorskip("pydantic_ai")
    langchain_openai = pytest.importorskip("langchain_openai")
    import openai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    store, _ = workspace
    backup_file, called = backup_tool(agents)
    with DoubleServer([Reply(None, tool_calls=[BACKUP_CALL]), Reply("from the agents sdk"),
                       Reply("from pydantic-ai"), Reply("from langchain")]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        base = f"http://127.0.0.1:{proxy.port}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
        agent = agents.Agent(name="ops", instructions="You change configs carefully.",
                             tools=[backup_file], model=agents.OpenAIChatCompletionsModel(
                                 model="gpt-5.1", openai_client=client))
        result = agents.Runner.run_sync(agent, ASK, run_config=agents.RunConfig(
            tracing_disabled=True))
        typed = pydantic_ai.Agent(OpenAIChatModel("gpt-5.1", provider=OpenAIProvider(
            base_url=base, api_key="unused")), instructions="You change configs carefully.")
        assert typed.run_sync(ASK).output == "from pydantic-ai"
        chat = langchain_openai.ChatOpenAI(model="gpt-5.1", base_url=base, api_key="unused",
                                           max_retries=0)
        assert chat.invoke(ASK).text == "from langchain"
        turns = turns_of(proxy, store)
    assert result.final_output == "from the agents sdk" and called == ["deploy/config.yaml"]
    assert [t["protocol"] for t in turns] == ["openai"] * 4
    assert [t["status"] for t in turns] == ["ok"] * 4
    assert all(t["injected_skills"][0] == "backup-before-modify" for t in turns)
    assert turns[1]["session_id"] == turns[0]["session_id"]
    assert turns[1]["identified_by"]["session"] == "fingerprint:reply-thread"
    assert len({t["session_id"] for t in turns}) == 3  # three conversations


def test_litellm_chat_and_anthropic_modes_through_the_proxy(workspace, monkeypatch):
    """``litellm.completion`` with an ``openai/`` model (``/v1/chat/completions``) and with an
    ``anthropic/`` model (``/v1/messages``, translated to the chat upstream), both at the
    proxy's address: each gets the fitting skill and is recorded in its own protocol."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    store, _ = workspace
    with DoubleServer([Reply("chat: back it up"), Reply("messages: back it up")]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        chat = litellm.completion(model="openai/gpt-5.1", api_key="unused",
                                  api_base=f"http://127.0.0.1:{proxy.port}/v1",
                                  messages=[{"role": "user", "content": ASK}])
        messages = litellm.completion(model="anthropic/claude-sonnet-4-5", api_key="unused",
                                      api_base=f"http://127.0.0.1:{proxy.port}",
                                      messages=[{"role": "user", "content": ASK}],
                                      max_tokens=100)
        turns = turns_of(proxy, store)
    assert chat.choices[0].message.content == "chat: back it up"
    assert messages.choices[0].message.content == "messages: back it up"
    assert [t["protocol"] for t in turns] == ["openai", "anthropic"]
    assert [t["status"] for t in turns] == ["ok"] * 2
    assert all(t["injected_skills"][0] == "backup-before-modify" for t in turns)
    assert [t["retrieval_query"] for t in turns] == [ASK, ASK]
