"""An offline Anthropic Messages server for tests and demos (a test/demo double, not a model).

:class:`AnthropicDoubleServer` speaks the real wire protocol on a real socket: ``POST
/v1/messages`` (JSON, or server-sent events with the full event sequence: ``message_start``,
``ping``, ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``,
``thinking_delta``, ``signature_delta``) / ``content_block_stop``, ``message_delta``,
``message_stop``), ``POST /v1/messages/count_tokens`` and ``GET /v1/models``. Every reply and
event is built and validated with the ``anthropic`` SDK's own types (``Message``,
``RawMessageStartEvent``, ...), so what it sends is what the SDK accepts from the real service.

Replies are *scripted*, never generated: a queue of :class:`AnthropicReply` consumed in order
(once empty, it echoes the last user message) or a function of the request body. Token counts are
whitespace word counts: stand-ins, not a tokenizer's output. Every request it receives is kept in
:attr:`AnthropicDoubleServer.requests`.

    with AnthropicDoubleServer([AnthropicReply("Hello!")]) as upstream:
        client = anthropic.Anthropic(base_url=upstream.base_url, api_key="unused")
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from metaclaw.proxy.server import BackgroundServer, ServedApp, _base_url

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
                529: "overloaded_error"}


@dataclass
class AnthropicReply:
    """One scripted reply. ``content``: a string (one text block) or a list of content-block
    dicts (text, tool_use, thinking with signature). ``stop_reason``: defaults to ``tool_use``
    when a tool_use block is present, else ``end_turn``. ``status``: anything but 200 answers with
    Anthropic's error JSON. ``usage``: overrides the word-count usage (e.g. cache fields).
    ``disconnect_after``: drop the connection after this many stream events."""

    content: str | list[dict[str, Any]] | None = None
    stop_reason: str | None = None
    status: int = 200
    message: str | None = None
    usage: dict[str, Any] | None = None
    delay: float = 0.0
    disconnect_after: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(b.get("text", "") for b in content
                        if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _words(value: Any) -> int:
    return len(json.dumps(value).split()) if not isinstance(value, str) else len(value.split())


class AnthropicDoubleServer(ServedApp):
    """Local Anthropic-compatible HTTP server (real sockets, real SSE), clearly a double.

    ``replies``: a list of :class:`AnthropicReply`, a function ``body -> AnthropicReply``, or
    ``None`` (always echo). :attr:`base_url` is what the ``anthropic`` SDK takes; :attr:`requests`
    fills with ``{"path", "headers", "body"}`` dicts. ``models``: the ids ``GET /v1/models``
    lists.
    """

    def __init__(self,
                 replies: list[AnthropicReply] | Callable[[dict], AnthropicReply] | None = None,
                 *, host: str = "127.0.0.1", port: int = 0,
                 models: tuple[str, ...] = ("claude-double",)):
        self.replies = replies if callable(replies) else list(replies or [])
        self.models = models
        self.requests: list[dict[str, Any]] = []
        self._server = BackgroundServer(self._make_app, host, port, "metaclaw-anthropic-double")

    @property
    def base_url(self) -> str:
        return _base_url(self._server.host, self._server.port)

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/v1/models", self._models)
        return app

    def _next(self, body: dict[str, Any]) -> AnthropicReply:
        if callable(self.replies):
            return self.replies(body)
        if self.replies:
            return self.replies.pop(0)
        users = [m for m in body.get("messages") or [] if m.get("role") == "user"]
        last = users[-1] if users else {}
        return AnthropicReply(f"echo: {_text_of(last.get('content'))}")

    @staticmethod
    def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response({"type": "error", "error": {
            "type": _ERROR_TYPES.get(status, "api_error"), "message": message}},
            status=status, headers=headers or {})

    async def _read(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        return body if isinstance(body, dict) and isinstance(body.get("messages"), list) else None

    async def _models(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path_qs, "headers": dict(request.headers),
                              "body": None})
        data = [{"type": "model", "id": m, "display_name": f"{m} (double)",
                 "created_at": "2026-01-02T03:04:05Z"} for m in self.models]
        return web.json_response({"data": data, "has_more": False,
                                  "first_id": self.models[0] if self.models else None,
                                  "last_id": self.models[-1] if self.models else None})

    async def _count_tokens(self, request: web.Request) -> web.Response:
        from anthropic.types import MessageTokensCount

        body = await self._read(request)
        if body is None:
            return self._error(400, "messages: field required")
        count = _words(body.get("system") or "") + _words(body["messages"])
        return web.json_response(MessageTokensCount(input_tokens=count).model_dump(mode="json"))

    def _message(self, body: dict[str, Any], reply: AnthropicReply):
        from anthropic.types import Message

        content = reply.content
        blocks = ([{"type": "text", "text": content}] if isinstance(content, str)
                  else [dict(b) for b in content or []])
        for block in blocks:
            if block.get("type") == "tool_use":
                block.setdefault("id", f"toolu_{uuid.uuid4().hex[:20]}")
        stop = reply.stop_reason or ("tool_use" if any(b.get("type") == "tool_use" for b in blocks)
                                     else "end_turn")
        usage = reply.usage or {"input_tokens": _words(body.get("system") or "") + _words(
            body["messages"]), "output_tokens": _words(blocks)}
        return Message.model_validate({
            "id": f"msg_double_{uuid.uuid4().hex[:16]}", "type": "message", "role": "assistant",
            "model": body.get("model") or "double-claude", "content": blocks,
            "stop_reason": stop, "stop_sequence": None, "usage": usage})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        if body is None:
            return self._error(400, "messages: field required")
        if not isinstance(body.get("max_tokens"), int):
            return self._error(400, "max_tokens: field required")
        reply = self._next(body)
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.status != 200:
            message = reply.message or f"injected upstream error (HTTP {reply.status})"
            return self._error(reply.status, message, reply.headers)
        message = self._message(body, reply)
        if not body.get("stream"):
            return web.json_response(message.model_dump(mode="json", exclude_none=True),
                                     headers=reply.headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **reply.headers})
        await response.prepare(request)
        try:
            for sent, event in enumerate(stream_events(message)):
                if reply.disconnect_after is not None and sent >= reply.disconnect_after:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                data = event.model_dump(mode="json", exclude_none=True)
                line = f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"
                await response.write(line.encode())
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response


def stream_events(message: Any) -> list[Any]:
    """The SDK-typed stream events that deliver ``message`` (an ``anthropic.types.Message``)."""
    from anthropic.types import (RawContentBlockDeltaEvent, RawContentBlockStartEvent,
                                 RawContentBlockStopEvent, RawMessageDeltaEvent,
                                 RawMessageStartEvent, RawMessageStopEvent)

    data = message.model_dump(mode="json", exclude_none=True)
    usage = data["usage"]
    start = {**data, "content": [], "stop_reason": None,
             "usage": {**usage, "output_tokens": 1}}
    events: list[Any] = [RawMessageStartEvent.model_validate(
        {"type": "message_start", "message": start})]

    events.append(_Ping())
    for index, block in enumerate(data["content"]):
        kind = block["type"]
        empty = {"text": {"type": "text", "text": ""},
                 "tool_use": {"type": "tool_use", "id": block.get("id"), "name": block.get("name"),
                              "input": {}},
                 "thinking": {"type": "thinking", "thinking": "", "signature": ""}}.get(kind, block)
        events.append(RawContentBlockStartEvent.model_validate(
            {"type": "content_block_start", "index": index, "content_block": empty}))
        deltas: list[dict[str, Any]] = []
        if kind == "text":
            deltas = [{"type": "text_delta", "text": piece}
                      for piece in re.findall(r"\s*\S+", block["text"])]
        elif kind == "tool_use":
            text = json.dumps(block.get("input") or {})
            deltas = [{"type": "input_json_delta", "partial_json": text[i:i + 8]}
                      for i in range(0, len(text), 8)]
        elif kind == "thinking":
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                      {"type": "signature_delta", "signature": block.get("signature", "")}]
        for delta in deltas:
            events.append(RawContentBlockDeltaEvent.model_validate(
                {"type": "content_block_delta", "index": index, "delta": delta}))
        events.append(RawContentBlockStopEvent.model_validate(
            {"type": "content_block_stop", "index": index}))
    events.append(RawMessageDeltaEvent.model_validate({
        "type": "message_delta",
        "delta": {"stop_reason": data["stop_reason"], "stop_sequence": data.get("stop_sequence")},
        "usage": {"output_tokens": usage["output_tokens"]}}))
    events.append(RawMessageStopEvent.model_validate({"type": "message_stop"}))
    return events


class _Ping:
    """The ``ping`` event (the SDK has no model class for it)."""

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return {"type": "ping"}
