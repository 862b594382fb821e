"""The upstream side of the proxy against a hostile or failing upstream (both protocols).

A real fault-injecting upstream (tests/fault_upstream.py) hangs, redirects or answers a JSON
body with HTTP 200 where a reply or a stream was due. Rules:

- stopping the proxy while it still waits on the upstream for a client that hung up leaves no
  request handler pending and loses no turn;
- an upstream redirect is a 502 in the client's protocol, before any byte of a stream, naming
  where it redirects (without credentials or query) and not retried;
- an error object answered with HTTP 200 is a 502 carrying the upstream's own message; another
  JSON body where a stream was due is a 502 saying the upstream does not stream;
- a reply body that cannot be decoded or is cut off is a 502 saying so (the upstream was
  reached); only a cut-off one is retried;
- an error body is read only as far as it is shown, and a stream's event only up to a bound.
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import time
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fault_upstream import FaultUpstream
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store

TIMEOUT = 30.0  # the proxy's upstream timeout here: far longer than any wait in these tests


@pytest.fixture(scope="module")
def upstream():
    with FaultUpstream() as served:
        yield served


@pytest.fixture(scope="module")
def env(upstream, tmp_path_factory):
    root = tmp_path_factory.mktemp("upstreams-hostile")
    store = Store(root / "metaclaw.db")
    library = SkillLibrary(root / "skills", store)
    proxies = {kind: Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical",
                                       timeout=TIMEOUT, max_retries=2, upstream_protocol=kind),
                           store, library).start()
               for kind in ("openai", "anthropic")}
    yield upstream, proxies, store
    for proxy in proxies.values():
        proxy.stop()
    store.close()


def _waited(check, within: float = 10.0):
    """``check()`` once it is true (polled), else its last answer."""
    deadline = time.monotonic() + within
    while not (answer := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return answer


def _turn(store: Store, session: str, within: float = 5.0) -> dict | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rows = store.turns("session_id = ?", (session,))
        if rows:
            return rows[-1]
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_cancels_its_upstream_request(upstream, tmp_path, caplog, stream):
    """A client that hangs up while the upstream is still thinking: the upstream request is
    cancelled at once (the upstream stopped generating a reply nobody reads; it went on for
    the whole timeout), the turn is recorded client_disconnected, and stopping the proxy then
    destroys no pending task ("Task was destroyed but it is pending!")."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    proxy = Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical", timeout=TIMEOUT),
                  store, library).start()
    session = f"hangup-{int(stream)}"
    body = json.dumps({"model": "m", "stream": stream,
                       "messages": [{"role": "user", "content": f"fault=hang {session}"}]}).encode()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nX-Session-Id: " + session.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with_upstream = _waited(lambda: [r for r in upstream.requests
                                         if r["fault"] == "hang" and r["at"] >= started])
        assert with_upstream, "the request never reached the upstream"
        left = time.monotonic()
    turn = _turn(store, session)
    assert turn is not None and turn["status"] == "client_disconnected", turn
    assert "the upstream request was cancelled" in turn["error"]
    assert _waited(lambda: "gone" in with_upstream[0])  # the upstream saw its client leave
    assert with_upstream[0]["gone"] - left < 2.0  # at once, not after the upstream timeout
    caplog.set_level(logging.ERROR, logger="asyncio")
    proxy.stop()
    gc.collect()  # a task destroyed pending is reported when it is collected
    try:
        assert [t["status"] for t in store.turns("session_id = ?", (session,))] == [
            "client_disconnected"]
        assert "Task was destroyed" not in caplog.text
    finally:
        store.close()


