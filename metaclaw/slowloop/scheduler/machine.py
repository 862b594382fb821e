"""The scheduler's state machine and its configuration builder (see :mod:`metaclaw.slowloop.scheduler`)."""

from __future__ import annotations

import html
import json
import re
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

from metaclaw.slowloop.scheduler.ical import CalendarBusy
from metaclaw.slowloop.scheduler.signals import (Clock, KeyboardIdle, NotebookIdle, ProxyIdle,
                                                 Signal, SignalReading, SleepWindow, _seconds,
                                                 _short, now_ts)

STATES = ("waiting", "window_open", "training", "pausing")
MODES = ("any", "all")


@dataclass(frozen=True)
class Transition:
    """One state change: when (epoch seconds), from, to, why, and the signal readings."""

    at: float
    from_state: str
    to_state: str
    reason: str
    signals: dict[str, Any]


class Scheduler:
    """Opens training windows from idle signals and runs ``train_step`` inside them.

    ``signals``: the :class:`Signal` objects (distinct names). ``train_step``: a callable doing one
    training step (e.g. one GRPO step); returning ``False`` means "nothing to train now". It runs
    in a background thread; the trainer may also poll :meth:`should_stop` inside a long step.
    ``mode``: ``"any"`` or ``"all"``; ``min_window_s``: see the module docstring. ``store``: a
    :class:`metaclaw.store.Store` for the transitions (optional). ``force``: train regardless of
    the signals until the run ends by itself. ``max_steps``: total step budget (None = no limit).
    ``signal_timeout_s``: a signal that has not answered within this many seconds reads as
    unavailable, so one hung signal (a stalled network share, a wedged X server) cannot keep
    training going after the user is back. ``lease``: the workspace's
    :class:`~metaclaw.training_lease.TrainingLease`, held from the start of a training run to
    its end, so that the schedulers of several processes on one workspace train one at a
    time: while another process holds it, an open window waits (``status()['waiting_for']``
    names the holder) and training starts when it is free.
    """

    def __init__(self, signals: Iterable[Signal] = (), *,
                 train_step: Callable[[], Any] | None = None, mode: str = "any",
                 min_window_s: float = 0.0, store: Any = None, clock: Clock = time.time,
                 force: bool = False, max_steps: int | None = None, poll_s: float = 5.0,
                 signal_timeout_s: float = 15.0, history: int = 500, lease: Any = None):
        self.signals = list(signals)
        names = [s.name for s in self.signals]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"two scheduler signals are named {duplicates[0]!r}; give each "
                             f"signal a distinct name")
        if mode not in MODES:
            raise ValueError(f"unknown scheduler mode {mode!r}; choose 'any' or 'all'")
        if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool)
                                      or max_steps < 0):
            raise ValueError(f"max_steps must be a non-negative integer or None, got {max_steps!r}")
        self.train_step, self.mode, self.store, self.clock = train_step, mode, store, clock
        self.min_window_s = _seconds(min_window_s, "min_window_s")
        self.poll_s = _seconds(poll_s, "poll_s") or 5.0
        self.signal_timeout_s = _seconds(signal_timeout_s, "signal_timeout_s")
        if not self.signal_timeout_s:
            raise ValueError("signal_timeout_s must be more than 0 seconds")
        self.force, self.max_steps, self.history = force, max_steps, history
        self.lease = lease
        self.waiting_for: str | None = None  # who holds the lease while a window waits for it
        self.state = "waiting"
        self.steps = 0
        #: the number the trainer gives its next step (its own count across runs and
        #: processes), for the transitions' reasons; None: this scheduler's steps, from 1
        self.step_number: Callable[[], int] | None = None
        self.last_result: Any = None
        self.last_error: str | None = None
        self.last_readings: list[SignalReading] = []
        self.transitions: list[Transition] = []
        self._lock = threading.RLock()
        self._idle_since: float | None = None
        self._pending: dict[str, tuple[threading.Thread, float]] = {}  # readings still running
        self._spent = False              # the current idle period already had its training run
        self._pause = threading.Event()  # set: the worker stops at the next step boundary
        self._worker: threading.Thread | None = None
        self._worker_end = ""
        self._wake = threading.Event()
        self._loop: threading.Thread | None = None
        self._running = False

    # -- signals ----------------------------------------------------------------------------
    def readings(self) -> list[SignalReading]:
        """Every signal's current reading, read side by side; a signal that raises, or has not
        answered within ``signal_timeout_s``, reads as unavailable."""
        started = time.monotonic()
        jobs = [(signal, self._start_reading(signal, started)) for signal in self.signals]
        out = []
        for signal, job in jobs:
            if isinstance(job, SignalReading):
                out.append(job)
                continue
            thread, answer = job
            thread.join(max(0.0, started + self.signal_timeout_s - time.monotonic()))
            if thread.is_alive():
                self._pending[signal.name] = (thread, started)
                out.append(SignalReading(signal.name, False, False, f"unavailable: no answer "
                                         f"within {self.signal_timeout_s:g}s"))
            elif "error" in answer:
                out.append(SignalReading(signal.name, False, False,
                                         f"unavailable: {_short(answer['error'])}"))
            else:
                out.append(answer["reading"])
        self.last_readings = out
        return out

    def _start_reading(self, signal: Signal, now: float):
        """Start reading ``signal`` in a thread: (thread, answer dict), or an unavailable
        reading while its previous reading is still running (a thread cannot be cancelled)."""
        pending = self._pending.get(signal.name)
        if pending is not None:
            if pending[0].is_alive():
                return SignalReading(signal.name, False, False, f"unavailable: no answer for "
                                     f"{now - pending[1]:.0f}s")
            del self._pending[signal.name]
        answer: dict[str, Any] = {}

        def read() -> None:
            try:
                answer["reading"] = signal.reading()
            except Exception as exc:  # noqa: BLE001 - reported as unavailable
                answer["error"] = exc

        thread = threading.Thread(target=read, name=f"metaclaw-signal-{signal.name}", daemon=True)
        thread.start()
        return thread, answer

    def combine(self, readings: list[SignalReading]) -> tuple[bool, str]:
        """Apply the combination rule: (idle?, human-readable reason)."""
        available = [r for r in readings if r.available]
        ignored = [r.name for r in readings if not r.available]
        note = f"; ignored (unavailable): {', '.join(ignored)}" if ignored else ""
        if not available:
            return False, f"no signal is available{note}"
        idle_names = [r.name for r in available if r.idle]
        active_names = [r.name for r in available if not r.idle]
        idle = bool(idle_names) if self.mode == "any" else not active_names
        parts = []
        if idle_names:
            parts.append(f"idle: {', '.join(idle_names)}")
        if active_names:
            parts.append(f"active: {', '.join(active_names)}")
        verdict = "idle" if idle else "active"
        return idle, f"{self.mode} rule -> {verdict} ({'; '.join(parts)}){note}"

    # -- state machine ----------------------------------------------------------------------
    def _transition(self, to_state: str, reason: str, readings: list[SignalReading],
                    at: float) -> None:
        snapshot = {r.name: r.as_dict() for r in readings}
        item = Transition(at, self.state, to_state, reason, snapshot)
        self.transitions.append(item)
        del self.transitions[:-self.history]
        self.state = to_state
        if self.store is not None:
            try:
                self.store.record_transition(from_state=item.from_state, to_state=to_state,
                                             reason=reason, signals=snapshot, at=at)
            except Exception as exc:  # noqa: BLE001 - kept in memory; reported in status()
                self.last_error = f"could not record a transition in the store: {_short(exc)}"

    def tick(self) -> str:
        """Read the signals, advance the state machine, return the new state."""
        readings = self.readings()  # outside the lock: a calendar fetch may take a while
        with self._lock:
            idle, reason = self.combine(readings)
            now = now_ts(self.clock)
            if idle:
                # a clock set back would otherwise hold off training until it caught up
                if self._idle_since is None or self._idle_since > now:
                    self._idle_since = now
            else:
                self._idle_since, self._spent = None, False
            finished = self.max_steps is not None and self.steps >= self.max_steps
            forced = self.force and not finished
            window = forced or (idle and not self._spent and not finished)
            if forced:
                reason = "forced (train now, signals ignored)"

            if self.state == "waiting" and window:
                self._transition("window_open", reason, readings, now)
            if self.state == "window_open":
                opened_for = 0.0 if self._idle_since is None else now - self._idle_since
                if not window:
                    self.waiting_for = None
                    self._transition("waiting", f"window closed before training started: "
                                                f"{reason}", readings, now)
                elif self.train_step is not None and (forced or opened_for >= self.min_window_s):
                    if self.lease is not None and not self.lease.acquire("idle-window training"):
                        self.waiting_for = self.lease.holder()
                    else:  # the worker gives the lease back when the run ends
                        self.waiting_for = None
                        self._transition("training", f"starting at step {self._next_step()}: "
                                                     f"{reason}", readings, now)
                        self._start_worker()
            elif self.state == "training":
                if self._worker is not None and not self._worker.is_alive():
                    self._finish_run()
                    self._transition("waiting", self._worker_end, readings, now)
                elif not window:
                    self._pause.set()
                    self._transition("pausing", f"window closed, pausing after the current "
                                                f"step: {reason}", readings, now)
            elif self.state == "pausing":
                if self._worker is None or not self._worker.is_alive():
                    ended = self._worker_end
                    self._worker = None
                    self._transition("waiting", f"paused at a step boundary after step "
                                                f"{self._next_step() - 1} ({ended})", readings,
                                     now)
            return self.state

    def _next_step(self) -> int:
        if self.step_number is not None:
            try:
                return int(self.step_number())
            except Exception:  # noqa: BLE001 - a reason's number is not worth a failed tick
                pass
        return self.steps + 1

    def _start_worker(self) -> None:
        self._pause.clear()
        self._worker_end = ""
        self._worker = threading.Thread(target=self._work, name="metaclaw-training", daemon=True)
        self._worker.start()

    def _finish_run(self) -> None:
        """The worker ended by itself: this idle period is used up and a forced run is done."""
        self._worker = None
        self._spent = True
        self.force = False

    def _work(self) -> None:
        end = "paused"
        try:
            while True:
                if self._pause.is_set():
                    end = "paused"
                    break
                if self.max_steps is not None and self.steps >= self.max_steps:
                    end = f"step budget of {self.max_steps} reached"
                    break
                result = self.train_step()
                if result is False:
                    end = "train_step reported nothing to train"
                    break
                with self._lock:
                    self.steps += 1
                    self.last_result = result
                if self.max_steps is None or self.steps < self.max_steps:
                    try:  # the signals read again at the boundary: a user back meanwhile
                        self.tick()  # stops the next step now, not at the next poll
                    except Exception as exc:  # noqa: BLE001 - as a failed tick of the loop
                        self.last_error = f"scheduler tick failed: {_short(exc)}"
        except Exception as exc:  # noqa: BLE001 - reported; the scheduler keeps running
            end = f"training step {self.steps + 1} failed: {_short(exc)}"
            self.last_error = end
        finally:
            if self.lease is not None:
                self.lease.release()
        self._worker_end = end
        self._wake.set()

    def should_stop(self) -> bool:
        """True once training should pause at the next step boundary (for the trainer to poll)."""
        return self._pause.is_set()

    def wait_for_training(self, timeout: float | None = None) -> bool:
        """Wait until the training thread (if any) has ended; True if it has."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    # -- running in the background ----------------------------------------------------------
    def run(self, poll_s: float | None = None) -> threading.Thread:
        """Start ticking every ``poll_s`` seconds in a daemon thread; returns the thread."""
        if self._loop is not None and self._loop.is_alive():
            return self._loop
        if poll_s is not None:
            self.poll_s = _seconds(poll_s, "poll_s") or self.poll_s
        self._running = True
        self._loop = threading.Thread(target=self._run_loop, name="metaclaw-scheduler",
                                      daemon=True)
        self._loop.start()
        return self._loop

    def _run_loop(self) -> None:
        while self._running:
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - keep scheduling; report in status()
                self.last_error = f"scheduler tick failed: {_short(exc)}"
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the loop; a running training step finishes and training pauses (state kept)."""
        self._running = False
        self._wake.set()
        if self._loop is not None:
            self._loop.join(timeout)
            self._loop = None
        with self._lock:
            now = now_ts(self.clock)
            if self.state == "training":
                self._pause.set()
                self._transition("pausing", "scheduler stopped", self.last_readings, now)
        self.wait_for_training(timeout)
        with self._lock:
            if self.state == "pausing" and (self._worker is None or not self._worker.is_alive()):
                self._worker = None
                self._transition("waiting", f"paused at a step boundary after step "
                                            f"{self._next_step() - 1} (scheduler stopped)",
                                 self.last_readings,
                                 now_ts(self.clock))
            elif self.state == "window_open":
                self.waiting_for = None
                self._transition("waiting", "scheduler stopped", self.last_readings,
                                 now_ts(self.clock))

    def close(self) -> None:
        """Stop, then release every signal's resources (input listeners, X display, callbacks)."""
        self.stop()
        for signal in self.signals:
            signal.close()

    # -- views ------------------------------------------------------------------------------
    def status(self, last: int = 10, refresh: bool = False) -> dict[str, Any]:
        """State, combined answer, each signal's reading, steps, and the ``last`` transitions.

        Readings are those of the last tick unless ``refresh`` is true (or no tick ran yet).
        """
        readings = self.readings() if refresh or not self.last_readings else self.last_readings
        with self._lock:
            idle, reason = self.combine(readings)
            if self.waiting_for and self.state == "window_open":
                reason = f"{reason}; waiting for {self.waiting_for} to finish training"
            return {
                "state": self.state, "idle": idle, "reason": reason, "mode": self.mode,
                "min_window_s": self.min_window_s, "force": self.force, "steps": self.steps,
                "max_steps": self.max_steps, "running": bool(self._loop and self._loop.is_alive()),
                "last_error": self.last_error,
                "waiting_for": self.waiting_for if self.state == "window_open" else None,
                "signals": [r.as_dict() for r in readings],
                "transitions": [asdict(t) for t in self.transitions[-last:]] if last else [],
            }

    def transitions_frame(self):
        """The in-memory transitions as a ``polars.DataFrame`` (signals as a JSON string)."""
        import polars as pl

        rows = self.transitions
        return pl.DataFrame({
            "at": [datetime.fromtimestamp(t.at, timezone.utc) for t in rows],
            "from_state": [t.from_state for t in rows],
            "to_state": [t.to_state for t in rows],
            "reason": [t.reason for t in rows],
            "signals": [json.dumps(t.signals) for t in rows],
        }, schema={"at": pl.Datetime("us", "UTC"), "from_state": pl.String,
                   "to_state": pl.String, "reason": pl.String, "signals": pl.String})

    def _repr_html_(self) -> str:
        status = self.status(last=5)
        rows = "".join(
            f"<tr><td>{html.escape(s['name'])}</td>"
            f"<td>{'idle' if s['idle'] else ('active' if s['available'] else 'unavailable')}</td>"
            f"<td>{html.escape(s['detail'])}</td></tr>" for s in status["signals"])
        moves = "".join(
            f"<li>{datetime.fromtimestamp(t['at'], timezone.utc):%Y-%m-%d %H:%M:%S} UTC "
            f"{t['from_state']} &rarr; {t['to_state']}: {html.escape(t['reason'])}</li>"
            for t in status["transitions"])
        return (f"<div><b>Scheduler</b>: {status['state']} &middot; {status['steps']} steps "
                f"&middot; {html.escape(status['reason'])}"
                f"<table><tr><th>signal</th><th>reads</th><th>detail</th></tr>{rows}</table>"
                f"<ul>{moves}</ul></div>")

    def __repr__(self) -> str:
        return (f"Scheduler(state={self.state!r}, mode={self.mode!r}, steps={self.steps}, "
                f"signals={[s.name for s in self.signals]})")


