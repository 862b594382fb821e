"""Upstream misbehaviour, and the upstream key, through the proxy (both protocols).

A fault-injecting upstream (tests/fault_upstream.py: real sockets, real SSE) resets, truncates,
sends garbage, answers 429/5xx with Retry-After, trickles its body or hangs. Every fault must end
in a clear error in the client's protocol (never a reply that looks complete) and an ``error``
turn in the store; retries happen only before any byte reached the client and wait as
Retry-After says. The upstream key is a canary: the fault upstream quotes it in its errors
(mid-stream and not), and it must appear in no client-visible byte, no log record and no byte of
the store's files, while the upstream itself does receive it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import httpx
import pytest

from fault_upstream import FaultUpstream
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store

CANARY = "sk-canary-" + uuid.uuid4().hex
KEY_ENV = "METACLAW_TEST_CANARY_KEY"
TIMEOUT = 0.6  # the proxy's upstream timeout in this suite (hang and slow_body exceed it)

NON_STREAM_FAULTS = ["reset", "invalid_json", "wrong_shape", "status_429", "status_500",
                     "status_503", "slow_body", "hang", "reflect_key"]
STREAM_FAULTS = ["reset", "reset_midstream", "truncate", "invalid_sse", "invalid_json",
                 "error_event", "status_429", "status_503", "slow_body", "hang", "reflect_key"]
RETRIED = ["flaky_503", "flaky_reset"]
#: (client protocol, upstream protocol): same-protocol relays and one translation each way.
ROUTES = [("openai", "openai"), ("anthropic", "anthropic"), ("anthropic", "openai"),
          ("openai", "anthropic")]

MISHANDLED: list[str] = []  # cases whose answer broke a rule (the suite's figure)
INJECTED: list[str] = []


@pytest.fixture(scope="module")
def env():
    import os

    os.environ[KEY_ENV] = CANARY
    upstream = FaultUpstream().start()
    root = __import__("tempfile").mkdtemp(prefix="metaclaw-faults-")
    store = Store(f"{root}/metaclaw.db")
    library = SkillLibrary(f"{root}/skills", store)
    proxies = {}
    for kind in ("openai", "anthropic"):
        config = ProxyConfig(upstream_url=upstream.url, api_key_env=KEY_ENV, retrieval="lexical",
                             timeout=TIMEOUT, max_retries=2, upstream_protocol=kind)
        proxies[kind] = Proxy(config, store, library).start()
    yield upstream, proxies, store, root
    for proxy in proxies.values():
        proxy.stop()
    upstream.stop()
    store.close()
    os.environ.pop(KEY_ENV, None)


def _request(proxy: Proxy, client: str, text: str, stream: bool, session: str) -> httpx.Response:
    if client == "openai":
        url, body = proxy.url + "/chat/completions", {
            "model": "m", "stream": stream, "messages": [{"role": "user", "content": text}]}
    else:
        url, body = proxy.base_url + "/v1/messages", {
            "model": "m", "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": text}]}
    return httpx.post(url, json=body, headers={"X-Session-Id": session}, timeout=30)


def _well_formed_error(client: str, payload: object) -> bool:
    if client == "openai":
        error = payload.get("error") if isinstance(payload, dict) else None
        return isinstance(error, dict) and isinstance(error.get("message"), str) and bool(
            error["message"])
    return (isinstance(payload, dict) and payload.get("type") == "error"
            and isinstance(payload.get("error"), dict)
            and isinstance(payload["error"].get("message"), str))


def _events(client: str, text: str) -> list[object]:
    out = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                out.append(None if data == "[DONE]" else json.loads(data))
    return out


def _turn(store: Store, session: str) -> dict:
    for _ in range(100):
        rows = store.turns("session_id = ?", (session,))
        if rows:
            return rows[-1]
        time.sleep(0.02)
    raise AssertionError(f"no turn recorded for {session}")


def _check_fault(env, client: str, upstream_kind: str, fault: str, stream: bool) -> None:
    upstream, proxies, store, _ = env
    session = f"{client}-{upstream_kind}-{fault}-{int(stream)}"
    case = f"{client}->{upstream_kind} {fault} stream={stream}"
    INJECTED.append(case)
    reply = _request(proxies[upstream_kind], client, f"say hi fault={fault}", stream, session)
    problems = []
    if CANARY in reply.text or any(CANARY in v for v in reply.headers.values()):
        problems.append("canary key in the client's reply")
    if reply.status_code != 200 or not stream:
        if reply.status_code < 400 or not _well_formed_error(client, reply.json()):
            problems.append(f"not an error in the {client} shape: {reply.status_code} "
                            f"{reply.text[:200]}")
    else:
        events = _events(client, reply.text)
        terminal = (None in events if client == "openai" else any(
            isinstance(e, dict) and e.get("type") == "message_stop" for e in events))
        errors = [e for e in events if isinstance(e, dict) and (
            "error" in e if client == "openai" else e.get("type") == "error")]
        if terminal:
            problems.append("the stream ended as if complete")
        if not errors or not _well_formed_error(client, errors[-1]):
            problems.append(f"no {client} error event at the end: {reply.text[-300:]!r}")
    turn = _turn(store, session)
    if turn["status"] != "error" or not turn["error"]:
        problems.append(f"recorded as {turn['status']!r} ({turn['error']!r})")
    if fault.startswith("status_") and reply.headers.get("Retry-After") != "3600":
        problems.append("Retry-After not relayed")
    if problems:
        MISHANDLED.append(case)
    assert not problems, f"{case}: {problems}"


@pytest.mark.parametrize("client,upstream_kind", ROUTES)
@pytest.mark.parametrize("fault", NON_STREAM_FAULTS)
def test_non_streaming_fault_is_a_clear_error_and_an_error_turn(env, client, upstream_kind, fault):
    _check_fault(env, client, upstream_kind, fault, stream=False)


@pytest.mark.parametrize("client,upstream_kind", ROUTES)
@pytest.mark.parametrize("fault", STREAM_FAULTS)
def test_streaming_fault_is_a_clear_error_and_an_error_turn(env, client, upstream_kind, fault):
    _check_fault(env, client, upstream_kind, fault, stream=True)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("client,upstream_kind", [("openai", "openai"), ("anthropic", "anthropic")])
@pytest.mark.parametrize("fault", RETRIED)
def test_failures_before_any_byte_are_retried_honouring_retry_after(env, client, upstream_kind,
                                                                    fault, stream):
    upstream, proxies, store, _ = env
    session = f"retry-{client}-{fault}-{int(stream)}"
    text = f"say hi fault={fault} {uuid.uuid4().hex}"
    INJECTED.append(f"{client} {fault} stream={stream}")
    started = time.monotonic()
    reply = _request(proxies[upstream_kind], client, text, stream, session)
    elapsed = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    assert "echo" in reply.text and "error" not in reply.text
    assert _turn(store, session)["status"] == "ok"
    if fault == "flaky_503":
        assert elapsed >= 0.95, f"Retry-After: 1 was not honoured ({elapsed:.2f} s)"


@pytest.mark.parametrize("stream", [False, True])
def test_without_retries_an_upstream_error_goes_to_the_agent_after_one_call(env, stream):
    """``metaclaw serve`` makes no retries (the agent retries on its own, and each of its
    attempts would cost three upstream calls): a 503 reaches the client at once with its
    Retry-After, and so does a connection the upstream dropped after receiving the request (it
    may have been charged), each after one upstream call."""
    upstream, _, store, root = env
    library = SkillLibrary(f"{root}/skills", store)
    proxy = Proxy(ProxyConfig(upstream_url=upstream.url, api_key_env=KEY_ENV, retrieval="lexical",
                              timeout=TIMEOUT, max_retries=0), store, library).start()
    try:
        for fault, status in (("flaky_503", 503), ("flaky_reset", 502)):
            text = f"say hi fault={fault} {uuid.uuid4().hex}"
            reply = _request(proxy, "openai", text, stream, f"no-retries-{fault}-{int(stream)}")
            assert reply.status_code == status, reply.text
            if status == 503:
                assert reply.headers["retry-after"] == "1"
            assert upstream._attempts[text] == 1
    finally:
        proxy.stop()


def test_without_retries_a_connection_that_could_not_be_opened_is_tried_once_more(
        env, caplog):
    """Nothing reached the upstream: one more try costs nothing (an upstream restarting)."""
    import socket

    _, _, store, root = env
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proxy = Proxy(ProxyConfig(upstream_url=f"http://127.0.0.1:{port}/v1", retrieval="lexical",
                              timeout=TIMEOUT, max_retries=0),
                  store, SkillLibrary(f"{root}/skills", store)).start()
    try:
        with caplog.at_level(logging.INFO, logger="metaclaw.proxy"):
            reply = _request(proxy, "openai", "say hi", False, "no-retries-unreachable")
    finally:
        proxy.stop()
    assert reply.status_code == 502 and "cannot reach the upstream" in reply.text
    retried = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retried) == 1 and "attempt 2 of 2" in retried[0].getMessage()


@pytest.mark.parametrize("stream", [False, True])
def test_reply_with_a_lone_surrogate_is_still_recorded(env, stream):
    """SQLite cannot store a lone surrogate: the turn is recorded with U+FFFD in its place."""
    _, proxies, store, _ = env
    session = f"surrogate-{int(stream)}"
    reply = _request(proxies["openai"], "openai", "hi fault=surrogate_reply", stream, session)
    assert reply.status_code == 200 and "[DONE]" in reply.text if stream else reply.status_code == 200
    turn = _turn(store, session)
    assert turn["status"] == "ok" and "\ufffd" in turn["response"]


@pytest.mark.parametrize("client", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_whose_content_is_a_list_of_parts_is_relayed_and_recorded(env, client, stream):
    """Some OpenAI-compatible servers (Mistral's Magistral) answer with content parts; the
    recorded response is the text parts' text, and an Anthropic client gets it as text."""
    _, proxies, store, _ = env
    session = f"parts-{client}-{int(stream)}"
    reply = _request(proxies["openai"], client, "hi there fault=parts_reply", stream, session)
    assert reply.status_code == 200, reply.text
    if client == "anthropic":
        text = ("".join(e["delta"].get("text", "") for e in _events(client, reply.text)
                        if isinstance(e, dict) and e.get("type") == "content_block_delta")
                if stream else "".join(b.get("text", "") for b in reply.json()["content"]))
        assert "echo: hi there" in text
    turn = _turn(store, session)
    assert turn["status"] == "ok" and turn["response"].strip() == "echo: hi there fault=parts_reply"


def test_a_failure_after_the_stream_began_closes_it_instead_of_a_second_response(env,
                                                                                  monkeypatch):
    """A bug surfacing after a stream's first bytes cannot become a 500 response written into
    the stream's body (which clients read as a corrupt chunk): the connection is closed."""
    import socket
    from urllib.parse import urlsplit

    from metaclaw.protocols.openai_chat import StreamAssembler

    def broken(self):
        raise RuntimeError("a bug after the reply began")

    monkeypatch.setattr(StreamAssembler, "columns", broken)
    _, proxies, _, _ = env
    url = urlsplit(proxies["openai"].url)
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"HTTP/1.1 ") == 1