# -- redirects ----------------------------------------------------------------------------------
SECRET = "hunter2-secret"
_HOSTS = st.sampled_from(["example.invalid", "127.0.0.1:9", "[::1]:8443", "xn--bcher-kva.example"])
_PATHS = st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1", "/", "", "/api/v2/x"])
LOCATIONS = st.one_of(
    st.none(),
    st.builds(lambda scheme, creds, host, path, query: f"{scheme}://{creds}{host}{path}{query}",
              st.sampled_from(["http", "https"]), st.sampled_from(["", f"user:{SECRET}@"]),
              _HOSTS, _PATHS, st.sampled_from(["", f"?key={SECRET}", f"#{SECRET}"])),
    st.sampled_from(["/v1/chat/completions", "chat/completions", "../v2/chat/completions",
                     "//other.example/v1/chat/completions", "http://[::1", "http://h:99999/",
                     ""]),
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(location=LOCATIONS, status=st.sampled_from([301, 302, 307, 308]), stream=st.booleans(),
       route=st.sampled_from([("openai", "openai"), ("anthropic", "anthropic"),
                              ("anthropic", "openai"), ("openai", "anthropic")]))
def test_an_upstream_redirect_is_a_502_naming_it_before_any_byte(env, location, status, stream,
                                                                  route):
    upstream, _, store = env
    client, _ = route
    upstream.location = location
    reply, session, before = _fault(env, route, f"redirect_{status}", stream)
    assert reply.status_code == 502, reply.text[:300]  # not a 200 stream that breaks off
    message = _error_message(client, reply)
    if client == "anthropic":
        assert reply.json()["error"]["type"] == "api_error"
    assert "redirect" in message and "retry the request" not in message
    assert reply.headers["x-should-retry"] == "false"  # nor by the client's SDK
    assert SECRET not in reply.text
    assert len(upstream.requests) - before == 1  # a redirect is not retried
    turn = _turn(store, session)
    assert turn is not None and turn["status"] == "error" and "redirect" in turn["error"]


def test_a_redirect_names_the_base_url_to_configure(env):
    """An ``http://`` URL of a server that moved to ``https://`` keeping its paths: the message
    names the base URL to set, as the user configures it."""
    upstream, proxies, _ = env
    upstream.location = "https://api.example.invalid/v1/chat/completions?x=1"
    reply = httpx.post(proxies["openai"].url + "/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "fault=redirect_301 base"}]})
    assert reply.status_code == 502
    assert "redirect to https://api.example.invalid/v1;" in reply.json()["error"]["message"]


# -- a JSON body answered with HTTP 200 where a reply or a stream was due ------------------------
TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=60).filter(
    str.strip)
ERROR_BODIES = {  # an error object in the upstream's protocol, as some gateways answer at 200
    "openai": st.builds(lambda message, kind: {"error": {"message": message, "type": kind,
                                                         "code": kind}},
                        TEXT, st.sampled_from(["insufficient_quota", "server_error", "x"])),
    "anthropic": st.builds(lambda message, kind: {"type": "error",
                                                  "error": {"type": kind, "message": message}},
                           TEXT, st.sampled_from(["overloaded_error", "api_error", "x"])),
}
OTHER_BODIES = st.dictionaries(st.sampled_from(["status", "detail", "message", "data", "object"]),
                               st.one_of(st.none(), st.integers(), TEXT), max_size=3)


def _fault(env, route: tuple[str, str], fault: str,
           stream: bool = False) -> tuple[httpx.Response, str, int]:
    """Send a request naming ``fault`` along ``route`` (client protocol, upstream protocol), in
    a session of its own: (the reply, the session, the upstream's request count before it)."""
    upstream, proxies, _ = env
    client, kind = route
    session = uuid.uuid4().hex
    if client == "openai":
        url, body = proxies[kind].url + "/chat/completions", {"model": "m", "stream": stream}
    else:
        url, body = proxies[kind].base_url + "/v1/messages", {"model": "m", "max_tokens": 16,
                                                              "stream": stream}
    body["messages"] = [{"role": "user", "content": f"fault={fault} {session}"}]
    before = len(upstream.requests)
    return (httpx.post(url, json=body, headers={"X-Session-Id": session}, timeout=30), session,
            before)


def _error_message(client: str, reply: httpx.Response) -> str:
    payload = reply.json()
    if client == "anthropic":
        assert payload["type"] == "error", payload
    return payload["error"]["message"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), stream=st.booleans(), error=st.booleans(),
       route=st.sampled_from([("openai", "openai"), ("anthropic", "anthropic"),
                              ("anthropic", "openai"), ("openai", "anthropic")]))