# -- configuration --------------------------------------------------------------------------------
SIGNAL_TYPES: dict[str, type[Signal]] = {
    "sleep": SleepWindow, "keyboard": KeyboardIdle, "calendar": CalendarBusy,
    "notebook": NotebookIdle, "proxy": ProxyIdle,
}
_SETTINGS = ("mode", "min_window_s", "max_steps", "force", "poll_s", "signal_timeout_s",
             "signals")

#: Used when no scheduler configuration is given: the local night, or 15 minutes without
#: keyboard/mouse input where a display exists.
DEFAULT_CONFIG: dict[str, Any] = {
    "mode": "any", "min_window_s": 60,
    "signals": {"sleep": {"start": "23:00", "end": "07:00"}, "keyboard": {"threshold_s": 900}},
}


_TIME_OF_DAY = re.compile(r"^(?:[01]?[0-9]|2[0-4]):[0-5][0-9]$")


def load_config(path: str | None) -> dict[str, Any]:
    """The scheduler configuration in a YAML or JSON file (the :func:`from_config` shape, at the
    top level or under a ``scheduler:`` key); :data:`DEFAULT_CONFIG` when ``path`` is None."""
    if path is None:
        return json.loads(json.dumps(DEFAULT_CONFIG))
    import yaml

    class Loader(yaml.SafeLoader):
        """Reads an unquoted time of day such as 23:00 as text: YAML 1.1 reads it as the
        base-60 number 1380."""

    Loader.yaml_implicit_resolvers = {
        first: list(resolvers)
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for digit in "0123456789":  # ahead of the int resolver
        Loader.yaml_implicit_resolvers[digit].insert(0, ("tag:yaml.org,2002:str", _TIME_OF_DAY))
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=Loader) or {}  # noqa: S506 - a SafeLoader
    except OSError as exc:
        raise ValueError(f"cannot read the scheduler configuration {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"the scheduler configuration {path} is not valid YAML/JSON: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("scheduler"), dict):
        data = data["scheduler"]
    if not isinstance(data, dict):
        raise ValueError(f"the scheduler configuration {path} must be a mapping of settings")
    return data


