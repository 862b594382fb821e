"""The fast loop's LLM client (:mod:`metaclaw.fastloop.llm`) against hostile servers: redirects,
huge, cut-off, corrupt and non-JSON bodies, error statuses with and without OpenAI's error JSON,
connections reset, bodies slower than the timeout, a server that does not speak HTTP, proxies
from the environment and TLS verification; and what the judge, the evolver and replays rely on
(the key's header, URL credentials, status codes, Retry-After, one-line masked errors). Real
sockets: the proxy tests' fault upstream, the offline double and scripted servers."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import threading
import time
from typing import Any

import pytest
from aiohttp import web
from fault_upstream import FaultUpstream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaclaw import jsonlib
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.llm import (MAX_REPLY_BYTES, LLMClient, LLMConnectionError, LLMError,
                                   LLMResponseError, LLMStatusError, error_text, retry_delay)
from metaclaw.fastloop.replay import Replayer
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.proxy.server import BackgroundServer, ServedApp
from metaclaw.proxy.upstreams import environment_proxy, tls_context

KEY = "sk-llm-0123456789abcdef"
REPLY = {"id": "c", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}]}


def call(client: LLMClient, text: str = "hello", **params: Any) -> dict[str, Any]:
    """One chat call on a loop of its own (the client closed after)."""
    async def main() -> dict[str, Any]:
        try:
            return await client.chat({"model": "m", "messages": [
                {"role": "user", "content": text}], **params})
        finally:
            await client.aclose()

    return asyncio.run(main())


def failure(client: LLMClient, text: str = "hello") -> BaseException:
    with pytest.raises(BaseException) as info:
        call(client, text)
    return info.value


def one_line(client: LLMClient, exc: BaseException) -> str:
    text = client.explain(exc)
    assert "\n" not in text and "\r" not in text and len(text) <= 310, text
    assert KEY not in text
    return text


class Scripted(ServedApp):
    """Answers every request with :attr:`answer` (status, headers, body); keeps the requests."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, str], bytes] = (200, {}, json.dumps(REPLY).encode())
        self.requests: list[dict[str, Any]] = []
        self._server = BackgroundServer(self._make_app, "127.0.0.1", 0, "scripted",
                                        shutdown_timeout=0.2)

    def _make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        return app

    async def _any(self, request: web.Request) -> web.Response:
        self.requests.append({"method": request.method, "path": request.path,
                              "host": request.headers.get("Host"),
                              "query": request.rel_url.raw_query_string,
                              "headers": dict(request.headers), "body": await request.read()})
        status, headers, body = self.answer
        return web.Response(status=status, headers=headers, body=body)


@pytest.fixture(scope="module")
def scripted():
    with Scripted() as server:
        yield server


@pytest.fixture(scope="module")
def faults():
    with FaultUpstream() as server:
        yield server


# -- what callers rely on ------------------------------------------------------------------
def test_the_request_carries_the_key_json_and_the_endpoints_path(scripted):
    scripted.requests.clear()
    assert call(LLMClient(scripted.url + "/", KEY, 5.0)) == REPLY  # a trailing slash is fine
    [request] = scripted.requests
    assert request["method"] == "POST" and request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == f"Bearer {KEY}"
    assert request["headers"]["Content-Type"] == "application/json"
    assert json.loads(request["body"])["messages"][0]["content"] == "hello"
    call(LLMClient(scripted.url, None, 5.0))  # no key: a placeholder, as the SDK sent
    assert scripted.requests[-1]["headers"]["Authorization"] == "Bearer unused"


def test_a_token_written_as_the_urls_user_name_is_masked():
    """``https://TOKEN@host/v1`` (a token, no password) is sent as Basic authentication; an
    error quoting the token, or its Basic form, shows neither. A user name that a password
    follows is a name, not a secret (masked, ``admin`` would mangle every reply saying it)."""
    import base64

    from metaclaw.redact import url_secrets

    client = LLMClient("https://sk-live-0123456789abcdef@judge.example/v1", None, 5.0)
    basic = base64.b64encode(b"sk-live-0123456789abcdef:").decode()
    said = client.mask(f"invalid token sk-live-0123456789abcdef ({basic})")
    assert "sk-live" not in said and basic not in said
    assert "admin" not in url_secrets("http://admin:pw-hunter2@h/v1")


