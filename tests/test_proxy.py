"""The proxy in front of the offline double, driven by the real openai client (sync and async).

Everything is real: both servers listen on 127.0.0.1 ephemeral ports, the store is a SQLite file,
skills are SKILL.md files retrieved with BM25 (one test uses the embedding retriever).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time

from typing import Any

import httpx
import openai
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.protocols.openai_chat import StreamAssembler
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.block import BLOCK_HEADER, render_block
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.skills.retrieval import ScoredSkill, make_retriever
from metaclaw.store import Store
from waiting import wait_until

TOKEN = "proxy-token-7f3a9c1e5b"
UPSTREAM_KEY = "sk-upstream-secret-4d2b8e6f0a"
KEY_ENV = "METACLAW_TEST_UPSTREAM_KEY"
COMMIT_BODY = "Write the subject line in the imperative mood, at most 50 characters."

SKILLS = [
    Skill("git-commit-messages", "How to write clear git commit messages for a change.",
          "coding", f"# Commit messages\n\n{COMMIT_BODY}"),
    Skill("sql-query-tuning", "Speed up slow SQL queries with indexes and query plans.",
          "data", "# SQL tuning\n\nRead the EXPLAIN plan before adding an index."),
    Skill("pytest-fixtures", "Structure pytest fixtures for fast isolated unit tests.",
          "testing", "# Fixtures\n\nPrefer function-scoped fixtures for mutable state."),
]
COMMIT_QUESTION = [{"role": "system", "content": "You are a careful assistant."},
                   {"role": "user", "content": "How should I word the git commit message for this fix?"}]


def _skill_dir(root) -> str:
    directory = root / "skills"
    for skill in SKILLS:
        (directory / skill.name).mkdir(parents=True)
        (directory / skill.name / "SKILL.md").write_text(skill.to_markdown())
    return str(directory)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("workspace")
    store = Store(root / "metaclaw.db")
    library = SkillLibrary(_skill_dir(root), store)
    yield store, library
    store.close()


@pytest.fixture(scope="module")
def double():
    with DoubleServer(models=("double-model", "other-model")) as server:
        yield server


@pytest.fixture(scope="module")
def upstream_key():
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = UPSTREAM_KEY
    yield UPSTREAM_KEY
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old


def _proxy(double, workspace, **overrides) -> Proxy:
    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, retrieval="lexical",
                         **overrides)
    return Proxy(config, store, library, make_retriever("lexical")).start()


@pytest.fixture(scope="module")
def proxy(double, workspace, upstream_key):
    """Default proxy: token auth, default retries and timeout."""
    p = _proxy(double, workspace, token=TOKEN)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def strict(double, workspace, upstream_key):
    """No retries, a short timeout and a small body limit: fast error paths. The timeout leaves
    a loaded 2-core machine time to relay an upstream's quick error (0.5 s did not, once)."""
    p = _proxy(double, workspace, max_retries=0, timeout=1.0, max_body_bytes=4096)
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def fresh_double(double):
    double.replies.clear()
    double.requests.clear()
    yield


def sync_client(proxy, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url, api_key=kw.pop("api_key", TOKEN), max_retries=0,
                         timeout=kw.pop("timeout", 10), **kw)


def last_turn(proxy) -> dict:
    proxy.flush()
    return proxy.store.turns(order="id DESC")[0]


def session_turns(proxy, session: str) -> list[dict]:
    """The session's turns once one is recorded (a turn whose client left is recorded when the
    proxy notices: on its next write, or when the upstream answers)."""
    def recorded() -> list[dict]:
        proxy.flush()
        return proxy.store.turns("session_id = ?", (session,))
    return wait_until(recorded, timeout=5, what=f"a turn of session {session!r}")


def upstream_body(double) -> dict:
    return [r for r in double.requests if r["path"] == "/v1/chat/completions"][-1]["body"]


# -- the happy paths -------------------------------------------------------------------------
def test_non_stream_injects_skills_forwards_and_records(proxy, double, workspace):
    store, library = workspace
    double.add(Reply("Use the imperative mood.", usage={"prompt_tokens": 40, "completion_tokens": 4,
                                                        "total_tokens": 44}))
    raw = sync_client(proxy).chat.completions.with_raw_response.create(
        model="gpt-test", messages=COMMIT_QUESTION, temperature=0.2,
        extra_headers={"X-Session-Id": "sess-1"}, extra_body={"session_id": "ignored-body-id"})
    out = raw.parse()
    assert out.choices[0].message.content == "Use the imperative mood."
    assert raw.headers["X-MetaClaw-Injected-Skills"].split(",")[0] == "git-commit-messages"
    assert raw.headers["X-MetaClaw-Skill-Generation"] == str(library.generation)

    sent = double.requests[-1]
    system = sent["body"]["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("You are a careful assistant.")
    assert BLOCK_HEADER.strip() in system["content"] and COMMIT_BODY in system["content"]
    assert sent["body"]["messages"][1:] == COMMIT_QUESTION[1:]
    assert sent["body"]["model"] == "gpt-test" and sent["body"]["temperature"] == 0.2
    assert "session_id" not in sent["body"]
    lowered = {k.lower(): v for k, v in sent["headers"].items()}
    assert "x-session-id" not in lowered
    assert lowered["authorization"] == f"Bearer {UPSTREAM_KEY}"  # the proxy's key, not the client's

    row = last_turn(proxy)
    assert row["session_id"] == "sess-1" and row["turn_type"] == "main"
    assert row["request_messages"] == sent["body"]["messages"]
    assert row["injected_skills"][0] == "git-commit-messages"
    assert row["skill_generation"] == library.generation and row["policy_version"] == 0
    assert row["response"] == "Use the imperative mood." and row["finish_reason"] == "stop"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (40, 4)
    assert row["status"] == "ok" and row["http_status"] == 200 and row["stream"] == 0
    assert row["request_params"] == {"temperature": 0.2}
    assert row["latency_ms"] > 0 and row["model"] == "gpt-test"


async def test_stream_is_relayed_incrementally_and_assembled(proxy, double):
    words = "alpha beta gamma delta epsilon zeta"
    double.add(Reply(words, chunk_delay=0.12))
    client = openai.AsyncOpenAI(base_url=proxy.url, api_key=TOKEN, max_retries=0, timeout=10)
    start = time.perf_counter()
    arrivals, text, usage = [], [], None
    stream = await client.chat.completions.create(
        model="m", messages=COMMIT_QUESTION, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "stream-1"})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - start)
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    await client.close()
    assert "".join(text) == words and len(text) == 6
    # the first word arrives long before the last: true streaming, not one buffered blob
    assert arrivals[-1] - arrivals[0] >= 0.45
    assert usage is not None and usage.completion_tokens == 6
    row = last_turn(proxy)
    assert row["stream"] == 1 and row["status"] == "ok" and row["session_id"] == "stream-1"
    assert row["response"] == words and row["finish_reason"] == "stop"
    assert row["completion_tokens"] == 6 and row["injected_skills"][0] == "git-commit-messages"
    assert COMMIT_BODY in row["request_messages"][0]["content"]


