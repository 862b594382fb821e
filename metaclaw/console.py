"""What the command line shows while it works: logging (``-v``/``-q``) and progress bars.

The core reports progress as :class:`metaclaw.progress.Progress` events; this module (imported by
the CLI only) draws them with rich on a terminal. Where stderr is not a terminal (a pipe, a log
file, CI) nothing extra is printed unless asked: with ``-v`` each event becomes one log line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Any, Callable, Iterator

from metaclaw.progress import Progress, ProgressFn

log = logging.getLogger("metaclaw.progress")

#: ``-q`` / default / ``-v`` / ``-vv`` -> the level of the ``metaclaw`` loggers.
LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted: a caller that replaces
    it (a test's capture, a notebook) never leaves this handler holding a closed stream."""

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(verbosity: int) -> None:
    """Send the ``metaclaw`` loggers to stderr at the level of ``verbosity`` (-1 quiet, 0
    warnings, 1 info, 2 debug); other libraries' loggers speak from warnings on (debug at 2).
    Called again, it changes the levels and adds no second handler; other handlers stay."""
    level = LEVELS[max(-1, min(2, verbosity))]
    root = logging.getLogger()
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    if verbosity >= 2:
        root.setLevel(logging.DEBUG)
    logging.getLogger("metaclaw").setLevel(level)


def interactive(stream: Any = None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal a person watches."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced by something without isatty
        return False


class _Bars:
    """rich progress bars on stderr, one per task name (thread-safe: rich locks its own)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                   SpinnerColumn, TextColumn, TimeElapsedColumn)

        self._bars = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.fields[detail]}", style="dim"),
                                  console=Console(file=sys.stderr), transient=False)
        self._tasks: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "_Bars":
        self._bars.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bars.stop()

    def __call__(self, event: Progress) -> None:
        with self._lock:
            task = self._tasks.get(event.task)
            if task is None:
                task = self._tasks[event.task] = self._bars.add_task(
                    event.task, total=event.total, detail=event.detail)
        self._bars.update(task, completed=event.done, total=event.total, detail=event.detail)


def _log_line(event: Progress) -> None:
    log.info("%s", event)


@contextlib.contextmanager
def progress(verbosity: int = 0, stream: Any = None) -> Iterator[ProgressFn | None]:
    """The ``on_progress`` to hand the core for one command: bars on a terminal (not with
    ``-q``), log lines with ``-v`` elsewhere, else None (nothing shown)."""
    if verbosity >= 0 and interactive(stream):
        with _Bars() as bars:
            yield bars
    elif verbosity >= 1:
        yield _log_line
    else:
        yield None


@contextlib.contextmanager
def status(verbosity: int, message: str, stream: Any = None) -> Iterator[None]:
    """A spinner beside ``message`` while the block runs (on a terminal, not with ``-q``), a
    log line with ``-v`` elsewhere, else nothing."""
    if verbosity >= 0 and interactive(stream):
        from rich.console import Console

        with Console(file=sys.stderr).status(message):
            yield
    else:
        if verbosity >= 1:
            log.info("%s", message)
        yield


def rounds(on_progress: ProgressFn | None, total: int) -> Callable[[dict], None] | None:
    """A benchmark runner's ``on_round`` hook reporting each graded round to ``on_progress``:
    one bar per mode (baseline, skills, full), ``total`` rounds each."""
    if on_progress is None:
        return None
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def on_round(record: dict) -> None:
        mode = str(record.get("mode", "bench"))
        with lock:
            counts[mode] = counts.get(mode, 0) + 1
            done = counts[mode]
        verdict = "error" if record.get("error") else ("pass" if record.get("passed") else "fail")
        on_progress(Progress(f"{mode} rounds", done, total,
                             f"{record.get('day', '?')} {record.get('round', '?')}: {verdict}"))

    return on_round