def _flag(value: Any, what: str) -> bool:
    """A yes/no option: YAML's true or false, never a string (``"false"`` is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {value!r}")
    return value


def from_config(config: dict[str, Any] | None, *, train_step: Callable[[], Any] | None = None,
                store: Any = None, clock: Clock = time.time,
                last_request: Callable[[], float | None] | None = None, lease: Any = None,
                **overrides: Any) -> Scheduler:
    """Build a :class:`Scheduler` from a plain dict (e.g. the ``scheduler:`` block of a config).

    Shape (every key optional)::

        {"mode": "any", "min_window_s": 300, "max_steps": None, "force": False, "poll_s": 5,
         "signals": {"sleep":    {"start": "23:00", "end": "07:00", "tz": "Europe/Berlin"},
                     "keyboard": {"threshold_s": 600},
                     "calendar": {"source": "https://.../basic.ics", "refresh_s": 900},
                     "notebook": {"threshold_s": 600},
                     "proxy":    {"threshold_s": 600}}}

    A signal set to ``false`` / ``None`` or with ``"enabled": false`` is left out. The proxy
    signal reads ``last_request`` if given, else the store's newest turn. ``lease``: see
    :class:`Scheduler`. ``overrides`` replace top-level settings (e.g. ``force=True``).
    Unknown keys raise ValueError naming the key.
    """
    config = dict(config or {})
    config.update(overrides)
    unknown = sorted(set(config) - set(_SETTINGS))
    if unknown:
        raise ValueError(f"unknown scheduler setting {unknown[0]!r}; expected one of "
                         f"{', '.join(_SETTINGS)}")
    configured = config.get("signals") or {}
    if not isinstance(configured, dict):
        raise ValueError("scheduler 'signals' must map signal names (sleep, keyboard, calendar, "
                         "notebook, proxy) to their options")
    signals: list[Signal] = []
    for kind, options in configured.items():
        if kind not in SIGNAL_TYPES:
            raise ValueError(f"unknown scheduler signal {kind!r}; choose from "
                             f"{', '.join(SIGNAL_TYPES)}")
        if options is False or options is None:
            continue
        if options is not True and not isinstance(options, dict):
            raise ValueError(f"the {kind} signal's options must be a mapping, true or false, "
                             f"got {options!r}")
        options = {} if options is True else dict(options)
        if not _flag(options.pop("enabled", True), f"the {kind} signal's 'enabled'"):
            continue
        if kind == "calendar" and "source" not in options:
            raise ValueError("the calendar signal needs a 'source': a path to an .ics file or an "
                             "http(s) iCal URL")
        options.setdefault("clock", clock)
        try:
            if kind == "proxy" and "last_request" not in options and last_request is None \
                    and store is not None:
                signals.append(ProxyIdle.from_store(store, **options))
            else:
                if kind == "proxy" and "last_request" not in options:
                    options["last_request"] = last_request
                signals.append(SIGNAL_TYPES[kind](**options))
        except TypeError as exc:  # said with the options it takes, not Python's words
            import inspect

            taken = [name for name in inspect.signature(SIGNAL_TYPES[kind]).parameters
                     if name not in ("self", "last_request", "clock")]
            unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
            what = f"no option {unknown.group(1)!r}" if unknown else str(exc)
            raise ValueError(f"bad option for the {kind} signal: {what}; it takes "
                             f"{', '.join(taken) or 'none'}") from None
    return Scheduler(signals, train_step=train_step, store=store, clock=clock, lease=lease,
                     mode=config.get("mode", "any"),
                     min_window_s=config.get("min_window_s", 0.0),
                     max_steps=config.get("max_steps"),
                     force=_flag(config.get("force", False), "'force'"),
                     poll_s=config.get("poll_s", 5.0),
                     signal_timeout_s=config.get("signal_timeout_s", 15.0))