def test_long_retry_after_is_relayed_not_waited_for(env):
    """A 429 asking for an hour is not retried: the client gets it at once, Retry-After kept."""
    upstream, proxies, store, _ = env
    before = len(upstream.requests)
    started = time.monotonic()
    reply = _request(proxies["openai"], "openai", "fault=status_429 once", False, "long-wait")
    assert reply.status_code == 429 and reply.headers["Retry-After"] == "3600"
    assert time.monotonic() - started < 5 and len(upstream.requests) - before == 1


def test_canary_key_reaches_the_upstream_and_nothing_else(env, caplog):
    """0 leaks: the key quoted by the upstream's errors is in no log record, no store byte."""
    upstream, proxies, store, root = env
    caplog.set_level(logging.DEBUG)
    for client in ("openai", "anthropic"):
        for stream in (False, True):
            for fault in ("reflect_key", "error_event", "reset", "invalid_json"):
                INJECTED.append(f"canary {client} {fault} stream={stream}")
                reply = _request(proxies[client], client, f"x fault={fault}", stream,
                                 f"canary-{client}-{fault}-{int(stream)}")
                assert CANARY not in reply.text
                assert not any(CANARY in v for v in reply.headers.values())
    for proxy in proxies.values():
        proxy.flush()
        health = httpx.get(proxy.base_url + "/healthz").text + repr(proxy)
        assert CANARY not in health
    received = [r for r in upstream.requests if CANARY in json.dumps(r["headers"])]
    assert received, "the upstream never received its key (the canary test would be vacuous)"
    store.execute("PRAGMA wal_checkpoint(PASSIVE)")
    import pathlib

    leaks = {p.name: p.read_bytes().count(CANARY.encode())
             for p in pathlib.Path(root).glob("metaclaw.db*")}
    leaks["log records"] = caplog.text.count(CANARY)
    leaks["store rows"] = json.dumps(store.query("SELECT * FROM turns"), default=str).count(CANARY)
    print(f"\ncanary leaks: {sum(leaks.values())} ({leaks}; 16 client replies checked; the "
          f"upstream received the key {len(received)} times)")
    assert sum(leaks.values()) == 0, leaks


