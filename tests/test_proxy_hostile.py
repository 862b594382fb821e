"""Malformed and hostile requests against a running proxy, over raw sockets (both protocols).

Named cases first (each defect class once), then a property-based fuzz suite (hypothesis) over
JSON structure, numbers, strings (surrogates, control characters, huge values), headers and
Content-Encodings. Rules every answer must follow:

- a well-formed HTTP response; never a 5xx (the upstream here is an echo double that accepts
  anything, so every failure is the client's);
- a 4xx carries a JSON error in the client protocol's shape (OpenAI ``error.message``; Anthropic
  ``type: "error"``) with a message, and records no turn; a 200 is a whole reply and records
  exactly one ``ok`` turn.

``METACLAW_FUZZ_EXAMPLES`` sets the number of generated requests (default 300, CI-fast).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import time
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from metaclaw.offline.double import DoubleServer
from metaclaw.proxy import edge
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.store import Store

FUZZ_EXAMPLES = int(os.environ.get("METACLAW_FUZZ_EXAMPLES", "300"))
ROUTES = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
          "responses": "/v1/responses"}
FIGURES = {"run": 0, "bad": 0}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    store = Store(root / "metaclaw.db")
    library = SkillLibrary(root / "skills", store)
    library.add(Skill("git-commit-messages", "How to write clear git commit messages.", "coding",
                      "Write the subject in the imperative mood.\n### pose\n</metaclaw-skills>"),
                reason="test")
    with DoubleServer() as double:
        config = ProxyConfig(upstream_url=double.url, retrieval="lexical", header_timeout=1.0,
                             body_timeout=1.0, max_connections=64, timeout=10)
        with Proxy(config, store, library) as proxy:
            yield proxy, store
    store.close()


def raw_http(port: int, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = (),
             method: bytes = b"POST", timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    """One request over a fresh socket; returns (status, headers, de-chunked body)."""
    head = [method + b" " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1",
            b"Connection: close", b"Content-Length: " + str(len(body)).encode()]
    head += [name + b": " + value for name, value in headers]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = header_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    parsed = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if parsed.get("transfer-encoding") == "chunked":
        out = b""
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        rest = out
    return status, parsed, rest


def _base(protocol: str, stream: bool = False) -> dict:
    body = {"model": "double-model", "stream": stream,
            "messages": [{"role": "user", "content": "How do I word a git commit message?"}]}
    if protocol == "anthropic":
        body["max_tokens"] = 64
    if protocol == "responses":  # the same conversation as input items
        body["input"] = body.pop("messages")
    return body


def _items(protocol: str, body: dict) -> list:
    """The body's list of messages (Responses: its input items)."""
    return body["input" if protocol == "responses" else "messages"]


def _turns(store: Store) -> int:
    return store.query("SELECT COUNT(*) AS n FROM turns")[0]["n"]


def judge(proxy: Proxy, store: Store, protocol: str, body: bytes,
          headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, dict, bytes]:
    """Send, then check the rules; returns the answer. Counts toward the suite's figures."""
    before = _turns(store)
    status, answer_headers, payload = raw_http(proxy.port, ROUTES[protocol], body, headers)
    proxy.flush()
    recorded = _turns(store) - before
    FIGURES["run"] += 1
    problem = _problem(protocol, status, answer_headers, payload, recorded)
    if problem:
        FIGURES["bad"] += 1
        raise AssertionError(f"{problem}: status {status}, body {payload[:300]!r}, "
                             f"request {body[:200]!r} headers {headers!r}")
    return status, answer_headers, payload


def _problem(protocol: str, status: int, headers: dict, payload: bytes, recorded: int) -> str:
    if status >= 500:
        return "a 5xx for a client's request"
    if status >= 400:
        if recorded:
            return "a refused request left a turn"
        try:
            error = json.loads(payload)
        except ValueError:
            return "an error that is not JSON"
        if protocol in ("openai", "responses"):
            ok = isinstance(error.get("error"), dict) and error["error"].get("message")
        else:
            ok = error.get("type") == "error" and isinstance(error.get("error"), dict) and \
                error["error"].get("message")
        return "" if ok else f"an error not in the {protocol} shape"
    if status != 200:
        return f"unexpected status {status}"
    if recorded != 1:
        return f"a 200 recorded {recorded} turns"
    if headers.get("content-type", "").startswith("text/event-stream"):
        end = {"openai": b"data: [DONE]", "anthropic": b"event: message_stop",
               "responses": b"event: response.completed"}[protocol]
        return "" if end in payload else "a 200 stream without its final event"
    try:
        json.loads(payload)
    except ValueError:
        return "a 200 whose body is not JSON"
    return ""