def test_stream_usage_recorded_even_when_client_did_not_ask(proxy, double):
    double.add(Reply("short answer"))
    chunks = list(sync_client(proxy).chat.completions.create(
        model="m", messages=COMMIT_QUESTION, stream=True))
    assert all(c.choices for c in chunks) and not any(c.usage for c in chunks)
    assert upstream_body(double)["stream_options"] == {"include_usage": True}
    row = last_turn(proxy)
    assert row["completion_tokens"] == 2 and row["usage"]["total_tokens"] > 2
    assert "stream_options" not in row["request_params"]


def test_tools_round_trip_plain_and_streamed(proxy, double):
    tools = [{"type": "function", "function": {
        "name": "run_git", "description": "Run a git command",
        "parameters": {"type": "object", "properties": {"args": {"type": "string"}}}}}]
    call = {"id": "call_1", "function": {"name": "run_git", "arguments": '{"args": "log --oneline -5"}'}}
    double.add(Reply(tool_calls=[call]), Reply(tool_calls=[call]), Reply("Done: 5 commits listed."))
    client = sync_client(proxy)
    session = {"X-Session-Id": "tools"}

    out = client.chat.completions.create(model="m", messages=COMMIT_QUESTION, tools=tools,
                                         extra_headers=session)
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.tool_calls[0].function.name == "run_git"
    assert upstream_body(double)["tools"] == tools
    plain = last_turn(proxy)
    assert plain["tool_calls"][0]["function"]["arguments"] == '{"args": "log --oneline -5"}'
    assert plain["finish_reason"] == "tool_calls" and plain["request_params"]["tools"] == tools

    deltas = []
    for chunk in client.chat.completions.create(model="m", messages=COMMIT_QUESTION, tools=tools,
                                                stream=True, extra_headers=session):
        deltas.extend(chunk.choices[0].delta.tool_calls or [])
    assert len(deltas) > 2
    streamed = last_turn(proxy)
    assert streamed["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "run_git", "arguments": '{"args": "log --oneline -5"}'}}]
    assert streamed["finish_reason"] == "tool_calls" and streamed["response"] is None

    follow_up = COMMIT_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": streamed["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a1 fix\nb2 feat\n"}]
    final = client.chat.completions.create(model="m", messages=follow_up, tools=tools,
                                           extra_headers=session)
    assert final.choices[0].message.content == "Done: 5 commits listed."
    sent = upstream_body(double)["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "a1 fix\nb2 feat\n"}
    assert sent[-2]["tool_calls"][0]["id"] == "call_1"
    proxy.flush()
    rows = proxy.store.turns("session_id = ?", ("tools",))
    assert [r["turn_index"] for r in rows] == [0, 1, 2]


def test_side_turns_are_not_injected(proxy, double):
    double.add(Reply("summary"))
    messages = [{"role": "user", "content": "Summarize the git commit message discussion"}]
    sync_client(proxy).chat.completions.create(model="m", messages=messages,
                                               extra_headers={"X-Turn-Type": "side"})
    assert upstream_body(double)["messages"] == messages
    row = last_turn(proxy)
    assert row["turn_type"] == "side" and row["injected_skills"] == []
    # no session header: the conversation's fingerprint, never a shared "default" session
    assert row["session_id"].startswith("conv-")
    assert row["identified_by"] == {"session": "fingerprint:first-user-message",
                                    "turn_type": "header:X-Turn-Type"}


def test_session_id_from_body_and_session_done(proxy, double, workspace):
    store, _ = workspace
    client = sync_client(proxy)
    client.chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                   extra_body={"session_id": "body-session"})
    proxy.flush()
    assert store.session("body-session")["done"] == 0
    client.chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                   extra_body={"session_id": "body-session"},
                                   extra_headers={"X-Session-Done": "true"})
    proxy.flush()
    assert store.session("body-session")["done"] == 1
    assert len(store.turns("session_id = ?", ("body-session",))) == 2


def test_models_health_and_configured_model(proxy, double, workspace):
    _, library = workspace
    assert [m.id for m in sync_client(proxy).models.list()] == ["double-model", "other-model"]
    health = httpx.get(proxy.url.removesuffix("/v1") + "/healthz", timeout=5).json()
    assert health["status"] == "ok" and health["skill_generation"] == library.generation
    assert health["upstream"] == double.url and health["policy_version"] == 0
    assert health["retrieval"] == "lexical" and health["auth"] is True

    pinned = _proxy(double, workspace, model="pinned-model")
    try:
        client = sync_client(pinned, api_key="anything")
        assert [m.id for m in client.models.list()] == ["pinned-model"]
        client.chat.completions.create(model="whatever", messages=COMMIT_QUESTION)
        assert upstream_body(double)["model"] == "pinned-model"
        assert last_turn(pinned)["model"] == "pinned-model"
        # what recording has cost so far: its transactions and their CPU time
        health = httpx.get(pinned.url.removesuffix("/v1") + "/healthz", timeout=5).json()
        assert health["record_commits"] == 1 and health["record_cpu_s"] > 0
    finally:
        pinned.stop()


# -- auth and request errors --------------------------------------------------------------------
def test_bearer_token_required(proxy, double):
    with pytest.raises(openai.AuthenticationError) as err:
        sync_client(proxy, api_key="wrong-token").chat.completions.create(
            model="m", messages=COMMIT_QUESTION)
    assert err.value.status_code == 401 and "invalid token" in err.value.message
    missing = httpx.post(proxy.url + "/chat/completions", json={"model": "m", "messages": COMMIT_QUESTION},
                         timeout=5)
    assert missing.status_code == 401
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert missing.json()["error"]["code"] == "missing_token"
    assert httpx.get(proxy.url + "/models", timeout=5).status_code == 401
    assert double.requests == []  # nothing reached the upstream


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "m"}).encode(), "messages"),
    (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
    (json.dumps({"model": "m", "messages": ["hi"]}).encode(), "messages[0]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), "stream"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), "temperature"),
])
def test_malformed_requests_get_400(strict, double, body, param):
    response = httpx.post(strict.url + "/chat/completions", content=body, timeout=5,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert double.requests == []


def test_bad_turn_type_and_unknown_route(strict):
    with pytest.raises(openai.BadRequestError) as err:
        sync_client(strict).chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                                    extra_headers={"X-Turn-Type": "sidecar"})
    assert "X-Turn-Type" in err.value.message
    missing = httpx.get(strict.url + "/nothing", timeout=5)
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]


