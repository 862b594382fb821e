"""An offline OpenAI-compatible server for tests and demos (a test/demo double, not a model).

:class:`DoubleServer` speaks the real wire protocol on a real socket: ``POST
/v1/chat/completions`` (JSON or server-sent events, tool calls, the final usage chunk when
``stream_options.include_usage`` is set) and ``GET /v1/models``. Its replies are *scripted*, never
generated: a queue of :class:`Reply` objects consumed in order (once empty, it echoes the last user
message) or a function of the request body. Replies can inject failures: an error status, a delay
before answering (to trigger timeouts), a delay between stream chunks, or a connection dropped after
N chunks. A non-streaming request with ``n`` gets one choice per reply (``n`` replies consumed or
computed). Every request it receives is kept in :attr:`DoubleServer.requests` for assertions.

Token counts in ``usage`` are whitespace word counts unless the reply gives its own: they are
stand-ins, not a tokenizer's output.

    with DoubleServer([Reply("Hello!"), Reply(status=429)]) as upstream:
        client = openai.OpenAI(base_url=upstream.url, api_key="unused")
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from metaclaw.protocols import error_json
from metaclaw.proxy.server import BackgroundServer, ServedApp

#: The most choices (``n``) one request may ask for.
MAX_CHOICES = 16

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


@dataclass
class Reply:
    """One scripted reply of the double.

    ``content``: assistant text (``None`` with ``tool_calls`` for a pure tool call; for an error
    reply, the error message). ``tool_calls``: OpenAI tool-call dicts
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` (``id``/``type`` filled in
    when missing). ``status``: anything but 200 answers with OpenAI error JSON and that status.
    ``delay``: seconds to wait before answering. ``chunk_delay``: seconds between stream chunks.
    ``disconnect_after``: drop the connection after this many stream chunks (``0`` on a
    non-streaming request drops it before answering). ``usage``: the usage dict to report
    (default: word counts). ``headers``: extra response headers (e.g. ``retry-after``).
    ``finish_reason``: overrides ``"stop"`` / ``"tool_calls"``. ``interleave``: stream parallel
    tool calls as some OpenAI-compatible servers do: every call starts in one chunk, then the
    calls' argument fragments alternate (by default each call streams whole before the next).
    """

    content: str | None = None
    tool_calls: list[dict] | None = None
    status: int = 200
    delay: float = 0.0
    chunk_delay: float = 0.0
    disconnect_after: int | None = None
    usage: dict | None = None
    headers: dict[str, str] = field(default_factory=dict)
    finish_reason: str | None = None
    interleave: bool = False


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """Text of the last user message (text parts of list contents joined), or ``""``."""
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p["text"] for p in content if isinstance(p, dict)
                                and p.get("type") == "text" and isinstance(p.get("text"), str))
            return content if isinstance(content, str) else ""
    return ""


def _words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(p.get("text") if isinstance(p, dict) else p) for p in value)
    return 0


class DoubleServer(ServedApp):
    """Local OpenAI-compatible HTTP server (real sockets, real SSE), clearly a test/demo double.

    ``replies``: a list of :class:`Reply` consumed in order (after exhaustion each request gets an
    echo of its last user message), or a function ``body -> Reply``, or ``None`` (always echo).
    ``models``: the ids listed by ``GET /v1/models``. After :meth:`start`, :attr:`url` is the base
    URL (``http://127.0.0.1:PORT/v1``) and :attr:`requests` fills with
    ``{"path", "headers", "body"}`` dicts, one per request received.
    """

    def __init__(self, replies: list[Reply] | Callable[[dict], Reply] | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, models: tuple[str, ...] = ("double-model",)):
        self.replies = replies if callable(replies) else list(replies or [])
        self.models = tuple(models)
        self.host = host
        self.requests: list[dict[str, Any]] = []
        self._server = BackgroundServer(self._make_app, host, port, "metaclaw-double")

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def add(self, *replies: Reply) -> None:
        """Append scripted replies to the queue."""
        if callable(self.replies):
            raise TypeError("this double answers with a function; it has no reply queue")
        self.replies.extend(replies)

    # -- application ----------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        if callable(self.replies):
            return self.replies(body)
        if self.replies:
            return self.replies.pop(0)
        return Reply(content=f"echo: {last_user_text(body.get('messages') or [])}")

    async def _models(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": None})
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "metaclaw-double"}
            for m in self.models]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return web.json_response(error_json("the double needs a JSON body with 'messages'"),
                                     status=400)
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            return web.json_response(error_json(
                f"'n' must be an integer from 1 to {MAX_CHOICES}, got {n!r}", param="n"),
                status=400)
        if n > 1 and body.get("stream"):
            return web.json_response(error_json(
                "the double streams one choice: 'n' above 1 needs a non-streaming request",
                param="n"), status=400)
        replies = [self._next_reply(body) for _ in range(n)]  # one per choice
        delay = max(r.delay for r in replies)
        if delay:
            await asyncio.sleep(delay)
        reply = next((r for r in replies if r.status != 200), replies[0])
        if reply.status != 200:  # one failed choice fails the request, as on a real server
            message = reply.content or f"injected upstream error (HTTP {reply.status})"
            return web.json_response(
                error_json(message, _ERROR_TYPES.get(reply.status, "server_error"), None,
                           str(reply.status)),
                status=reply.status, headers=reply.headers)
        if body.get("stream"):
            return await self._stream(request, body, reply)
        if any(r.disconnect_after is not None for r in replies):
            _drop(request)
            return web.Response()
        headers = {k: v for r in replies for k, v in r.headers.items()}
        return web.json_response(self._completion(body, replies), headers=headers)

    # -- reply shapes ---------------------------------------------------------------------
    @staticmethod
    def _tool_calls(reply: Reply) -> list[dict[str, Any]] | None:
        if not reply.tool_calls:
            return None
        calls = []
        for i, call in enumerate(reply.tool_calls):
            function = call.get("function") or {}
            arguments = function.get("arguments", "{}")
            calls.append({"id": call.get("id") or f"call_{i}_{uuid.uuid4().hex[:8]}",
                          "type": call.get("type", "function"),
                          "function": {"name": function.get("name", ""),
                                       "arguments": arguments if isinstance(arguments, str)
                                       else json.dumps(arguments)}})
        return calls

    @staticmethod
    def _usage(body: dict[str, Any], reply: Reply, calls: list[dict[str, Any]] | None) -> dict:
        if reply.usage is not None:
            return reply.usage
        prompt = sum(_words(m.get("content")) for m in body["messages"] if isinstance(m, dict))
        completion = _words(reply.content) + sum(
            _words(c["function"]["arguments"]) + 1 for c in calls or [])
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _completion(self, body: dict[str, Any], replies: list[Reply]) -> dict[str, Any]:
        """A chat.completion of one choice per reply (the usage of the first reply's prompt
        counted once, as a real server bills ``n`` choices)."""
        choices, usage = [], None
        for index, reply in enumerate(replies):
            calls = self._tool_calls(reply)
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": index, "message": message, "logprobs": None,
                            "finish_reason": reply.finish_reason or
                            ("tool_calls" if calls else "stop")})
            one = self._usage(body, reply, calls)
            if usage is None:
                usage = dict(one)
            else:
                usage["completion_tokens"] += one.get("completion_tokens", 0)
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {
            "id": f"chatcmpl-double-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.models[0],
            "choices": choices,
            "usage": usage,
        }

    def _chunks(self, body: dict[str, Any], reply: Reply) -> list[dict[str, Any]]:
        calls = self._tool_calls(reply)
        base = {"id": f"chatcmpl-double-{uuid.uuid4().hex[:12]}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body.get("model") or self.models[0]}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]}

        chunks = [chunk({"role": "assistant", "content": ""})]
        for piece in re.findall(r"\s*\S+", reply.content or ""):
            chunks.append(chunk({"content": piece}))
        starts = [{"index": index, "id": call["id"], "type": call["type"],
                   "function": {"name": call["function"]["name"], "arguments": ""}}
                  for index, call in enumerate(calls or [])]
        fragments = [[{"index": index, "function": {"arguments": arguments[start:start + 8]}}
                      for start in range(0, len(arguments), 8)]
                     for index, arguments in enumerate(c["function"]["arguments"]
                                                       for c in calls or [])]
        if reply.interleave and starts:
            chunks.append(chunk({"tool_calls": starts}))
            for row in range(max(map(len, fragments))):
                chunks.extend(chunk({"tool_calls": [parts[row]]})
                              for parts in fragments if row < len(parts))
        else:
            for start, parts in zip(starts, fragments):
                chunks.append(chunk({"tool_calls": [start]}))
                chunks.extend(chunk({"tool_calls": [part]}) for part in parts)
        chunks.append(chunk({}, reply.finish_reason or ("tool_calls" if calls else "stop")))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**base, "choices": [], "usage": self._usage(body, reply, calls)})
        return chunks

    async def _stream(self, request: web.Request, body: dict[str, Any],
                      reply: Reply) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **reply.headers})
        try:
            await response.prepare(request)  # sends the headers: the client may be gone already
            for sent, chunk in enumerate(self._chunks(body, reply)):
                if reply.disconnect_after is not None and sent >= reply.disconnect_after:
                    _drop(request)
                    return response
                if sent and reply.chunk_delay:
                    await asyncio.sleep(reply.chunk_delay)
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            # the client hung up (aiohttp's ClientConnectionResetError "Cannot write to closing
            # transport" is a ConnectionResetError): end the stream quietly, nothing to answer
            pass
        return response


def _drop(request: web.Request) -> None:
    """Abort the connection (no more bytes, no clean end of the HTTP message)."""
    if request.transport is not None:
        request.transport.abort()