def test_a_query_in_the_url_goes_with_every_call_and_never_into_errors(scripted):
    """Azure OpenAI's ``?api-version=`` (as the proxy's upstream client sends it): a judge or
    evolver pointed at such a URL was called without it. A key in the query is masked."""
    scripted.requests.clear()
    call(LLMClient(scripted.url + "?api-version=2024-06-01&api-key=qk%2Fsecret", KEY, 5.0))
    assert scripted.requests[-1]["path"] == "/v1/chat/completions"
    assert scripted.requests[-1]["query"] == "api-version=2024-06-01&api-key=qk%2Fsecret"
    scripted.answer = (400, {}, b'{"error": {"message": "bad: api-key=qk/secret"}}')
    try:
        client = LLMClient(scripted.url + "?api-key=qk%2Fsecret", KEY, 5.0)
        text = one_line(client, failure(client))
    finally:
        scripted.answer = (200, {}, json.dumps(REPLY).encode())
    assert "qk/secret" not in text and "qk%2Fsecret" not in text


def test_credentials_in_the_url_are_sent_as_basic_authentication_never_in_errors(scripted):
    scripted.requests.clear()
    url = scripted.url.replace("http://", "http://team:pw%20hunter2@")
    call(LLMClient(url, KEY, 5.0))
    assert scripted.requests[-1]["headers"]["Authorization"] == "Basic dGVhbTpwdyBodW50ZXIy"
    scripted.answer = (401, {}, b'{"error": {"message": "bad: team:pw hunter2"}}')
    try:
        client = LLMClient(url, KEY, 5.0)
        text = one_line(client, failure(client))
    finally:
        scripted.answer = (200, {}, json.dumps(REPLY).encode())
    assert text.startswith("HTTP 401: bad: ") and "hunter2" not in text


def test_a_status_error_keeps_its_code_headers_and_the_servers_message(faults):
    client = LLMClient(faults.url, KEY, 5.0)
    error = failure(client, "fault=status_429")
    assert isinstance(error, LLMStatusError) and error.status_code == 429
    assert error.headers["Retry-After"] == "3600"
    assert retry_delay(error, 0) == 20.0  # honoured up to the cap
    assert one_line(client, error) == "HTTP 429: Incorrect API key provided: ***"


def test_a_timeout_is_a_timeout_error_with_the_body_included(faults):
    """``slow_body`` sends the headers at once, then a byte every 0.4 s: the whole call is
    timed, so a reply that trickles in is given up on at the timeout (no caller's wait_for)."""
    client = LLMClient(faults.url, KEY, 1.0)
    for fault in ("slow_body", "hang"):
        started = time.monotonic()
        error = failure(client, f"fault={fault}")
        assert isinstance(error, TimeoutError), repr(error)
        assert time.monotonic() - started < 3.0
        assert one_line(client, error) == "timed out"


def test_an_unreachable_server_is_a_connection_error_worth_retrying():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = LLMClient(f"http://127.0.0.1:{port}/v1", KEY, 5.0)
    error = failure(client)
    assert isinstance(error, LLMConnectionError) and retry_delay(error, 0) is not None
    assert one_line(client, error).startswith("connection error: ")


# -- redirects -------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_not_followed_and_names_the_url_to_configure(faults, status):
    before = len(faults.requests)
    client = LLMClient(faults.url, KEY, 5.0)
    error = failure(client, f"fault=redirect_{status}")
    assert isinstance(error, LLMStatusError) and error.status_code == status
    assert len(faults.requests) == before + 1  # asked once, never sent on
    assert one_line(client, error) == (
        f"HTTP {status}: a redirect to https://example.invalid/v1, not followed; set the URL to "
        "where it redirects")
    assert retry_delay(error, 0) is None  # it would redirect again


def test_a_redirect_without_a_location_or_with_an_odd_one_is_still_one_line(faults):
    client = LLMClient(faults.url, KEY, 5.0)
    for location in (None, "/elsewhere/chat/completions?key=" + KEY, "http://ex\u00e4mple/a b/x"):
        faults.location = location
        try:
            error = failure(client, "fault=redirect_308")
        finally:
            faults.location = "https://example.invalid/v1/chat/completions"
        text = one_line(client, error)
        assert text.startswith("HTTP 308: a redirect") and "?key" not in text