def test_oversize_body_gets_413(strict, double):
    big = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(openai.APIStatusError) as err:
        sync_client(strict).chat.completions.create(model="m", messages=big)
    assert err.value.status_code == 413 and "max_body_bytes" in err.value.message

    def chunks():  # no Content-Length: the limit holds while reading too
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    response = httpx.post(strict.url + "/chat/completions", content=chunks(), timeout=5)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert double.requests == []


# -- upstream failures --------------------------------------------------------------------------
def test_upstream_429_and_500_are_relayed_and_recorded(strict, double):
    double.add(Reply(status=429, content="Rate limit reached for requests", headers={"retry-after": "3"}),
               Reply(status=500, content="upstream exploded"))
    client = sync_client(strict)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="m", messages=COMMIT_QUESTION)
    assert err.value.message.endswith("Rate limit reached for requests")
    assert err.value.response.headers["retry-after"] == "3"
    row = last_turn(strict)
    assert (row["status"], row["http_status"]) == ("error", 429)
    assert "Rate limit reached" in row["error"]
    assert row["injected_skills"][0] == "git-commit-messages"  # what was sent is kept

    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="m", messages=COMMIT_QUESTION, stream=True)
    assert err.value.status_code == 500 and "upstream exploded" in err.value.message
    assert "x-should-retry" not in err.value.response.headers  # the client may try again
    row = last_turn(strict)
    assert (row["status"], row["http_status"], row["stream"]) == ("error", 500, 1)


def test_non_stream_retries_a_transient_upstream_error(proxy, double):
    double.add(Reply(status=503, headers={"retry-after-ms": "20"}), Reply("recovered"))
    out = sync_client(proxy).chat.completions.create(model="m", messages=COMMIT_QUESTION)
    assert out.choices[0].message.content == "recovered"
    assert len(double.requests) == 2


def test_upstream_timeout_gets_504(strict, double):
    double.add(Reply("too late", delay=3.0))
    with pytest.raises(openai.APIStatusError) as err:
        sync_client(strict).chat.completions.create(model="m", messages=COMMIT_QUESTION)
    assert err.value.status_code == 504 and err.value.code == "upstream_timeout"
    assert "did not answer within 1 s" in err.value.message
    row = last_turn(strict)
    assert (row["status"], row["http_status"]) == ("error", 504)


def unreachable_proxy(workspace) -> Proxy:
    """A proxy whose upstream is a port that nothing listens on."""
    store, library = workspace
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = ProxyConfig(upstream_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=2)
    return Proxy(config, store, library, make_retriever("lexical"))


def test_unreachable_upstream_gets_502_and_no_upstream_503(workspace, upstream_key, caplog):
    store, library = workspace
    with unreachable_proxy(workspace) as p:
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as err:
                sync_client(p).chat.completions.create(model="m", messages=COMMIT_QUESTION)
            assert err.value.status_code == 502 and err.value.code == "upstream_unreachable"
        assert last_turn(p)["http_status"] == 502
    # whoever runs the proxy sees it too: one warning line, not one per turn
    lines = [r.getMessage() for r in caplog.records
             if r.name == "metaclaw.proxy" and "a turn failed (HTTP 502)" in r.getMessage()]
    assert len(lines) == 1 and "cannot reach the upstream" in lines[0]
    with Proxy(ProxyConfig(), store, library, make_retriever("lexical")) as p:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as err:
                sync_client(p).chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                                       stream=stream)
            assert err.value.status_code == 503 and "no upstream is configured" in err.value.message
        row = last_turn(p)
        assert (row["status"], row["http_status"]) == ("error", 503)


def test_an_unreachable_upstream_tells_clients_not_to_retry(workspace, upstream_key):
    """The proxy tried the unreachable upstream again itself: its 502 says ``x-should-retry:
    false``, so an SDK with retries on asks once and shows the message at once (Claude Code
    retried for minutes, saying nothing)."""
    store, _ = workspace
    with unreachable_proxy(workspace) as p:
        p.flush()
        before = len(store.turns())  # the workspace is the module's
        client = openai.OpenAI(base_url=p.url, api_key=TOKEN, max_retries=3, timeout=10)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                               stream=stream)
            assert err.value.code == "upstream_unreachable"
            assert err.value.response.headers["x-should-retry"] == "false"
        p.flush()
        assert len(store.turns()) == before + 2  # one request each, no retry
        # the model list is asked once, not retried by the proxy: the client may retry it
        models = httpx.get(p.url + "/models", headers={"Authorization": f"Bearer {TOKEN}"},
                           timeout=10)
        assert models.status_code == 502 and "x-should-retry" not in models.headers


def test_upstream_disconnect_mid_stream_ends_with_error_event(strict, double):
    double.add(Reply("one two three four five six", disconnect_after=4))
    received = []
    with pytest.raises(openai.APIError) as err:
        for chunk in sync_client(strict).chat.completions.create(
                model="m", messages=COMMIT_QUESTION, stream=True,
                extra_headers={"X-Session-Id": "dropped"}):
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "one", " two", " three"]
    assert "mid-stream" in err.value.message or "mid-stream" in str(err.value.body)
    row = last_turn(strict)
    assert row["status"] == "error" and row["session_id"] == "dropped"
    assert "mid-stream" in row["error"] and row["response"] == "one two three"

    double.add(Reply("x y", disconnect_after=2))
    with httpx.stream("POST", strict.url + "/chat/completions", timeout=5,
                      json={"model": "m", "messages": COMMIT_QUESTION, "stream": True}) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert response.status_code == 200
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_disconnected" and set(error) == {"message", "type", "param", "code"}


def test_upstream_stall_mid_stream_ends_with_timeout_event(strict, double):
    double.add(Reply("slow words here", chunk_delay=2.0))
    with pytest.raises(openai.APIError):
        for _ in sync_client(strict).chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                                             stream=True):
            pass
    row = last_turn(strict)
    assert row["status"] == "error" and "did not answer within 1 s mid-stream" in row["error"]


def test_client_disconnect_mid_stream_is_recorded(strict, double):
    double.add(Reply("w " * 40, chunk_delay=0.05))
    with httpx.stream("POST", strict.url + "/chat/completions", timeout=5,
                      json={"model": "m", "messages": COMMIT_QUESTION, "stream": True,
                            "session_id": "walked-away"}) as response:
        next(response.iter_bytes())
    rows = session_turns(strict, "walked-away")
    assert rows[0]["status"] == "client_disconnected" and "client disconnected" in rows[0]["error"]


def test_a_client_that_gave_up_before_the_reply_is_not_recorded_as_served(proxy, double):
    """An SDK timeout while the upstream thinks: the upstream request is cancelled (nobody
    would read its reply) and the turn is client_disconnected (never judged or trained on)."""
    double.add(Reply("a late answer", delay=1.0))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(proxy.url + "/chat/completions", timeout=0.3,
                   headers={"Authorization": f"Bearer {TOKEN}"},
                   json={"model": "m", "messages": COMMIT_QUESTION, "session_id": "gave-up"})
    rows = session_turns(proxy, "gave-up")
    assert rows[0]["status"] == "client_disconnected" and rows[0]["response"] is None
    assert "before the reply; the upstream request was cancelled" in rows[0]["error"]


