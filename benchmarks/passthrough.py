"""The floor for the proxy's overhead: a bare aiohttp pass-through.

It receives a request's body, forwards it unchanged with one pooled ``aiohttp.ClientSession`` and
relays the reply (a stream chunk by chunk, as the chunks arrive): no parsing, no retrieval, no
recording. ``benchmarks/bench_proxy.py`` runs it beside ``metaclaw serve``, in the same framework
and on the same event loop (:func:`metaclaw.server.new_event_loop`: uvloop where installed), and
prints the proxy's figures as ratios to this one's: what the proxy adds beyond forwarding bytes.

    python benchmarks/passthrough.py --upstream http://127.0.0.1:PORT [--port 0]

Prints the port once listening; serves until its standard input closes or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import aiohttp
from aiohttp import web

from metaclaw.server import new_event_loop

#: Request and reply headers the pass-through carries over (everything else is the framework's).
FORWARDED = ("Content-Type", "Authorization", "x-api-key", "anthropic-version")


def make_app(upstream: str) -> web.Application:
    """``POST <path>`` is forwarded to ``upstream + <path>`` (``upstream``: scheme://host:port)."""
    root = upstream.rstrip("/")
    app = web.Application(client_max_size=8 * 2**20)

    async def open_session(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar())

    async def close_session(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
        async with app["session"].post(root + request.path, data=body,
                                       headers=headers) as upstream_reply:
            content_type = upstream_reply.headers.get("Content-Type", "application/json")
            if not content_type.startswith("text/event-stream"):
                return web.Response(body=await upstream_reply.read(),
                                    status=upstream_reply.status,
                                    headers={"Content-Type": content_type})
            response = web.StreamResponse(status=upstream_reply.status,
                                          headers={"Content-Type": content_type})
            await response.prepare(request)
            async for chunk in upstream_reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.router.add_post("/{path:.*}", forward)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


async def serve(upstream: str, host: str, port: int) -> None:
    runner = web.AppRunner(make_app(upstream), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: os.read(sys.stdin.fileno(), 4096) or stop.set())
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="scheme://host:port of the upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(args.upstream, args.host, args.port))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