def test_credentials_written_in_the_upstream_url_are_never_relayed_stored_or_logged(
        env, caplog):
    """A password (``user:password@``) and a key in the query of ``--upstream`` are masked as
    the key from the environment is: an upstream that quotes its request (the URL, the Basic
    header, decoded or not) reached the agent, the store and the log with them."""
    upstream, _, _, root = env
    password, key = "pw-" + uuid.uuid4().hex, "qk-" + uuid.uuid4().hex
    url = upstream.url.replace("http://", f"http://team:{password}@") + \
        f"?api-version=2024-06-01&api-key={key}"
    store = Store(f"{root}/url-credentials.db")
    proxy = Proxy(ProxyConfig(upstream_url=url, api_key_env="METACLAW_TEST_UNSET_KEY",
                              retrieval="lexical", timeout=TIMEOUT, max_retries=0),
                  store, SkillLibrary(f"{root}/skills", store)).start()
    caplog.set_level(logging.DEBUG)
    try:
        replies = [_request(proxy, "openai", "x fault=reflect_url", stream, f"url-{stream}")
                   for stream in (False, True)]
        proxy.flush()
    finally:
        proxy.stop()
    assert replies[0].status_code == 400 and "api-version=2024-06-01" in replies[0].text
    import base64

    basic = base64.b64encode(f"team:{password}".encode()).decode()
    said = [r.text for r in replies] + [caplog.text, json.dumps(
        store.query("SELECT * FROM turns"), default=str), repr(proxy)]
    assert upstream.requests[-1]["headers"].get("Authorization") == f"Basic {basic}"
    for secret in (password, key, basic):
        assert not [text for text in said if secret in text], secret
    store.close()


def test_fault_suite_figures(env):
    """Printed figure: upstream faults injected and mishandled (run with -s to see it)."""
    print(f"\nupstream faults injected: {len(INJECTED)}, mishandled: {len(MISHANDLED)}")
    assert not MISHANDLED