def test_a_resent_skill_block_is_replaced_never_doubled(proxy, double):
    """Agents resend their whole history, system prompt included: the block an earlier turn got
    is replaced by this turn's, or taken out when this turn gets no skill."""
    client = sync_client(proxy)
    double.add(Reply("first"), Reply("second"), Reply("third"))
    client.chat.completions.create(model="m", messages=COMMIT_QUESTION)
    injected = double.requests[-1]["body"]["messages"][0]  # the system prompt with its block
    again = [injected, *COMMIT_QUESTION[1:], {"role": "assistant", "content": "first"},
             {"role": "user", "content": "And the commit message body?"}]
    client.chat.completions.create(model="m", messages=again)
    system = double.requests[-1]["body"]["messages"][0]["content"]
    assert system.count(BLOCK_HEADER.strip()) == 1
    small_talk = [injected, {"role": "user", "content": "zzz qqq"}]  # retrieves nothing
    client.chat.completions.create(model="m", messages=small_talk)
    assert double.requests[-1]["body"]["messages"][0]["content"] == COMMIT_QUESTION[0]["content"]


def test_building_the_lexical_index_never_stalls_other_requests(double, workspace):
    """The index of a large library takes seconds to build: that happens in the retrieval
    pool, while the event loop keeps answering (here /healthz)."""
    from metaclaw.skills.retrieval import LexicalRetriever

    building, release = threading.Event(), threading.Event()

    class SlowToBuild(LexicalRetriever):
        def _build(self, skills):
            building.set()
            release.wait(10)  # as 10,000 skills take seconds
            return super()._build(skills)

    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, retrieval="lexical")
    slow = Proxy(config, store, library, SlowToBuild()).start()
    try:
        double.add(Reply("ok"))
        chat = threading.Thread(target=lambda: sync_client(slow).chat.completions.create(
            model="m", messages=COMMIT_QUESTION))
        chat.start()
        assert building.wait(10)  # the chat is building the index now
        assert httpx.get(slow.url.removesuffix("/v1") + "/healthz", timeout=5).status_code == 200
        assert not release.is_set() and chat.is_alive()  # answered while the build still runs
        release.set()
        chat.join(10)
    finally:
        slow.stop()


def test_a_resent_block_is_found_when_the_client_escapes_angle_brackets(proxy, double):
    """Go's and .NET's JSON encoders write "<" as \\u003c: the block is taken out all the same."""
    double.add(Reply("ok"))
    block = render_block([ScoredSkill(SKILLS[0], 1.0)])
    body = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": f"Be brief.\n\n{block}"},
        {"role": "user", "content": "zzz qqq"}]}).replace("<", "\\u003c").replace(">", "\\u003e")
    reply = httpx.post(proxy.url + "/chat/completions", content=body, timeout=10,
                       headers={"Authorization": f"Bearer {TOKEN}",
                                "Content-Type": "application/json"})
    assert reply.status_code == 200
    assert double.requests[-1]["body"]["messages"][0]["content"] == "Be brief."


def test_a_custom_lexical_retriever_without_an_index_check_still_serves(double, workspace):
    """``indexed`` is not part of the Retriever protocol: a retriever without it runs in the
    retrieval pool."""
    from metaclaw.skills.retrieval import LexicalRetriever

    class Logged:
        kind, default_min_score = "lexical", 1e-9

        def __init__(self):
            self.inner = LexicalRetriever()

        def rank(self, query, skills, *, limit=None):
            return self.inner.rank(query, skills, limit=limit)

    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, retrieval="lexical")
    custom = Proxy(config, store, library, Logged()).start()
    try:
        double.add(Reply("ok"))
        raw = sync_client(custom).chat.completions.with_raw_response.create(
            model="m", messages=COMMIT_QUESTION)
        assert raw.headers["X-MetaClaw-Injected-Skills"].split(",")[0] == "git-commit-messages"
    finally:
        custom.stop()


# -- recording hygiene, listeners, seams --------------------------------------------------------
@pytest.mark.sqlite_only  # reads the database files' bytes
def test_no_secret_reaches_the_store_file(proxy, double, workspace):
    store, _ = workspace
    client = sync_client(proxy)
    double.add(Reply(status=401, content=f"Incorrect API key provided: {UPSTREAM_KEY}."))
    with pytest.raises(openai.PermissionDeniedError) as err:  # an upstream echoing the key
        client.chat.completions.create(model="m", messages=COMMIT_QUESTION)
    assert "Incorrect API key provided: ***. [the upstream" in err.value.message
    assert "refused the key the proxy sends ($METACLAW_TEST_UPSTREAM_KEY" in err.value.message
    client.chat.completions.create(model="m", messages=COMMIT_QUESTION)
    list(client.chat.completions.create(model="m", messages=COMMIT_QUESTION, stream=True))
    with pytest.raises(openai.AuthenticationError):
        sync_client(proxy, api_key=TOKEN + "x").chat.completions.create(model="m", messages=COMMIT_QUESTION)
    proxy.flush()
    assert any(r["headers"].get("Authorization") == f"Bearer {UPSTREAM_KEY}" for r in double.requests)
    data = b"".join(p.read_bytes() for p in store.path.parent.glob(store.path.name + "*"))
    assert len(data) > 0 and b"git-commit-messages" in data
    for secret in (TOKEN, UPSTREAM_KEY):
        assert secret.encode() not in data


def test_turn_listeners_run_off_the_loop_and_errors_are_contained(proxy, double, caplog):
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def broken(turn_id):
        raise RuntimeError("listener bug")

    def listener(turn_id):
        seen.append((turn_id, threading.current_thread().name))
        done.set()

    proxy.add_turn_listener(broken)
    proxy.add_turn_listener(listener)
    try:
        with caplog.at_level(logging.ERROR, logger="metaclaw.proxy"):
            sync_client(proxy).chat.completions.create(model="m", messages=COMMIT_QUESTION)
            assert done.wait(5)
        turn_id, thread = seen[0]
        assert proxy.store.turn(turn_id)["response"].startswith("echo:")
        assert thread.startswith("metaclaw-listeners")
        assert "listener bug" in caplog.text
    finally:
        proxy.remove_turn_listener(broken)
        proxy.remove_turn_listener(listener)


