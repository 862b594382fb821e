"""The proxy's Anthropic Messages endpoint, driven by the official ``anthropic`` SDK, in front of
both upstream kinds: the OpenAI-compatible double (translation) and the Anthropic double built on
the SDK's own types (pass-through). Also: OpenAI clients reaching an Anthropic upstream, errors in
Anthropic's shape, caller-auth and the context budget, for both protocols.

Everything is real: servers on 127.0.0.1 ephemeral ports, SQLite store, BM25 retrieval.
"""

from __future__ import annotations

import base64
import json
import logging

import httpx
import openai
import pytest

anthropic = pytest.importorskip("anthropic", reason="the Anthropic tests need the anthropic SDK "
                                                    "(pip install -e '.[anthropic]')")

from metaclaw.offline.double import DoubleServer, Reply  # noqa: E402
from metaclaw.offline.double_anthropic import AnthropicDoubleServer, AnthropicReply  # noqa: E402
from metaclaw.proxy.app import Proxy, ProxyConfig  # noqa: E402
from metaclaw.skills.block import BLOCK_HEADER  # noqa: E402
from metaclaw.skills.library import Skill, SkillLibrary  # noqa: E402
from metaclaw.store import Store  # noqa: E402

MODEL = "claude-test"
COMMIT_BODY = "Write the subject line in the imperative mood, at most 50 characters."
SKILLS = [
    Skill("git-commit-messages", "How to write clear git commit messages for a change.",
          "coding", f"# Commit messages\n\n{COMMIT_BODY}"),
    Skill("git-branch-names", "Name git branches after the change they hold.",
          "coding", "# Branches\n\nUse kebab-case: fix/short-description. " * 20),
    Skill("sql-query-tuning", "Speed up slow SQL queries with indexes and query plans.",
          "data", "# SQL tuning\n\nRead the EXPLAIN plan before adding an index."),
]
QUESTION = "How should I word the git commit message for this fix?"
SYSTEM = [{"type": "text", "text": "You are a careful coding agent.",
           "cache_control": {"type": "ephemeral"}}]
READ_TOOL = {"name": "read_file", "description": "Read a file of the repository.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                              "required": ["path"]}}
CALL = {"function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}


@pytest.fixture()
def workspace(tmp_path):
    directory = tmp_path / "skills"
    for skill in SKILLS:
        (directory / skill.name).mkdir(parents=True)
        (directory / skill.name / "SKILL.md").write_text(skill.to_markdown())
    store = Store(tmp_path / "metaclaw.db")
    yield store, SkillLibrary(str(directory), store)
    store.close()


@pytest.fixture()
def openai_double():
    with DoubleServer(models=(MODEL,)) as server:
        yield server


@pytest.fixture()
def anthropic_double():
    with AnthropicDoubleServer() as server:
        yield server


def _proxy(workspace, upstream, protocol, **overrides) -> Proxy:
    store, library = workspace
    url = upstream.url if protocol == "openai" else upstream.base_url
    config = ProxyConfig(upstream_url=url, upstream_protocol=protocol, retrieval="lexical",
                         max_retries=0, **overrides)
    return Proxy(config, store, library)


def _client(proxy, **kw) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=proxy.base_url, api_key=kw.pop("api_key", "unused"),
                               max_retries=0, **kw)


def _turns(proxy, store):
    proxy.flush()
    return store.turns()


# ---------------------------------------------------------------------------------------------
# Anthropic client -> OpenAI-compatible upstream (translation)
# ---------------------------------------------------------------------------------------------
def test_anthropic_sdk_through_openai_upstream(workspace, openai_double):
    store, _ = workspace
    with _proxy(workspace, openai_double, "openai") as proxy:
        message = _client(proxy).messages.create(
            model=MODEL, max_tokens=200, system=SYSTEM,
            messages=[{"role": "user", "content": QUESTION}])
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].text == f"echo: {QUESTION}"
    assert message.stop_reason == "end_turn" and message.usage.input_tokens > 0
    sent = openai_double.requests[-1]["body"]
    assert sent["max_tokens"] == 200 and sent["messages"][0]["role"] == "system"
    assert sent["messages"][0]["content"].startswith("You are a careful coding agent.\n\n")
    assert BLOCK_HEADER in sent["messages"][0]["content"] and COMMIT_BODY in sent["messages"][0]["content"]
    assert "cache_control" not in json.dumps(sent)  # a lossy corner, documented
    (turn,) = _turns(proxy, store)
    assert turn["protocol"] == "anthropic" and turn["status"] == "ok"
    assert turn["request_messages"][0]["role"] == "system"  # the neutral (OpenAI chat) form
    assert COMMIT_BODY in turn["request_messages"][0]["content"]
    assert turn["request_messages"][1] == {"role": "user", "content": QUESTION}
    assert "git-commit-messages" in turn["injected_skills"]
    assert turn["response"] == f"echo: {QUESTION}" and turn["finish_reason"] == "stop"
    assert turn["request_params"]["max_tokens"] == 200


def test_anthropic_sdk_tools_through_openai_upstream(workspace, openai_double):
    store, _ = workspace
    openai_double.add(Reply(None, tool_calls=[CALL]), Reply(None, tool_calls=[CALL]),
                      Reply("The app starts the server."))
    with _proxy(workspace, openai_double, "openai") as proxy:
        client = _client(proxy)
        first = client.messages.create(model=MODEL, max_tokens=100, tools=[READ_TOOL],
                                       tool_choice={"type": "auto"},
                                       messages=[{"role": "user", "content": "What does app.py do?"}])
        (use,) = first.content
        assert use.type == "tool_use" and use.name == "read_file"
        assert use.input == {"path": "src/app.py"} and first.stop_reason == "tool_use"
        with client.messages.stream(model=MODEL, max_tokens=100, tools=[READ_TOOL],
                                    messages=[{"role": "user", "content": "What does app.py do?"}]
                                    ) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert streamed.content[0].type == "tool_use"
        assert streamed.content[0].input == {"path": "src/app.py"}
        assert streamed.stop_reason == "tool_use" and "input_json" in kinds
        final = client.messages.create(model=MODEL, max_tokens=100, tools=[READ_TOOL], messages=[
            {"role": "user", "content": "What does app.py do?"},
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "app.run()"}]}])
    assert final.content[0].text == "The app starts the server."
    sent = openai_double.requests[-1]["body"]
    assert sent["tools"][0]["function"]["name"] == "read_file"
    assert sent["messages"][-2]["tool_calls"][0]["id"] == use.id
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": use.id, "content": "app.run()"}
    assert openai_double.requests[0]["body"]["tool_choice"] == "auto"
    turns = _turns(proxy, store)
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "tool_calls", "stop"]
    assert turns[1]["tool_calls"][0]["function"]["name"] == "read_file"
    assert json.loads(turns[1]["tool_calls"][0]["function"]["arguments"]) == {"path": "src/app.py"}