# -- bodies ----------------------------------------------------------------------------------
def test_a_huge_error_page_is_read_only_in_part(faults):
    client = LLMClient(faults.url, KEY, 30.0)
    started = time.monotonic()
    error = failure(client, "fault=huge_error")
    assert isinstance(error, LLMStatusError) and error.status_code == 500
    assert time.monotonic() - started < 5.0
    assert one_line(client, error).startswith("HTTP 500: <html>xxxx")
    assert retry_delay(error, 0) is not None
    entry = [r for r in faults.requests if r["fault"] == "huge_error"][-1]
    deadline = time.monotonic() + 5
    while "ended" not in entry and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry["sent"] < 16 * 2**20  # the other ~100 MB were never sent: the client hung up


def test_a_reply_larger_than_the_limit_is_refused_not_held(faults):
    big = dict(REPLY, padding="x" * (MAX_REPLY_BYTES + 10))
    faults.json_body = big
    try:
        client = LLMClient(faults.url, KEY, 60.0)
        error = failure(client, "fault=json_200")
    finally:
        faults.json_body = {"error": {"message": "quota exceeded", "type": "insufficient_quota"}}
    assert isinstance(error, LLMResponseError) and not error.retryable
    assert retry_delay(error, 0) is None
    assert "larger than 32 MiB" in one_line(client, error)


def test_a_reply_cut_off_in_transit_is_a_connection_error_retried(faults):
    client = LLMClient(faults.url, KEY, 5.0)
    error = failure(client, "fault=short_body")
    assert isinstance(error, LLMConnectionError) and retry_delay(error, 0) is not None
    assert one_line(client, error).startswith("connection error: the reply was cut off")


def test_a_body_that_cannot_be_decoded_is_not_retried(faults):
    client = LLMClient(faults.url, KEY, 5.0)
    error = failure(client, "fault=corrupt_gzip")
    assert isinstance(error, LLMResponseError) and retry_delay(error, 0) is None
    assert one_line(client, error).startswith("invalid reply: the reply cannot be decoded")


@pytest.mark.parametrize("fault", ["invalid_json", "reset", "flaky_reset"])
def test_broken_answers_are_llm_errors_with_one_line(faults, fault):
    client = LLMClient(faults.url, KEY, 5.0)
    error = failure(client, f"fault={fault} {time.monotonic()}")  # flaky: a first attempt
    expected = LLMResponseError if fault == "invalid_json" else LLMConnectionError
    assert isinstance(error, expected), repr(error)
    assert retry_delay(error, 0) is not None  # a gateway's hiccup may pass
    one_line(client, error)


def test_a_server_that_does_not_speak_http_is_an_llm_error():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        for _ in range(2):
            connection, _ = listener.accept()
            connection.recv(65536)
            connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\x00\x01garbage\r\n\r\n")
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = LLMClient(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", KEY, 5.0)
        error = failure(client)
    finally:
        listener.close()
    assert isinstance(error, LLMError), repr(error)
    one_line(client, error)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                 lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                 max_leaves=8).map(lambda v: json.dumps(v).encode())))
def test_any_200_body_is_a_json_object_or_an_invalid_reply(scripted, body):
    scripted.answer = (200, {"Content-Type": "application/json"}, body)
    client = LLMClient(scripted.url, KEY, 5.0)
    try:
        expected = jsonlib.loads(body)
    except ValueError:
        expected = None
    if isinstance(expected, dict):
        assert call(client) == expected
    else:
        error = failure(client)
        assert isinstance(error, LLMResponseError), repr(error)
        assert one_line(client, error).startswith("invalid reply: the server at ")