class LocalPolicy:
    """A trivial responder (the slow loop's seam): answers with a fixed text."""

    policy_version = 7
    model = "local-policy"

    def __init__(self):
        self.bodies = []

    async def complete(self, body):
        self.bodies.append(body)
        return {"id": "local-1", "object": "chat.completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "from the local policy"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}

    async def stream(self, body):
        self.bodies.append(body)
        for piece in ("from", " the", " local", " policy"):
            await asyncio.sleep(0)
            yield {"id": "local-2", "object": "chat.completion.chunk", "created": 0,
                   "model": self.model, "choices": [{"index": 0, "delta": {"content": piece},
                                                     "finish_reason": None}]}
        yield {"id": "local-2", "object": "chat.completion.chunk", "created": 0, "model": self.model,
               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


def test_responder_seam(proxy, double):
    policy = LocalPolicy()
    with pytest.raises(TypeError):
        proxy.set_responder(object())
    proxy.set_responder(policy)
    try:
        client = sync_client(proxy)
        out = client.chat.completions.create(model="m", messages=COMMIT_QUESTION)
        assert out.choices[0].message.content == "from the local policy"
        row = last_turn(proxy)
        assert row["policy_version"] == 7 and row["completion_tokens"] == 4
        assert COMMIT_BODY in policy.bodies[0]["messages"][0]["content"]  # skills still injected
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=COMMIT_QUESTION, stream=True))
        assert text == "from the local policy"
        assert last_turn(proxy)["response"] == text and last_turn(proxy)["policy_version"] == 7
        assert [m.id for m in client.models.list()] == ["local-policy"]
        assert httpx.get(proxy.url[:-3] + "/healthz").json()["policy_version"] == 7
        assert double.requests == []  # the upstream was not used
    finally:
        proxy.set_responder(None)
    sync_client(proxy).chat.completions.create(model="m", messages=COMMIT_QUESTION)
    assert last_turn(proxy)["policy_version"] == 0 and len(double.requests) == 1


class BlockedRetriever:
    """A retriever that does not answer until released (stands in for a heavy embedding model)."""

    kind = "slow"
    default_min_score = 0.0

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def rank(self, query, skills):
        self.entered.set()
        self.release.wait(10)
        return [ScoredSkill(s, 1.0) for s in sorted(skills, key=lambda s: s.name)]


def test_retrieval_never_blocks_the_event_loop(double, workspace, upstream_key):
    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, top_k=1)
    retriever = BlockedRetriever()
    with Proxy(config, store, library, retriever) as p:
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=sync_client(p).chat.completions.create(
            model="m", messages=COMMIT_QUESTION)))
        worker.start()
        try:
            assert retriever.entered.wait(10)
            # answered while retrieval is still held (a blocked loop could not answer at all)
            assert httpx.get(p.url[:-3] + "/healthz", timeout=5).status_code == 200
            assert worker.is_alive() and not retriever.release.is_set()
        finally:
            retriever.release.set()
        worker.join(10)
        assert result["out"].choices[0].message.content.startswith("echo:")
        assert last_turn(p)["injected_skills"] == ["git-commit-messages"]


async def test_concurrent_streams_are_all_relayed_and_recorded(proxy, double):
    double.replies.extend(Reply(f"answer {i} done", chunk_delay=0.02) for i in range(12))
    client = openai.AsyncOpenAI(base_url=proxy.url, api_key=TOKEN, max_retries=0, timeout=20)

    async def one(i):
        stream = await client.chat.completions.create(
            model="m", messages=COMMIT_QUESTION, stream=True,
            extra_headers={"X-Session-Id": f"parallel-{i % 3}"})
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    texts = await asyncio.gather(*(one(i) for i in range(12)))
    await client.close()
    assert sorted(texts) == sorted(f"answer {i} done" for i in range(12))
    await asyncio.to_thread(proxy.flush)
    rows = proxy.store.turns("session_id LIKE 'parallel-%'")
    assert sorted(r["response"] for r in rows) == sorted(texts)
    for session in ("parallel-0", "parallel-1", "parallel-2"):
        assert sorted(r["turn_index"] for r in rows if r["session_id"] == session) == [0, 1, 2, 3]


def test_stop_and_restart(double, workspace, upstream_key):
    store, library = workspace
    p = Proxy(ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV), store, library,
              make_retriever("lexical"))
    for _ in range(2):
        with p:
            assert p.running and p.url.startswith("http://127.0.0.1:")
            out = sync_client(p).chat.completions.create(model="m", messages=COMMIT_QUESTION)
            assert out.choices[0].message.content.startswith("echo:")
        assert not p.running
        with pytest.raises(httpx.HTTPError):
            httpx.get(p.url[:-3] + "/healthz", timeout=1)


def test_stream_assembler_merges_tool_call_deltas_by_index():
    assembler = StreamAssembler()
    for chunk in [
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "b", "type": "function", "function": {"name": "second", "arguments": ""}},
            {"index": 0, "id": "a", "type": "function", "function": {"name": "first", "arguments": '{"x"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}, {"index": 1, "function": {"arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    ]:
        assembler.add(chunk)
    assert [c["function"] for c in assembler.tool_calls] == [
        {"name": "first", "arguments": '{"x": 1}'}, {"name": "second", "arguments": "{}"}]
    assert assembler.finish_reason == "tool_calls" and assembler.usage["completion_tokens"] == 2
    assert assembler.content is None


def test_embedding_retrieval_finds_a_paraphrase(double, workspace, upstream_key):
    pytest.importorskip("sentence_transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    store, library = workspace
    # MiniLM: the static default ranks this ask (no word in common with the skill) first by a
    # hair, below its threshold (tests/test_retrieval.py measures both)
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, retrieval="embedding",
                         embedding_model="minilm", top_k=1)
    with Proxy(config, store, library) as p:
        assert p.retriever.kind == "embedding"
        messages = [{"role": "user", "content": "My database report takes minutes to load; "
                                                "how can I make it faster?"}]
        sync_client(p).chat.completions.create(model="m", messages=messages)
        assert last_turn(p)["injected_skills"] == ["sql-query-tuning"]
        assert "EXPLAIN plan" in upstream_body(double)["messages"][0]["content"]


SERVE_SCRIPT = """
import sys
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.retrieval import make_retriever
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store
store = Store(sys.argv[2])
library = SkillLibrary(sys.argv[3], store)
proxy = Proxy(ProxyConfig(upstream_url=sys.argv[1]), store, library, make_retriever("lexical"))
proxy.serve_forever(on_ready=lambda url: print(url, flush=True))
print("stopped", flush=True)
"""


def test_serve_forever_in_the_foreground_stops_cleanly_on_sigterm(double, tmp_path):
    import signal
    import subprocess
    import sys

    skills = _skill_dir(tmp_path)
    db = tmp_path / "serve.db"
    double.add(Reply("served in the foreground"))
    process = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, double.url, str(db), skills],
                               stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        out = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=10).chat.completions.create(
            model="m", messages=COMMIT_QUESTION)
        assert out.choices[0].message.content == "served in the foreground"
        process.send_signal(signal.SIGTERM)
        assert process.stdout.read().strip() == "stopped" and process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
    with Store(db) as store:  # the turn answered just before SIGTERM is on disk
        (row,) = store.turns()
        assert row["response"] == "served in the foreground"
        assert row["injected_skills"][0] == "git-commit-messages"