def test_interleaved_parallel_tool_calls_reach_an_anthropic_client(workspace, openai_double):
    """An upstream that interleaves its parallel calls' argument deltas (both calls start in one
    chunk) gives the Anthropic client one whole tool_use block per call, each delta inside its
    block; it used to get six blocks, four nameless, their inputs lost."""
    calls = [{"id": "call_a", "function": {"name": "read_file",
                                           "arguments": '{"path": "src/app.py"}'}},
             {"id": "call_b", "function": {"name": "read_file",
                                           "arguments": '{"path": "src/cli.py"}'}}]
    openai_double.add(Reply("Reading both.", tool_calls=calls, interleave=True),
                      Reply("Reading both.", tool_calls=calls, interleave=True))
    request = {"model": MODEL, "max_tokens": 50, "tools": [READ_TOOL],
               "messages": [{"role": "user", "content": "read both files"}]}
    with _proxy(workspace, openai_double, "openai") as proxy:
        with _client(proxy).messages.stream(**request) as stream:
            final = stream.get_final_message()
        raw = httpx.post(proxy.base_url + "/v1/messages", json={**request, "stream": True})
    assert [(b.type, getattr(b, "id", None), getattr(b, "input", None)) for b in final.content] \
        == [("text", None, None), ("tool_use", "call_a", {"path": "src/app.py"}),
            ("tool_use", "call_b", {"path": "src/cli.py"})]
    assert final.stop_reason == "tool_use"
    stopped: set[int] = set()
    for line in raw.text.splitlines():
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event["type"] == "content_block_stop":
                stopped.add(event["index"])
            elif event["type"] in ("content_block_start", "content_block_delta"):
                assert event["index"] not in stopped, event  # never into a closed block