def test_a_json_body_at_http_200_is_an_error_status_with_the_upstreams_message(env, data, stream,
                                                                               error, route):
    """An error object answered with HTTP 200 reaches the client as an error status carrying
    the upstream's own message (not "no 'choices' list", nor a 200 stream that breaks off
    advising a retry); another JSON body where a stream was due says the upstream does not
    stream."""
    upstream, _, store = env
    client, kind = route
    body = data.draw(ERROR_BODIES[kind] if error else OTHER_BODIES)
    upstream.json_body = body
    reply, session, _ = _fault(env, route, "json_200", stream)
    assert reply.status_code == 502, reply.text[:300]
    message = _error_message(client, reply)
    assert "retry the request" not in message
    if error:
        assert message == body["error"]["message"]
    elif stream:
        assert "does not stream" in message
    turn = _turn(store, session)
    assert turn is not None and turn["status"] == "error"


# -- a reply body that breaks, an error body or an event without end ----------------------------
ROUTES = [("openai", "openai"), ("anthropic", "anthropic"), ("anthropic", "openai")]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fault, what, attempts", [("corrupt_gzip", "is corrupt", 1),
                                                   ("short_body", "was truncated", 3)])
def test_a_corrupt_or_truncated_reply_is_a_502_saying_so(env, route, fault, what, attempts):
    """The upstream was reached and answered 200, but its body cannot be decoded or ends before
    its Content-Length: not "cannot reach the upstream". A cut-off body may arrive whole on
    another attempt; a corrupt encoding would come back the same, so it is not retried."""
    upstream, _, store = env
    client, _ = route
    reply, session, before = _fault(env, route, fault)
    assert reply.status_code == 502, reply.text[:300]
    message = _error_message(client, reply)
    assert what in message and "cannot reach" not in message, message
    assert len(upstream.requests) - before == attempts
    turn = _turn(store, session)
    assert turn is not None and turn["status"] == "error" and what in turn["error"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_huge_error_body_is_not_read_whole(env, route):
    """A 100 MB error page: the client gets its start, and each attempt reads a bounded part
    of it (what the sockets buffer), not all 100 MB."""
    upstream = env[0]
    client, _ = route
    reply, _, before = _fault(env, route, "huge_error")
    assert reply.status_code == 500, reply.text[:300]
    assert _error_message(client, reply).startswith("the upstream answered HTTP 500: <html>xxx")
    attempts = upstream.requests[before:]
    assert len(attempts) == 3  # a 500 is retried
    assert _waited(lambda: all("ended" in a for a in attempts))
    assert max(a["sent"] for a in attempts) < 32 * 2**20, [a["sent"] for a in attempts]


@pytest.mark.parametrize("route", ROUTES)
def test_an_event_that_never_ends_is_cut_off_with_a_clear_error(env, route):
    """An upstream streaming one event without end: the stream ends with an error saying so
    once the event passes the bound, long before the proxy's timeout, having read a bounded
    part of it."""
    upstream, _, store = env
    started = time.monotonic()
    reply, session, before = _fault(env, route, "endless_event", True)
    assert time.monotonic() - started < TIMEOUT / 2
    assert "larger than 16 MiB" in reply.text and "timeout" not in reply.text, reply.text[:300]
    attempt = upstream.requests[before]
    assert _waited(lambda: "ended" in attempt)
    assert attempt["sent"] < 64 * 2**20
    turn = _turn(store, session)
    assert turn is not None and turn["status"] == "error" and "16 MiB" in turn["error"]
