"""Serving an aiohttp application on its own event loop (the proxy and the offline doubles).

:class:`BackgroundServer` runs one application in a daemon thread or in the foreground;
:class:`ServedApp` is the start / stop / context-manager / URL lifecycle the servers share.
The loop is uvloop's where it is installed (the ``fast`` extra), asyncio's
otherwise (:func:`new_event_loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import threading
from typing import Any, Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed (a loop written in C, lighter per request),
    asyncio's otherwise or when ``METACLAW_UVLOOP=0``."""
    import os

    if os.environ.get("METACLAW_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


# ---------------------------------------------------------------------------------------------
class BackgroundServer:
    """Serve an aiohttp application on its own event loop, in a thread or in the foreground.

    ``make_app()`` builds the application (called once per start, inside the server's loop).
    :meth:`start` returns once the socket listens; :attr:`port` is the bound port.
    """

    def __init__(self, make_app: Callable[[], web.Application], host: str = "127.0.0.1",
                 port: int = 0, name: str = "metaclaw-server", shutdown_timeout: float = 2.0,
                 runner: Callable[..., web.AppRunner] = web.AppRunner):
        self.make_app = make_app
        self.runner = runner  # e.g. metaclaw.proxy.edge.EdgeRunner: limits for untrusted clients
        self.host = host
        self.port = port
        self.name = name
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.loop is not None and self.loop.is_running()

    async def _open(self) -> None:
        self._runner = self.runner(self.make_app(), access_log=None,
                                     shutdown_timeout=self.shutdown_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            if exc.errno == errno.EADDRNOTAVAIL:
                advice = (f"{self.host} is not an address of this machine (127.0.0.1: this "
                          "machine only; 0.0.0.0: every interface)")
            elif exc.errno == errno.EADDRINUSE:
                advice = "choose another port (0 picks a free one)"
            else:
                advice = "check the host and the port"
            raise OSError(exc.errno, f"cannot listen on {self.host}:{self.port}: {exc.strerror}; "
                                     f"{advice}") from exc
        self.port = int(self._runner.addresses[0][1])

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> "BackgroundServer":
        """Serve in a daemon thread; returns when listening (raises if the port is taken)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} is already running on port {self.port}")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:  # reported to the caller of start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            self.loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._close())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread to finish (no-op when not running)."""
        thread, loop = self._thread, self.loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None
        self.loop = None

    def call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        """Run a coroutine on the server's loop from another thread and return its result."""
        if self.loop is None:
            raise RuntimeError(f"{self.name} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling thread until Ctrl-C or SIGTERM, then shut down cleanly.

        One coroutine opens, reports ready and waits for the stop. Both signals are taken by the
        loop, never raised inside a request's code: a stop that arrives while the socket opens is
        kept, and one during the shutdown (Ctrl-C pressed twice) is said to wait, so the
        requests in flight are always recorded."""
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()

        def stopping() -> None:
            if stop.is_set():
                log.warning("%s is still stopping: the requests in flight are being recorded "
                            "(a few seconds; kill -9 loses nothing acknowledged)", self.name)
            stop.set()

        taken: dict[int, Any] = {}
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            for signum in (signal.SIGINT, signal.SIGTERM):  # main thread, POSIX only
                previous = signal.getsignal(signum)
                loop.add_signal_handler(signum, stopping)
                taken[signum] = previous

        async def serve() -> None:
            await self._open()
            self.loop = loop
            if on_ready is not None:
                on_ready()
            await stop.wait()

        main = loop.create_task(serve())
        try:
            loop.run_until_complete(main)
        except KeyboardInterrupt:  # where the loop cannot take signals
            pass
        finally:
            self.loop = None
            stop.set()
            main.cancel()
            loop.run_until_complete(self._close())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            for signum, previous in taken.items():  # uvloop leaves its own handler behind
                signal.signal(signum, previous)


def _base_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"



class ServedApp:
    """Lifecycle shared by the servers built on :class:`BackgroundServer` (the proxy, the
    doubles): start in the background, stop, use as a context manager, port and base URL."""

    _server: BackgroundServer

    def start(self):
        """Serve in a background thread with its own event loop; returns when listening."""
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def running(self) -> bool:
        return self._server.running

    @property
    def url(self) -> str:
        """Base URL for OpenAI clients, e.g. ``http://127.0.0.1:PORT/v1``."""
        return _base_url(self._server.host, self._server.port) + "/v1"
