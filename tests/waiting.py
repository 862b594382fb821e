"""Waiting in tests for something another thread or process does."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_until(condition: Callable[[], Any], timeout: float = 15.0, what: str = "condition",
               interval: float = 0.02) -> Any:
    """Poll ``condition`` until it returns something true (returned), or fail the test after
    ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def kill_once_it_says(proc: Any, line: str) -> None:
    """``kill -9`` the child process ``proc`` (text stdout) as soon as it prints ``line``, and
    reap it; it is killed and reaped whatever it printed."""
    try:
        assert proc.stdout.readline().strip() == line
    finally:
        proc.kill()
        proc.wait()
