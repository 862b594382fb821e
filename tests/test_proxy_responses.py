"""The OpenAI Responses protocol (``POST /v1/responses``): the official openai SDK
(``responses.create`` / ``responses.stream``, tools, errors) through the proxy to a chat
upstream and to an Anthropic upstream, the captured Codex CLI request, and the real Codex CLI
in ``codex exec`` mode when it is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import openai
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.offline.double_anthropic import AnthropicDoubleServer, AnthropicReply
from metaclaw.protocols.openai_responses import RESPONSES, ChatToResponsesStream
from metaclaw.protocols.registry import get_protocol
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.asks import extract_ask
from metaclaw.skills.block import BLOCK_HEADER
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store
from client_workspace import ASK, BACKUP_CALL, backup_tool, proxy_for, turns_of
from client_workspace import workspace  # noqa: F401  (the fixture)
from waiting import wait_until

CAPTURES = Path(__file__).parent / "fixtures" / "requests" / "codex"
MODEL = "double-model"
RENAME = {"type": "function", "name": "rename_file", "description": "Rename a file.",
          "parameters": {"type": "object", "properties": {"src": {"type": "string"},
                                                          "dst": {"type": "string"}}}}


def _client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="unused",
                         max_retries=0)


def test_sdk_create_gets_skills_and_is_recorded_in_the_neutral_form(workspace):
    store, _ = workspace
    with DoubleServer([Reply("Back it up first.")]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        response = _client(proxy).responses.create(
            model=MODEL, instructions="You are a careful agent.", input=ASK,
            max_output_tokens=50, extra_headers={"session-id": "codex-session-1"})
        (turn,) = turns_of(proxy, store)
    assert response.status == "completed" and response.output_text == "Back it up first."
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    sent = upstream.requests[-1]["body"]
    assert sent["max_tokens"] == 50 and sent["messages"][0]["role"] == "system"
    assert sent["messages"][0]["content"].startswith("You are a careful agent.\n\n" + BLOCK_HEADER)
    assert "cp config.yaml" in sent["messages"][0]["content"]
    assert turn["protocol"] == "responses" and turn["status"] == "ok"
    assert turn["session_id"] == "codex-session-1"
    assert turn["injected_skills"][0] == "backup-before-modify"
    assert turn["retrieval_query"] == ASK and turn["response"] == "Back it up first."
    assert turn["request_messages"][-1] == {"role": "user", "content": ASK}


def test_sdk_tool_round_trip_streaming_and_not(workspace):
    store, _ = workspace
    call = {"id": "call_1", "function": {"name": "rename_file",
                                         "arguments": '{"src": "a.txt", "dst": "b.txt"}'}}
    with DoubleServer([Reply(None, tool_calls=[call]), Reply(None, tool_calls=[call]),
                       Reply("Renamed.")]) as upstream, proxy_for(workspace, upstream) as proxy:
        client = _client(proxy)
        first = client.responses.create(model=MODEL, input="Rename a.txt to b.txt",
                                        tools=[RENAME], tool_choice="auto")
        (item,) = first.output
        assert item.type == "function_call" and item.name == "rename_file"
        assert json.loads(item.arguments) == {"src": "a.txt", "dst": "b.txt"}
        with client.responses.stream(model=MODEL, input="Rename a.txt to b.txt",
                                     tools=[RENAME]) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert "response.function_call_arguments.delta" in kinds
        assert kinds[-1] == "response.completed"
        (streamed_item,) = streamed.output
        assert streamed_item.type == "function_call" and streamed_item.call_id == "call_1"
        final = client.responses.create(model=MODEL, tools=[RENAME], input=[
            {"role": "user", "content": "Rename a.txt to b.txt"},
            {"type": "function_call", "call_id": item.call_id, "name": item.name,
             "arguments": item.arguments},
            {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}])
        assert final.output_text == "Renamed."
        turns = turns_of(proxy, store)
    sent = upstream.requests[-1]["body"]
    roles = [m["role"] for m in sent["messages"]]
    assert roles[-3:] == ["user", "assistant", "tool"]
    assert sent["messages"][-2]["tool_calls"][0]["function"]["name"] == "rename_file"
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    assert sent["tools"][0]["function"]["name"] == "rename_file"
    assert [t["tool_calls"][0]["function"]["name"] for t in turns[:2]] == ["rename_file"] * 2


def test_streamed_text_through_an_anthropic_upstream(workspace):
    store, _ = workspace
    with AnthropicDoubleServer([AnthropicReply("Copy it to config.yaml.bak.")]) as upstream, \
            proxy_for(workspace, upstream, "anthropic") as proxy:
        with _client(proxy).responses.stream(model="claude-double", input=ASK) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        (turn,) = turns_of(proxy, store)
    assert "".join(deltas) == final.output_text == "Copy it to config.yaml.bak."
    sent = upstream.requests[-1]["body"]
    assert BLOCK_HEADER in sent["system"] and sent["max_tokens"] > 0
    assert turn["protocol"] == "responses" and turn["response"] == final.output_text


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": 3}, "input"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": MODEL, "input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c"}]},
     "input[0].output"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "tools": [{"name": "f"}]}, "tools[0]"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": MODEL, "input": "x", "instructions": ["a"]}, "instructions"),
])
def test_bad_requests_get_a_400_in_the_openai_error_shape_naming_the_field(workspace, body,
                                                                         param):
    store, _ = workspace
    with DoubleServer() as upstream, proxy_for(workspace, upstream) as proxy:
        with pytest.raises(openai.BadRequestError) as caught:
            _client(proxy).post("/responses", body=body, cast_to=object)
        assert turns_of(proxy, store) == []
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["message"]


def test_the_captured_codex_request_in_the_chat_form():
    """Codex CLI 0.171's real request: developer messages, an environment message, a namespace
    of tools declared in an ``additional_tools`` item, a free-form tool with a grammar."""
    body = json.loads((CAPTURES / "001.json").read_text())["body"]
    RESPONSES.parse_request(body, None)
    chat = RESPONSES.to_chat(body)
    messages = chat["messages"]
    assert messages[0]["role"] == "system" and "You are Codex" in messages[0]["content"]
    assert [m["role"] for m in messages] == ["system", "user", "user"]  # instructions merged
    assert extract_ask(messages).text == "Add a --verbose flag to cli.py"
    names = {t["function"]["name"] for t in chat["tools"]}
    assert {"exec", "wait", "spawn_agent"} <= names
    exec_tool = next(t["function"] for t in chat["tools"] if t["function"]["name"] == "exec")
    assert exec_tool["parameters"]["required"] == ["input"] and "grammar" in exec_tool[
        "description"]
    injected = RESPONSES.inject(body, BLOCK_HEADER + "\nskills")
    assert injected["input"][:-1] == body["input"]  # the client's items, its cached prefix, kept
    assert injected["input"][-1]["role"] == "developer"
    assert RESPONSES.to_chat(injected)["messages"][0]["content"].endswith(
        BLOCK_HEADER + "\nskills")
    assert RESPONSES.inject(RESPONSES.inject(injected, ""), "") == {**body, "input": body["input"]}
    tools_004 = json.loads((CAPTURES / "004.json").read_text())["body"]
    chat = RESPONSES.to_chat(tools_004)
    assert "web_search" not in json.dumps(chat["tools"])  # a hosted tool: dropped for chat
    assert {"exec_command", "close_agent"} <= {t["function"]["name"] for t in chat["tools"]}


def test_a_free_form_tool_call_comes_back_as_a_custom_tool_call():
    request = {"model": MODEL, "input": "patch it", "tools": [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}]}
    stream = ChatToResponsesStream(request)
    events = []
    for chunk in ({"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "function": {"name": "apply_patch",
                                                  "arguments": '{"input": "*** Begin'}}]}}]},
                  {"choices": [{"index": 0, "delta": {"tool_calls": [
                      {"index": 0, "function": {"arguments": ' Patch"}'}}]},
                      "finish_reason": "tool_calls"}]}):
        events += stream.feed(chunk)
    events += stream.close()
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["type"] == "custom_tool_call"
    assert done[0]["item"]["input"] == "*** Begin Patch" and done[0]["item"]["call_id"] == "c1"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reply = RESPONSES.reply_from_chat({"model": "m", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "c2", "type": "function",
        "function": {"name": "apply_patch", "arguments": '{"input": "x"}'}}]},
        "finish_reason": "tool_calls"}]}, request)
    assert reply["output"][0] == {**reply["output"][0], "type": "custom_tool_call",
                                  "input": "x", "call_id": "c2"}
    assert json.loads(RESPONSES.reply_to_chat(reply)["choices"][0]["message"]["tool_calls"][0][
        "function"]["arguments"]) == {"input": "x"}


def test_interleaved_parallel_calls_stream_as_whole_items_in_order():
    stream = ChatToResponsesStream({"model": MODEL, "input": "x"})
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}},
        {"index": 1, "id": "b", "function": {"name": "g", "arguments": ""}}]}}]}]
    for i, piece in enumerate(['{"x":', '{"y":', ' 1}', ' 2}']):
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i % 2, "function": {"arguments": piece}}]}}]})
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.close()
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["call_id"], json.loads(i["arguments"])) for i in items] == [
        ("a", {"x": 1}), ("b", {"y": 2})]
    completed = events[-1]
    assert completed["type"] == "response.completed"
    assert [i["call_id"] for i in completed["response"]["output"]] == ["a", "b"]


def test_the_protocol_is_registered_and_round_trips_the_pivot():
    assert get_protocol("responses") is RESPONSES
    chat = {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "done"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "",
                                                    "parameters": {"type": "object"}}}],
        "max_tokens": 9}
    again = RESPONSES.to_chat(RESPONSES.from_chat(chat))
    assert again["messages"] == chat["messages"] and again["max_tokens"] == 9
    assert again["tools"][0]["function"]["name"] == "f"


def _codex() -> str | None:
    return os.environ.get("METACLAW_CODEX") or shutil.which("codex")


@pytest.mark.skipif(_codex() is None, reason="the Codex CLI is not installed (npm install "
                    "@openai/codex, or set METACLAW_CODEX to its binary)")
def test_codex_cli_exec_through_the_proxy(workspace, tmp_path):
    """The real Codex CLI (``codex exec``, Responses API, streaming) completes a turn through the
    proxy: the fitting skill is injected and the turn is recorded under Codex's session."""
    store, _ = workspace
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with DoubleServer([Reply("Make a backup copy of deploy/config.yaml first.")]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        (home / "config.toml").write_text(
            'model_provider = "metaclaw"\nmodel = "gpt-5-codex"\n\n'
            '[model_providers.metaclaw]\nname = "MetaClaw"\n'
            f'base_url = "http://127.0.0.1:{proxy.port}/v1"\n'
            'env_key = "METACLAW_PROXY_TOKEN"\nwire_api = "responses"\n')
        done = subprocess.run([_codex(), "exec", "--skip-git-repo-check", ASK], cwd=work,
                              env={**os.environ, "CODEX_HOME": str(home),
                                   "METACLAW_PROXY_TOKEN": "unused"},
                              capture_output=True, text=True, timeout=180)
        turns = turns_of(proxy, store)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Make a backup copy of deploy/config.yaml first." in done.stdout
    (turn,) = [t for t in turns if t["turn_type"] == "main"]
    assert turn["protocol"] == "responses" and turn["status"] == "ok"
    assert turn["injected_skills"][0] == "backup-before-modify"
    assert turn["identified_by"]["session"] == "header:Session-Id"
    assert turn["retrieval_query"] == ASK
    sent = upstream.requests[-1]["body"]
    assert sent["stream"] is True and BLOCK_HEADER in sent["messages"][0]["content"]
    assert "Codex" in sent["messages"][0]["content"]  # its instructions, then the skills


@pytest.mark.skipif(_codex() is None, reason="the Codex CLI is not installed (npm install "
                    "@openai/codex, or set METACLAW_CODEX to its binary)")
def test_codex_says_why_its_reply_ended_when_the_proxy_stops(workspace, tmp_path):
    """The proxy stopped mid-reply: the real Codex CLI prints the proxy's reason (the stream's
    ``error`` and ``response.failed`` in a whole reply), not a transport error."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with DoubleServer([Reply(" ".join(f"word{i}" for i in range(40)), chunk_delay=0.5)]) \
            as upstream, proxy_for(workspace, upstream) as proxy:
        (home / "config.toml").write_text(
            'model_provider = "metaclaw"\nmodel = "gpt-5-codex"\n\n'
            '[model_providers.metaclaw]\nname = "MetaClaw"\n'
            f'base_url = "http://127.0.0.1:{proxy.port}/v1"\n'
            'env_key = "METACLAW_PROXY_TOKEN"\nwire_api = "responses"\n'
            'stream_max_retries = 0\nrequest_max_retries = 0\n')
        codex = subprocess.Popen([_codex(), "exec", "--skip-git-repo-check", ASK], cwd=work,
                                 env={**os.environ, "CODEX_HOME": str(home),
                                      "METACLAW_PROXY_TOKEN": "unused"},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until(lambda: upstream.requests, timeout=120, what="Codex's request upstream")
            time.sleep(1.0)  # a few words streamed
            proxy.stop()
            said, _ = codex.communicate(timeout=60)
        finally:
            if codex.poll() is None:
                codex.kill()
    assert "the MetaClaw proxy stopped before this reply was complete" in said, said[-2000:]


def test_an_unknown_route_says_the_route_is_missing_not_the_model(workspace):
    """Clients that read any 404 as "model not found" get a message naming the route and every
    route the proxy serves, the Responses one among them, in the caller's error shape."""
    import httpx

    with DoubleServer() as upstream, proxy_for(workspace, upstream) as proxy:
        base = f"http://127.0.0.1:{proxy.port}"
        missing = httpx.post(f"{base}/v1/responses/compact", json={"model": MODEL})
        anthropic_shaped = httpx.post(f"{base}/v1/complete", json={},
                                      headers={"anthropic-version": "2023-06-01"})
        wrong_method = httpx.get(f"{base}/v1/responses")
    error = missing.json()["error"]
    assert missing.status_code == 404 and error["code"] == "unknown_route"
    assert "no route POST /v1/responses/compact" in error["message"]
    assert "the model is not the problem" in error["message"]
    assert "POST /v1/responses" in error["message"] and "POST /v1/messages" in error["message"]
    assert anthropic_shaped.status_code == 404 and anthropic_shaped.json()["type"] == "error"
    assert wrong_method.status_code == 405
    assert "POST /v1/responses" in wrong_method.json()["error"]["message"]


def test_the_agents_sdk_default_model_runs_a_tool_turn_through_the_proxy(workspace):
    """The OpenAI Agents SDK as it comes: an agent that names no model, run with the default
    provider (pointed at the proxy), gets the SDK's default model, which speaks the Responses
    API. A function tool's whole turn (call, result, answer) goes through the proxy, the first
    request gets the fitting skill, and the tool turn continues the same session."""
    agents = pytest.importorskip("agents")
    from agents.models.default_models import get_default_model

    store, _ = workspace
    backup_file, called = backup_tool(agents)
    with DoubleServer([Reply(None, tool_calls=[BACKUP_CALL]), Reply("Backed up; now edit it.")]) \
            as upstream, proxy_for(workspace, upstream) as proxy:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1",
                                    api_key="unused", max_retries=0)
        agent = agents.Agent(name="ops", instructions="You change configs carefully.",
                             tools=[backup_file])
        result = agents.Runner.run_sync(agent, ASK, run_config=agents.RunConfig(
            model_provider=agents.OpenAIProvider(openai_client=client),
            tracing_disabled=True))
        turns = turns_of(proxy, store)
    assert result.final_output == "Backed up; now edit it."
    assert called == ["deploy/config.yaml"]
    assert [r["path"] for r in upstream.requests] == ["/v1/chat/completions"] * 2
    assert upstream.requests[0]["body"]["model"] == get_default_model()
    assert [t["protocol"] for t in turns] == ["responses", "responses"]
    assert turns[0]["injected_skills"][0] == "backup-before-modify"
    assert turns[0]["retrieval_query"] == ASK
    assert turns[0]["session_id"] == turns[1]["session_id"]  # the tool turn continues the reply
    assert turns[1]["identified_by"]["session"] == "fingerprint:reply-thread"
    sent = upstream.requests[-1]["body"]["messages"]
    assert sent[-1]["role"] == "tool" and "copied deploy/config.yaml" in sent[-1]["content"]


