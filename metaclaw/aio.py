"""Running a coroutine to completion from synchronous code, in a script or in a notebook."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


def run_sync(factory: Callable[[], Awaitable[T]], name: str = "metaclaw-sync") -> T:
    """Run ``factory()``'s coroutine on a new event loop and return its result (or raise).

    Where no loop runs in this thread (a script), it is ``asyncio.run``. Where one already runs
    (a notebook kernel), the coroutine runs on a fresh loop in a worker thread named ``name``
    while this thread waits, so the kernel's loop is never re-entered.

    An interrupt (``KeyboardInterrupt``: Ctrl-C, a kernel's stop button) cancels the coroutine
    and waits for it to unwind before it is raised, in both cases: what the work holds (judge
    leases, the evolver's lock, HTTP clients) is released, and nothing it had not committed
    lands later behind the user's back. The worker is waited for in short slices, because an
    interrupt is taken only when the waiting thread runs Python again: a single long wait
    would see it only once the work had finished. (On an event, not ``Thread.join``: a join
    interrupted on Python 3.11 marks a running thread as stopped.)
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # asyncio.run itself cancels the coroutine on an interrupt
        return asyncio.run(_await(factory))
    box: dict[str, Any] = {}
    started, done = threading.Event(), threading.Event()

    async def main() -> T:
        box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        return await factory()

    def worker() -> None:
        try:
            box["value"] = asyncio.run(main())
        except BaseException as exc:  # re-raised in the calling thread
            box["error"] = exc
        finally:
            started.set()
            done.set()

    threading.Thread(target=worker, name=name, daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        started.wait()
        if "task" in box:
            with contextlib.suppress(RuntimeError):  # the loop has ended meanwhile
                box["loop"].call_soon_threadsafe(box["task"].cancel)
        while not done.is_set():
            with contextlib.suppress(KeyboardInterrupt):  # a second interrupt: still unwinding
                done.wait(0.1)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _await(factory: Callable[[], Awaitable[T]]) -> T:
    return await factory()