@pytest.mark.parametrize("path, body, ends", [
    ("/chat/completions", {"messages": COMMIT_QUESTION},
     lambda text: '"code":"proxy_stopped"' in text.split("data: ")[-1]),
    ("/responses", {"input": COMMIT_QUESTION[-1]["content"]},
     lambda text: "event: error" in text and text.rstrip().split("\n\n")[-1].startswith(
         "event: response.failed") and "proxy_stopped" in text.split("event: error")[-1]),
])
def test_a_stream_still_open_when_the_proxy_stops_ends_with_an_error_event(
        double, workspace, upstream_key, path, body, ends):
    """Stopped with a reply still streaming, the proxy waits its grace period, then ends the
    stream with the client protocol's error event (Responses: numbered ``error`` and
    ``response.failed``), so the agent says why, and records the turn as cancelled."""
    p = _proxy(double, workspace)
    double.add(Reply("one two three four five six seven eight nine ten eleven twelve",
                     chunk_delay=0.6))
    got: list[bytes] = []
    try:
        with httpx.stream("POST", p.url + path, json={"model": "m", "stream": True, **body},
                          timeout=30) as reply:
            stopper = None
            for chunk in reply.iter_raw():  # a whole reply: no transport error at its end
                got.append(chunk)
                if stopper is None:
                    stopper = threading.Thread(target=p.stop)
                    stopper.start()
            stopper.join(20)
    finally:
        p.stop()
    text = b"".join(got).decode()
    assert ends(text), text[-600:]
    row = p.store.turns(order="id")[-1]  # recorded before the proxy stopped
    assert row["status"] == "cancelled" and "the proxy stopped" in row["error"], row


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_waiting_on_the_upstream_when_the_proxy_stops_gets_a_503(
        double, workspace, upstream_key, stream):
    """Before the reply's first byte, a request cut off by the stop gets a 503 in its protocol's
    error shape (SDKs retry it), not a dropped connection."""
    p = _proxy(double, workspace)
    double.add(Reply("too late", delay=8))
    replies: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: replies.append(httpx.post(
        p.url + "/chat/completions", json={"model": "m", "stream": stream,
                                           "messages": COMMIT_QUESTION}, timeout=30)))
    seen = len(double.requests)
    asking.start()
    wait_until(lambda: len(double.requests) > seen, what="the request at the upstream")
    p.stop()
    asking.join(20)
    (reply,) = replies
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "proxy_stopped"
    row = p.store.turns(order="id")[-1]
    assert (row["status"], row["http_status"]) == ("cancelled", 503)


def test_a_second_ctrl_c_while_stopping_waits_for_the_turns_in_flight_to_be_recorded(
        double, tmp_path):
    """Ctrl-C pressed twice (a habit): the second one is said to wait, and the turn cut off by
    the stop is still recorded as cancelled; the client's stream ends whole."""
    import signal
    import subprocess
    import sys

    db = tmp_path / "serve.db"
    double.add(Reply("one two three four five six seven eight nine ten", chunk_delay=0.5))
    process = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, double.url, str(db),
                                _skill_dir(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        with httpx.stream("POST", url + "/chat/completions", timeout=30, json={
                "model": "m", "stream": True, "messages": COMMIT_QUESTION}) as reply:
            chunks = reply.iter_raw()
            next(chunks)
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            text = b"".join(chunks).decode()
        out, err = process.communicate(timeout=20)
        assert process.returncode == 0 and out.strip() == "stopped", err
    finally:
        if process.poll() is None:
            process.kill()
    assert "proxy_stopped" in text.split("data: ")[-1] and "still stopping" in err, err
    with Store(db) as store:
        (row,) = store.turns()
        assert row["status"] == "cancelled"


def test_a_server_that_cannot_listen_says_whether_the_host_or_the_port_is_wrong():
    from aiohttp import web

    from metaclaw.proxy.server import BackgroundServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}: .*choose another port"):
            BackgroundServer(web.Application, "127.0.0.1", port).start()
    with pytest.raises(OSError, match="192.0.2.1:0: .*192.0.2.1 is not an address of this"):
        BackgroundServer(web.Application, "192.0.2.1", 0).start()  # TEST-NET: not this host's


def test_a_request_still_in_retrieval_when_the_proxy_stops_gets_a_503(
        double, workspace, upstream_key):
    """Retrieval in the pool (a cold embedding model, a large index) when the stop comes: the
    request is cut off with the 503 ``proxy_stopped`` too, not a dropped connection."""
    from metaclaw.skills.retrieval import LexicalRetriever

    building = threading.Event()

    class SlowToBuild(LexicalRetriever):
        def _build(self, skills):
            building.set()
            time.sleep(4)  # past the grace period
            return super()._build(skills)

    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, retrieval="lexical")
    p = Proxy(config, store, library, SlowToBuild()).start()
    replies: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: replies.append(httpx.post(
        p.url + "/chat/completions", json={"model": "m", "messages": COMMIT_QUESTION},
        timeout=30)))
    asking.start()
    assert building.wait(10)  # the warm-up or the request: either way the request waits for it
    wait_until(lambda: p._in_flight, what="the request in flight")
    p.stop()
    asking.join(20)
    (reply,) = replies
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "proxy_stopped"


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_waiting_for_its_record_when_the_proxy_stops_is_still_delivered(
        double, workspace, upstream_key, stream):
    """The reply is done but its record waits for the store (another process holds the write
    lock) when the stop cuts requests off: the record is kept, so the reply goes out whole, not
    a turn recorded as served that its client never got."""
    import sqlite3

    store, _ = workspace
    if getattr(store, "path", None) is None:
        pytest.skip("holds a SQLite workspace's write lock")
    p = _proxy(double, workspace)
    double.add(Reply("one two three"))
    lock = sqlite3.connect(store.path, timeout=10, check_same_thread=False)
    lock.execute("BEGIN IMMEDIATE")  # another process writing
    got: dict[str, Any] = {}

    def ask() -> None:
        with httpx.stream("POST", p.url + "/chat/completions", timeout=30, json={
                "model": "m", "stream": stream, "messages": COMMIT_QUESTION}) as reply:
            got["status"], got["text"] = reply.status_code, b"".join(reply.iter_raw()).decode()

    seen = len(double.requests)
    asking = threading.Thread(target=ask)
    asking.start()
    try:
        wait_until(lambda: len(double.requests) > seen, what="the request at the upstream")
        time.sleep(0.5)  # the reply is done; its acknowledgement waits for the commit
        threading.Timer(3.0, lock.rollback).start()  # the lock goes after the grace period
        p.stop()
    finally:
        asking.join(20)
        lock.close()
    assert got["status"] == 200 and "three" in got["text"], got
    assert ("[DONE]" in got["text"]) is stream
    assert store.turns(order="id")[-1]["status"] == "ok"


