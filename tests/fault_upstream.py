"""A fault-injecting upstream for tests: a real HTTP server (real sockets, real SSE) speaking the
OpenAI chat-completions and the Anthropic Messages wire protocols, scripted, not a model.

The fault a request gets follows only from the request itself: the last user message names it
as ``fault=<name>`` (anything else is answered normally, with an echo). Faults:

``reset``            the connection is aborted before any answer
``reset_midstream``  a stream is aborted after two events
``truncate``         a stream ends cleanly (end of HTTP body) after two events, with no final event
``invalid_sse``      a stream carries a line that is not server-sent events
``invalid_json``     a non-streaming body / a stream event that is not JSON
``wrong_shape``      a non-streaming 200 body that is JSON but not a reply of the protocol
``error_event``      a stream carries the protocol's error event (quoting the request's key)
``status_429`` / ``status_500`` / ``status_503``  that status, ``Retry-After: 3600``, an error JSON
                     quoting the request's key
``flaky_503``        503 with ``Retry-After: 1`` on the first attempt of a request, then normal
``flaky_reset``      connection reset on the first attempt of a request, then normal
``slow_body``        headers at once, then the body (or each event) a byte every 0.4 s
``hang``             nothing, ever (until the client gives up; its request's ``gone`` is then
                     the time it noticed)
``redirect_301`` / ``redirect_302`` / ``redirect_307`` / ``redirect_308``  that redirect, to
                     :attr:`FaultUpstream.location` (None: without a Location header)
``json_200``         HTTP 200 with :attr:`FaultUpstream.json_body` as a JSON body, streamed or not
``scripted``         a stream of :attr:`FaultUpstream.chunks` (each a ``data:`` event, as written),
                     then ``data: [DONE]`` where :attr:`FaultUpstream.done` (a server's quirks:
                     calls without ``index`` or ``id``, refusals, no ``[DONE]``); not streamed:
                     :attr:`FaultUpstream.json_body`
``reflect_key``      a 401 error whose message, param and code quote the request's key
``reflect_url``      a 400 error whose message quotes the request's path, query and
                     ``Authorization`` header, decoded where it is Basic
``surrogate_reply``  a normal OpenAI reply whose text holds a lone surrogate (escaped in JSON)
``parts_reply``      a normal OpenAI reply whose content is a list of parts, a ``thinking`` part
                     then ``text`` (as Mistral's Magistral models answer), streamed or not
``corrupt_gzip``     HTTP 200 with ``Content-Encoding: gzip`` and a body that is not gzip
``short_body``       HTTP 200 whose ``Content-Length`` promises more than is sent before the
                     connection closes (a reply cut off in transit)
``huge_error``       HTTP 500 with a 100 MB text body, written in 1 MiB pieces until the client
                     stops reading; the request's ``sent`` counts the bytes written, its
                     ``ended`` is when the writing stopped
``endless_event``    a stream whose one event never ends: 1 MiB pieces without a blank line,
                     up to 256 MiB or until the client stops reading (``sent``, ``ended`` as
                     above)

:attr:`FaultUpstream.requests` lists ``{"path", "headers", "fault", "at"}`` per request received.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from aiohttp import web

from metaclaw.proxy.server import BackgroundServer, ServedApp

#: A request's entry in :attr:`FaultUpstream.requests`, kept on the request for the faults.
ENTRY = web.RequestKey("entry", dict)
FAULT = re.compile(r"fault=([a-z0-9_]+)")
FAULTS = ("reset", "reset_midstream", "truncate", "invalid_sse", "invalid_json", "wrong_shape",
          "error_event", "status_429", "status_500", "status_503", "flaky_503", "flaky_reset",
          "slow_body", "hang", "reflect_key", "reflect_url", "redirect_301", "redirect_302", "redirect_307",
          "redirect_308", "json_200", "scripted", "corrupt_gzip", "short_body", "huge_error",
          "endless_event")


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return " ".join(p.get("text", "") for p in content or () if isinstance(p, dict))
    return ""


class FaultUpstream(ServedApp):
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._attempts: dict[str, int] = {}
        self.location: str | None = "https://example.invalid/v1/chat/completions"
        self.json_body: Any = {"error": {"message": "quota exceeded", "type": "insufficient_quota"}}
        self.chunks: list[dict[str, Any]] = []
        self.done = True
        self._server = BackgroundServer(self._make_app, "127.0.0.1", 0, "fault-upstream",
                                        shutdown_timeout=0.2)

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/v1/messages", self._anthropic)
        return app

    # -- shared ---------------------------------------------------------------------------
    async def _begin(self, request: web.Request) -> tuple[dict[str, Any], str, str]:
        body = await request.json()
        text = _last_user_text(body)
        match = FAULT.search(text)
        fault = match.group(1) if match else ""
        if fault.startswith("flaky_"):
            attempt = self._attempts.get(text, 0)
            self._attempts[text] = attempt + 1
            fault = fault if attempt == 0 else ""
        request[ENTRY] = {"path": request.path, "headers": dict(request.headers),
                            "fault": fault, "at": time.monotonic(),
                            "stream": bool(body.get("stream"))}
        self.requests.append(request[ENTRY])
        key = request.headers.get("x-api-key") or request.headers.get(
            "Authorization", "").removeprefix("Bearer ")
        return body, fault, key

    @staticmethod
    def _abort(request: web.Request) -> web.Response:
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=500)  # never sent: the connection is gone

    async def _special(self, request: web.Request, fault: str, key: str,
                       error: dict[str, Any]) -> web.StreamResponse | None:
        """The faults shared by both protocols that happen before any reply; None otherwise."""
        if fault in ("reset", "flaky_reset"):
            return self._abort(request)
        if fault == "hang":  # until the client gives up and closes the connection
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.05)
            request[ENTRY]["gone"] = time.monotonic()
            return web.Response(status=500)
        if fault == "reflect_url":
            import base64

            sent = request.headers.get("Authorization", "")
            if sent.startswith("Basic "):
                sent += " = " + base64.b64decode(sent[6:]).decode()
            return web.json_response({"error": {"message": f"bad request to {request.path_qs} "
                                                           f"with {sent}"}}, status=400)
        if fault.startswith("redirect_") and fault[9:] in ("301", "302", "307", "308"):
            headers = {"Location": self.location} if self.location is not None else {}
            return web.Response(status=int(fault[9:]), headers=headers, text="Moved")
        status = {"status_429": 429, "status_500": 500, "status_503": 503, "flaky_503": 503,
                  "reflect_key": 401}.get(fault)
        if status:
            wait = "1" if fault == "flaky_503" else "3600"
            return web.json_response(error, status=status, headers={"Retry-After": wait})
        if fault == "json_200" or fault == "scripted" and not request[ENTRY]["stream"]:
            return web.json_response(self.json_body)
        if fault == "scripted":
            events = [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in self.chunks]
            return await self._stream(request, events + [b"data: [DONE]\n\n"] * self.done,
                                      fault, b"")
        if fault == "corrupt_gzip":
            return web.Response(body=b"this is not gzip" * 64, status=200,
                                headers={"Content-Type": "application/json",
                                         "Content-Encoding": "gzip"})
        if fault == "short_body":
            return await self._short_body(request, json.dumps(error).encode())
        if fault == "huge_error":
            return await self._pieces(request, 500, "text/html", b"",
                                      b"<html>" + b"x" * (2**20 - 6), 100)
        if fault == "endless_event":
            return await self._pieces(request, 200, "text/event-stream", b'data: {"a": "',
                                      b"a" * 2**20, 256)
        if fault == "invalid_json":
            return web.Response(body=b'{"choices": [{"message": ', status=200,
                                content_type="application/json")
        if fault == "wrong_shape":
            return web.json_response({"unexpected": True, "echo": key[:0]})
        return None

    @staticmethod
    async def _short_body(request: web.Request, data: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(data) + 100
        await response.prepare(request)
        await response.write(data)
        if request.transport is not None:
            request.transport.close()  # after what was written is flushed
        return response

    @staticmethod
    async def _pieces(request: web.Request, status: int, content_type: str, head: bytes,
                      piece: bytes, count: int) -> web.StreamResponse:
        """``head`` then ``count`` times ``piece``, stopping when the client hangs up."""
        entry = request[ENTRY]
        entry["sent"] = 0
        response = web.StreamResponse(status=status, headers={"Content-Type": content_type})
        await response.prepare(request)
        try:
            await response.write(head)
            for _ in range(count):
                if request.transport is None or request.transport.is_closing():
                    break
                await response.write(piece)  # waits while the client does not read
                entry["sent"] += len(piece)
            await response.write_eof()
        except ConnectionError:
            pass
        finally:
            entry["ended"] = time.monotonic()
        return response

    async def _trickle(self, request: web.Request, response: web.StreamResponse,
                       data: bytes) -> None:
        for i in range(len(data)):
            if request.transport is None or request.transport.is_closing():
                return
            await response.write(data[i:i + 1])
            await asyncio.sleep(0.4)

    async def _stream(self, request: web.Request, events: list[bytes], fault: str,
                      bad: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i, event in enumerate(events):
                if fault == "slow_body":
                    await self._trickle(request, response, event)
                    continue
                if i == 2 and fault == "reset_midstream":
                    return self._abort(request)
                if i == 2 and fault == "truncate":
                    break
                if i == 2 and fault in ("invalid_sse", "invalid_json", "error_event"):
                    await response.write(bad)
                    if fault == "error_event":
                        continue
                    break
                await response.write(event)
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response

    # -- OpenAI ---------------------------------------------------------------------------
    async def _openai(self, request: web.Request) -> web.StreamResponse:
        body, fault, key = await self._begin(request)
        error = {"error": {"message": f"Incorrect API key provided: {key}", "type": "invalid_key",
                           "param": key, "code": f"bad_key:{key}"}}
        special = await self._special(request, fault, key, error)
        if special is not None:
            return special
        text = "echo: " + _last_user_text(body)
        if fault == "surrogate_reply":  # valid JSON, but not valid Unicode text
            text += " \ud800"
        if not body.get("stream"):
            content: Any = text
            if fault == "parts_reply":
                content = [{"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]},
                           {"type": "text", "text": text}]
            completion = {"id": "chatcmpl-f", "object": "chat.completion", "created": 0,
                          "model": body.get("model"), "choices": [{
                              "index": 0, "message": {"role": "assistant", "content": content},
                              "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
            if fault == "slow_body":
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)
                await self._trickle(request, response, json.dumps(completion).encode())
                return response
            return web.json_response(completion)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data = {"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 0,
                    "model": body.get("model"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(data)}\n\n".encode()

        def words(word: str) -> Any:
            return [{"type": "text", "text": word}] if fault == "parts_reply" else word

        events = [chunk({"role": "assistant", "content": ""}),
                  *(chunk({"content": words(w + " ")}) for w in text.split()),
                  chunk({}, "stop"), b"data: [DONE]\n\n"]
        bad = {"invalid_sse": b"this is not server-sent events\n\n",
               "invalid_json": b"data: {\"choices\": [\n\n",
               "error_event": f"data: {json.dumps(error)}\n\n".encode()}.get(fault, b"")
        if fault == "error_event":
            events = events[:3] + [b"data: [DONE]\n\n"]
        return await self._stream(request, events, fault, bad)

    # -- Anthropic ------------------------------------------------------------------------
    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        body, fault, key = await self._begin(request)
        error = {"type": "error", "error": {"type": "authentication_error",
                                            "message": f"invalid x-api-key: {key}",
                                            "detail": key}}
        special = await self._special(request, fault, key, error)
        if special is not None:
            return special
        text = "echo: " + _last_user_text(body)
        message = {"id": "msg_f", "type": "message", "role": "assistant",
                   "model": body.get("model"), "content": [{"type": "text", "text": text}],
                   "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 3, "output_tokens": 2}}
        if not body.get("stream"):
            if fault == "slow_body":
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)
                await self._trickle(request, response, json.dumps(message).encode())
                return response
            return web.json_response(message)

        def event(data: dict[str, Any]) -> bytes:
            return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()

        start = {**message, "content": [], "stop_reason": None,
                 "usage": {"input_tokens": 3, "output_tokens": 0}}
        events = [event({"type": "message_start", "message": start}),
                  event({"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}),
                  *(event({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": w + " "}})
                    for w in text.split()),
                  event({"type": "content_block_stop", "index": 0}),
                  event({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                            "stop_sequence": None},
                         "usage": {"output_tokens": 2}}),
                  event({"type": "message_stop"})]
        bad = {"invalid_sse": b"this is not server-sent events\n\n",
               "invalid_json": b"event: content_block_delta\ndata: {\"type\": \n\n",
               "error_event": event(error)}.get(fault, b"")
        if fault == "error_event":
            events = events[:3]
        return await self._stream(request, events, fault, bad)
