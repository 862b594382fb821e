"""Progress of long work as plain events: the core reports it, the CLI and the notebook show it.

A long operation (judging turns, an evolver run, a benchmark, a training step) takes an
``on_progress`` callable and calls it with one :class:`Progress` per unit of work done. The core
never draws anything: ``metaclaw.console`` turns the events into a progress bar on a terminal (or
log lines), the notebook layer into a bar in the cell. A display that fails is logged and the work
goes on.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """``done`` of ``total`` units of ``task`` finished (``total`` None: not known in advance);
    ``detail``: what the last unit was, in a few words."""

    task: str
    done: int
    total: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        return f"{self.task}: {count}" + (f" ({self.detail})" if self.detail else "")


ProgressFn = Callable[[Progress], None]


def notify(fn: ProgressFn | None, task: str, done: int, total: int | None = None,
           detail: str = "") -> None:
    """Hand ``fn`` one :class:`Progress` (nothing when ``fn`` is None); a display that raises is
    logged (its traceback once: a display that cannot draw fails at every update, and a cell
    showed a traceback per judged turn), never stops the work."""
    if fn is None:
        return
    try:
        fn(Progress(task, done, total, detail))
    except Exception as exc:  # noqa: BLE001 - a display must not break the work it shows
        try:
            if fn in _FAILED:
                log.debug("progress display %r failed again: %s", fn, exc)
                return
            _FAILED.add(fn)
        except TypeError:  # a display that cannot be weakly referenced: logged every time
            pass
        log.exception("progress display %r failed (its later failures are logged at DEBUG)", fn)


#: The displays whose failure was logged (kept as long as they live).
_FAILED: "weakref.WeakSet[Any]" = weakref.WeakSet()