def test_a_cancel_while_a_streams_error_event_goes_out_still_records_the_turn(
        double, workspace, upstream_key, monkeypatch):
    """The upstream cut its stream; as the proxy writes the error event, the handler is
    cancelled (the client left, or the proxy stopped): the failed turn is recorded anyway."""
    from metaclaw.proxy import pipeline

    real = pipeline._Relay.write

    async def write(self, response, data):
        if b"upstream_truncated" in data or b'"error"' in data:
            raise asyncio.CancelledError()
        return await real(self, response, data)

    monkeypatch.setattr(pipeline._Relay, "write", write)
    p = _proxy(double, workspace)
    try:
        double.add(Reply("one two three four five", disconnect_after=2))
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("POST", p.url + "/chat/completions", timeout=30,
                              headers={"X-Session-Id": "cut-as-it-failed"}, json={
                    "model": "m", "stream": True, "messages": COMMIT_QUESTION}) as reply:
                b"".join(reply.iter_raw())
        p.flush()
        wait_until(lambda: [t for t in p.store.turns(order="id")
                            if t["session_id"] == "cut-as-it-failed"], what="the turn's record")
        (row,) = [t for t in p.store.turns(order="id") if t["session_id"] == "cut-as-it-failed"]
        assert row["status"] == "error" and row["error"]
    finally:
        p.stop()


EARLY_SIGTERM_SCRIPT = """
import asyncio, os, signal
from metaclaw.proxy.server import BackgroundServer

class Server(BackgroundServer):  # SIGTERM lands while the socket opens, as from a supervisor
    async def _open(self):
        await super()._open()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.2)

Server(lambda: __import__("aiohttp").web.Application()).serve_forever(
    on_ready=lambda: print("ready", flush=True))
print("stopped", flush=True)
# Ctrl-C and SIGTERM are the process's again (uvloop leaves its own handlers behind)
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
"""


def test_a_sigterm_while_the_socket_opens_is_kept_and_stops_the_server():
    """A stop that arrives between listening and serving is not lost (the server would then
    serve on until killed) and does not end in a traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EARLY_SIGTERM_SCRIPT], capture_output=True,
                          text=True, timeout=30)
    assert (done.returncode, done.stdout.split(), done.stderr) == (
        0, ["ready", "stopped", "True", "True"], "")


def test_runs_of_one_task_without_a_session_id_are_kept_apart_by_their_replies(proxy, double):
    """A harness runs one task twice at once, without a session id: both runs open with the same
    message, so one fingerprint. Each later turn resends the reply it answers, and joins the
    run that got that reply; an opening retried after an upstream error stays in its session."""
    client = sync_client(proxy)
    opening = [{"role": "user", "content": "Tidy the release notes for run-alike-7."}]
    call = {"id": "call_a", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "NOTES.md"}'}}
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    double.add(Reply("I will start with the headings."),  # run A opens
               Reply(status=400, content="context too long"),  # run B's opening fails once
               Reply(None, tool_calls=[call]),  # run B's retry
               Reply("B: done"), Reply("A: done"))
    a1 = client.chat.completions.create(model="m", messages=opening)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=opening)
    b1 = client.chat.completions.create(model="m", messages=opening, tools=tools)
    b_history = [*opening, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",  # re-serialised arguments, as clients do
         "function": {"name": "read_file", "arguments": '{ "path":"NOTES.md" }'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "# Notes"}]
    client.chat.completions.create(model="m", messages=b_history, tools=tools)
    a_history = [*opening, {"role": "assistant", "content": a1.choices[0].message.content},
                 {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="m", messages=a_history)
    assert b1.choices[0].message.tool_calls
    proxy.flush()
    rows = [r for r in proxy.store.turns(order="id")
            if r["request_messages"][0] == opening[0]]
    sessions = {r["session_id"] for r in rows}
    assert len(sessions) == 2
    by_session = {s: [r for r in rows if r["session_id"] == s] for s in sessions}
    first, second = sorted(by_session, key=len)  # A: two turns; B: a failure, a retry, a turn
    assert [r["response"] for r in by_session[first]] == ["I will start with the headings.",
                                                          "A: done"]
    assert [r["status"] for r in by_session[second]] == ["error", "ok", "ok"]
    assert by_session[second][-1]["response"] == "B: done"
    assert second == f"{first}.2"
    assert [r["identified_by"]["session"] for r in by_session[first]] == [
        "fingerprint:first-user-message", "fingerprint:reply-thread"]


def test_runs_opening_alike_keep_their_sessions_across_a_proxy_restart(double, workspace,
                                                                      upstream_key):
    """Two runs of one task open alike, then the proxy restarts (a new process on the same
    workspace knows only what was recorded). Each run's next turn joins its own session, with
    its skills injected into the recorded request; a third run opening alike takes a session
    of its own, not the first run's."""
    opening = [{"role": "system", "content": "You are a release assistant."},
               {"role": "user", "content": "Tidy the changelog of restart-alike-5."}]
    double.add(Reply("A: headings first."), Reply("B: dates first."))
    first = _proxy(double, workspace, token=TOKEN)
    client = sync_client(first)
    replies = [client.chat.completions.create(model="m", messages=opening)
               .choices[0].message.content for _ in range(2)]
    first.flush()
    first.stop()

    double.add(Reply("B: done"), Reply("A: done"), Reply("C: started"))
    again = _proxy(double, workspace, token=TOKEN)
    try:
        client = sync_client(again)
        for reply in reversed(replies):
            client.chat.completions.create(model="m", messages=[
                *opening, {"role": "assistant", "content": reply},
                {"role": "user", "content": "Go on."}])
        client.chat.completions.create(model="m", messages=opening)
        again.flush()
    finally:
        again.stop()
    rows = [r for r in again.store.turns(order="id") if opening[1] in r["request_messages"]]
    sessions: dict[str, list[str]] = {}
    for row in rows:
        sessions.setdefault(row["session_id"], []).append(row["response"])
    base = rows[0]["session_id"]
    assert sessions == {base: ["A: headings first.", "A: done"],
                        f"{base}.2": ["B: dates first.", "B: done"],
                        f"{base}.3": ["C: started"]}
    assert [r["identified_by"]["session"] for r in rows[2:4]] == ["fingerprint:reply-thread"] * 2