def test_translated_stream_has_the_full_event_sequence(workspace, openai_double):
    openai_double.add(Reply("Checking now.", tool_calls=[CALL]))
    with _proxy(workspace, openai_double, "openai") as proxy:
        body = {"model": MODEL, "max_tokens": 50, "stream": True, "tools": [READ_TOOL],
                "messages": [{"role": "user", "content": "look at app.py"}]}
        with httpx.stream("POST", proxy.base_url + "/v1/messages", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = []
            for line in response.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
    assert events[:2] == ["message_start", "ping"]
    assert events[-2:] == ["message_delta", "message_stop"]
    blocks = [e for e in events if e.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks.count("content_block_start") == 2
    assert blocks.count("content_block_stop") == 2


# ---------------------------------------------------------------------------------------------
# Anthropic client -> Anthropic upstream (pass-through, nothing lost)
# ---------------------------------------------------------------------------------------------
THINKING_REPLY = [{"type": "thinking", "thinking": "The user wants a commit message.",
                   "signature": "sig-abc123"},
                  {"type": "text", "text": "Use: Fix crash on empty input"},
                  {"type": "tool_use", "name": "read_file", "input": {"path": "CHANGELOG.md"}}]


def test_pass_through_keeps_everything(workspace, anthropic_double):
    store, _ = workspace
    anthropic_double.replies.append(AnthropicReply(THINKING_REPLY, usage={
        "input_tokens": 12, "output_tokens": 30, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 100}))
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Earlier question",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "old thought", "signature": "sig-old"},
            {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "a"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "file a",
             "is_error": False},
            {"type": "text", "text": QUESTION}]}]
    request = {"model": MODEL, "max_tokens": 300, "system": SYSTEM, "messages": history,
               "tools": [READ_TOOL], "tool_choice": {"type": "any"},
               "thinking": {"type": "enabled", "budget_tokens": 1024}, "top_k": 5,
               "metadata": {"user_id": "u-1"}}
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        raw = httpx.post(proxy.base_url + "/v1/messages", json=request,
                         headers={"anthropic-version": "2023-06-01",
                                  "anthropic-beta": "prompt-caching-2024-07-31"})
        message = _client(proxy).messages.create(
            **{k: v for k, v in request.items() if k != "top_k"}, extra_body={"top_k": 5},
            extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert raw.status_code == 200
    body = raw.json()
    assert body["content"][0] == THINKING_REPLY[0]  # the signature survives
    assert body["usage"]["cache_read_input_tokens"] == 100
    assert message.content[0].text.startswith("echo:")
    sent = anthropic_double.requests[0]
    forwarded = sent["body"]
    # the client's body is forwarded as sent, with one system block appended
    assert forwarded["system"][:1] == SYSTEM and forwarded["system"][1]["text"].startswith(
        BLOCK_HEADER)
    assert "cache_control" not in forwarded["system"][1]
    assert {k: v for k, v in forwarded.items() if k != "system"} == {
        k: v for k, v in request.items() if k != "system"}
    assert sent["headers"]["anthropic-version"] == "2023-06-01"
    assert sent["headers"]["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert anthropic_double.requests[1]["headers"]["anthropic-beta"] == \
        "interleaved-thinking-2025-05-14"
    turn = _turns(proxy, store)[0]
    assert turn["protocol"] == "anthropic" and turn["finish_reason"] == "tool_calls"
    assert turn["response"] == "Use: Fix crash on empty input"
    assert turn["usage"]["cache_read_input_tokens"] == 100
    assert turn["prompt_tokens"] == 112 and turn["completion_tokens"] == 30
    neutral = turn["request_messages"]
    assert [m["role"] for m in neutral] == ["system", "user", "assistant", "tool", "user"]
    assert neutral[2]["tool_calls"][0]["id"] == "toolu_01"


def test_pass_through_stream_is_byte_identical(workspace, anthropic_double):
    store, _ = workspace
    reply = AnthropicReply(THINKING_REPLY)
    anthropic_double.replies.extend([reply, reply, reply])
    request = {"model": MODEL, "max_tokens": 100, "stream": True,
               "messages": [{"role": "user", "content": "hello there"}]}
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        via_proxy = httpx.post(proxy.base_url + "/v1/messages", json=request).content
        direct = httpx.post(anthropic_double.base_url + "/v1/messages", json=request).content
        with _client(proxy).messages.stream(**{k: v for k, v in request.items()
                                               if k != "stream"}) as stream:
            final = stream.get_final_message()
    strip = [line for line in via_proxy.decode().splitlines() if '"id"' not in line]
    assert strip == [line for line in direct.decode().splitlines() if '"id"' not in line]
    assert final.content[0].type == "thinking" and final.content[0].signature == "sig-abc123"
    assert final.content[2].input == {"path": "CHANGELOG.md"}
    turn = _turns(proxy, store)[0]
    assert turn["stream"] == 1 and turn["status"] == "ok"
    assert turn["response"] == "Use: Fix crash on empty input"
    assert turn["tool_calls"][0]["function"]["name"] == "read_file"


def test_upstream_errors_relay_in_anthropic_shape(workspace, anthropic_double, openai_double):
    anthropic_double.replies.append(AnthropicReply(status=429, message="slow down",
                                                   headers={"retry-after": "3"}))
    openai_double.add(Reply("boom", status=500))
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        with pytest.raises(anthropic.RateLimitError) as caught:
            _client(proxy).messages.create(model=MODEL, max_tokens=10,
                                           messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {"type": "error", "error": {"type": "rate_limit_error",
                                                            "message": "slow down"}}
    assert caught.value.response.headers["retry-after"] == "3"
    with _proxy(workspace, openai_double, "openai") as proxy:
        with pytest.raises(anthropic.InternalServerError) as caught:
            _client(proxy).messages.create(model=MODEL, max_tokens=10,
                                           messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"] == {"type": "api_error", "message": "boom"}


def test_client_errors_in_anthropic_shape(workspace, openai_double):
    with _proxy(workspace, openai_double, "openai", token="tok-123456",
                max_body_bytes=4096) as proxy:
        url = proxy.base_url + "/v1/messages"
        ok = {"x-api-key": "tok-123456"}
        cases = [
            (httpx.post(url, content=b"{not json", headers=ok), 400, "invalid_request_error"),
            (httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                        headers=ok), 400, "invalid_request_error"),
            (httpx.post(url, json={"model": MODEL, "max_tokens": 5, "messages": [
                {"role": "system", "content": "x"}]}, headers=ok), 400, "invalid_request_error"),
            (httpx.post(url, json={"model": MODEL, "max_tokens": 5, "messages": []}),
             401, "authentication_error"),
            (httpx.post(url, json={"x": "y" * 5000}, headers=ok), 413, "request_too_large"),
            (httpx.get(url, headers=ok), 405, "invalid_request_error"),
        ]
        with pytest.raises(anthropic.AuthenticationError):
            _client(proxy, api_key="wrong-token").messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
        message = _client(proxy, api_key="tok-123456").messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert message.content[0].text == "echo: x"
    for response, status, kind in cases:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == kind, body
        assert body["error"]["message"]
    assert "max_tokens" in cases[1][0].json()["error"]["message"]
    assert "system messages alone" in cases[2][0].json()["error"]["message"]


def test_an_upstream_refusing_the_proxys_key_is_no_wrong_key_of_the_agents(
        workspace, anthropic_double, monkeypatch):
    """Anthropic's 401 says "invalid x-api-key". Relayed as it was, Claude Code retried it ten
    times (three minutes), then said "Invalid API key · Fix external API key" (it reads any
    error naming that header as its user's own key). The key refused is the proxy's: the agent
    gets a 403 permission_error, naming neither the header nor a key of its own."""
    monkeypatch.setenv("METACLAW_UPSTREAM_API_KEY", "sk-ant-proxy-key")
    anthropic_double.replies.append(AnthropicReply(status=401, message="invalid x-api-key"))
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        with pytest.raises(anthropic.PermissionDeniedError) as caught:
            _client(proxy).messages.create(model=MODEL, max_tokens=10,
                                           messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body["error"]
    assert error["type"] == "permission_error" and "x-api-key" not in error["message"].lower()
    assert error["message"].startswith("invalid API key [the upstream ")
    assert "refused the key the proxy sends ($METACLAW_UPSTREAM_API_KEY" in error["message"]
    # an upstream's own 403 to that key is relayed as it is, the header named so as well
    anthropic_double.replies.append(AnthropicReply(status=403, message="x-api-key lacks scope"))
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        with pytest.raises(anthropic.PermissionDeniedError) as caught:
            _client(proxy).messages.create(model=MODEL, max_tokens=10,
                                           messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["message"].startswith("API key lacks scope [the upstream ")


def test_anthropic_sdk_gets_its_error_shape_on_every_path(workspace, openai_double):
    """/v1/models and unknown paths belong to no protocol: an Anthropic SDK (it sends
    anthropic-version) gets Anthropic's error shape there too, an OpenAI SDK OpenAI's."""
    with _proxy(workspace, openai_double, "openai", token="tok-123456") as proxy:
        client = _client(proxy, api_key="wrong-token")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client.models.list()
        assert caught.value.body["type"] == "error", caught.value.body
        assert caught.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.NotFoundError) as caught:
            _client(proxy, api_key="tok-123456").get("/v1/no/such/path", cast_to=object)
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "not_found_error"
        assert "no route" in caught.value.body["error"]["message"]
        with pytest.raises(openai.AuthenticationError) as caught_openai:
            openai.OpenAI(base_url=proxy.url, api_key="wrong-token", max_retries=0).models.list()
        assert caught_openai.value.body["type"] == "authentication_error"  # error.* in OpenAI's


def test_anthropic_sdk_pdf_reaches_an_openai_upstream(workspace, openai_double):
    """A PDF document block (how Claude Code sends a PDF) reaches an OpenAI-compatible upstream
    as a file part; it used to be dropped without a word, the model answering without it."""
    pdf = base64.b64encode(b"%PDF-1.4 minimal").decode()
    with _proxy(workspace, openai_double, "openai") as proxy:
        message = _client(proxy).messages.create(model=MODEL, max_tokens=50, messages=[{
            "role": "user", "content": [
                {"type": "document", "title": "spec.pdf",
                 "source": {"type": "base64", "media_type": "application/pdf", "data": pdf}},
                {"type": "text", "text": "Summarize the spec."}]}])
    assert message.content[0].text == "echo: Summarize the spec."
    sent = openai_double.requests[-1]["body"]["messages"][-1]["content"]
    assert sent[0] == {"type": "file", "file": {
        "filename": "spec.pdf", "file_data": f"data:application/pdf;base64,{pdf}"}}


def test_count_tokens(workspace, anthropic_double, openai_double):
    request = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        counted = _client(proxy).messages.count_tokens(**request)
    # the upstream counted the request as the proxy would send it: with the skill block
    forwarded = anthropic_double.requests[-1]
    assert forwarded["path"] == "/v1/messages/count_tokens"
    assert BLOCK_HEADER in forwarded["body"]["system"][0]["text"]
    assert counted.input_tokens > len(QUESTION.split())
    with _proxy(workspace, openai_double, "openai") as proxy:
        estimated = _client(proxy).messages.count_tokens(**request)
        store = proxy.store
        proxy.flush()
    assert estimated.input_tokens > 50  # the estimate includes the injected skill block
    assert store.turns() == []  # counting is not a turn


# ---------------------------------------------------------------------------------------------
# OpenAI client -> Anthropic upstream (translation the other way)
# ---------------------------------------------------------------------------------------------
def test_openai_sdk_through_anthropic_upstream(workspace, anthropic_double):
    store, _ = workspace
    anthropic_double.replies.extend([AnthropicReply(THINKING_REPLY), AnthropicReply(THINKING_REPLY)])
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read",
                                               "parameters": READ_TOOL["input_schema"]}}]
    messages = [{"role": "system", "content": "You are a careful coding agent."},
                {"role": "user", "content": QUESTION}]
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        client = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                               tool_choice="required", stop="END")
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                     stream=True))
        anthropic_double.replies.append(AnthropicReply(THINKING_REPLY))
        with_usage = list(client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, stream=True,
            stream_options={"include_usage": True}))
    usage = [c.usage for c in with_usage if c.usage]  # asked for: relayed, as OpenAI sends it
    assert len(usage) == 1 and usage[0].prompt_tokens > 0 and not with_usage[-1].choices
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Use: Fix crash on empty input"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"path": "CHANGELOG.md"}
    assert reply.usage.prompt_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Use: Fix crash on empty input"
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in c.choices[0].delta.tool_calls or ())
    assert json.loads(args) == {"path": "CHANGELOG.md"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage
    sent = anthropic_double.requests[0]["body"]
    assert sent["system"].startswith("You are a careful coding agent.")
    assert BLOCK_HEADER in sent["system"] and sent["max_tokens"] == 4096
    assert sent["tool_choice"] == {"type": "any"} and sent["stop_sequences"] == ["END"]
    assert sent["tools"][0]["input_schema"] == READ_TOOL["input_schema"]
    turns = _turns(proxy, store)
    assert [t["protocol"] for t in turns] == ["openai", "openai", "openai"]
    assert all(t["finish_reason"] == "tool_calls" and t["status"] == "ok" for t in turns)
    assert turns[1]["completion_tokens"] and turns[1]["prompt_tokens"]


def test_openai_sdk_file_parts_and_n_with_an_anthropic_upstream(workspace, anthropic_double):
    """An OpenAI client's PDF (a file part) reaches an Anthropic upstream as a document block,
    never as the empty text block Anthropic refuses; n > 1, which Anthropic cannot answer, is
    a 400 naming n instead of one choice where the client reads several."""
    pdf = base64.b64encode(b"%PDF-1.4 minimal").decode()
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        client = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What does the report say?"},
            {"type": "file", "file": {"filename": "report.pdf",
                                      "file_data": f"data:application/pdf;base64,{pdf}"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}])
        assert reply.choices[0].message.content == "echo: What does the report say?"
        blocks = anthropic_double.requests[-1]["body"]["messages"][0]["content"]
        assert blocks == [{"type": "text", "text": "What does the report say?"},
                          {"type": "document", "title": "report.pdf", "source": {
                              "type": "base64", "media_type": "application/pdf", "data": pdf}}]
        sent = len(anthropic_double.requests)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, n=2,
                                           messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["param"] == "n" and "'n' is 2" in caught.value.body["message"]
        assert len(anthropic_double.requests) == sent  # refused before the upstream