# ---------------------------------------------------------------------------------------------
# named cases
# ---------------------------------------------------------------------------------------------
def _with(protocol: str, **fields) -> bytes:
    return json.dumps({**_base(protocol), **fields}).encode()


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("name, body, status, param", [
    ("deep nesting", lambda p: b'{"model": "m", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}",
     400, None),
    ("nesting past the limit", lambda p: _with(p, metadata=json.loads("[" * 150 + "]" * 150)),
     400, "metadata"),
    ("NaN", lambda p: _with(p).replace(b'"stream": false', b'"temperature": NaN'), 400,
     "temperature"),
    ("Infinity", lambda p: _with(p).replace(b'"stream": false', b'"top_p": -Infinity'), 400,
     "top_p"),
    ("1e400", lambda p: _with(p).replace(b'"stream": false', b'"temperature": 1e400'), 400,
     "temperature"),
    ("lone surrogate", lambda p: _with(p).replace(b"git commit", b"git \\ud800 commit"), 400,
     "messages[0].content"),
    ("wrong-type falsy max_tokens", lambda p: _with(p, max_tokens=False), 400, "max_tokens"),
    ("wrong-type falsy stop", lambda p: _with(p, stop=0) if p == "openai"
     else _with(p, stop_sequences=""), 400, None),
    ("wrong-type falsy session id", lambda p: _with(p, session_id=0), 400, "session_id"),
    ("wrong-type falsy metadata", lambda p: _with(p, metadata=""), 400, "metadata"),
    ("stream null", lambda p: _with(p, stream=None), 200, None),
    ("temperature null", lambda p: _with(p, temperature=None), 200, None),
])
def test_malformed_body_gets_a_4xx_naming_the_field(env, protocol, name, body, status, param):
    proxy, store = env
    got, _, payload = judge(proxy, store, protocol, body(protocol))
    assert got == status, (name, payload)
    if status == 400:
        error = json.loads(payload)["error"]
        if protocol == "openai" and param is not None:
            assert error["param"] == param, (name, error)
        if param:
            assert param.split("[")[0] in error["message"], (name, error)


@pytest.mark.parametrize("protocol, messages, param", [
    ("anthropic", [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "text", "text": None}]}],
     "messages.1.content.0"),
    ("anthropic", [{"role": "user", "content": [{"type": "image", "source": "http://x/y.png"}]}],
     "messages.0.content.0"),
    ("anthropic", [{"role": "user", "content": [{"type": "document", "source": "text"}]}],
     "messages.0.content.0"),
    ("openai", [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x"}]}],
     "messages[0].content[0].image_url"),
    ("openai", [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": ["call"]}],
     "messages[1].tool_calls[0]"),
    ("openai", [{"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
                    "name": "f", "arguments": 5}}]}],
     "messages[1].tool_calls[0].function.arguments"),
])
def test_malformed_blocks_and_parts_get_a_400_naming_them(env, protocol, messages, param):
    """Shapes the adapters read (content blocks, image parts, tool calls): refused as the
    provider's API refuses them, never a 500 from a translation that could not read them."""
    proxy, store = env
    status, _, payload = judge(proxy, store, protocol, _with(protocol, messages=messages))
    assert status == 400 and param in json.loads(payload)["error"]["message"], payload


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_content_encodings(env, protocol):
    proxy, store = env
    body = _with(protocol)
    assert judge(proxy, store, protocol, gzip.compress(body), [(b"Content-Encoding", b"gzip")])[0] == 200
    assert judge(proxy, store, protocol, zlib.compress(body), [(b"Content-Encoding", b"deflate")])[0] == 200
    status, _, payload = judge(proxy, store, protocol, body, [(b"Content-Encoding", b"bogus")])
    assert status == 415 and b"Content-Encoding" in payload
    offered = json.loads(payload)["error"]["message"].rpartition("send the body as ")[2]
    assert offered.split(", ") == list(edge.ENCODINGS)  # only what can be decoded here
    for name in (b"br", b"zstd"):
        if name.decode() not in edge.ENCODINGS:  # its package is not installed: a JSON 415
            status, _, payload = judge(proxy, store, protocol, b"\x0b\x02\x80",
                                       [(b"Content-Encoding", name)])
            assert status == 415 and b"identity, gzip, deflate" in payload, payload
    status, _, payload = judge(proxy, store, protocol, body, [(b"Content-Encoding", b"gzip")])
    assert status == 400 and b"Content-Encoding" in payload