ERROR_BODIES = st.one_of(
    st.builds(lambda m: {"error": {"message": m, "type": "x", "code": None}}, st.text(max_size=400)),
    st.builds(lambda m: {"error": m}, st.text(max_size=50)),
    st.builds(lambda m: {"message": m}, st.text(max_size=50)),
    st.builds(lambda m: {"detail": [{"msg": m}]}, st.text(max_size=50)),
    st.just({"error": None}), st.just([]), st.just("just a string"),
).map(lambda v: json.dumps(v).encode()) | st.binary(max_size=300) | st.sampled_from(
    [b"", b"<html><body>Bad Gateway</body></html>", f"denied for {KEY}\n".encode()])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(status=st.sampled_from([400, 401, 403, 404, 408, 409, 413, 422, 429, 500, 502, 503, 504,
                               520, 599]),
       body=ERROR_BODIES, quote_key=st.booleans())
def test_any_error_status_is_a_status_error_explained_in_one_masked_line(scripted, status,
                                                                          body, quote_key):
    if quote_key:
        body = body.replace(b"x", KEY.encode(), 1) + KEY.encode()
    scripted.answer = (status, {"Content-Type": "application/json"}, body)
    client = LLMClient(scripted.url, KEY, 5.0)
    error = failure(client)
    assert isinstance(error, LLMStatusError) and error.status_code == status
    text = one_line(client, error)
    assert text.startswith(f"HTTP {status}")
    retried = retry_delay(error, 0) is not None
    assert retried == (status >= 500 or status in (408, 409, 429))


# -- the callers -----------------------------------------------------------------------------
def test_a_judge_vote_whose_connection_was_reset_is_retried(faults):
    """``flaky_reset`` drops the first attempt's connection; the second gets the fault
    upstream's echo (no verdict in it: unparsable, but answered)."""
    text = f"fault=flaky_reset {time.monotonic()}"
    judge = Judge(faults.url, "judge-model", api_key=KEY, votes=1, structured=False,
                  timeout=5.0, retries=1)
    result = judge.judge({"request_messages": [{"role": "user", "content": text}],
                          "response": "4"})
    [vote] = result.votes
    assert vote["error"].startswith("unparsable"), vote
    assert result.failed == 0


def test_a_replay_through_a_redirecting_upstream_fails_as_the_upstreams_fault(faults):
    with DoubleServer([Reply(content='{"score": 1, "rationale": "ok"}')]) as judge_server:
        judge = Judge(judge_server.url, "judge", votes=1, structured=False)
        replayer = Replayer(judge, faults.url, "m", api_key=KEY, timeout=5.0)

        async def main():
            try:
                return await replayer.areplay(
                    {"request_messages": [{"role": "user", "content": "fault=redirect_307"}]}, [])
            finally:
                await replayer.aclose()
                await judge.aclose()

        replay = asyncio.run(main())
    assert replay.upstream_failed and replay.score is None
    assert replay.error.startswith("upstream failed: HTTP 307: a redirect to "
                                   "https://example.invalid/v1")


def test_error_text_of_other_exceptions_is_one_line():
    assert error_text(ValueError("x" * 1000)).startswith("ValueError: x")
    assert len(error_text(ValueError("x" * 1000))) == 300
    assert error_text(asyncio.TimeoutError()) == "timed out"


# -- proxies from the environment --------------------------------------------------------------
def test_the_environments_proxy_carries_the_calls_and_no_proxy_is_honoured(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                 "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with DoubleServer([Reply(content="via the proxy")]) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url.removesuffix("/v1"))
        reply = call(LLMClient("http://metaclaw-test.invalid/v1", KEY, 5.0))
        assert reply["choices"][0]["message"]["content"] == "via the proxy"
        assert proxy.requests[-1]["headers"]["Host"] == "metaclaw-test.invalid"
        monkeypatch.delenv("HTTP_PROXY")
        monkeypatch.setenv("ALL_PROXY", proxy.url.removesuffix("/v1"))
        proxy.add(Reply(content="via all_proxy"))
        reply = call(LLMClient("http://metaclaw-test.invalid/v1", KEY, 5.0))
        assert reply["choices"][0]["message"]["content"] == "via all_proxy"
        monkeypatch.setenv("NO_PROXY", "metaclaw-test.invalid")
        seen = len(proxy.requests)
        client = LLMClient("http://metaclaw-test.invalid/v1", KEY, 5.0)
        error = failure(client)  # straight to a host that does not resolve
        assert isinstance(error, LLMConnectionError) and len(proxy.requests) == seen


def test_a_proxy_the_http_client_cannot_use_is_not_taken(monkeypatch):
    """One lookup for the proxy's upstreams and this client: a SOCKS proxy is left out (calls go
    direct, as before the lookup was shared), a proxy without a scheme is an HTTP one."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                 "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    assert environment_proxy("https://api.example.com/v1") is None
    monkeypatch.setenv("HTTPS_PROXY", "corp-proxy:3128")
    assert environment_proxy("https://api.example.com/v1") == "http://corp-proxy:3128"


# -- TLS ---------------------------------------------------------------------------------------
def _certificates(folder):
    """A CA and a certificate it signed for 127.0.0.1 (PEM files): ca, cert, key."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject, issuer, public, signer, ca: bool, issuer_key):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                   .public_key(public).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(public),
                                  critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       issuer_key), critical=False))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        else:
            builder = (builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False))
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "metaclaw test CA")])
    ca = build(ca_name, ca_name, ca_key.public_key(), ca_key, True, ca_key.public_key())
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ca_name,
                 key.public_key(), ca_key, False, ca_key.public_key())
    paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


