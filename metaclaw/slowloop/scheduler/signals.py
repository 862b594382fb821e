"""Idle signals: each answers "is the user away?" as a :class:`SignalReading`.

Every signal takes an injectable ``clock`` (a callable returning epoch seconds or an aware
``datetime``) so tests can drive time. The calendar signal lives in :mod:`.ical`.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Callable

Clock = Callable[[], "float | datetime"]


def now_ts(clock: Clock) -> float:
    """Read ``clock`` and return epoch seconds; it may return a number or an aware datetime."""
    value = clock()
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("the scheduler clock returned a naive datetime; return an aware "
                             "datetime or epoch seconds")
        return value.timestamp()
    return float(value)


def _zone(tz: str | None):
    """A ``ZoneInfo`` for an IANA name (None means the machine's local zone)."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if tz is not None and not isinstance(tz, str):
        raise ValueError(f"the time zone must be an IANA name such as 'Europe/Berlin' or "
                         f"'UTC', got {tz!r}")
    if tz is None or tz == "local":
        try:
            from dateutil.tz import tzlocal  # follows daylight saving time
        except ImportError:  # pragma: no cover - dateutil comes with icalendar
            return datetime.now().astimezone().tzinfo
        return tzlocal()
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {tz!r}; use an IANA name such as "
                         f"'Europe/Berlin' or 'UTC'") from None


def _seconds(value: Any, what: str) -> float:
    # YAML reads `yes` as True, which float() would take as 1 second
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    # NaN compares false with everything: a NaN threshold would silently never read idle
    if not math.isfinite(number):
        raise ValueError(f"{what} must be a finite number of seconds, got {value!r}")
    if number < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return number


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}min"
    return f"{seconds / 3600:.1f}h"


@dataclass(frozen=True)
class SignalReading:
    """One signal's answer: is it ``available``, does it say ``idle``, and why (``detail``)."""

    name: str
    available: bool
    idle: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Signal:
    """Base class: subclasses implement :meth:`reading`; :meth:`close` releases resources."""

    name = "signal"

    def reading(self) -> SignalReading:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _read(self, available: bool, idle: bool, detail: str) -> SignalReading:
        return SignalReading(self.name, available, idle if available else False, detail)


# -- sleep window ---------------------------------------------------------------------------------
def _parse_hhmm(value: str, what: str, *, end_of_day: bool = False) -> int:
    """Minutes after midnight of an ``"HH:MM"`` string; ``"24:00"`` only where ``end_of_day``."""
    if isinstance(value, int) and not isinstance(value, bool):
        # YAML 1.1 reads an unquoted 23:00 as the base-60 number 1380
        raise ValueError(f"{what} must be a time of day 'HH:MM' (24-hour), got the number "
                         f"{value}; quote the time in YAML, e.g. '23:00'")
    try:
        hours, minutes = str(value).strip().split(":")
        h, m = int(hours), int(minutes)
        if not (0 <= h <= 23 and 0 <= m <= 59) and not (end_of_day and (h, m) == (24, 0)):
            raise ValueError
    except ValueError:
        raise ValueError(f"{what} must be a time of day 'HH:MM' (24-hour), got {value!r}") from None
    return h * 60 + m


class SleepWindow(Signal):
    """Idle while the local time (in ``tz``) is within [start, end); the window may wrap midnight.

    ``start`` / ``end`` are ``"HH:MM"`` strings (``end`` may be ``"24:00"``, so ``"00:00"`` to
    ``"24:00"`` is the whole day); ``tz`` an IANA zone name (None = machine zone).
    """

    def __init__(self, start: str = "23:00", end: str = "07:00", tz: str | None = None, *,
                 clock: Clock = time.time, name: str = "sleep"):
        self.start, self.end, self.tz_name = start, end, tz
        self._start = _parse_hhmm(start, "the sleep window start")
        self._end = _parse_hhmm(end, "the sleep window end", end_of_day=True)
        if self._start == self._end:
            raise ValueError(f"the sleep window start and end are both {start!r}; give two "
                             f"different times ('00:00' to '24:00' for the whole day)")
        self.tz = _zone(tz)
        self.clock, self.name = clock, name

    def contains(self, when: datetime) -> bool:
        """True if the aware datetime ``when`` falls inside the window (in this signal's zone)."""
        local = when.astimezone(self.tz)
        minute = local.hour * 60 + local.minute
        if self._start < self._end:
            return self._start <= minute < self._end
        return minute >= self._start or minute < self._end

    def reading(self) -> SignalReading:
        local = datetime.fromtimestamp(now_ts(self.clock), self.tz)
        inside = self.contains(local)
        zone = self.tz_name or "local time"
        detail = (f"{local:%H:%M} {zone} is {'inside' if inside else 'outside'} "
                  f"{self.start}-{self.end}")
        return self._read(True, inside, detail)