def test_a_responses_upstream_gets_responses_as_sent_and_serves_chat_clients(workspace,
                                                                            tmp_path):
    """``--upstream-protocol responses``: a Responses client's request goes upstream as sent
    (plus the skills' developer item) and its reply and stream events come back unchanged; a
    chat client is translated to Responses and back. The upstream here is a second proxy, which
    speaks the Responses API on the wire, in front of the chat double."""
    store, _ = workspace
    inner_store = Store(tmp_path / "inner.db")
    inner_library = SkillLibrary(tmp_path / "inner-skills", inner_store)
    with DoubleServer([Reply("first"), Reply("second"), Reply("third")]) as chat_double, \
            Proxy(ProxyConfig(upstream_url=chat_double.url, retrieval="lexical", max_retries=0),
                  inner_store, inner_library) as inner:
        outer_config = ProxyConfig(upstream_url=f"http://127.0.0.1:{inner.port}/v1",
                                   upstream_protocol="responses", retrieval="lexical",
                                   max_retries=0)
        with Proxy(outer_config, store, workspace[1]) as outer:
            client = _client(outer)
            response = client.responses.create(model=MODEL, input=ASK, instructions="Be brief.")
            with client.responses.stream(model=MODEL, input=ASK) as stream:
                kinds = [event.type for event in stream]
                streamed = stream.get_final_response()
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": ASK}])
            turns = turns_of(outer, store)
        inner.flush()
        inner_turns = inner_store.turns()
    inner_store.close()
    assert response.output_text == "first" and streamed.output_text == "second"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert chat.choices[0].message.content == "third"
    assert [t["protocol"] for t in inner_turns] == ["responses"] * 3
    assert [t["status"] for t in turns] == ["ok"] * 3
    assert turns[0]["injected_skills"][0] == "backup-before-modify"
    assert turns[2]["response"] == "third" and turns[2]["protocol"] == "openai"
    recorded = turns[0]["request_messages"]
    assert recorded[0]["role"] == "system" and recorded[0]["content"].startswith("Be brief.")
    assert BLOCK_HEADER in recorded[0]["content"]
    # the upstream proxy, with no skills of its own, took the block out of what it forwarded
    assert BLOCK_HEADER not in json.dumps(chat_double.requests[0]["body"])


