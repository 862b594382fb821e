"""Wire protocols the proxy speaks, to its clients and to its upstreams.

A :class:`WireProtocol` is everything the proxy knows about one API's wire format. The turn
pipeline (:mod:`metaclaw.proxy.pipeline`) never looks inside a wire body: it asks the client's protocol
to validate the request and to inject the skill block, and it translates between the client's and
the upstream's protocol through one *pivot* form, the OpenAI chat-completions shape (which is also
the neutral form recorded in the store: ``request_messages`` are OpenAI chat messages whatever the
protocol). When client and upstream speak the same protocol nothing is translated: bodies, replies
and stream events pass through byte for byte.

Protocols shipped: :mod:`metaclaw.protocols.openai_chat` (``POST /v1/chat/completions``, also the
pivot), :mod:`metaclaw.protocols.anthropic_messages` (``POST /v1/messages``) and
:mod:`metaclaw.protocols.openai_responses` (``POST /v1/responses``). Each can be served to clients
and forwarded to: the proxy's one HTTP upstream (:class:`metaclaw.proxy.upstreams.HTTPUpstream`)
reads everything protocol-specific (path, key headers, model list) from the adapter.

May import: the shared modules at the top of the package (``metaclaw.jsonlib``, ...) and
:mod:`metaclaw.skills` (the message readers of :mod:`metaclaw.skills.asks`). Never the proxy,
the loops, the offline stand-ins or the outer layers (checked by ``tests/test_architecture.py``).

Adding a protocol
-----------------
Write one module ``metaclaw/protocols/<name>.py`` with a subclass of :class:`WireProtocol` and
register an instance: one entry in :data:`~metaclaw.protocols.registry.PROTOCOLS` (the
``register(...)`` line of :mod:`metaclaw.protocols.registry`), or, from code outside the
package (a plug-in, a test), one call of :func:`metaclaw.protocols.registry.add`. Nothing else
changes: the proxy then serves its routes, answers its errors in its shape, records its turns in
the neutral form, reaches every upstream through the pivot, and, when the protocol declares an
``upstream_path``, forwards to upstreams of it (``ProxyConfig.upstream_protocol`` /
``metaclaw serve --upstream-protocol`` take its name). It declares:

- ``routes``: the POST paths it serves (the proxy adds them under ``/v1`` and at the root);
- ``field_types``: the JSON type of each optional top-level field of its requests, checked at
  the proxy's edge (:func:`metaclaw.proxy.edge.check_fields`: a 400 naming the field). Required:
  registering a protocol that does not declare it is an error; :data:`NO_FIELD_CHECKS` says
  explicitly that none are checked. ``message_field_types``: the same for each message of a
  chat-shaped ``messages`` list (the OpenAI chat protocol's);
- optionally ``client_headers`` (request headers that tell its clients apart on the routes no
  protocol owns, such as ``GET /v1/models``), ``forward_headers`` (client headers an upstream
  of the same protocol receives as they came), ``key_header`` (the header its clients and
  upstreams carry a key in, besides ``Authorization: Bearer``) and ``count_tokens_route`` (a
  POST path answering with the tokens of a request, as Anthropic's ``/messages/count_tokens``);
- to be forwarded to: ``upstream_path`` (the POST path after the upstream's base URL; ``None``,
  the default, means clients only), optionally ``upstream_models_path`` and
  ``upstream_count_tokens_path`` (the upstream's model list and token count), and the methods
  ``upstream_base_url(url)``, ``upstream_server_headers(key)`` (what every request carries: the
  server key, a version header) and ``upstream_request_headers(key, headers)`` (a request's own
  headers: the caller's key under caller-auth); the defaults are OpenAI's;

and implements:

- ``parse_request(body)``: validate a wire body (raise :class:`ProxyError`) and return the model,
  the stream flag and the body to forward;
- ``to_chat(body)`` / ``from_chat(chat_body)``: the request to and from the OpenAI chat shape;
- ``inject(body, block)``: the body with the skill block added to its system prompt;
- ``reply_to_chat`` / ``reply_from_chat``: a non-streaming reply to and from ``chat.completion``;
- ``stream_to_chat()`` / ``stream_from_chat()``: stateful translators of stream events
  (``feed(event) -> [out events]``, ``close() -> [out events]``);
- ``assembler()``: accumulates the protocol's stream events into the recorded reply columns;
- ``encode_event(event)``, ``is_terminal(event)``, ``ends_failed(event)`` (a terminal event
  that says the response failed, relayed even though the stream errored; default none),
  ``error_payload(error)``, ``stream_error_event(error, first, last)`` (the first and the last
  event the client got, for numbered events): the wire encoding of events and errors;
  ``upstream_events`` reads an upstream's stream (server-sent events unless overridden);
  optionally ``complete_reply(data)`` and ``complete_without_terminal(assembler)``: what an
  upstream of this protocol may leave out (see :class:`WireProtocol`).

The tests for a new protocol are its own round trips (``from_chat(to_chat(x))``, as in
``tests/test_protocols.py``) and an SDK of that protocol against a running proxy (as in
``tests/test_proxy_anthropic.py``). ``tests/test_protocol_registry.py`` shows the whole of it:
a protocol defined and registered inside the test is served to its clients and forwarded to an
upstream of its own, with no other change.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, AsyncIterator, Mapping

from metaclaw.jsonlib import dumpb, loads
from metaclaw.skills.asks import content_text

Event = tuple[bytes, "dict[str, Any] | None"]
"""One stream event: the bytes to relay as they are, and its parsed JSON data (``None`` for
markers such as OpenAI's ``[DONE]``)."""


def error_json(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ProxyError(Exception):
    """A request the proxy answers with an error in the client's protocol and an HTTP status.

    ``payload`` is the OpenAI error JSON; ``upstream`` is ``(protocol name, error JSON)`` when the
    error is an upstream's own answer, relayed unchanged to a client of the same protocol.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 payload: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                 upstream: tuple[str, dict[str, Any]] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.payload = payload or error_json(message, type, param, code)
        self.headers = headers or {}
        self.upstream = upstream



#: The JSON types a field type is made of (a field type is a tuple of them; join with ``+``).
STRING, INTEGER, NUMBER, BOOLEAN, ARRAY, OBJECT = (("string",), ("integer",), ("number",),
                                                   ("boolean",), ("array",), ("object",))
JSON_TYPES = STRING + INTEGER + NUMBER + BOOLEAN + ARRAY + OBJECT
#: A protocol's ``field_types`` saying, explicitly, that the proxy checks none of its fields.
NO_FIELD_CHECKS: Mapping[str, tuple[str, ...]] = MappingProxyType({})


class WireProtocol:
    """Base of the protocol adapters; see the module docstring for what a protocol implements."""

    name = "base"
    routes: tuple[str, ...] = ()
    #: Header that carries the caller's upstream key in this protocol (besides Authorization).
    key_header: str | None = None
    #: The JSON types of each optional top-level request field (``null`` is always accepted):
    #: ``{"stream": BOOLEAN, "stop": STRING + ARRAY, ...}``. Every protocol declares it (or
    #: :data:`NO_FIELD_CHECKS`); :func:`check_declaration` refuses one that does not.
    field_types: Mapping[str, tuple[str, ...]] | None = None
    #: The JSON types of the fields of each message in a ``messages`` list (chat-shaped bodies).
    message_field_types: Mapping[str, tuple[str, ...]] = NO_FIELD_CHECKS
    #: Request headers by which a client of this protocol is known on a route no protocol owns.
    client_headers: tuple[str, ...] = ()
    #: Client headers an upstream of this protocol receives as they came (pass-through only).
    forward_headers: tuple[str, ...] = ()
    #: The POST path that counts a request's tokens in this protocol, if it has one.
    count_tokens_route: str | None = None
    #: Whether this is the pivot protocol: its requests, replies and stream events are the chat
    #: shape already (translating them to chat is the identity).
    pivot = False
    #: The POST path of a request to an upstream of this protocol, after its base URL;
    #: ``None``: the proxy serves this protocol's clients but does not forward in it.
    upstream_path: str | None = None
    #: The GET path of an upstream's model list (``None``: it has none the proxy reads).
    upstream_models_path: str | None = None
    #: The POST path counting a request's tokens at an upstream (``None``: it has none).
    upstream_count_tokens_path: str | None = None

    # -- requests -------------------------------------------------------------------------
    def parse_request(self, body: dict[str, Any], model: str | None) -> tuple[str, bool]:
        """Validate ``body`` (raise :class:`ProxyError`); return ``(model, stream)``."""
        raise NotImplementedError

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def inject(self, body: dict[str, Any], block: str) -> dict[str, Any]:
        raise NotImplementedError

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return None

    def prepare_forward(self, body: dict[str, Any],
                        stream_usage: bool) -> tuple[dict[str, Any], bool]:
        """The body to forward to an upstream of this protocol and whether the client itself asked
        for what the proxy adds (OpenAI's usage chunk)."""
        return body, self.asks_for_usage(body)

    def asks_for_usage(self, body: dict[str, Any]) -> bool:
        """Whether a client's request asks for the token usage of a streamed reply (an event
        :meth:`is_private` withholds otherwise)."""
        return True

    # -- replies --------------------------------------------------------------------------
    def reply_to_chat(self, data: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def reply_problem(self, data: Any) -> str | None:
        """What makes ``data`` not a reply of this protocol (``None`` when it is one)."""
        return None if isinstance(data, dict) else f"a JSON {type(data).__name__}, not an object"

    def reply_from_chat(self, completion: dict[str, Any],
                        request: dict[str, Any] | None = None) -> dict[str, Any]:
        """A ``chat.completion`` as this protocol's reply; ``request``: the client's request in
        this protocol (what a reply echoes, or how its tools are declared)."""
        raise NotImplementedError

    def stream_to_chat(self) -> "StreamTranslator":
        raise NotImplementedError

    def stream_from_chat(self, request: dict[str, Any] | None = None) -> "StreamTranslator":
        raise NotImplementedError

    def assembler(self) -> Any:
        raise NotImplementedError

    def reply_columns(self, data: dict[str, Any]) -> dict[str, Any]:
        """Recorded columns (response, tool_calls, finish_reason, usage...) of a reply."""
        return summarize_completion(self.reply_to_chat(data))

    def complete_reply(self, data: dict[str, Any]) -> bool:
        """Fill in, in place, what an upstream's non-streamed reply left out and every reader
        needs alike (a tool call's id); whether anything was (the reply is then re-encoded)."""
        return False

    def complete_without_terminal(self, assembler: Any) -> bool:
        """Whether an upstream stream that closed without this protocol's terminal event still
        holds a whole reply (``assembler``: its events so far)."""
        return False

    # -- wire encoding --------------------------------------------------------------------
    def encode_event(self, event: dict[str, Any] | None) -> bytes:
        raise NotImplementedError

    def is_terminal(self, raw: bytes, event: dict[str, Any] | None) -> bool:
        raise NotImplementedError

    def ends_failed(self, event: dict[str, Any] | None) -> bool:
        """Whether a terminal event says the response failed (the client then gets it even
        though the stream errored; default: no terminal event does)."""
        return False

    def is_private(self, event: dict[str, Any] | None, client_asked: bool) -> bool:
        """Whether an upstream event was asked for by the proxy only (never relayed)."""
        return False

    def error_payload(self, error: ProxyError) -> dict[str, Any]:
        raise NotImplementedError

    def error_response(self, error: ProxyError, extra_headers: dict[str, str] | None = None):
        from aiohttp import web

        return web.Response(body=dumpb(self.error_payload(error)), status=error.status,
                            headers={**error.headers, **(extra_headers or {})},
                            content_type="application/json")

    def stream_error_event(self, error: ProxyError, first: dict[str, Any] | None = None,
                           last: dict[str, Any] | None = None) -> bytes:
        """The wire bytes that end a stream with ``error``; ``first`` and ``last``: the first and
        the last event the client got (for protocols whose events are numbered or name their
        response)."""
        raise NotImplementedError

    # -- as an upstream (the proxy forwards to it; see ``upstream_path``) --------------------
    def upstream_base_url(self, url: str) -> str:
        """The base URL the upstream paths are appended to, from the configured ``url``."""
        return url.rstrip("/")

    def upstream_server_headers(self, key: str) -> dict[str, str]:
        """Headers every request to the upstream carries: the server's ``key`` (a placeholder
        when none is configured) and whatever else the API requires of every request."""
        return {"Authorization": f"Bearer {key}"}

    def upstream_request_headers(self, key: str | None,
                                 headers: dict[str, str]) -> dict[str, str]:
        """One request's headers: ``headers`` (the client's :attr:`forward_headers`) and,
        under caller-auth, the caller's ``key``, replacing the server key (as ``Authorization:
        Bearer`` and in :attr:`key_header`)."""
        if not key:
            return headers
        out = {**headers, "Authorization": f"Bearer {key}"}
        if self.key_header:
            out[self.key_header] = key
        return out

    def upstream_events(self, chunks: AsyncIterator[bytes],
                        timeout: float | None) -> AsyncIterator[list[Event]]:
        """The events of an upstream's streamed reply, batched as they arrived (see
        :func:`sse_events`, the framing of every protocol shipped)."""
        return sse_events(chunks, timeout)

    # -- the model list (``GET /v1/models``) -----------------------------------------------
    # A model in the neutral view: ``{"id", "name", "created"}`` (a display name, Unix seconds).
    def models_payload(self, models: list[dict[str, Any]]) -> dict[str, Any]:
        """The list of ``models`` as this protocol's clients read it."""
        raise NotImplementedError

    def models_of(self, payload: Any) -> list[dict[str, Any]]:
        """The models of a list in this protocol's shape (entries without an id skipped)."""
        raise NotImplementedError


def check_declaration(protocol: WireProtocol) -> WireProtocol:
    """``protocol`` if it declares what the proxy needs of every protocol (its name, routes and
    field types, each made of :data:`JSON_TYPES`); ``TypeError`` naming what is missing."""
    where = f"{type(protocol).__name__} (protocol {protocol.name!r})"
    if protocol.field_types is None:
        raise TypeError(f"{where} declares no field_types: give the JSON type of each optional "
                        "request field (or NO_FIELD_CHECKS to check none)")
    if not protocol.routes or protocol.name == WireProtocol.name:
        raise TypeError(f"{where} needs a name and at least one route")
    for table in (protocol.field_types, protocol.message_field_types):
        for field, kinds in table.items():
            if not kinds or not isinstance(kinds, tuple) or set(kinds) - set(JSON_TYPES):
                raise TypeError(f"{where}: the type of {field!r} must be a tuple of "
                                f"{', '.join(JSON_TYPES)}, not {kinds!r}")
    return protocol


class StreamTranslator:
    """Translates one stream, event by event: ``feed`` returns the events to emit now,
    ``close`` the ones that end the stream (called once, after the last ``feed``)."""

    def feed(self, event: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        raise NotImplementedError

    def close(self) -> list[dict[str, Any] | None]:
        return []


#: The largest server-sent event read from an upstream (bytes). Reply events are far smaller; an
#: upstream that sends more without the blank line that ends an event is cut off with a 502
#: instead of being held in memory however long it goes on.
MAX_EVENT_BYTES = 16 * 2**20


async def sse_events(chunks: AsyncIterator[bytes],
                     timeout: float | None = None) -> AsyncIterator[list[Event]]:
    """Server-sent events from a stream of bytes however it is cut into chunks: yields, for each
    chunk that completes events, the list of those events (each: the bytes to relay, its JSON
    data or None), so that what arrived together can be relayed together. Lines may end in
    ``\\n``, ``\\r\\n`` or ``\\r``; events are relayed with ``\\n``. An event that is not SSE,
    or longer than :data:`MAX_EVENT_BYTES`, raises (see :func:`sse_event`) after the good events
    before it are yielded.

    ``timeout``: seconds each event may take after the previous one. It is checked as bytes
    arrive, without a timer per event (the transport's own read timeout covers a silent
    upstream), so an upstream trickling an event byte by byte is cut off one byte after its
    deadline with ``TimeoutError``."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    # the bytes of events not complete yet, line ends already made "\n"; a chunk is appended
    # and only it is searched for the blank line (copying and searching the whole buffer on
    # every chunk made one long event cost time quadratic in its length)
    buffer = bytearray()
    cr = b""  # a "\r" that ended the last chunk: it may be half of a "\r\n", so it waits
    async for chunk in chunks:
        if deadline is not None and loop.time() > deadline:
            raise TimeoutError(f"no complete event within {timeout:g} s")
        if cr or b"\r" in chunk:
            chunk = cr + chunk
            cr = b"\r" if chunk.endswith(b"\r") else b""
            chunk = chunk[:len(chunk) - len(cr)].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = max(len(buffer) - 1, 0)  # a "\n" at the end and one in the chunk: a blank line
        buffer += chunk
        if buffer.find(b"\n\n", start) >= 0:
            *blocks, rest = bytes(buffer).split(b"\n\n")
            buffer = bytearray(rest)
            batch: list[Event] = []
            try:
                for block in blocks:
                    block = block.strip(b"\n")
                    if block:
                        batch.append(_bounded_event(block))
            except ProxyError:
                if batch:
                    yield batch
                raise
            if batch:
                yield batch
            if deadline is not None:
                deadline = loop.time() + timeout
        # an event not ended yet, with at most one line end before and after it
        if len(buffer) > MAX_EVENT_BYTES + 2:
            raise _event_too_large()
    rest = bytes(buffer).strip(b"\n")  # a waiting "\r" is one more line end: stripped too
    if rest:
        yield [_bounded_event(rest)]


def _bounded_event(block: bytes) -> Event:
    if len(block) > MAX_EVENT_BYTES:
        raise _event_too_large()
    return sse_event(block)


def _event_too_large() -> ProxyError:
    bound = (f"{MAX_EVENT_BYTES // 2**20} MiB" if MAX_EVENT_BYTES % 2**20 == 0
             else f"{MAX_EVENT_BYTES} bytes")
    return ProxyError(502, f"the upstream sent a server-sent event larger than {bound} (or no "
                           "blank line to end one); no reply event is that long, so the stream "
                           "was cut off there (check that the upstream streams server-sent "
                           "events)",
                      type="upstream_error", code="upstream_event_too_large")


_SSE_FIELDS = (b"data", b"event", b"id", b"retry")


def sse_event(block: bytes) -> Event:
    """One SSE event from its lines (``\\n``-separated). An upstream event that is not SSE (a line
    that is neither a comment nor one of the fields ``data``, ``event``, ``id``, ``retry``) or whose
    data is neither ``[DONE]`` nor a JSON object raises a 502 :class:`ProxyError`: garbage is
    never relayed."""
    if block.startswith(b"data: {") and b"\n" not in block:  # the usual event: one JSON line
        try:  # JSON that starts with "{" is an object or nothing
            return block + b"\n\n", loads(block[6:])
        except ValueError:
            raise _bad_stream(f"an event whose data is not JSON ({_text(block[6:])!r})") from None
    lines = block.split(b"\n")
    for line in lines:
        if line and not line.startswith(b":") and line.partition(b":")[0] not in _SSE_FIELDS:
            raise _bad_stream(f"a line that is not server-sent events ({_text(line)!r})")
    data = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
    chunk = None
    if data and data != b"[DONE]":
        try:
            chunk = loads(data)
        except ValueError:
            raise _bad_stream(f"an event whose data is not JSON ({_text(data)!r})") from None
        if not isinstance(chunk, dict):
            raise _bad_stream(f"an event whose data is not a JSON object ({_text(data)!r})")
    return block + b"\n\n", chunk


def _text(data: bytes) -> str:
    return data[:60].decode("utf-8", "replace")


def _bad_stream(what: str) -> ProxyError:
    return ProxyError(502, f"the upstream's stream broke off with {what}; the reply is "
                           "incomplete, retry the request", type="upstream_error",
                      code="bad_upstream_stream")


# -- the pivot form's recorded columns ---------------------------------------------------
def summarize_completion(data: dict[str, Any]) -> dict[str, Any]:
    """Turn columns (response, tool_calls, finish_reason, usage, tokens) of a chat.completion."""
    choices = data.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    usage = data.get("usage") or None
    logprobs = [item.get("logprob") for item in ((choice.get("logprobs") or {}).get("content") or ())]
    content = message.get("content")
    if not content and isinstance(message.get("refusal"), str):  # the model refused: its words
        content = message["refusal"]
    return {
        "response": content if content is None else content_text(content),
        "tool_calls": message.get("tool_calls") or None,
        "finish_reason": choice.get("finish_reason"),
        **usage_columns(usage),
        **({"completion_logprobs": logprobs} if logprobs else {}),
    }


def tool_input(value: Any) -> dict[str, Any]:
    """A chat tool call's ``arguments`` (JSON text, or an object already) as a JSON object, the
    form Anthropic clients get (a ``tool_use`` block's ``input``) and resend: none as ``{}``,
    text that is not a JSON object wrapped (``{"_raw": text}``, ``{"_value": other JSON}``)."""
    if isinstance(value, dict):
        return value
    try:
        parsed = loads(value or "{}")
    except (ValueError, TypeError, RecursionError):  # RecursionError: nested too deep to read
        return {"_raw": value}
    return parsed if isinstance(parsed, dict) else {"_value": parsed}


def usage_columns(usage: dict[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {"usage": None}
    return {"usage": usage, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens")}
