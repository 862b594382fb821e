"""The floor for the proxy's overhead: a bare aiohttp pass-through.

It receives a request's body, forwards it unchanged with one pooled ``aiohttp.ClientSession`` and
relays the reply (a stream chunk by chunk, as the chunks arrive): no parsing, no retrieval, no
recording. ``benchmarks/bench_proxy.py`` runs it beside ``metaclaw serve``, in the same framework
and on the same event loop (:func:`metaclaw.proxy.server.new_event_loop`: uvloop where installed), and
prints the proxy's figures as ratios to this one's: what the proxy adds beyond forwarding bytes.

With ``--record DB`` it is the least a recording proxy does: each exchange, the request's bytes
and the reply's, is one row committed to a SQLite database (write-ahead log, no fsync per commit,
as ``metaclaw serve`` commits its turns) before the reply's end is sent (a stream's last chunk
waits for it), so that it survives ``kill -9``. Still no parsing and no retrieval.

    python benchmarks/passthrough.py --upstream http://127.0.0.1:PORT [--port 0] [--record DB]

Prints the port once listening; serves until its standard input closes or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sqlite3
import stat
import sys
import time

import aiohttp
from aiohttp import web

from metaclaw.proxy.server import new_event_loop

#: Request and reply headers the pass-through carries over (everything else is the framework's).
FORWARDED = ("Content-Type", "Authorization", "x-api-key", "anthropic-version")


def open_record(path: str) -> sqlite3.Connection:
    """The recording pass-through's database: one table of exchanges, write-ahead log."""
    db = sqlite3.connect(path, isolation_level=None)  # each INSERT commits on its own
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # in WAL mode: no fsync per commit
    db.execute("CREATE TABLE IF NOT EXISTS exchanges (id INTEGER PRIMARY KEY, at REAL NOT NULL, "
               "path TEXT NOT NULL, request BLOB NOT NULL, reply BLOB NOT NULL)")
    return db


def make_app(upstream: str, record: sqlite3.Connection | None = None) -> web.Application:
    """``POST <path>`` is forwarded to ``upstream + <path>`` (``upstream``: scheme://host:port);
    with ``record``, each exchange is committed to it before the reply ends."""
    root = upstream.rstrip("/")
    app = web.Application(client_max_size=8 * 2**20)

    def commit(path: str, request: bytes, reply: bytes) -> None:
        if record is not None:
            record.execute("INSERT INTO exchanges (at, path, request, reply) VALUES (?, ?, ?, ?)",
                           (time.time(), path, request, reply))

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
                reply = await upstream_reply.read()
                commit(request.path, body, reply)
                return web.Response(body=reply, status=upstream_reply.status,
                                    headers={"Content-Type": content_type})
            response = web.StreamResponse(status=upstream_reply.status,
                                          headers={"Content-Type": content_type})
            await response.prepare(request)
            chunks: list[bytes] = []  # recording: the last one waits for the commit
            async for chunk in upstream_reply.content.iter_any():
                if record is None:
                    await response.write(chunk)
                    continue
                if chunks:
                    await response.write(chunks[-1])
                chunks.append(chunk)
            commit(request.path, body, b"".join(chunks))
            await response.write_eof(chunks[-1] if chunks else b"")
            return response

    app.router.add_post("/{path:.*}", forward)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


async def serve(upstream: str, host: str, port: int, record: str | None = None) -> None:
    db = open_record(record) if record else None
    runner = web.AppRunner(make_app(upstream, db), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    mode = os.fstat(sys.stdin.fileno()).st_mode if not sys.stdin.closed else 0
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) and sys.stdin.isatty():
        # stdin closed (its parent gone) stops it too; a file or /dev/null cannot be watched
        loop.add_reader(sys.stdin.fileno(),
                        lambda: os.read(sys.stdin.fileno(), 4096) or stop.set())
    await stop.wait()
    await runner.cleanup()
    if db is not None:
        db.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="scheme://host:port of the upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--record", metavar="DB", default=None,
                        help="commit each exchange to this SQLite database before its reply ends")
    args = parser.parse_args(argv)
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(args.upstream, args.host, args.port, args.record))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