# -- keyboard / mouse idle ------------------------------------------------------------------------
class KeyboardIdle(Signal):
    """Idle when there has been no keyboard or mouse input for ``threshold_s`` seconds.

    How the last input time is found (first that works, probed on the first reading):

    1. ``last_input``: a callable returning the epoch seconds of the last input (tests, custom
       platforms);
    2. pynput keyboard and mouse listeners (needs a display on Linux; imported lazily, because
       pynput raises ImportError at import time without one). Until the first event, the time the
       listeners started counts as the last input;
    3. the X screensaver extension's idle time via python-xlib;
    4. ``xprintidle`` if it is on PATH.

    If none works the signal reads ``available=False`` with the reasons, and the combination rule
    ignores it. ``backend`` may force one of ``"pynput"``, ``"xscreensaver"``, ``"xprintidle"``.
    """

    BACKENDS = ("pynput", "xscreensaver", "xprintidle")

    def __init__(self, threshold_s: float = 600.0, *, clock: Clock = time.time,
                 last_input: Callable[[], float | None] | None = None,
                 backend: str = "auto", name: str = "keyboard"):
        self.threshold_s = _seconds(threshold_s, "the keyboard idle threshold")
        if backend != "auto" and backend not in self.BACKENDS:
            raise ValueError(f"unknown keyboard backend {backend!r}; choose 'auto' or one of "
                             f"{', '.join(self.BACKENDS)}")
        self.clock, self.name, self.backend = clock, name, backend
        self._last_input_fn = last_input
        self._probed = last_input is not None
        self.method: str | None = "injected" if last_input is not None else None
        self.unavailable_reason = ""
        self._listeners: list[Any] = []
        self._last_event: float | None = None
        self._xdisplay: Any = None

    # probing ------------------------------------------------------------------------------
    def _probe(self) -> None:
        self._probed = True
        order = self.BACKENDS if self.backend == "auto" else (self.backend,)
        reasons = []
        for method in order:
            try:
                getattr(self, f"_start_{method}")()
            except Exception as exc:  # noqa: BLE001 - each failure becomes part of the reason
                reasons.append(f"{method}: {_short(exc)}")
                continue
            self.method = method
            return
        self.unavailable_reason = "; ".join(reasons)

    def _start_pynput(self) -> None:
        if sys.platform.startswith("linux") and not os.environ.get("DISPLAY"):
            raise RuntimeError("no X display (DISPLAY is not set)")
        from pynput import keyboard, mouse  # lazy: raises ImportError without a display

        def touched(*_args: Any) -> None:
            self._last_event = now_ts(self.clock)

        listeners = [keyboard.Listener(on_press=touched, on_release=touched),
                     mouse.Listener(on_move=touched, on_click=touched, on_scroll=touched)]
        for listener in listeners:
            if getattr(listener, "IS_TRUSTED", True) is False:  # macOS without permission
                raise RuntimeError("this process may not monitor input; allow it under System "
                                   "Settings > Privacy & Security > Input Monitoring")
            listener.daemon = True
            listener.start()
            waiter = threading.Thread(target=listener.wait, daemon=True)
            waiter.start()
            waiter.join(3.0)
            if waiter.is_alive() or not listener.is_alive():
                for started in listeners:
                    started.stop()
                raise RuntimeError("the input listener did not start")
        self._listeners = listeners
        self._last_event = now_ts(self.clock)

    def _start_xscreensaver(self) -> None:
        if not os.environ.get("DISPLAY"):
            raise RuntimeError("no X display (DISPLAY is not set)")
        from Xlib import display

        xdisplay = display.Display()
        if not xdisplay.has_extension("MIT-SCREEN-SAVER"):
            xdisplay.close()
            raise RuntimeError("the X server lacks the MIT-SCREEN-SAVER extension")
        self._xdisplay = xdisplay
        self._xscreensaver_idle()

    def _xscreensaver_idle(self) -> float:
        info = self._xdisplay.screen().root.screensaver_query_info()
        return info.idle / 1000.0

    def _start_xprintidle(self) -> None:
        if shutil.which("xprintidle") is None:
            raise RuntimeError("xprintidle is not on PATH")
        self._xprintidle_idle()

    @staticmethod
    def _xprintidle_idle() -> float:
        out = subprocess.run(["xprintidle"], capture_output=True, text=True, timeout=5, check=True)
        return int(out.stdout.strip()) / 1000.0

    # reading ------------------------------------------------------------------------------
    def idle_seconds(self) -> float | None:
        """Seconds since the last input, or None when no method is available."""
        if not self._probed:
            self._probe()
        now = now_ts(self.clock)
        if self.method == "injected":
            last = self._last_input_fn()
            return None if last is None else max(0.0, now - float(last))
        if self.method == "pynput":
            return max(0.0, now - (self._last_event or now))
        if self.method == "xscreensaver":
            return self._xscreensaver_idle()
        if self.method == "xprintidle":
            return self._xprintidle_idle()
        return None

    def reading(self) -> SignalReading:
        try:
            idle_for = self.idle_seconds()
        except Exception as exc:  # noqa: BLE001 - a broken query must not stop the scheduler
            return self._read(False, False, f"unavailable: {self.method} failed: {_short(exc)}")
        if idle_for is None:
            why = self.unavailable_reason or "no input has been recorded yet"
            return self._read(False, False, f"unavailable: {why}")
        idle = idle_for >= self.threshold_s
        return self._read(True, idle, f"no input for {_fmt_duration(idle_for)} "
                                      f"(threshold {_fmt_duration(self.threshold_s)}, "
                                      f"via {self.method})")

    def close(self) -> None:
        for listener in self._listeners:
            listener.stop()
        for listener in self._listeners:  # on X a listener thread ends at its next event
            listener.join(0.2)
        self._listeners = []
        if self._xdisplay is not None:
            self._xdisplay.close()
            self._xdisplay = None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# -- notebook and proxy ---------------------------------------------------------------------------