class _TLSServer(BackgroundServer):
    def __init__(self, make_app, context):
        super().__init__(make_app, "127.0.0.1", 0, "tls-double", shutdown_timeout=0.2)
        self.context = context

    async def _open(self) -> None:
        self._runner = self.runner(self.make_app(), access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 0, ssl_context=self.context).start()
        self.port = int(self._runner.addresses[0][1])


def test_tls_is_verified_against_the_system_authorities_or_ssl_cert_file(tmp_path, monkeypatch):
    import ssl

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    assert tls_context().verify_mode == ssl.CERT_REQUIRED and tls_context().check_hostname
    paths = _certificates(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(paths["cert"], paths["key"])
    double = DoubleServer([Reply(content="over TLS")])
    server = _TLSServer(double._make_app, context).start()
    try:
        url = f"https://127.0.0.1:{server.port}/v1"
        client = LLMClient(url, KEY, 5.0)
        error = failure(client)  # a CA the system does not know
        assert isinstance(error, LLMConnectionError) and "certificate" in str(error)
        assert retry_delay(error, 0) is None  # the same certificate comes back
        monkeypatch.setenv("SSL_CERT_FILE", str(paths["ca"]))
        reply = call(LLMClient(url, KEY, 5.0))
        assert reply["choices"][0]["message"]["content"] == "over TLS"
    finally:
        server.stop()


def test_complete_is_the_one_retry_loop_of_the_judge_and_the_evolver():
    """A refused schema is asked once more as text (a try not counted); a retryable status is
    retried up to ``retries``; a client error stops at once; every failure says its kind."""
    import asyncio

    from metaclaw.fastloop.llm import CallFailed, LLMClient
    from metaclaw.offline.double import DoubleServer, Reply

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    params = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def call(replies, **options):
        with DoubleServer(replies) as double:
            client = LLMClient(double.url, "sk-test", 5.0)

            async def main():
                try:
                    return await client.complete(params, timeout=5.0, **options)
                finally:
                    await client.aclose()

            try:
                return asyncio.run(main()), double.requests
            except CallFailed as failed:
                return failed, double.requests

    (response, structured), sent = call([Reply("no schema here", status=400), Reply("{}")],
                                        retries=0, schema=schema)
    assert not structured and response["choices"][0]["message"]["content"] == "{}"
    assert "response_format" in sent[0]["body"] and "response_format" not in sent[1]["body"]
    (response, structured), _ = call([Reply("{}")], retries=0, schema=schema)
    assert structured
    failed, sent = call([Reply("busy", status=503), Reply("busy", status=503)], retries=1)
    assert isinstance(failed, CallFailed) and failed.kind == "error" and failed.attempts == 2
    assert failed.retryable and "HTTP 503" in failed.detail and len(sent) == 2
    failed, sent = call([Reply("bad key sk-test", status=401)], retries=3)
    assert failed.kind == "error" and failed.attempts == 1 and not failed.retryable
    assert "sk-test" not in failed.detail and len(sent) == 1