def _compress(encoding: str, data: bytes) -> bytes:
    """``data`` compressed as ``encoding`` ("raw-deflate": a deflate stream without the zlib
    wrapper, which some clients send as Content-Encoding deflate)."""
    if encoding == "gzip":
        return gzip.compress(data)
    if encoding == "deflate":
        return zlib.compress(data)
    if encoding == "raw-deflate":
        packer = zlib.compressobj(wbits=-15)
        return packer.compress(data) + packer.flush()
    if encoding == "br":
        return edge._BROTLI.compress(data)
    return edge._ZSTD.compress(data)


#: Every encoding this machine decodes, raw deflate included.
CODECS = ["gzip", "deflate", "raw-deflate"] + [e for e in ("br", "zstd") if e in edge.ENCODINGS]


def _header(encoding: str) -> list[tuple[bytes, bytes]]:
    return [(b"Content-Encoding", b"deflate" if encoding == "raw-deflate" else encoding.encode())]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("name, encoding, cut, reason", [
    ("gzip without its trailer", "gzip", lambda g: g[:-8], "truncated"),
    ("gzip with half its trailer", "gzip", lambda g: g[:-4], "truncated"),
    ("gzip cut midway", "gzip", lambda g: g[:len(g) // 2], "truncated"),
    ("gzip header only", "gzip", lambda g: g[:10], "truncated"),
    ("gzip, empty body", "gzip", lambda g: b"", "truncated"),
    ("gzip with a wrong CRC", "gzip", lambda g: g[:-8] + bytes(4) + g[-4:], "checksum"),
    ("gzip with a wrong length", "gzip", lambda g: g[:-4] + bytes(4), "length"),
    ("gzip then garbage", "gzip", lambda g: g + b"xx", "valid header"),
    ("deflate without its Adler-32", "deflate", lambda z: z[:-4], "truncated"),
    ("deflate cut midway", "deflate", lambda z: z[:len(z) // 2], "truncated"),
    ("deflate then more data", "deflate", lambda z: z + b"zz", "data follows the end"),
    ("raw deflate cut short", "raw-deflate", lambda z: z[:-3], "truncated"),
])
def test_truncated_or_corrupt_compressed_body_gets_a_400(env, protocol, name, encoding, cut,
                                                         reason):
    """A compressed body that is cut short or corrupt is refused with a 400 in the client's
    protocol naming the encoding and the fault, never served (a gzip body without its trailer
    used to be accepted, the JSON inside it being whole)."""
    proxy, store = env
    status, _, payload = judge(proxy, store, protocol, cut(_compress(encoding, _with(protocol))),
                               _header(encoding))
    error = json.loads(payload)["error"]
    assert status == 400 and reason in error["message"], (name, error)
    assert "Content-Encoding" in error["message"], error
    if protocol == "openai":
        assert error["code"] == "bad_content_encoding" and error["param"] == "Content-Encoding"


@pytest.mark.parametrize("encoding", CODECS)
def test_whole_compressed_bodies_are_served(env, encoding):
    proxy, store = env
    assert judge(proxy, store, "openai", _compress(encoding, _with("openai")),
                 _header(encoding))[0] == 200
    if encoding in ("gzip", "zstd"):  # concatenated members are one body (RFC 1952)
        body = _with("openai")
        two = _compress(encoding, body[:20]) + _compress(encoding, body[20:])
        assert judge(proxy, store, "openai", two, _header(encoding))[0] == 200


def test_decompressed_size_is_limited(tmp_path):
    """A small compressed body that expands past max_body_bytes gets a 413 once the decoded
    bytes pass the limit (a decompression bomb never expands in full); one within it is served."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    limit = 64 * 1024
    with DoubleServer() as double, Proxy(ProxyConfig(
            upstream_url=double.url, retrieval="lexical", max_body_bytes=limit), store,
            library) as proxy:
        for encoding in CODECS:
            for protocol in ROUTES:
                body = _with(protocol, metadata={"pad": " " * (limit - 500)})
                assert judge(proxy, store, protocol, _compress(encoding, body),
                             _header(encoding))[0] == 200
                bomb = _with(protocol, metadata={"pad": " " * (1000 * limit)})
                status, _, payload = judge(proxy, store, protocol, _compress(encoding, bomb),
                                           _header(encoding))
                assert status == 413 and b"decompresses to more than" in payload, payload
        members = gzip.compress(b"{}") * (edge.MAX_MEMBERS + 1)  # thousands would cost time
        status, _, payload = judge(proxy, store, "openai", members, _header("gzip"))
        assert status == 400 and b"concatenated gzip members" in payload, payload
    store.close()


@pytest.mark.parametrize("encoding", CODECS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_decoder_reads_any_chunking_and_refuses_any_truncation(encoding, data):
    """In memory: a body split into chunks anywhere decodes to itself; any strict prefix of it,
    in any chunks, is a 400 (the decoder, not the JSON parser, sees the cut)."""
    body = data.draw(st.binary(max_size=3000)) + b" " * data.draw(st.integers(0, 5000))
    packed = _compress(encoding, body)
    cut = data.draw(st.integers(0, len(packed)))
    cuts = sorted(data.draw(st.lists(st.integers(0, cut), max_size=6)))
    decoder = edge.BodyDecoder(_header(encoding)[0][1].decode(), 1 << 20)
    try:
        for start, end in zip([0] + cuts, cuts + [cut]):
            decoder.feed(packed[start:end])
        decoded = decoder.finish()
    except edge.ProxyError as exc:
        assert cut < len(packed) and exc.status == 400, exc.message
    else:
        assert cut == len(packed) and decoded == body


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_a_body_sent_in_tiny_pieces_costs_its_size_not_ten_times_it(encoding):
    """A client sending its body a few bytes per packet hands the decoder a few bytes per read
    (a 1 MB body trickled a byte per send arrived in about 200,000 pieces): kept as a list of
    small bytes objects, a body near the limit took about ten times the limit in memory."""
    import tracemalloc

    body = json.dumps({"pad": os.urandom(150_000).hex()}).encode()  # gzip keeps half of it
    packed = _compress(encoding, body) if encoding != "identity" else body
    decoder = edge.BodyDecoder(encoding, 1 << 20)
    tracemalloc.start()
    try:
        for i in range(0, len(packed), 3):
            decoder.feed(packed[i:i + 3])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoder.finish() == body
    assert peak < 3 * len(body), f"{peak:,} bytes held for a body of {len(body):,}"


@settings(max_examples=max(30, FUZZ_EXAMPLES // 5), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(protocol=st.sampled_from(sorted(ROUTES)), encoding=st.sampled_from(CODECS),
       stream=st.booleans(), data=st.data())
def test_fuzz_truncated_compressed_bodies(env, protocol, encoding, stream, data):
    """Over sockets: any truncation of a valid compressed request is a 4xx in the client's
    shape that records no turn; never a 5xx, never served."""
    proxy, store = env
    packed = _compress(encoding, json.dumps(_base(protocol, stream)).encode())
    cut = data.draw(st.integers(0, len(packed) - 1))
    status, _, _ = judge(proxy, store, protocol, packed[:cut], _header(encoding))
    assert status == 400


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("header", [
    (b"X-Big", b"a" * 20000),
    (b"X-Session-Id", b"bad\x01id"),
    (b"X-Ctl", b"va\x00lue"),
    (b"Bad Header Name", b"v"),
])
def test_bad_headers_get_a_json_4xx(env, protocol, header):
    proxy, store = env
    status, headers, payload = judge(proxy, store, protocol, _with(protocol), [header])
    assert 400 <= status < 500 and headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("header", [
    (b"Authorization", b"Bearer sk-live-SECRET0123456789\x01"),
    (b"x-api-key", b"sk-live-SECRET0123456789\x00x"),
    (b"x-api-key", b"sk-live-SECRET0123456789\x7f"),
    (b"x-api-key", b"sk-live-SECRET0123456789" + b" " * 9000),
])
def test_malformed_header_errors_never_quote_the_key(env, header):
    """The HTTP parser's reason quotes the bad header line, which may hold the caller's key:
    the JSON error says what is wrong without the bytes (clients and agents log error bodies)."""
    proxy, store = env
    for protocol in ROUTES:
        status, _, payload = judge(proxy, store, protocol, _with(protocol), [header])
        assert 400 <= status < 500 and b"SECRET" not in payload, payload
        assert b"malformed HTTP request (" in payload, payload


def test_nested_content_is_answered_at_once(env):
    """A tool_result nested 90 lists deep (within the depth limit) is served like any other:
    reading its text for the translation took time exponential in the depth, on the event loop,
    stalling every client of the proxy."""
    proxy, store = env
    nested: object = "deep"
    for _ in range(90):
        nested = [nested]
    content = [{"type": "tool_result", "tool_use_id": "t", "content": [nested]}]
    status, _, payload = judge(proxy, store, "anthropic", _with("anthropic", messages=[
        {"role": "user", "content": content}]))
    assert status == 200, payload


def test_deeply_nested_tool_arguments_in_the_history_are_served(env):
    """A resent assistant tool call whose arguments (a string) nest deeper than Python's
    recursion limit: reading the history to thread the conversation must not answer 500."""
    proxy, store = env
    arguments = "[" * 100_000 + "]" * 100_000
    messages = [{"role": "user", "content": "open it"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "open", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    status, _, payload = judge(proxy, store, "openai", _with("openai", messages=messages))
    assert status in (200, 400), payload


def test_slowloris_headers_are_cut_off(env):
    """A client that never finishes its headers is disconnected after header_timeout."""
    proxy, _ = env
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for _ in range(20):  # a header line now and then, never the blank line
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
            time.sleep(0.2)
            sock.settimeout(0.01)
            try:
                if sock.recv(1) == b"":
                    break
            except (socket.timeout, BlockingIOError):
                pass
            except OSError:
                break
        assert time.monotonic() - started < 3.5


def test_slow_body_gets_408(env):
    proxy, store = env
    body = _with("openai")
    before = _turns(store)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        data = b""
        while b"did not arrive" not in data and (chunk := sock.recv(65536)):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408") and b"did not arrive" in data
    assert _turns(store) == before


def test_connection_cap(env):
    """Connections beyond max_connections get a 503 JSON answer and are closed."""
    proxy, _ = env
    held = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(64)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as extra:
            data = extra.recv(65536)
        assert data.startswith(b"HTTP/1.1 503") and b"too_many_connections" in data
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    status, _, _ = raw_http(proxy.port, "/healthz", b"", method=b"GET")
    assert status == 200


# ---------------------------------------------------------------------------------------------
# property-based fuzz suite
# ---------------------------------------------------------------------------------------------
HOSTILE_CHARS = st.sampled_from(["\ud800", "\udfff", "\x00", "\x1b[31m", "\u2028", "\ufeff",
                                 "\U0001f600", "</metaclaw-skills>", "### x", "\\", '"'])
STRINGS = st.one_of(st.text(max_size=20), st.lists(HOSTILE_CHARS, max_size=4).map("".join),
                    st.just("x" * 100_000))
NUMBERS = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([10**400, -10**30, 2**63, 0, -0.0]))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(STRINGS, inner, max_size=4)),
                    max_leaves=12)
FIELDS = st.sampled_from(["model", "messages", "stream", "max_tokens", "temperature", "top_p",
                          "tools", "tool_choice", "stop", "stop_sequences", "system", "metadata",
                          "session_id", "turn_type", "session_done", "stream_options", "n",
                          "user", "seed", "thinking", "x_unknown", "input", "instructions",
                          "max_output_tokens", "text", "reasoning", "previous_response_id",
                          "include", "store", "prompt_cache_key", "parallel_tool_calls"])


def _dump(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def hostile_requests(draw):
    protocol = draw(st.sampled_from(["openai", "anthropic", "responses"]))
    body = _base(protocol, stream=draw(st.booleans()))
    kind = draw(st.sampled_from(["field", "message", "content", "raw", "deep", "number"]))
    if kind == "field":
        body[draw(FIELDS)] = draw(JSON)
        raw = _dump(body)
    elif kind == "message":
        _items(protocol, body).append(draw(JSON))
        raw = _dump(body)
    elif kind == "content":
        _items(protocol, body)[0]["content"] = draw(STRINGS)
        raw = _dump(body)
    elif kind == "deep":
        depth = draw(st.integers(1, 5000))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        raw = _dump(body)[:-1] + b', "deep": ' + (opener * depth + "1" + closer * depth).encode() + b"}"
    elif kind == "number":
        token = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999",
                                      "1" * 5000, "0.1e-400", "1E+308"]))
        raw = _dump(body).replace(b'"stream": ', b'"temperature": ' + token.encode() + b', "stream": ')
    else:
        raw = draw(st.binary(max_size=200)) if draw(st.booleans()) else _dump(body)[
            :draw(st.integers(0, 60))]
    headers = []
    encoding = draw(st.sampled_from([None, "gzip", "deflate", "bogus", "gzip-lie", "identity",
                                     "br", "zstd"]))
    if encoding == "gzip":
        raw, headers = gzip.compress(raw), [(b"Content-Encoding", b"gzip")]
    elif encoding == "deflate":
        raw, headers = zlib.compress(raw), [(b"Content-Encoding", b"deflate")]
    elif encoding == "gzip-lie":
        headers = [(b"Content-Encoding", b"gzip")]
    elif encoding is not None:
        headers = [(b"Content-Encoding", encoding.encode())]
    name = draw(st.sampled_from([b"X-Session-Id", b"X-Turn-Type", b"X-Session-Done", b"X-Other",
                                 b"Content-Type"]))
    value = draw(st.one_of(st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
                           st.sampled_from([b"main", b"side", b"true", b"x" * 9000, b"\x7f",
                                            b"\x1b[2J", "caf\u00e9".encode()])))
    if draw(st.booleans()):
        headers.append((name, value))
    return protocol, raw, headers


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=hostile_requests())
def test_fuzz_every_answer_is_well_formed(env, request):
    proxy, store = env
    protocol, raw, headers = request
    judge(proxy, store, protocol, raw, headers)


def test_hostile_suite_figures():
    """Printed figure: generated and named requests run, and badly answered (run with -s)."""
    print(f"\nhostile requests run: {FIGURES['run']}, badly answered: {FIGURES['bad']}")
    assert FIGURES["bad"] == 0


@pytest.mark.parametrize("auth, header", [
    ({"token": "team-token"}, (b"Authorization", b"Bearer team-token\xff")),
    ({"token": "team-token"}, (b"x-api-key", b"\xe9t\xe9")),
    ({"caller_auth": True}, (b"x-api-key", b"sk-\xff\xfe-1234")),
    ({"caller_auth": True}, (b"Authorization", "Bearer sk-caf\u00e9".encode())),
])
def test_keys_that_are_not_ascii_get_a_401(tmp_path, auth, header):
    """A key or token with bytes that are not UTF-8 (or not printable ASCII) is refused as any
    wrong key is, on every route: never a 500 from encoding it."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    with DoubleServer() as double, Proxy(ProxyConfig(upstream_url=double.url, retrieval="lexical",
                                                     **auth), store, library) as proxy:
        for protocol, path in ROUTES.items():
            status, headers, payload = raw_http(proxy.port, path, _with(protocol), [
                (b"Content-Type", b"application/json"), header])
            assert status == 401 and headers["content-type"].startswith("application/json"), \
                payload
        status, _, payload = raw_http(proxy.port, "/v1/models", b"", [header], method=b"GET")
        assert status == 401, payload
        assert _turns(store) == 0
    store.close()