def test_an_opening_whose_client_left_during_retrieval_leaves_its_session_free(
        double, workspace, upstream_key):
    """The client of a conversation's first turn hangs up while skills are still being
    retrieved (an embedding model off the event loop): the turn never reached the upstream,
    so its retry is that conversation's opening, in the fingerprint's session, not ``.2``."""
    import threading

    from metaclaw.skills.retrieval import LexicalRetriever

    class SlowRetriever(LexicalRetriever):
        kind = "slow"  # not an inline retriever: ranked in the retrieval pool
        release = threading.Event()

        def rank(self, query, skills, **options):
            self.release.wait(5)
            return super().rank(query, skills, **options)

    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, api_key_env=KEY_ENV, retrieval="lexical",
                         token=TOKEN)
    retriever = SlowRetriever()
    slow = Proxy(config, store, library, retriever).start()
    opening = [{"role": "user", "content": "Plan the commit for left-during-retrieval-2."}]
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(slow.url + "/chat/completions", timeout=0.3,
                       headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"model": "m", "messages": opening})
        retriever.release.set()
        double.add(Reply("planned"))
        reply = sync_client(slow).chat.completions.create(model="m", messages=opening)
        slow.flush()
    finally:
        slow.stop()
    assert reply.choices[0].message.content == "planned"
    rows = [r for r in store.turns(order="id") if r["request_messages"][-1] == opening[0]]
    assert [(r["status"], r["identified_by"]["session"]) for r in rows] == [
        ("ok", "fingerprint:first-user-message")]
    assert "." not in rows[0]["session_id"]


def test_a_retry_after_a_client_timeout_stays_in_its_run(proxy, double):
    """The SDK times out on a slow turn and resends it (the first attempt is cancelled with its
    connection): the retry continues the same reply, so it joins the same run, not the run
    whose session is the fingerprint's."""
    client = openai.OpenAI(base_url=proxy.url, api_key=TOKEN, max_retries=1, timeout=30)
    opening = [{"role": "user", "content": "Rename the helpers in retry-alike-3."}]
    double.add(Reply("A: renamed"), Reply("B: renamed"), Reply("B: slow", delay=1.5),
               Reply("B: retried"))
    client.chat.completions.create(model="m", messages=opening)
    b = client.chat.completions.create(model="m", messages=opening)
    # only the slow call times out (a fast one slowed by a loaded machine must not be retried)
    reply = client.with_options(timeout=0.5).chat.completions.create(model="m", messages=[
        *opening, {"role": "assistant", "content": b.choices[0].message.content},
        {"role": "user", "content": "Now the tests."}])
    assert reply.choices[0].message.content == "B: retried"

    def rows():
        proxy.flush()
        return [r for r in proxy.store.turns(order="id") if opening[0] in r["request_messages"]]
    wait_until(lambda: len(rows()) == 4, what="the slow first attempt's record")
    sessions = {r["response"]: r["session_id"] for r in rows()}
    # the first attempt was cancelled when its client gave up: no reply recorded
    assert [r["status"] for r in rows() if r["response"] is None] == ["client_disconnected"]
    assert sessions["B: retried"] == sessions[None] == sessions["B: renamed"]
    assert sessions["B: renamed"] != sessions["A: renamed"]


def test_with_v_each_recorded_turn_is_a_log_line(proxy, double, caplog):
    """``metaclaw -v serve``: one line per turn, as recorded (its number, session, status,
    time and skills), for whoever watches the proxy through the day."""
    double.add(Reply("done"))
    with caplog.at_level("INFO", logger="metaclaw.proxy"):
        sync_client(proxy).chat.completions.create(model="m", messages=COMMIT_QUESTION,
                                                   extra_headers={"X-Session-Id": "log-line-1"})
        proxy.flush()
    (line,) = [r.getMessage() for r in caplog.records if "session log-line-1" in r.getMessage()]
    turn = proxy.store.turns(order="id")[-1]
    assert line.startswith(f"turn #{turn['id']} ") and ": ok in " in line
    assert line.endswith("skills: " + ", ".join(turn["injected_skills"]))


def test_the_failure_log_says_each_kind_once_a_minute_and_counts_the_rest(caplog, monkeypatch):
    from metaclaw.proxy.pipeline import FailureLog

    now = [1000.0]
    monkeypatch.setattr("metaclaw.proxy.pipeline.time.monotonic", lambda: now[0])
    failures = FailureLog()
    with caplog.at_level("WARNING", logger="metaclaw.proxy"):
        for _ in range(3):
            failures.warn(502, "cannot reach the upstream")
        failures.warn(401, "Incorrect API key provided")
        now[0] += FailureLog.EVERY_S
        failures.warn(502, "cannot reach the upstream")
        failures.warn(502, "cannot reach the upstream")
        failures.close(lambda: " --db bench/workspace.db")  # the proxy stops: the one no line
        failures.close()  # counted yet is said, with what opens the proxy's workspace
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and "HTTP 401" in lines[1]
    assert lines[2].endswith("(2 more turns failed with it since the last such line)")
    assert lines[3].startswith("1 more turn failed (HTTP 502) since the last such line")
    assert "`metaclaw turns --db bench/workspace.db --status error --why`" in lines[3]


def test_a_workspace_names_the_option_that_opens_it(tmp_path, monkeypatch):
    """Messages naming a command add ``--db`` only for a workspace a bare command would not
    open, with a database URL's password masked."""
    from metaclaw.store import Store

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("METACLAW_DB", raising=False)
    (tmp_path / ".metaclaw").mkdir()
    assert Store(".metaclaw/metaclaw.db").db_option() == ""
    assert Store(tmp_path / ".metaclaw" / "metaclaw.db").db_option() == ""
    assert Store(tmp_path / "my run.db").db_option() == f" --db '{tmp_path / 'my run.db'}'"
    monkeypatch.setenv("METACLAW_DB", str(tmp_path / "my run.db"))
    assert Store(tmp_path / "my run.db").db_option() == ""
    # a $METACLAW_DB that cannot be read (the proxy was opened with --db): never an error (the
    # proxy's stop called it before its drain)
    monkeypatch.setenv("METACLAW_DB", "mysql://u@h/db")
    assert Store(tmp_path / "my run.db").db_option() == f" --db '{tmp_path / 'my run.db'}'"
    import copy  # the store's writer copies it (no path given): never read from $METACLAW_DB

    assert copy.copy(Store(tmp_path / "my run.db")).target == str(tmp_path / "my run.db")


def test_a_large_body_is_decoded_parsed_and_matched_off_the_event_loop(proxy, double,
                                                                       monkeypatch):
    """A body of megabytes is read into a turn in worker threads: on the event loop it held
    every other client's turns and streams (a 16 MB Anthropic body: /healthz waited 2.6 s,
    now 0.2 s). A small one is parsed on the loop, where it arrives."""
    import metaclaw.proxy.pipeline as pipeline

    real, seen = pipeline.parse_turn, []

    def parse_turn(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "parse_turn", parse_turn)
    client = sync_client(proxy)
    for size in (1_000, pipeline.OFF_LOOP_BYTES + 1_000):
        double.add(Reply("done"))
        client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "x" * size}])
    loop = proxy._server._thread.name
    assert seen[0] == loop and seen[1] != loop, (seen, loop)