class NotebookIdle(Signal):
    """Idle when no notebook cell has run for ``threshold_s`` seconds and none is running.

    Fed by IPython's ``pre_run_cell`` / ``post_run_cell`` events: call :meth:`attach` with the
    shell (``get_ipython()``), or call :meth:`notify_activity` from any other front end. Before
    either happens the signal is unavailable.
    """

    def __init__(self, threshold_s: float = 600.0, *, clock: Clock = time.time,
                 name: str = "notebook"):
        self.threshold_s = _seconds(threshold_s, "the notebook idle threshold")
        self.clock, self.name = clock, name
        self.last_activity: float | None = None
        self.running = False
        self._shells: list[Any] = []

    def notify_activity(self) -> None:
        """Record user activity now."""
        self.last_activity = now_ts(self.clock)

    def _pre_run_cell(self, *_args: Any) -> None:
        self.running = True
        self.notify_activity()

    def _post_run_cell(self, *_args: Any) -> None:
        self.running = False
        self.notify_activity()

    def attach(self, ipython: Any) -> None:
        """Register the cell callbacks on an IPython shell (anything with ``.events``)."""
        ipython.events.register("pre_run_cell", self._pre_run_cell)
        ipython.events.register("post_run_cell", self._post_run_cell)
        self._shells.append(ipython)
        if self.last_activity is None:
            self.notify_activity()

    def detach(self, ipython: Any) -> None:
        """Unregister the callbacks from a shell previously attached."""
        if ipython in self._shells:
            ipython.events.unregister("pre_run_cell", self._pre_run_cell)
            ipython.events.unregister("post_run_cell", self._post_run_cell)
            self._shells.remove(ipython)

    def close(self) -> None:
        for shell in list(self._shells):
            self.detach(shell)

    def reading(self) -> SignalReading:
        if self.last_activity is None:
            return self._read(False, False, "unavailable: not attached to a notebook kernel "
                                            "(call attach(get_ipython()))")
        if self.running:
            return self._read(True, False, "a cell is running")
        idle_for = max(0.0, now_ts(self.clock) - self.last_activity)
        return self._read(True, idle_for >= self.threshold_s,
                          f"no cell run for {_fmt_duration(idle_for)} "
                          f"(threshold {_fmt_duration(self.threshold_s)})")


class ProxyIdle(Signal):
    """Idle when the proxy has served no request for ``threshold_s`` seconds.

    ``last_request`` returns the epoch seconds of the latest proxied request, or None if there
    was none yet (then the time since this signal was created counts). Without ``last_request``
    the signal is unavailable. :meth:`from_store` reads a workspace store: its latest turn, or a
    request still in flight there (every proxy reports one every few seconds while it runs).
    """

    def __init__(self, threshold_s: float = 600.0, last_request: Callable[[], float | None] | None
                 = None, *, clock: Clock = time.time, name: str = "proxy"):
        self.threshold_s = _seconds(threshold_s, "the proxy idle threshold")
        self.last_request, self.clock, self.name = last_request, clock, name
        self.created = now_ts(clock)

    @classmethod
    def from_store(cls, store: Any, threshold_s: float = 600.0, **kwargs: Any) -> "ProxyIdle":
        """A proxy signal reading :meth:`~metaclaw.store.Store.last_proxy_activity` of a
        :class:`Store`: its newest turn, or a request in flight since."""
        def last_request() -> float | None:
            return store.last_proxy_activity()

        return cls(threshold_s, last_request, **kwargs)

    def reading(self) -> SignalReading:
        if self.last_request is None:
            return self._read(False, False, "unavailable: not connected to a proxy")
        try:
            last = self.last_request()
        except Exception as exc:  # noqa: BLE001
            return self._read(False, False, f"unavailable: {_short(exc)}")
        since = self.created if last is None else float(last)
        idle_for = max(0.0, now_ts(self.clock) - since)
        what = "no proxied request yet" if last is None else "last proxied request"
        return self._read(True, idle_for >= self.threshold_s,
                          f"{what} {_fmt_duration(idle_for)} ago "
                          f"(threshold {_fmt_duration(self.threshold_s)})")