def test_pydantic_ai_and_langchain_in_their_responses_modes(workspace):
    """pydantic-ai's ``OpenAIResponsesModel`` and langchain-openai's ``ChatOpenAI`` with
    ``use_responses_api=True`` (both reported a missing model when the proxy answered 404)."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    store, _ = workspace
    with DoubleServer([Reply("from pydantic-ai"), Reply("from langchain")]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        base = f"http://127.0.0.1:{proxy.port}/v1"
        agent = pydantic_ai.Agent(OpenAIResponsesModel(MODEL, provider=OpenAIProvider(
            base_url=base, api_key="unused")), instructions="You change configs carefully.")
        assert agent.run_sync(ASK).output == "from pydantic-ai"
        chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=base, api_key="unused",
                                           use_responses_api=True, max_retries=0)
        assert chat.invoke(ASK).text == "from langchain"
        turns = turns_of(proxy, store)
    assert [t["protocol"] for t in turns] == ["responses", "responses"]
    assert all(t["injected_skills"][0] == "backup-before-modify" for t in turns)


def test_translation_corners_found_in_review():
    """A failed upstream response is an error, not a reply; text after a call in the same turn
    folds into the calls' message; a cut-off stream ends with response.incomplete; an image by
    file id is valid; a namespace whose tools are not a list is a 400, not a 500; a chat tool
    is not made strict by the translation, and an image keeps its detail."""
    from metaclaw.protocols import ProxyError
    from metaclaw.protocols.openai_responses import ResponsesToChatStream

    failed = ResponsesToChatStream().feed({"type": "response.failed", "response": {
        "error": {"code": "server_error", "message": "the model failed"}}})
    assert failed == [{"error": {"message": "the model failed", "code": "server_error"}}]
    chat = RESPONSES.to_chat({"model": MODEL, "input": [
        {"role": "user", "content": "check main"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Calling f now."}]},
        {"type": "function_call_output", "call_id": "c1", "output": "green"}]})
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    assert chat["messages"][1]["content"] == "Calling f now."
    stream = ChatToResponsesStream({"model": MODEL, "input": "x"})
    events = stream.feed({"choices": [{"index": 0, "delta": {"content": "cut"},
                                       "finish_reason": "length"}]}) + stream.close()
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    RESPONSES.parse_request({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1", "image_url": None}]}]}, None)
    with pytest.raises(ProxyError) as caught:
        RESPONSES.parse_request({"model": MODEL, "input": "x", "tools": [
            {"type": "namespace", "name": "ns", "tools": True}]}, None)
    assert caught.value.status == 400 and caught.value.param == "tools[0].tools"
    body = RESPONSES.from_chat({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}}]}],
        "tools": [{"type": "function", "function": {"name": "grep", "parameters": {}}}]})
    assert body["tools"][0]["strict"] is False
    assert body["input"][0]["content"][0]["detail"] == "high"
    split = ChatToResponsesStream({"model": MODEL, "input": "x"})
    events = [e for chunk in (
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c", "function": {"name": "get_", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "weather", "arguments": "{}"}}]}}]})
        for e in split.feed(chunk)] + split.close()
    assert events[-1]["response"]["output"][0]["name"] == "get_weather"  # a name in pieces


def _sse(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_stream_cut_mid_way_ends_with_a_numbered_error_and_response_failed(workspace):
    """Codex reads a bare ``error`` event as a dropped stream (it retries, then says only
    "stream disconnected"): the proxy's error is numbered after the last event and followed by
    ``response.failed`` carrying the message, the terminal event Codex shows."""
    import httpx

    store, _ = workspace
    with DoubleServer([Reply("one two three four five six", disconnect_after=4)]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        raw = httpx.post(f"http://127.0.0.1:{proxy.port}/v1/responses", timeout=30, json={
            "model": MODEL, "stream": True, "input": ASK}).content
        (turn,) = turns_of(proxy, store)
    events = _sse(raw)
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(len(events)))  # one count, no restart at the error
    error, failed = events[-2:]
    assert error["code"] == "upstream_disconnected" and "mid-stream" in error["message"]
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["id"] == events[0]["response"]["id"]
    assert failed["response"]["error"] == {"code": "upstream_disconnected",
                                           "message": error["message"]}
    assert turn["status"] == "error" and "mid-stream" in turn["error"]


def test_an_upstreams_own_failure_reaches_a_responses_client_as_response_failed(workspace,
                                                                                 tmp_path):
    """A chat upstream's error event mid-stream, translated for a Responses client, ends with
    ``error`` and ``response.failed`` (the terminal event Codex waits for). One proxy in front
    of another: the outer one passes that Responses stream through, ``response.failed``
    included (it used to drop the terminal event of a stream that errored)."""
    import httpx
    from fault_upstream import FaultUpstream

    outer_store = Store(tmp_path / "outer.db")
    outer_library = SkillLibrary(str(tmp_path / "outer-skills"), outer_store)
    try:
        with FaultUpstream() as chat, proxy_for(workspace, chat) as inner:
            outer = Proxy(ProxyConfig(upstream_url=f"http://127.0.0.1:{inner.port}/v1",
                                      upstream_protocol="responses", retrieval="lexical",
                                      max_retries=0), outer_store, outer_library)
            with outer:
                for port in (inner.port, outer.port):
                    raw = httpx.post(f"http://127.0.0.1:{port}/v1/responses", timeout=30, json={
                        "model": MODEL, "stream": True,
                        "input": "say three words fault=error_event"}).content
                    events = _sse(raw)
                    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
                    assert [e["sequence_number"] for e in events] == list(range(len(events)))
                    failed = events[-1]["response"]
                    assert failed["status"] == "failed" and failed["error"]["message"]
                    assert failed["id"] == events[0]["response"]["id"]
                (outer_turn,) = turns_of(outer, outer_store)
        assert outer_turn["status"] == "error"
    finally:
        outer_store.close()


def test_a_protocol_with_the_one_argument_error_event_still_records_the_turn(workspace):
    """An adapter written to ``stream_error_event(error)`` (before it took the first and the
    last event) still ends a cut stream with its error, and the turn is recorded."""
    import httpx
    from metaclaw.protocols.openai_chat import OpenAIChat

    class OneArgument(OpenAIChat):
        def stream_error_event(self, error):
            return b"data: " + json.dumps({"error": {"message": error.message}}).encode() + b"\n\n"

    store, _ = workspace
    with DoubleServer([Reply("one two three four five six", disconnect_after=4)]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        import metaclaw.proxy.pipeline as pipeline

        legacy = OneArgument()
        raw = pipeline._error_event(legacy, pipeline.ProxyError(502, "cut"), None, None)
        assert b'"cut"' in raw
        httpx.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": ASK}]})
        (turn,) = turns_of(proxy, store)
    assert turn["status"] == "error" and "mid-stream" in turn["error"]


def test_a_stream_that_failed_gets_one_terminal_event_even_if_its_record_fails(workspace,
                                                                              monkeypatch):
    import httpx
    from metaclaw.protocols import ProxyError
    from metaclaw.proxy.pipeline import TurnPipeline

    async def refuse(self, recorded):
        raise ProxyError(503, "the store is down", code="record_failed")

    monkeypatch.setattr(TurnPipeline, "acknowledge", refuse)
    with DoubleServer([Reply("one two three four five six", disconnect_after=4)]) as upstream, \
            proxy_for(workspace, upstream) as proxy:
        raw = httpx.post(f"http://127.0.0.1:{proxy.port}/v1/responses", timeout=30, json={
            "model": MODEL, "stream": True, "input": ASK}).content
    kinds = [e["type"] for e in _sse(raw)]
    assert kinds.count("error") == 1 and kinds.count("response.failed") == 1
    assert kinds[-2:] == ["error", "response.failed"]
