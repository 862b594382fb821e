"""Progress of long work as plain events: the core reports it, the CLI and the notebook show it.

A long operation (judging turns, an evolver run, a benchmark, a training step) takes an
``on_progress`` callable and calls it with one :class:`Progress` per unit of work done. The core
never draws anything: ``metaclaw.console`` turns the events into a progress bar on a terminal (or
log lines), the notebook layer into a bar in the cell. A display that fails is logged and the work
goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

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
    logged, never stops the work."""
    if fn is None:
        return
    try:
        fn(Progress(task, done, total, detail))
    except Exception:  # noqa: BLE001 - a display must not break the work it shows
        log.exception("progress display %r failed", fn)
