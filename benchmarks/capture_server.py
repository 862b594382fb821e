"""A tiny capture server: records what real agent clients send, and answers just enough for
them to finish a turn.

Every request is written to ``OUT/NNN.json`` (one file per request, numbered in arrival order)
as ``{"method", "path", "query", "headers", "body"}``, with the values of the ``Authorization``,
``api-key``, ``x-api-key`` and ``Proxy-Authorization`` headers replaced by ``"<redacted>"``.
``body`` is the parsed JSON (gzip / deflate / zstd request bodies are decoded first), or
``{"_raw": text}`` when the body is not JSON.

Answers (the assistant always says ``--text``, "OK." by default, with a small usage block):

- ``GET  /v1/models``: a one-model list (``--model``).
- ``POST /v1/chat/completions``: a ``chat.completion``, or with ``"stream": true`` real SSE
  ``chat.completion.chunk`` events ending in ``data: [DONE]`` (a usage chunk first when
  ``stream_options.include_usage`` is set).
- ``POST /v1/responses``: a ``response`` object, or with ``"stream": true`` the Responses SSE
  events ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, ``response.completed`` (what
  the Codex CLI's SSE reader needs: it ends a turn on ``response.completed`` with an ``id``).
- anything else: a 404 JSON error (still recorded).

The ``/v1`` prefix is optional on every route.

    python benchmarks/capture_server.py --port 18080 --out /tmp/captures
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import time
import uuid
import zlib
from pathlib import Path

from aiohttp import web

REDACTED_HEADERS = {"authorization", "api-key", "x-api-key", "proxy-authorization"}


def redact(headers) -> dict[str, str]:
    return {k: ("<redacted>" if k.lower() in REDACTED_HEADERS else v) for k, v in headers.items()}


def decode_body(raw: bytes, encoding: str) -> bytes:
    encoding = (encoding or "").lower().strip()
    if encoding == "gzip":
        return gzip.decompress(raw)
    if encoding == "deflate":
        return zlib.decompress(raw)
    if encoding == "zstd":
        import zstandard  # only needed when a client compresses with zstd

        return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    return raw


def usage_chat() -> dict:
    return {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}


def usage_responses() -> dict:
    return {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 12}


class CaptureServer:
    def __init__(self, out: Path, text: str, model: str):
        self.out, self.text, self.model = out, text, model
        self.out.mkdir(parents=True, exist_ok=True)
        start = max((int(p.stem) for p in self.out.glob("[0-9][0-9][0-9].json")), default=0)
        self.counter = itertools.count(start + 1)

    # -- recording -----------------------------------------------------------------------
    @web.middleware
    async def record(self, request: web.Request, handler):
        raw = await request.read()
        try:
            raw = decode_body(raw, request.headers.get("Content-Encoding", ""))
        except Exception as exc:  # keep what came, say why it could not be decoded
            body: object = {"_undecodable": repr(exc), "_len": len(raw)}
        else:
            if not raw:
                body = None
            else:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {"_raw": raw.decode("utf-8", "replace")}
        n = next(self.counter)
        entry = {"n": n, "time": time.time(), "method": request.method, "path": request.path,
                 "query": request.query_string, "headers": redact(request.headers),
                 "body": body}
        (self.out / f"{n:03d}.json").write_text(json.dumps(entry, indent=1, ensure_ascii=False))
        request["json_body"] = body if isinstance(body, dict) else {}
        return await handler(request)

    # -- answers -------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "capture"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = request["json_body"]
        model = body.get("model") or self.model
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if not body.get("stream"):
            return web.json_response({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": self.text}}],
                "usage": usage_chat()})
        resp = await self._sse_start(request)

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": 0, "delta": delta,
                                                 "finish_reason": finish, "logprobs": None}]}

        await self._data(resp, chunk({"role": "assistant", "content": ""}))
        await self._data(resp, chunk({"content": self.text}))
        await self._data(resp, chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await self._data(resp, {"id": cid, "object": "chat.completion.chunk",
                                    "created": created, "model": model, "choices": [],
                                    "usage": usage_chat()})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _response(self, rid: str, body: dict, status: str, output: list) -> dict:
        return {"id": rid, "object": "response", "created_at": int(time.time()),
                "status": status, "model": body.get("model") or self.model, "output": output,
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "tool_choice": body.get("tool_choice", "auto"), "tools": [],
                "usage": usage_responses() if status == "completed" else None}

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = request["json_body"]
        rid = f"resp_{uuid.uuid4().hex[:24]}"
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        part = {"type": "output_text", "text": self.text, "annotations": []}
        done_item = {"id": mid, "type": "message", "status": "completed", "role": "assistant",
                     "content": [part]}
        if not body.get("stream"):
            return web.json_response(self._response(rid, body, "completed", [done_item]))
        resp = await self._sse_start(request)
        seq = itertools.count()

        async def event(kind: str, **fields) -> None:
            await self._data(resp, {"type": kind, "sequence_number": next(seq), **fields},
                             event=kind)

        started = self._response(rid, body, "in_progress", [])
        await event("response.created", response=started)
        await event("response.in_progress", response=started)
        await event("response.output_item.added", output_index=0,
                    item={"id": mid, "type": "message", "status": "in_progress",
                          "role": "assistant", "content": []})
        await event("response.content_part.added", item_id=mid, output_index=0,
                    content_index=0, part={"type": "output_text", "text": "",
                                           "annotations": []})
        await event("response.output_text.delta", item_id=mid, output_index=0,
                    content_index=0, delta=self.text)
        await event("response.output_text.done", item_id=mid, output_index=0,
                    content_index=0, text=self.text)
        await event("response.content_part.done", item_id=mid, output_index=0,
                    content_index=0, part=part)
        await event("response.output_item.done", output_index=0, item=done_item)
        await event("response.completed",
                    response=self._response(rid, body, "completed", [done_item]))
        await resp.write_eof()
        return resp

    async def not_found(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"no route {request.method} "
                                            f"{request.path}", "type": "not_found"}},
                                 status=404)

    # -- SSE helpers ---------------------------------------------------------------------
    @staticmethod
    async def _sse_start(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _data(resp: web.StreamResponse, data: dict, event: str | None = None) -> None:
        head = f"event: {event}\n" if event else ""
        await resp.write(f"{head}data: {json.dumps(data)}\n\n".encode())
        await asyncio.sleep(0)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.record], client_max_size=256 * 1024 ** 2)
        for prefix in ("/v1", ""):
            app.router.add_get(f"{prefix}/models", self.models)
            app.router.add_post(f"{prefix}/chat/completions", self.chat)
            app.router.add_post(f"{prefix}/responses", self.responses)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--out", type=Path, required=True, help="folder for NNN.json files")
    parser.add_argument("--text", default="OK.", help="what the assistant answers")
    parser.add_argument("--model", default="capture-model", help="the model /v1/models lists")
    args = parser.parse_args()
    server = CaptureServer(args.out, args.text, args.model)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
