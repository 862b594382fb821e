"""The proxy's fast path: one JSON library (orjson) with exact fallbacks, SSE parsed from raw
byte chunks, commits that survive kill -9 without an fsync (unless asked), the event loop, the
lingering close, and the upstream session's authentication headers."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3

import pytest

from metaclaw import jsonlib
from metaclaw.offline.double import DoubleServer
from metaclaw.protocols import ProxyError, sse_events
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.proxy.edge import decode_body
from metaclaw.proxy.pipeline import Recorder
from metaclaw.proxy.server import new_event_loop
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store


# -- JSON ---------------------------------------------------------------------------------------
def test_jsonlib_writes_what_the_standard_library_writes():
    value = {"text": "héllo \u2028 \"quoted\" \n", "n": [1, -2.5, 10**18, None, True],
             "nested": {"ü": []}}
    assert jsonlib.dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert jsonlib.dumpb(value) == jsonlib.dumps(value).encode()
    # what orjson refuses goes through the standard library, unchanged in meaning
    assert jsonlib.dumps({"seed": 10**30}) == '{"seed":1000000000000000000000000000000}'
    assert jsonlib.dumps({1: "a"}) == '{"1":"a"}'


def test_jsonlib_reads_escaped_lone_surrogates_and_refuses_nan():
    assert jsonlib.loads(b'{"a": "\\ud800"}') == {"a": "\ud800"}
    assert jsonlib.loads('{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}
    for bad in (b'{"a": NaN}', b'{"a": -Infinity}', b'{"a":', b"\xff"):
        with pytest.raises(ValueError):
            jsonlib.loads(bad)


@pytest.mark.parametrize("raw", [
    b'{"model":"m","messages":[{"role":"user","content":"hi \xc3\xa9"}],"temperature":0.2}',
    b'{"seed": 123456789012345678901234567890, "x": [1.5e300, -0.0, 1e-300]}',
    b'{"ids": "12345678901234567890", "nested": {"a": [{"b": [true, null]}]}}',
    b'  {"a": "\\ud83d\\ude00", "b": "\\u00e9"}  ',
])
def test_decode_body_reads_exactly_what_the_standard_library_reads(raw):
    assert decode_body(raw) == json.loads(raw)
    assert type(decode_body(raw).get("seed", 0)) is int  # never an integer rounded to a float


@pytest.mark.parametrize("raw,code", [
    (b'{"a": NaN}', "invalid_number"), (b'{"a": 1e400}', "invalid_number"),
    (b'{"a": "\\udc00"}', "invalid_unicode"), (b'{"a": "\xed\xa0\x80"}', "invalid_unicode"),
    (b'{"a": ' + b"[" * 150 + b"]" * 150 + b"}", "too_deep"), (b'{"a": }', "invalid_json"),
])
def test_decode_body_still_names_what_is_wrong(raw, code):
    with pytest.raises(ProxyError) as caught:
        decode_body(raw)
    assert caught.value.status == 400 and caught.value.code == code


# -- server-sent events ---------------------------------------------------------------------------
STREAM = (b'data: {"a": 1}\r\n\r\n: comment\r\nevent: delta\r\ndata: {"b":\r\ndata: 2}\r\n\r\n'
          b'data: {"c": 3}\n\ndata: {"d": 4}\r\rdata: [DONE]\n\n')
EXPECTED = [(b'data: {"a": 1}\n\n', {"a": 1}),
            (b': comment\nevent: delta\ndata: {"b":\ndata: 2}\n\n', {"b": 2}),
            (b'data: {"c": 3}\n\n', {"c": 3}), (b'data: {"d": 4}\n\n', {"d": 4}),
            (b"data: [DONE]\n\n", None)]


async def _collect(chunks, timeout=None):
    async def source():
        for chunk in chunks:
            yield chunk

    return [event async for batch in sse_events(source(), timeout) for event in batch]


def test_sse_events_do_not_depend_on_how_the_bytes_are_cut():
    assert asyncio.run(_collect([STREAM])) == EXPECTED
    for cut in range(1, len(STREAM)):  # every two-piece cut, "\r|\n" included
        assert asyncio.run(_collect([STREAM[:cut], STREAM[cut:]])) == EXPECTED, cut
    assert asyncio.run(_collect([bytes([b]) for b in STREAM])) == EXPECTED


def test_sse_events_yield_the_good_events_before_a_bad_one():
    got = []

    async def run():
        async def source():
            yield b'data: {"a": 1}\n\ndata: not json\n\n'

        async for batch in sse_events(source()):
            got.extend(batch)

    with pytest.raises(ProxyError) as caught:
        asyncio.run(run())
    assert got == [(b'data: {"a": 1}\n\n', {"a": 1})]
    assert caught.value.status == 502 and caught.value.code == "bad_upstream_stream"


def test_sse_events_time_each_event_not_each_byte():
    async def source(pieces, pause):
        for piece in pieces:
            await asyncio.sleep(pause)
            yield piece

    async def run(pieces, pause, timeout):
        return [e async for batch in sse_events(source(pieces, pause), timeout) for e in batch]

    # events 0.05 s apart for 0.5 s: never a timeout of 0.2 s
    assert len(asyncio.run(run([b'data: {"a": 1}\n\n'] * 10, 0.05, 0.2))) == 10
    # one event trickled a byte every 0.05 s: cut off once it is 0.2 s late
    with pytest.raises(TimeoutError):
        asyncio.run(run([bytes([b]) for b in b'data: {"a": 1}\n\n'], 0.05, 0.2))


# -- recording --------------------------------------------------------------------------------------
def test_commit_without_fsync_is_synchronous_normal_for_that_commit_only(tmp_path):
    store = Store(tmp_path / "m.db")
    level = lambda: store.execute("PRAGMA synchronous").fetchone()[0]  # noqa: E731
    assert level() == 2  # FULL
    with store.transaction(fsync=False):
        assert level() == 1  # NORMAL: written to the OS at commit, fsynced at checkpoints
        store.record_turn(session_id="s", request_messages=[], status="ok")
    assert level() == 2
    other = sqlite3.connect(tmp_path / "m.db")  # committed: another connection sees it
    assert other.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 1
    with pytest.raises(RuntimeError), store.transaction(fsync=False):
        store.record_turn(session_id="s", request_messages=[], status="ok")
        raise RuntimeError("rolled back")
    assert level() == 2 and other.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 1
    store.close()


def test_proxy_config_reaches_the_recorder(tmp_path):
    store = Store(tmp_path / "m.db")
    library = SkillLibrary(tmp_path / "skills", store)
    assert Proxy(ProxyConfig(), store, library, retriever=object())._recorder.fsync is False
    assert Proxy(ProxyConfig(fsync_acks=True), store, library,
                 retriever=object())._recorder.fsync is True
    store.close()


# -- serving --------------------------------------------------------------------------------------
def test_event_loop_is_uvloop_when_installed_unless_turned_off(monkeypatch):
    monkeypatch.setenv("METACLAW_UVLOOP", "0")
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
    monkeypatch.delenv("METACLAW_UVLOOP")
    loop = new_event_loop()
    try:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            assert type(loop).__module__.startswith("asyncio")
        else:
            assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_an_early_answer_reaches_a_client_still_sending(tmp_path):
    """A body that does not decode is answered at its first bytes and the connection lingers
    (half-closed) so the client, still sending megabytes, reads that answer; on uvloop too,
    whose transports cannot be patched (the lingering close wraps them instead)."""
    store = Store(tmp_path / "m.db")
    library = SkillLibrary(tmp_path / "skills", store)
    config = ProxyConfig(retrieval="lexical")
    with Proxy(config, store, library) as proxy:
        body = b"\x00not gzip" * (4 * 2**20 // 9)
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(head)
            try:
                sock.sendall(body)
            except OSError:  # the proxy stopped reading: fine, as long as its answer arrives
                pass
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"bad_content_encoding" in reply
    store.close()


def test_upstream_gets_basic_auth_from_its_url_and_anthropic_version(tmp_path):
    from metaclaw.offline.double_anthropic import AnthropicDoubleServer

    store = Store(tmp_path / "m.db")
    library = SkillLibrary(tmp_path / "skills", store)
    with DoubleServer() as double:
        url = double.url.replace("http://", "http://user:p%40ss@")
        with Proxy(ProxyConfig(upstream_url=url, retrieval="lexical"), store, library) as proxy:
            import httpx

            reply = httpx.post(proxy.url + "/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
        import base64

        sent = double.requests[-1]["headers"]
        assert sent["Authorization"] == "Basic " + base64.b64encode(b"user:p@ss").decode()
    with AnthropicDoubleServer() as anthropic:
        config = ProxyConfig(upstream_url=anthropic.url, upstream_protocol="anthropic",
                             retrieval="lexical")
        with Proxy(config, store, library) as proxy:
            reply = httpx.post(proxy.base_url + "/v1/messages", json={
                "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
        sent = {k.lower(): v for k, v in anthropic.requests[-1]["headers"].items()}
        assert sent["anthropic-version"] == "2023-06-01" and sent["x-api-key"]
    store.close()


def test_a_query_in_the_upstream_url_goes_with_every_request_and_is_never_shown(tmp_path, caplog):
    """Azure OpenAI's ``...?api-version=...``: the query of the ``--upstream`` URL is sent with
    each request (it was dropped without a word); like a key it is not shown in the health
    answer or the logs."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    seen: list[str] = []

    class Azure(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.path)
            body = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                   "role": "assistant", "content": "hi"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Azure)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = Store(tmp_path / "m.db")
    url = (f"http://127.0.0.1:{server.server_port}/openai/deployments/d1"
           "?api-version=2024-10-21&key=s3cret")
    try:
        with Proxy(ProxyConfig(upstream_url=url, retrieval="lexical"), store,
                   SkillLibrary(tmp_path / "skills", store)) as proxy:
            for _ in range(2):
                reply = httpx.post(proxy.url + "/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert reply.status_code == 200, reply.text
            health = httpx.get(proxy.base_url + "/healthz").text
    finally:
        server.shutdown()
        store.close()
    assert seen == ["/openai/deployments/d1/chat/completions?api-version=2024-10-21&key=s3cret"] * 2
    assert "s3cret" not in health and "s3cret" not in caplog.text


def test_a_turn_records_its_ask_when_the_library_is_empty(tmp_path):
    """A new user's first turns, before any skill exists: ``turns --why`` shows each turn's ask
    (it showed ``query: -``: the ask was only found to choose skills)."""
    import httpx

    store = Store(tmp_path / "m.db")
    with DoubleServer() as double, Proxy(ProxyConfig(upstream_url=double.url), store,
                                         SkillLibrary(tmp_path / "empty", store)) as proxy:
        reply = httpx.post(proxy.url + "/chat/completions", json={"model": "m", "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "hello there, tidy the imports in utils.py"}]})
        assert reply.status_code == 200
        proxy.flush()
        turns = store.turns()
    store.close()
    assert turns[0]["retrieval_query"] == "hello there, tidy the imports in utils.py"
    assert not turns[0]["injected_skills"]