def test_anthropic_upstream_dropping_mid_stream(workspace, anthropic_double):
    store, _ = workspace
    anthropic_double.replies.extend([AnthropicReply("one two three four five",
                                                    disconnect_after=4)] * 2)
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        with pytest.raises(anthropic.APIStatusError):
            with _client(proxy).messages.stream(model=MODEL, max_tokens=10,
                                                messages=[{"role": "user", "content": "hi"}]) as s:
                s.get_final_message()
        client = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError):
            list(client.chat.completions.create(model=MODEL, stream=True,
                                                messages=[{"role": "user", "content": "hi"}]))
    turns = _turns(proxy, store)
    assert [t["status"] for t in turns] == ["error", "error"]
    assert all("mid-stream" in t["error"] for t in turns)


# ---------------------------------------------------------------------------------------------
# caller-auth
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_caller_auth_forwards_the_callers_key(workspace, openai_double, anthropic_double,
                                              protocol, monkeypatch, tmp_path):
    monkeypatch.setenv("METACLAW_UPSTREAM_API_KEY", "sk-server-key-should-not-be-used")
    store, _ = workspace
    double = openai_double if protocol == "openai" else anthropic_double
    caller_key = "sk-caller-own-key-5e9d1c"
    with _proxy(workspace, double, protocol, caller_auth=True, token="team-token") as proxy:
        message = _client(proxy, api_key=caller_key,
                          default_headers={"X-MetaClaw-Token": "team-token"}).messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
        reply = openai.OpenAI(base_url=proxy.url, api_key=caller_key, max_retries=0,
                              default_headers={"X-MetaClaw-Token": "team-token"}
                              ).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])
        missing = httpx.post(proxy.base_url + "/v1/messages", headers={
            "X-MetaClaw-Token": "team-token"}, json={"model": MODEL, "max_tokens": 5, "messages": [
                {"role": "user", "content": "x"}]})
        no_token = httpx.post(proxy.url + "/chat/completions", headers={
            "Authorization": f"Bearer {caller_key}"}, json={"model": MODEL, "messages": [
                {"role": "user", "content": "x"}]})
        wrong = httpx.post(proxy.url + "/chat/completions", headers={
            "Authorization": f"Bearer {caller_key}", "X-MetaClaw-Token": "wrong"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        # Claude Code retries a 401 for minutes, saying nothing: a 403 naming its setting
        claude_code = httpx.post(proxy.base_url + "/v1/messages", headers={
            "x-api-key": caller_key, "X-MetaClaw-Token": "wrong",
            "User-Agent": "claude-cli/2.1.328 (external, cli)"},
            json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
        proxy.flush()
    assert message.content[0].text == "echo: hi" and reply.choices[0].message.content == "echo: hi"
    for sent in double.requests:
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        seen = headers.get("x-api-key") if protocol == "anthropic" else headers["authorization"]
        assert caller_key in seen and "server-key" not in json.dumps(headers)
        assert "team-token" not in json.dumps(headers)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert no_token.status_code == 401 and no_token.json()["error"]["code"] == "missing_token"
    # the fix it names is the token's own header, never "set the api_key to the token" (which
    # would send the team's token upstream as the member's key)
    assert wrong.status_code == 401 and "X-MetaClaw-Token" in wrong.json()["error"]["message"]
    assert "api_key" not in wrong.json()["error"]["message"].split("(")[0]
    assert claude_code.status_code == 403
    assert "ANTHROPIC_CUSTOM_HEADERS" in claude_code.json()["error"]["message"]
    store.close()
    data = (tmp_path / "metaclaw.db").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.glob("metaclaw.db-*"))
    assert caller_key.encode() not in data and b"team-token" not in data


def test_caller_key_is_scrubbed_from_upstream_errors(workspace, openai_double):
    caller_key = "sk-caller-echoed-77aa"
    openai_double.add(Reply(f"invalid key {caller_key}", status=401))
    with _proxy(workspace, openai_double, "openai", caller_auth=True) as proxy:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            _client(proxy, api_key=caller_key).messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
        proxy.flush()
        (turn,) = proxy.store.turns()
    assert caller_key not in json.dumps(caught.value.body)
    assert caller_key not in (turn["error"] or "") and "***" in turn["error"]


# ---------------------------------------------------------------------------------------------
# context budget
# ---------------------------------------------------------------------------------------------
def test_context_budget_cuts_skills_first(workspace, openai_double):
    store, _ = workspace
    question = "git commit message and git branch names for this fix?"
    with _proxy(workspace, openai_double, "openai", top_k=3,
                context_windows={MODEL: 400}) as proxy:
        _client(proxy).messages.create(model=MODEL, max_tokens=100,
                                       messages=[{"role": "user", "content": question}])
        openai.OpenAI(base_url=proxy.url, api_key="unused").chat.completions.create(
            model=MODEL, max_tokens=100, messages=[{"role": "user", "content": question}])
    turns = _turns(proxy, store)
    for turn in turns:
        budget = turn["context_budget"]
        assert budget["window"] == 400 and budget["reserved_output"] == 100
        assert budget["method"] == "estimate" and not budget["over_window"]
        assert "git-branch-names" in budget["cut"]  # the long skill did not fit
        assert turn["injected_skills"] == ["git-commit-messages"]
        assert budget["request_tokens"] + budget["reserved_output"] + budget["block_tokens"] <= 400
    assert COMMIT_BODY in openai_double.requests[0]["body"]["messages"][0]["content"]


def test_claude_codes_output_ask_is_cut_to_the_chat_models_limit(workspace, openai_double):
    """Claude Code asks for 128,000 output tokens, what Claude gives. In front of gpt-4o-mini
    (16,384 at most; a larger ask is a 400) the translated request asks for 16,384, and only
    that much is reserved, so the skills still fit its 128,000-token window."""
    store, _ = workspace
    with _proxy(workspace, openai_double, "openai", model="gpt-4o-mini") as proxy:
        with _client(proxy).messages.stream(  # as Claude Code asks: streamed
                model="claude-sonnet-4-5", max_tokens=128_000,
                messages=[{"role": "user", "content": QUESTION}]) as stream:
            stream.get_final_message()
        _client(proxy).messages.create(model="claude-sonnet-4-5", max_tokens=2_000,
                                       messages=[{"role": "user", "content": QUESTION}])
    cut, kept = (r["body"] for r in openai_double.requests)
    assert cut["model"] == "gpt-4o-mini" and cut["max_tokens"] == 16_384
    assert kept["max_tokens"] == 2_000
    first, second = _turns(proxy, store)
    assert "git-commit-messages" in first["injected_skills"]
    assert first["context_budget"]["reserved_output"] == 16_384
    assert first["context_budget"]["asked_output"] == 128_000
    assert "asked_output" not in second["context_budget"]
    # an unknown model: the operator says its limit
    with _proxy(workspace, openai_double, "openai", model="local-llama",
                max_output_tokens=4_096) as proxy:
        _client(proxy).messages.create(model="claude-sonnet-4-5", max_tokens=128_000,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       timeout=30)
    assert openai_double.requests[-1]["body"]["max_tokens"] == 4_096
    # no skill to fit (none matches the ask): the cut is recorded all the same
    with _proxy(workspace, openai_double, "openai", model="gpt-4o-mini") as proxy:
        _client(proxy).messages.create(model="claude-sonnet-4-5", max_tokens=128_000,
                                       messages=[{"role": "user", "content": "tell me a joke"}],
                                       timeout=30)
    (plain,) = _turns(proxy, store)[-1:]
    assert plain["injected_skills"] == [] and plain["context_budget"] == {
        "reserved_output": 16_384, "asked_output": 128_000}


def test_a_client_of_the_upstreams_own_protocol_keeps_its_output_ask(workspace, openai_double):
    with _proxy(workspace, openai_double, "openai") as proxy:
        openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0).chat.completions.create(
            model="gpt-4o-mini", max_tokens=100_000,
            messages=[{"role": "user", "content": QUESTION}])
    assert openai_double.requests[-1]["body"]["max_tokens"] == 100_000  # its own model: as sent


def test_request_already_over_the_window_passes_untouched(workspace, anthropic_double, caplog):
    store, _ = workspace
    request = {"model": MODEL, "max_tokens": 50, "system": "Be brief.",
               "messages": [{"role": "user", "content": QUESTION + " " + "context " * 300}]}
    with _proxy(workspace, anthropic_double, "anthropic", context_windows={MODEL: 200},
                tokenizer=lambda text: len(text.split())) as proxy:
        with caplog.at_level(logging.WARNING, logger="metaclaw.proxy"):
            _client(proxy).messages.create(**request)
    assert anthropic_double.requests[0]["body"] == request  # not a byte added
    (turn,) = _turns(proxy, store)
    assert turn["injected_skills"] == [] and turn["context_budget"]["over_window"]
    assert turn["context_budget"]["method"] == "tokenizer"
    assert "git-commit-messages" in turn["context_budget"]["cut"]
    assert any("already over" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# a real agent client (optional: runs where the Claude Code CLI is installed)
# ---------------------------------------------------------------------------------------------
def _claude_code() -> str | None:
    import os
    import shutil

    return os.environ.get("METACLAW_CLAUDE_CODE") or shutil.which("claude")


def _run_claude_code(proxy, tmp_path, *args: str):
    """Claude Code in print mode (``-p QUESTION``), offline, against ``proxy``."""
    import os
    import subprocess

    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": proxy.base_url,
           "ANTHROPIC_API_KEY": "sk-ant-offline", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return subprocess.run([_claude_code(), "-p", QUESTION, *args], cwd=tmp_path / "work",
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(_claude_code() is None, reason="the Claude Code CLI is not installed (npm "
                    "install @anthropic-ai/claude-code, or set METACLAW_CLAUDE_CODE to its binary)")
def test_claude_code_agent_through_the_proxy(workspace, anthropic_double, tmp_path):
    """Claude Code in print mode, offline: its real request (system blocks, a dozen tools,
    thinking, streaming) goes through the proxy to the Anthropic double and back."""
    store, _ = workspace
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        done = _run_claude_code(proxy, tmp_path, "--model", "claude-sonnet-4-5")
        turns = _turns(proxy, store)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("echo: ")  # the double's echo, relayed to the agent
    main = [t for t in turns if t["injected_skills"]]
    assert main and main[0]["protocol"] == "anthropic" and main[0]["status"] == "ok"
    assert "git-commit-messages" in main[0]["injected_skills"]
    assert main[0]["identified_by"]["session"] == "header:X-Claude-Code-Session-Id"
    assert len({t["session_id"] for t in turns}) == 1  # its side requests join its session
    sent = next(r["body"] for r in anthropic_double.requests if r["path"] == "/v1/messages"
                and r["body"].get("tools"))
    assert isinstance(sent["system"], list) and sent["system"][-1]["text"].startswith(BLOCK_HEADER)


def test_a_wrong_proxy_token_is_a_403_naming_claude_codes_setting_for_claude_code(
        workspace, anthropic_double):
    """To Claude Code (its User-Agent) a missing or wrong proxy token is a 403 naming the
    setting to fix, without the x-api-key header's name: it took the 401 for its login
    expiring (ten retries over three minutes, then "Not logged in"). Other clients keep the 401."""
    import httpx

    claude = {"User-Agent": "claude-cli/2.1.328 (external, cli)", "anthropic-version": "2023-06-01"}
    body = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with _proxy(workspace, anthropic_double, "anthropic", token="right") as proxy:
        for key, code in (("wrong", "invalid_token"), ("", "missing_token")):
            refused = httpx.post(f"{proxy.base_url}/v1/messages", json=body,
                                 headers={**claude, **({"x-api-key": key} if key else {})})
            error = refused.json()["error"]
            assert refused.status_code == 403 and error["type"] == "permission_error"
            assert "ANTHROPIC_AUTH_TOKEN" in error["message"]
            # wired, its settings.json holds the token and wins over the shell: wire it again
            assert "metaclaw wire claude-code" in error["message"]
            assert "x-api-key" not in error["message"].lower()
            assert error["message"].startswith(code.split("_")[0])
        with pytest.raises(anthropic.AuthenticationError):
            _client(proxy, api_key="wrong").messages.create(
                model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert not anthropic_double.requests


def test_claude_code_system_messages_in_the_conversation_translate_in_place():
    """Claude Code sends ``role: "system"`` messages inside ``messages`` (its environment and
    reminders): accepted, and kept as system messages where they are in the chat form (they were
    refused with a 400, and system messages with block content became user messages)."""
    import pathlib

    from metaclaw.protocols.anthropic_messages import ANTHROPIC
    from metaclaw.skills.asks import extract_ask

    captured = pathlib.Path(__file__).parent / "fixtures" / "requests"
    body = json.loads((captured / "claude-code" / "004.json").read_text())["body"]
    ANTHROPIC.parse_request(body, None)
    chat = ANTHROPIC.to_chat(body)
    roles = [m["role"] for m in chat["messages"]]
    wire = ["system"] + [m["role"] for m in body["messages"]]
    assert roles == wire and roles[2] == "system"
    assert isinstance(chat["messages"][2]["content"], str) and chat["messages"][2]["content"]
    assert extract_ask(chat["messages"]).text
    for key in ("thinking", "context_management", "output_config"):
        assert key not in chat
    tui = json.loads((captured / "claude-code-tui" / "002.json").read_text())["body"]
    assert ANTHROPIC.to_chat(tui)["response_format"]["json_schema"]["schema"]["required"] == [
        "title"]


@pytest.mark.skipif(_claude_code() is None, reason="the Claude Code CLI is not installed (npm "
                    "install @anthropic-ai/claude-code, or set METACLAW_CLAUDE_CODE to its binary)")
def test_claude_code_agent_on_a_chat_upstream(workspace, openai_double, tmp_path):
    """Claude Code in front of an OpenAI-compatible model ("Claude Code on another model"): its
    real requests, system messages inside the conversation included, are translated to chat
    completions and the replies back; the fitting skill is injected and the turn recorded."""
    store, _ = workspace
    with _proxy(workspace, openai_double, "openai") as proxy:
        # its default model: with it, Claude Code 2.1.328 sends system messages inside
        # ``messages`` (refused with a 400 before they were translated)
        done = _run_claude_code(proxy, tmp_path)
        turns = _turns(proxy, store)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert "echo: " in done.stdout  # the chat double's echo, translated back to the agent
    main = [t for t in turns if t["injected_skills"]]
    assert main and main[0]["protocol"] == "anthropic" and main[0]["status"] == "ok"
    assert "git-commit-messages" in main[0]["injected_skills"]
    assert main[0]["identified_by"]["session"] == "header:X-Claude-Code-Session-Id"
    assert len({t["session_id"] for t in turns}) == 1
    refused = [t for t in turns if t["status"] != "ok"]
    assert not refused, refused[0]["error"]
    sent = next(r["body"] for r in openai_double.requests
                if r["path"].endswith("/chat/completions") and r["body"].get("tools"))
    assert sent["messages"][0]["role"] == "system" and BLOCK_HEADER in sent["messages"][0]["content"]


@pytest.mark.skipif(_claude_code() is None, reason="the Claude Code CLI is not installed (npm "
                    "install @anthropic-ai/claude-code, or set METACLAW_CLAUDE_CODE to its binary)")
def test_claude_code_shows_a_wrong_proxy_token_at_once(workspace, anthropic_double, tmp_path):
    """The real Claude Code with a key that is not the proxy's token: it stops at once and
    shows what to set (it said "Not logged in · Please run /login" after three minutes)."""
    import time

    with _proxy(workspace, anthropic_double, "anthropic", token="the-proxy-token") as proxy:
        started = time.monotonic()
        done = _run_claude_code(proxy, tmp_path, "--model", "claude-sonnet-4-5")
        took = time.monotonic() - started
    shown = done.stdout + done.stderr
    assert done.returncode != 0 and took < 60, (took, shown[-2000:])
    assert "invalid proxy token" in shown and "ANTHROPIC_AUTH_TOKEN" in shown, shown[-2000:]
    assert "sk-ant-offline" not in shown and not anthropic_double.requests


@pytest.mark.skipif(_claude_code() is None, reason="the Claude Code CLI is not installed (npm "
                    "install @anthropic-ai/claude-code, or set METACLAW_CLAUDE_CODE to its binary)")
def test_claude_code_shows_an_unreachable_upstream_at_once(workspace, tmp_path):
    """The real Claude Code in front of an upstream that is down: the proxy's 502 (after its own
    retry) says not to retry, so Claude Code shows the proxy's message at once; it retried for
    minutes, saying nothing."""
    import socket
    import time
    from types import SimpleNamespace

    store, _ = workspace
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with _proxy(workspace, SimpleNamespace(base_url=down), "anthropic") as proxy:
        before = len(_turns(proxy, store))
        started = time.monotonic()
        done = _run_claude_code(proxy, tmp_path, "--model", "claude-sonnet-4-5")
        took = time.monotonic() - started
        turns = _turns(proxy, store)[before:]
    shown = done.stdout + done.stderr
    assert done.returncode != 0 and took < 60, (took, shown[-2000:])
    assert "cannot reach the upstream" in shown, shown[-2000:]
    assert [t["http_status"] for t in turns] == [502]


# ---------------------------------------------------------------------------------------------
# a local policy (the slow loop's responder) serving Anthropic clients
# ---------------------------------------------------------------------------------------------
class LocalPolicy:
    """A trivial responder answering in the chat shape, with the ``metaclaw`` object a trained
    policy attaches (kept from the client, recorded with the turn)."""

    policy_version = 5
    info = {"policy_version": 5, "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4],
            "completion_logprobs": [-0.1, -0.2]}

    async def complete(self, body):
        return {"id": "p-1", "object": "chat.completion", "created": 0, "model": "local",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": "from the policy"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "metaclaw": self.info}

    async def stream(self, body):
        base = {"id": "p-2", "object": "chat.completion.chunk", "created": 0, "model": "local"}
        for piece in ("from", " the", " policy"):
            yield {**base, "choices": [{"index": 0, "delta": {"content": piece},
                                        "finish_reason": None}]}
        yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "metaclaw": self.info}


def test_responder_serves_anthropic_clients(workspace, anthropic_double):
    store, _ = workspace
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        proxy.set_responder(LocalPolicy())
        client = _client(proxy)
        message = client.messages.create(model=MODEL, max_tokens=20,
                                          messages=[{"role": "user", "content": QUESTION}])
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=20, messages=[{"role": "user", "content": QUESTION}])
        with client.messages.stream(model=MODEL, max_tokens=20,
                                    messages=[{"role": "user", "content": QUESTION}]) as stream:
            streamed = stream.get_final_message()
    assert message.content[0].text == "from the policy" and message.stop_reason == "end_turn"
    assert "metaclaw" not in raw.http_response.text
    assert raw.http_response.headers["x-metaclaw-policy-version"] == "5"
    assert streamed.content[0].text == "from the policy"
    assert anthropic_double.requests == []  # the upstream was not used
    turns = _turns(proxy, store)
    assert [t["policy_version"] for t in turns] == [5, 5, 5]
    assert turns[2]["completion_tokens_ids"] == [3, 4] and turns[2]["protocol"] == "anthropic"


def test_context_budget_with_a_real_tokenizer(workspace, openai_double, tmp_path):
    pytest.importorskip("transformers", reason="the tokenizer test needs transformers "
                                               "(the training extra)")
    from metaclaw.offline.tinymodel import build_tokenizer

    build_tokenizer().backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    store, _ = workspace
    with _proxy(workspace, openai_double, "openai", context_windows={MODEL: 100_000},
                tokenizer=str(tmp_path / "tokenizer.json")) as proxy:
        _client(proxy).messages.create(model=MODEL, max_tokens=10,
                                       messages=[{"role": "user", "content": QUESTION}])
    budget = _turns(proxy, store)[0]["context_budget"]
    assert budget["method"] == f"tokenizer:{tmp_path / 'tokenizer.json'}"
    assert budget["cut"] == [] and 0 < budget["request_tokens"] < 200


def test_two_anthropic_runs_opening_alike_keep_their_own_sessions(workspace, openai_double):
    """Claude-style clients resend tool_use blocks (input objects) and move cache markers: two
    runs of one task with the same opening still land in two sessions, each turn in its own."""
    store, _ = workspace
    opening = [{"role": "user", "content": "Find the bug in src/app.py."}]
    other_call = {"function": {"name": "read_file", "arguments": '{"path": "src/other.py"}'}}
    openai_double.add(Reply(None, tool_calls=[CALL]), Reply(None, tool_calls=[other_call]),
                      Reply("run two: fixed"), Reply("run one: fixed"))
    with _proxy(workspace, openai_double, "openai") as proxy:
        client = _client(proxy)
        asked = dict(model=MODEL, max_tokens=200, system=SYSTEM, tools=[READ_TOOL])
        first = [client.messages.create(**asked, messages=opening) for _ in range(2)]
        for message in reversed(first):  # run two goes on first
            use = message.content[-1]
            client.messages.create(**asked, messages=[
                *opening, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input,
                     "cache_control": {"type": "ephemeral"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": f"contents of {use.input['path']}"}]}])
        turns = _turns(proxy, store)
    sessions: dict[str, list[dict]] = {}
    for turn in turns:
        sessions.setdefault(turn["session_id"], []).append(turn)
    assert len(sessions) == 2
    for rows in sessions.values():
        path = json.loads(rows[0]["tool_calls"][0]["function"]["arguments"])["path"]
        assert rows[1]["request_messages"][-1]["content"] == f"contents of {path}"
        assert rows[1]["response"] == ("run one: fixed" if path == "src/app.py"
                                       else "run two: fixed")


@pytest.mark.parametrize("upstream_protocol", ["openai", "anthropic"])
def test_each_sdk_lists_the_upstreams_models_in_its_own_shape(workspace, openai_double,
                                                             anthropic_double, upstream_protocol):
    """GET /v1/models serves both SDKs whatever the upstream speaks: the Anthropic SDK parses
    ModelInfo pages (type, display_name, created_at), the OpenAI SDK model objects; an Anthropic
    upstream is asked at its own /v1/models."""
    upstream = openai_double if upstream_protocol == "openai" else anthropic_double
    with _proxy(workspace, upstream, upstream_protocol) as proxy:
        listed = list(_client(proxy).models.list())
        listed_openai = list(openai.OpenAI(base_url=proxy.url, api_key="unused",
                                           max_retries=0).models.list())
    expected = MODEL if upstream_protocol == "openai" else "claude-double"
    assert [m.id for m in listed] == [expected] and listed[0].type == "model"
    assert [m.id for m in listed_openai] == [expected] and listed_openai[0].object == "model"
    if upstream_protocol == "anthropic":
        assert listed[0].display_name == "claude-double (double)"
        assert listed_openai[0].created == listed[0].created_at.timestamp() == 1767323045
        assert anthropic_double.requests[-1]["path"] == "/v1/models?limit=1000"


def test_the_configured_model_is_listed_in_the_anthropic_shape(workspace, openai_double):
    with _proxy(workspace, openai_double, "openai", model="pinned-model") as proxy:
        [model] = list(_client(proxy).models.list())
    assert model.id == "pinned-model" and model.display_name == "pinned-model"


def test_count_tokens_between_turns_leaves_alike_runs_in_their_own_sessions(workspace,
                                                                            anthropic_double):
    """A client that counts a request's tokens before sending it: the count is no turn, so it
    neither takes the session the run's opening is due nor the reply its next turn continues."""
    store, _ = workspace
    anthropic_double.replies = [AnthropicReply("run one opens"), AnthropicReply("run two opens"),
                                AnthropicReply("run two goes on"), AnthropicReply("run one goes on")]
    opening = [{"role": "user", "content": "Tidy the changelog."}]
    with _proxy(workspace, anthropic_double, "anthropic") as proxy:
        client = _client(proxy)
        histories = []
        for _ in range(2):
            client.messages.count_tokens(model=MODEL, messages=opening)
            reply = client.messages.create(model=MODEL, max_tokens=100, messages=opening)
            histories.append([*opening, {"role": "assistant", "content": reply.content[0].text},
                              {"role": "user", "content": "Go on."}])
        for history in reversed(histories):
            client.messages.count_tokens(model=MODEL, messages=history)
            client.messages.create(model=MODEL, max_tokens=100, messages=history)
        turns = _turns(proxy, store)
    by_session: dict[str, list[str]] = {}
    for turn in sorted(turns, key=lambda t: t["id"]):
        by_session.setdefault(turn["session_id"], []).append(turn["response"])
    fingerprint = min(by_session)
    assert by_session == {fingerprint: ["run one opens", "run one goes on"],
                          f"{fingerprint}.2": ["run two opens", "run two goes on"]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_without_arguments_keeps_its_run_in_its_session(workspace, openai_double,
                                                                    stream):
    """A chat server's call with no arguments ("") reaches the Anthropic client as input {},
    which it resends: the next turn still joins the run that got the call, not another run."""
    store, _ = workspace
    no_arguments = {"function": {"name": "list_files", "arguments": ""}}
    openai_double.add(Reply("run one: hello"), Reply(None, tool_calls=[no_arguments]),
                      Reply("run two: listed"))
    tool = {"name": "list_files", "description": "List the files.",
            "input_schema": {"type": "object", "properties": {}}}
    opening = [{"role": "user", "content": "Clean up the repository."}]
    with _proxy(workspace, openai_double, "openai") as proxy:
        client = _client(proxy)

        def create(messages):
            asked = dict(model=MODEL, max_tokens=100, tools=[tool], messages=messages)
            if not stream:
                return client.messages.create(**asked)
            with client.messages.stream(**asked) as events:
                return events.get_final_message()

        create(opening)
        second = create(opening)
        use = second.content[-1]
        assert use.type == "tool_use" and use.input == {}
        create([*opening, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "README.md"}]}])
        turns = sorted(_turns(proxy, store), key=lambda t: t["id"])
    assert turns[2]["session_id"] == turns[1]["session_id"] != turns[0]["session_id"]
    assert turns[2]["identified_by"]["session"] == "fingerprint:reply-thread"


@pytest.mark.parametrize("upstream_protocol", ["openai", "anthropic"])
def test_each_sdk_retrieves_one_model_or_gets_a_404_in_its_shape(workspace, openai_double,
                                                                anthropic_double,
                                                                upstream_protocol):
    """models.retrieve (GET /v1/models/{id}), which clients call to check a model before use,
    was not routed: both SDKs got a 404 for every model."""
    upstream = openai_double if upstream_protocol == "openai" else anthropic_double
    expected = MODEL if upstream_protocol == "openai" else "claude-double"
    with _proxy(workspace, upstream, upstream_protocol) as proxy:
        model = _client(proxy).models.retrieve(expected)
        plain = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
        model_openai = plain.models.retrieve(expected)
        with pytest.raises(anthropic.NotFoundError) as missing:
            _client(proxy).models.retrieve("no-such-model")
        with pytest.raises(openai.NotFoundError) as missing_openai:
            plain.models.retrieve("no-such-model")
    assert model.id == model_openai.id == expected
    assert model.type == "model" and model_openai.object == "model"
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "'no-such-model' does not exist" in missing.value.body["error"]["message"]
    assert missing_openai.value.body["code"] == "model_not_found"
