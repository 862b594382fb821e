"""The proxy's edge: what a request must be before the turn pipeline sees it.

Everything a client controls is checked here, and every refusal is a 4xx in the client's
protocol naming the field and the reason (a client error is never a 5xx):

- the HTTP layer (:class:`EdgeRunner`): malformed request lines and headers, oversize or
  control-character headers get a JSON error instead of aiohttp's plain text (the route is not
  known yet, so the body is shaped to satisfy both protocols' SDKs); a header read timeout (a
  connection that has not sent a whole request within ``header_timeout`` seconds is closed) and a
  cap on open connections hold off slowloris clients; the body read timeout is in the pipeline;
- the body's Content-Encoding (:class:`BodyDecoder`): decoded as it arrives, within the size
  limit after decompression; a corrupt or truncated stream is a 400 naming the fault;
- the body (:func:`decode_body`): JSON only, an object, nested at most :data:`MAX_DEPTH` deep,
  no NaN / Infinity / numbers too large for a double, no lone surrogate code points (SQLite and
  every upstream refuse them);
- the fields (:func:`check_fields`): the type of each optional field the protocol's adapter
  declares (:attr:`metaclaw.protocols.WireProtocol.field_types`); ``null`` means "not given" (as
  the OpenAI API reads it) and is dropped before forwarding.
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from http import HTTPStatus
from typing import Any

from aiohttp import http_exceptions, web, web_protocol, web_server
from orjson import loads as loads_fast

from metaclaw.jsonlib import LONE_SURROGATE as _SURROGATE, dumps
from metaclaw.protocols import BOOLEAN, STRING, ProxyError, WireProtocol

#: Deepest JSON nesting accepted in a request body (tool schemas stay far below it).
MAX_DEPTH = 100


def _zstd() -> Any:
    """The zstd module (Python 3.14's, or its backport), or ``None``."""
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        try:
            from backports import zstd  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    return zstd


def _brotli() -> Any:
    """The Brotli module when it can cap the output of one step (Brotli 1.2+), or ``None``:
    without that cap a few kilobytes could expand to gigabytes before the size limit is seen."""
    try:
        import brotli  # type: ignore[import-not-found]
        brotli.Decompressor().process(b"", output_buffer_limit=1)
    except Exception:  # not installed, or an older API without output_buffer_limit
        return None
    return brotli


_ZSTD, _BROTLI = _zstd(), _brotli()
#: Content-Encodings the proxy decodes (brotli and zstd where their packages are installed:
#: they are not dependencies).
ENCODINGS = ("identity", "gzip", "deflate") + ("br",) * bool(_BROTLI) + ("zstd",) * bool(_ZSTD)
#: Concatenated gzip or zstd members accepted in one body (clients send one; each new member
#: copies the rest of its chunk, so a body of thousands of tiny members would cost quadratic time).
MAX_MEMBERS = 64

#: Fields the proxy itself reads, whatever the protocol (each protocol's own are declared by its
#: adapter: :attr:`metaclaw.protocols.WireProtocol.field_types`).
PROXY_FIELD_TYPES = {"session_id": STRING, "turn_type": STRING, "session_done": BOOLEAN + STRING}

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_LONG_NUMBER = re.compile(rb"[0-9]{19}")


class _NonFinite:
    """Placeholder the decoder leaves for a number JSON cannot carry (found later, with its path)."""

    def __init__(self, text: str):
        self.text = text


def _parse_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _bad(param: str | None, message: str, code: str = "invalid_request_body") -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 :class:`ProxyError` naming where and why.

    orjson reads it when it can: it refuses NaN, Infinity, numbers beyond a double, lone
    surrogates and deep nesting, the body is then read again by the standard library below, whose
    hooks find what is wrong and where. A number of 19 digits or more also goes that way (orjson
    would read an integer beyond 64 bits as a rounded float)."""
    if _LONG_NUMBER.search(raw) is None:
        try:
            body = loads_fast(raw)
        except ValueError:
            pass
        else:
            if isinstance(body, dict) and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
                return body
    flagged: list[bool] = []

    def constant(name: str) -> Any:
        flagged.append(True)
        return _NonFinite(name)

    def parse_float(text: str) -> Any:
        value = _parse_float(text)
        if isinstance(value, _NonFinite):
            flagged.append(True)
        return value

    try:
        body = json.loads(raw, parse_constant=constant, parse_float=parse_float)
    except RecursionError:
        raise _bad(None, f"the request body is nested deeper than {MAX_DEPTH} levels; "
                           "flatten it", code="too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(None, f"the request body is not valid JSON ({_printable(str(exc))}); send "
                           "a JSON object in UTF-8", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(None, "the request body must be a JSON object, not "
                           f"{type(body).__name__ if body is not None else 'null'}")
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if flagged or surrogates or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
        _walk(body, surrogates)
    return body


def _walk(body: Any, surrogates: bool) -> None:
    """Depth, non-finite numbers and lone surrogates, each reported with its JSON path."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            field = _printable(re.split(r"[.\[]", path, maxsplit=1)[0])
            raise _bad(field, f"'{field}' is nested deeper than {MAX_DEPTH} levels; flatten it",
                       code="too_deep")
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if surrogates and _SURROGATE.search(key):
                    raise _surrogate(_printable(where))
                stack.append((item, where, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, _NonFinite):
            raise _bad(_printable(path), f"{_printable(path)}: {value.text[:40]} is not a finite "
                                         "number (JSON has no NaN or Infinity, and this value "
                                         "does not fit a double)", code="invalid_number")
        elif surrogates and isinstance(value, str) and _SURROGATE.search(value):
            raise _surrogate(_printable(path))


def _surrogate(path: str) -> ProxyError:
    return _bad(path, f"{path} contains a lone surrogate code point (\\ud800-\\udfff without "
                      "its pair), which is not valid Unicode text; send well-formed UTF-8",
                code="invalid_unicode")


def _printable(text: str, limit: int = 120) -> str:
    """``text`` for an error message: control characters and surrogates escaped, cut short."""
    text = text[:limit]
    return "".join(c if c.isprintable() and not _SURROGATE.match(c) else repr(c)[1:-1]
                   for c in text)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


_PYTHON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float),
                 "boolean": (bool,), "array": (list,), "object": (dict,)}


@functools.lru_cache(maxsize=None)
def _accepted(kinds: tuple[str, ...]) -> frozenset[type]:
    return frozenset(t for kind in kinds for t in _PYTHON_TYPES.get(kind, ()))


def _matches(value: Any, kinds: tuple[str, ...]) -> bool:
    if type(value) in _accepted(kinds):  # what a JSON decoder returns: checked in one lookup
        return True
    name = _type_name(value)
    return name in kinds or (name == "integer" and "number" in kinds)


@functools.lru_cache(maxsize=None)
def _field_types(protocol: WireProtocol) -> dict[str, tuple[str, ...]]:
    """The types of the top-level fields of ``protocol``'s requests: its adapter's declaration
    and the proxy's own fields (:data:`PROXY_FIELD_TYPES`)."""
    return {**protocol.field_types, **PROXY_FIELD_TYPES}


def check_fields(protocol: WireProtocol, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without its ``null`` fields, after checking the type of each field the
    protocol's adapter declares (``field_types``, and ``message_field_types`` for each message
    of a ``messages`` list): 400 naming the field, its type and the expected ones otherwise."""
    types = _field_types(protocol)
    for name, value in body.items():
        kinds = types.get(name)
        if value is None or kinds is None or _matches(value, kinds):
            continue
        raise _bad(name, f"'{name}' must be {' or '.join(_a(k) for k in kinds)} (or null), not "
                         f"{_a(_type_name(value))}", code="invalid_type")
    message_types = protocol.message_field_types
    if message_types and isinstance(body.get("messages"), list):
        for i, message in enumerate(body["messages"]):
            if not isinstance(message, dict):
                continue
            for name, kinds in message_types.items():
                value = message.get(name)
                if value is not None and not _matches(value, kinds):
                    raise _bad(f"messages[{i}].{name}",
                               f"messages[{i}].{name} must be "
                               f"{' or '.join(_a(k) for k in kinds)}, not "
                               f"{_a(_type_name(value))}", code="invalid_type")
    if any(value is None for value in body.values()):
        body = {k: v for k, v in body.items() if v is not None}
    return body


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def too_large(limit: int, decompressed: bool = False) -> ProxyError:
    """The 413 for a body beyond ``limit`` bytes (as sent, or once decompressed)."""
    what = "decompresses to more than" if decompressed else "is larger than"
    return ProxyError(413, f"request body {what} the proxy's limit of {limit} bytes; send a "
                           "smaller request, or raise the limit (metaclaw serve --max-body-bytes N, "
                           "ProxyConfig.max_body_bytes)", code="request_too_large")


#: zlib's terse reasons, said plainly.
_ZLIB_REASONS = {"incorrect header check": "it does not start with a valid header",
                 "incorrect data check": "its checksum does not match its data: corrupt",
                 "incorrect length check": "its trailer's length does not match its data"}


class BodyDecoder:
    """Decodes a request body chunk by chunk as its Content-Encoding says (the HTTP server's own
    decoding is off: it accepts a gzip stream cut before its end, and it cannot say what is wrong).

    ``feed(chunk)`` for each chunk as it arrives, then ``finish()`` for the whole decoded body.
    Both raise a :class:`ProxyError`: 415 for an encoding not in :data:`ENCODINGS`, 413 when more
    than ``limit`` bytes arrive or the decoded body would exceed ``limit`` (a decompression bomb
    stops at ``limit`` bytes of output), 400 naming the encoding and the fault for a corrupt
    stream, data after its end, or a stream cut short (a gzip body without its trailer, a
    deflate, brotli or zstd stream without its final block). A corrupt body is refused at its
    first bad chunk, before the rest has arrived.
    """

    def __init__(self, encoding: str | None, limit: int):
        self.encoding = (encoding or "").strip().lower() or "identity"
        if self.encoding not in ENCODINGS:
            raise ProxyError(415, f"Content-Encoding {_printable(self.encoding, 40)!r} is not "
                                  f"supported; send the body as {', '.join(ENCODINGS)}",
                             param="Content-Encoding", code="unsupported_encoding")
        self.limit = limit
        self.received = 0  # bytes as sent
        self.size = 0  # bytes decoded
        self.members = 0
        # the usual body arrives in one chunk, kept as it is (no copy); later chunks go into one
        # growing buffer, not a list: a client sending its body a byte per packet hands over a
        # chunk of a few bytes per read, and a list of those would hold about ten times the body
        # (a bytes object costs some 40 bytes besides its data)
        self.first: bytes | None = None
        self.buffer = bytearray()
        # the current member's decompressor; None before the first, False after one ended
        self._stream: Any = None

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.limit:
            raise too_large(self.limit)
        if self.encoding == "identity":
            self._keep(chunk)
            return
        while chunk:
            if not self._stream:
                self._start(chunk)
            room = self.limit - self.size + 1  # one byte more than fits: enough to see a bomb
            try:  # zlib, brotli and zstd each raise their own error type
                if self.encoding == "br":
                    out, rest = self._stream.process(chunk, output_buffer_limit=room), b""
                    if self._stream.is_finished():
                        self._stream = False  # a finished brotli stream takes no more input
                else:
                    out, rest = self._stream.decompress(chunk, room), b""
                    if self._stream.eof:
                        rest, self._stream = self._stream.unused_data, False
            except Exception as exc:
                reason = str(exc).rpartition("data: ")[2] or type(exc).__name__
                raise self._corrupt(_ZLIB_REASONS.get(reason, reason)) from None
            self.size += len(out)
            if self.size > self.limit:
                raise too_large(self.limit, decompressed=True)
            self._keep(out)
            chunk = rest

    def _keep(self, data: bytes) -> None:
        if self.first is None and not self.buffer:
            self.first = data
            return
        if self.first is not None:
            self.buffer += self.first
            self.first = None
        self.buffer += data

    def _start(self, chunk: bytes) -> None:
        """A decompressor for the member that starts with ``chunk``."""
        if self._stream is False and self.encoding not in ("gzip", "zstd"):
            raise self._corrupt(f"data follows the end of the {self.encoding} stream")
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise self._corrupt(f"more than {MAX_MEMBERS} concatenated {self.encoding} members")
        if self.encoding == "gzip":
            self._stream = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif self.encoding == "deflate":
            # RFC 9110 deflate is zlib-wrapped (first byte: method 8, window <= 7); some clients
            # send a raw deflate stream instead, which is read as such (as browsers do)
            wrapped = chunk[0] & 0x0F == 8 and chunk[0] >> 4 <= 7
            self._stream = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        elif self.encoding == "br":
            self._stream = _BROTLI.Decompressor()
        else:
            self._stream = _ZSTD.ZstdDecompressor()

    def finish(self) -> bytes:
        if self.encoding != "identity" and self._stream is not False:  # no member ended
            trailer = " and its 8-byte trailer (CRC-32 and length)" if self.encoding == "gzip" \
                else ""
            raise self._corrupt(f"the {self.encoding} stream is truncated: the body ends after "
                                f"{self.received} bytes, before the end of the stream{trailer}",
                                whole=True)
        return self.first if self.first is not None else bytes(self.buffer)

    def _corrupt(self, reason: str, whole: bool = False) -> ProxyError:
        fix = ("send the whole compressed body" if whole else
               f"send the body compressed as {self.encoding}")
        return ProxyError(400, f"the request body does not decode as Content-Encoding "
                               f"{self.encoding!r} ({_printable(reason, 200)}); {fix}, or send it "
                               "uncompressed without the Content-Encoding header",
                          param="Content-Encoding", code="bad_content_encoding")


# ---------------------------------------------------------------------------------------------
# the HTTP layer
# ---------------------------------------------------------------------------------------------
def neutral_error(status: int, message: str, code: str) -> bytes:
    """An error body both SDKs read: OpenAI's ``error.message`` and Anthropic's
    ``type: "error"`` with ``error.type`` / ``error.message`` (used before the route is known)."""
    kind = "invalid_request_error" if status < 500 else "api_error"
    return dumps({"type": "error", "error": {"type": kind, "message": message,
                                             "param": None, "code": code}}).encode()


def _parser_reason(exc: BaseException | None, message: str | None) -> str:
    """Why aiohttp could not parse a request, without the request bytes its message quotes: the
    quoted line may be an ``Authorization`` or ``x-api-key`` header, and an error body is shown
    and logged by clients and the agents behind them (a key must never appear in one)."""
    text = str(getattr(exc, "message", None) or exc or message or "")
    # llhttp: "description:\n\n  b'<the bytes>'\n  ^" -- keep the descriptions only
    lines = [line.strip() for line in text.splitlines()]
    text = " ".join(line for line in lines if line and set(line) != {"^"}
                    and not line.startswith(("b'", 'b"', "'", '"')))
    if isinstance(exc, (http_exceptions.LineTooLong, http_exceptions.InvalidHeader,
                        http_exceptions.BadStatusLine, http_exceptions.InvalidURLError)):
        text = re.split(r""":?\s*b?['"]""", text, maxsplit=1)[0]  # "...: b'<the bytes>'"
    return text.rstrip(" :.") or "unreadable request"


class EdgeHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler with JSON errors for malformed HTTP and a connection cap."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        manager = self._manager
        if manager is not None and len(manager.connections) > manager.max_connections:
            body = neutral_error(503, f"the proxy has {manager.max_connections} open connections, "
                                      "its limit; retry shortly", "too_many_connections")
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                            b"\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.force_close()
            transport.close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        if status == 500:
            self.log_exception("Error handling request", exc_info=exc)
            text, code = "internal proxy error while reading the request", "internal_error"
        else:
            reason = _printable(_parser_reason(exc, message), 200)
            too_long = "too long" in reason.lower() or "got more than" in reason.lower()
            if too_long:
                status = 431 if "header" in reason.lower() or "field" in reason.lower() else status
            text = (f"malformed HTTP request ({reason}); send a well-formed request with "
                    f"printable header values of at most {self.max_field_size} bytes")
            code = "request_header_fields_too_large" if status == 431 else "bad_http_request"
        response = web.Response(status=status, body=neutral_error(status, text, code),
                                content_type="application/json",
                                reason=HTTPStatus(status).phrase)
        response.force_close()
        self._linger_on_close()
        return response

    def _linger_on_close(self, seconds: float = 2.0) -> None:
        """Close gracefully after an early answer: closing a socket that still holds unread
        request bytes makes the kernel send a reset, which can destroy the answer before the
        client reads it. So: half-close (no more bytes from us), keep reading and discarding what
        the client still sends, and close once it is done or after ``seconds``."""
        transport = self.transport
        if transport is None or isinstance(transport, _Lingering):
            return
        self.transport = _Lingering(transport, self._loop, seconds)  # type: ignore[assignment]


class _Lingering:
    """A connection's transport whose ``close()`` half-closes it, then closes it for good once
    the client is done or after ``seconds`` (see :meth:`EdgeHandler._linger_on_close`). A
    wrapper rather than a patched transport: uvloop's transports take no new attributes."""

    def __init__(self, transport: Any, loop: Any, seconds: float):
        self._transport = transport
        self._loop = loop
        self._seconds = seconds
        self._closing = False

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self._transport.close()
            return
        self._loop.call_later(self._seconds, self._transport.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class EdgeServer(web_server.Server):
    def __init__(self, *args: Any, max_connections: int = 1024, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections

    def __call__(self) -> EdgeHandler:
        return EdgeHandler(self, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` serving through :class:`EdgeHandler`.

    ``header_timeout``: seconds a connection may take to send a whole request (and stay idle
    between requests) before it is closed; ``max_connections``: connections beyond it get a 503
    JSON answer and are closed.
    """

    def __init__(self, app: web.Application, *, header_timeout: float = 10.0,
                 max_connections: int = 1024, **kwargs: Any):
        # lingering: after an early answer (408, 413) the rest of a body is read for at most
        # this long, so that a slow sender cannot keep the connection through it either
        # auto_decompress off: bodies are decoded by BodyDecoder, which refuses a truncated
        # stream (aiohttp's decoder accepts a gzip body cut before its trailer)
        super().__init__(app, keepalive_timeout=header_timeout,
                         lingering_time=min(header_timeout, 2.0), auto_decompress=False, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        return EdgeServer(server.request_handler, request_factory=server.request_factory,
                          handler_cancellation=server.handler_cancellation, loop=server._loop,
                          max_connections=self.max_connections, **server._kwargs)
