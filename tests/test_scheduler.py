"""Tests for the idle-gated training scheduler (metaclaw.slowloop.scheduler), driven by a fake clock."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from metaclaw.slowloop.scheduler import ical
from metaclaw.slowloop.scheduler.ical import CalendarBusy, busy_events, parse_calendar
from metaclaw.slowloop.scheduler.machine import Scheduler, from_config, load_config
from metaclaw.slowloop.scheduler.signals import (KeyboardIdle, NotebookIdle, ProxyIdle, Signal,
                                                 SignalReading, SleepWindow)
from metaclaw.store import Store
import waiting

BERLIN = ZoneInfo("Europe/Berlin")


class FakeClock:
    """A settable clock returning epoch seconds."""

    def __init__(self, t: float | datetime = 1_800_000_000.0):
        self.t = t.timestamp() if isinstance(t, datetime) else float(t)

    def __call__(self) -> float:
        return self.t

    def set(self, when: datetime) -> None:
        self.t = when.timestamp()

    def advance(self, seconds: float) -> None:
        self.t += seconds


def berlin(*args: int) -> datetime:
    return datetime(*args, tzinfo=BERLIN)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=timezone.utc)


wait_until = functools.partial(waiting.wait_until, timeout=10.0, interval=0.005)


# -- sleep window ---------------------------------------------------------------------------------
def test_sleep_window_wraps_midnight_in_its_time_zone():
    clock = FakeClock()
    sleep = SleepWindow("23:00", "07:00", "Europe/Berlin", clock=clock)
    cases = [  # (UTC instant, idle?) in winter, Berlin = UTC+1
        (utc(2026, 11, 22, 21, 59), False),   # 22:59 Berlin
        (utc(2026, 11, 22, 22, 0), True),     # 23:00 Berlin, start is inclusive
        (utc(2026, 11, 23, 1, 30), True),     # 02:30 Berlin, after midnight
        (utc(2026, 11, 23, 5, 59), True),     # 06:59 Berlin
        (utc(2026, 11, 23, 6, 0), False),     # 07:00 Berlin, end is exclusive
        (utc(2026, 7, 1, 21, 30), True),      # summer, Berlin = UTC+2: 23:30
        (utc(2026, 7, 1, 20, 30), False),     # 22:30 Berlin
    ]
    for instant, expected in cases:
        clock.set(instant)
        reading = sleep.reading()
        assert reading.available and reading.idle is expected, (instant, reading)
    clock.set(utc(2026, 11, 22, 22, 30))
    assert "23:30 Europe/Berlin is inside 23:00-07:00" in sleep.reading().detail
    # the same instant is 22:30 in UTC, outside the window there
    assert not SleepWindow("23:00", "07:00", "UTC", clock=clock).reading().idle
    # a window that does not wrap, and a clock returning an aware datetime
    lunch = SleepWindow("12:00", "13:00", "Asia/Tokyo",
                        clock=lambda: datetime(2026, 11, 22, 3, 15, tzinfo=timezone.utc))
    assert lunch.reading().idle  # 12:15 in Tokyo
    noon_utc = SleepWindow("12:00", "13:00", "UTC", clock=lambda: utc(2026, 11, 22, 3, 15))
    assert not noon_utc.reading().idle


@pytest.mark.parametrize("kwargs, message", [
    ({"start": "25:00"}, "HH:MM"),
    ({"end": "seven"}, "HH:MM"),
    ({"tz": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
    ({"start": "07:00", "end": "07:00"}, "two different times"),
])
def test_sleep_window_bad_input_is_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SleepWindow(**{"start": "23:00", "end": "07:00", "tz": "UTC", **kwargs})


def test_naive_datetime_clock_is_refused_clearly():
    sleep = SleepWindow("23:00", "07:00", "UTC", clock=lambda: datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="naive datetime"):
        sleep.reading()


# -- keyboard -------------------------------------------------------------------------------------
def test_keyboard_idle_from_injected_last_input():
    clock = FakeClock(1000.0)
    last = {"t": 1000.0}
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])
    assert keyboard.reading() == SignalReading("keyboard", True, False, keyboard.reading().detail)
    clock.advance(59)
    assert not keyboard.reading().idle
    clock.advance(1)
    reading = keyboard.reading()
    assert reading.available and reading.idle and "no input for 60s" in reading.detail
    last["t"] = clock.t  # the user types
    assert not keyboard.reading().idle


def test_keyboard_without_display_is_unavailable_with_reasons(monkeypatch, tmp_path):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no xprintidle either
    keyboard = KeyboardIdle(60, clock=FakeClock())
    reading = keyboard.reading()
    assert reading.available is False and reading.idle is False
    assert "no X display" in reading.detail and "xprintidle is not on PATH" in reading.detail
    # the combination rule ignores it, and says so
    clock = FakeClock(utc(2026, 11, 22, 23, 30))
    scheduler = Scheduler([keyboard, SleepWindow("23:00", "07:00", "UTC", clock=clock)],
                          clock=clock)
    idle, reason = scheduler.combine(scheduler.readings())
    assert idle and "ignored (unavailable): keyboard" in reason
    # a forced backend that cannot work is unavailable too
    assert not KeyboardIdle(60, backend="xscreensaver").reading().available
    with pytest.raises(ValueError, match="unknown keyboard backend"):
        KeyboardIdle(60, backend="evdev")


def _fake_input(display_name: str) -> None:
    """Type one key and move the pointer on an X display through the XTEST extension."""
    from Xlib import X, XK, display
    from Xlib.ext import xtest

    xdisplay = display.Display(display_name)
    try:
        keycode = xdisplay.keysym_to_keycode(XK.string_to_keysym("a"))
        xtest.fake_input(xdisplay, X.KeyPress, keycode)
        xtest.fake_input(xdisplay, X.KeyRelease, keycode)
        xtest.fake_input(xdisplay, X.MotionNotify, x=20, y=30)
        xdisplay.sync()
    finally:
        xdisplay.close()


@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb is not installed")
def test_keyboard_listeners_and_screensaver_query_under_xvfb(monkeypatch):
    read_end, write_end = os.pipe()  # Xvfb picks a free display number and writes it here
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", "640x480x24",
                               "-noreset", "-nolisten", "tcp"], pass_fds=(write_end,),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            display_name = ":" + pipe.readline().strip()
        assert display_name != ":", "Xvfb did not start"
        monkeypatch.setenv("DISPLAY", display_name)
        clock = FakeClock(500.0)
        keyboard = KeyboardIdle(30, clock=clock)  # auto: pynput comes first
        try:
            reading = keyboard.reading()
            assert reading.available, reading.detail
            assert "via pynput" in reading.detail and not reading.idle
            clock.advance(31)
            assert keyboard.reading().idle
            _fake_input(display_name)  # the user presses a key: the listener sees it
            wait_until(lambda: keyboard._last_event == clock.t)
            assert not keyboard.reading().idle
        finally:
            listeners = list(keyboard._listeners)
            keyboard.close()
            _fake_input(display_name)  # lets the stopped listener threads return
            for listener in listeners:
                listener.join(5)
            assert not any(listener.is_alive() for listener in listeners)

        screensaver = KeyboardIdle(3600, backend="xscreensaver")
        try:
            reading = screensaver.reading()
            assert reading.available and not reading.idle and "via xscreensaver" in reading.detail
        finally:
            screensaver.close()
    finally:
        server.terminate()
        server.wait(10)


# -- calendar -------------------------------------------------------------------------------------
ICS = """BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//metaclaw tests//EN
BEGIN:VEVENT
UID:weekly-sync
SUMMARY:Weekly sync
DTSTART;TZID=Europe/Berlin:20261102T100000
DTEND;TZID=Europe/Berlin:20261102T110000
RRULE:FREQ=WEEKLY;BYDAY=MO
EXDATE;TZID=Europe/Berlin:20261116T100000
END:VEVENT
BEGIN:VEVENT
UID:weekly-sync
RECURRENCE-ID;TZID=Europe/Berlin:20261130T100000
SUMMARY:Weekly sync (moved)
DTSTART;TZID=Europe/Berlin:20261130T120000
DTEND;TZID=Europe/Berlin:20261130T130000
END:VEVENT
BEGIN:VEVENT
UID:dentist
SUMMARY:Dentist
DTSTART:20261123T130000Z
DTEND:20261123T140000Z
END:VEVENT
BEGIN:VEVENT
UID:conference
SUMMARY:Conference
DTSTART;VALUE=DATE:20261125
DTEND;VALUE=DATE:20261126
END:VEVENT
BEGIN:VEVENT
UID:focus
SUMMARY:Focus time (free)
TRANSP:TRANSPARENT
DTSTART:20261124T090000Z
DTEND:20261124T100000Z
END:VEVENT
BEGIN:VEVENT
UID:cancelled
SUMMARY:Cancelled
STATUS:CANCELLED
DTSTART:20261124T120000Z
DTEND:20261124T130000Z
END:VEVENT
END:VCALENDAR
"""

CALENDAR_CASES = [
    (berlin(2026, 11, 2, 9, 30), None),                    # before the series starts
    (berlin(2026, 11, 2, 10, 0), "Weekly sync"),            # first occurrence, start inclusive
    (berlin(2026, 11, 9, 10, 30), "Weekly sync"),           # recurring, week 2
    (berlin(2026, 11, 9, 11, 0), None),                     # end exclusive
    (berlin(2026, 11, 16, 10, 30), None),                   # EXDATE
    (berlin(2026, 11, 23, 10, 30), "Weekly sync"),          # recurring again after the EXDATE
    (berlin(2026, 11, 23, 14, 30), "Dentist"),              # one-off event (given in UTC)
    (berlin(2026, 11, 23, 15, 30), None),
    (berlin(2026, 11, 24, 10, 30), None),                   # transparent (free) event
    (berlin(2026, 11, 24, 13, 30), None),                   # cancelled event
    (berlin(2026, 11, 25, 0, 30), "Conference"),            # all-day event, local midnight
    (berlin(2026, 11, 25, 23, 30), "Conference"),
    (berlin(2026, 11, 26, 0, 30), None),
    (berlin(2026, 11, 30, 10, 30), None),                   # this instance was moved ...
    (berlin(2026, 11, 30, 12, 30), "Weekly sync (moved)"),  # ... to noon
    (berlin(2027, 3, 29, 10, 30), "Weekly sync"),           # after the switch to summer time
    (berlin(2027, 3, 29, 11, 30), None),
]


def test_parse_calendar_busy_events():
    series = parse_calendar(ICS, BERLIN)
    for when, expected in CALENDAR_CASES:
        names = [name for name, _end in busy_events(series, when)]
        assert names == ([expected] if expected else []), when


def test_calendar_signal_from_file(tmp_path):
    path = tmp_path / "basic.ics"
    path.write_text(ICS)
    clock = FakeClock()
    calendar = CalendarBusy(path, refresh_s=900, tz="Europe/Berlin", clock=clock)
    for when, expected in CALENDAR_CASES:
        clock.set(when)
        reading = calendar.reading()
        assert reading.available and reading.idle is bool(expected), (when, reading)
        if expected:
            assert reading.detail.startswith(f"busy: {expected} until")
    clock.set(berlin(2026, 11, 9, 10, 30))
    assert calendar.reading().detail == "busy: Weekly sync until 2026-11-09 11:00"


def test_calendar_bad_sources_are_unavailable_with_a_reason(tmp_path):
    missing = CalendarBusy(tmp_path / "nope.ics", clock=FakeClock(), tz="UTC")
    reading = missing.reading()
    assert not reading.available and "could not load the calendar" in reading.detail
    garbage = tmp_path / "garbage.ics"
    garbage.write_text("this is not a calendar")
    reading = CalendarBusy(garbage, clock=FakeClock(), tz="UTC").reading()
    assert not reading.available and "not a valid iCalendar document" in reading.detail
    with pytest.raises(ValueError, match="calendar source is empty"):
        CalendarBusy("  ")
    with pytest.raises(ValueError, match="must be a path .* got int 5"):
        from_config({"signals": {"calendar": {"source": 5}}})


class _CalendarServer:
    """A real HTTP server on 127.0.0.1 serving an iCalendar body, or failing on demand."""

    def __init__(self, body: str):
        self.body, self.fail, self.requests = body, False, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                outer.requests += 1
                if outer.fail or self.path != "/calendar/ical/secret-token/basic.ics":
                    self.send_error(500 if outer.fail else 404)
                    return
                data = outer.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/calendar; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = (f"http://127.0.0.1:{self.server.server_address[1]}"
                    f"/calendar/ical/secret-token/basic.ics")

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_calendar_from_url_refreshes_and_keeps_last_good_on_failure():
    server = _CalendarServer(ICS)
    try:
        clock = FakeClock(berlin(2026, 11, 9, 10, 30))
        calendar = CalendarBusy(server.url, refresh_s=600, tz="Europe/Berlin", clock=clock)
        assert calendar.reading().idle and server.requests == 1
        clock.advance(60)
        assert calendar.reading().idle and server.requests == 1  # not refreshed yet

        server.fail = True
        clock.advance(600)  # 10:41, still inside the meeting
        reading = calendar.reading()
        assert server.requests == 2
        assert reading.available and reading.idle
        assert "using the last good calendar" in reading.detail and "500" in reading.detail
        assert "secret-token" not in reading.detail  # the private address is not printed
        assert calendar.last_error

        # the calendar changes upstream: the meeting is removed; the next refresh picks it up
        server.fail = False
        server.body = ICS.replace("RRULE:FREQ=WEEKLY;BYDAY=MO", "RRULE:FREQ=WEEKLY;BYDAY=TU")
        clock.advance(600)
        reading = calendar.reading()
        assert server.requests == 3 and calendar.last_error is None
        assert reading.available and not reading.idle and "free" in reading.detail
    finally:
        server.close()


def test_calendar_url_that_never_loaded_is_unavailable_then_retried():
    server = _CalendarServer(ICS)
    server.fail = True
    try:
        clock = FakeClock(berlin(2026, 11, 9, 10, 30))
        calendar = CalendarBusy(server.url, refresh_s=3600, tz="Europe/Berlin", clock=clock)
        reading = calendar.reading()
        assert not reading.available and "HTTP Error 500" in reading.detail
        server.fail = False
        clock.advance(30)
        assert not calendar.reading().available and server.requests == 1
        clock.advance(30)  # nothing loaded yet: retried after a minute, not after refresh_s
        assert calendar.reading().idle and server.requests == 2
    finally:
        server.close()


# -- notebook and proxy ---------------------------------------------------------------------------
class _Shell:
    """Holds IPython's real event manager, as ``get_ipython()`` does."""

    def __init__(self):
        from IPython.core.events import EventManager, available_events

        self.events = EventManager(self, available_events)


def test_notebook_idle_follows_ipython_cell_events():
    clock = FakeClock(100.0)
    notebook = NotebookIdle(300, clock=clock)
    assert not notebook.reading().available
    shell = _Shell()
    notebook.attach(shell)
    assert notebook.reading().available and not notebook.reading().idle
    clock.advance(100)
    shell.events.trigger("pre_run_cell", None)   # a long cell starts
    clock.advance(1000)
    reading = notebook.reading()
    assert reading.available and not reading.idle and reading.detail == "a cell is running"
    shell.events.trigger("post_run_cell", None)  # and ends
    clock.advance(299)
    assert not notebook.reading().idle
    clock.advance(1)
    assert notebook.reading().idle
    notebook.notify_activity()
    assert not notebook.reading().idle
    notebook.detach(shell)
    shell.events.trigger("pre_run_cell", None)
    assert not notebook.running


def test_proxy_idle_from_callable_and_from_store(tmp_path):
    clock = FakeClock(1000.0)
    assert not ProxyIdle(60, clock=clock).reading().available
    last = {"t": None}
    proxy = ProxyIdle(60, lambda: last["t"], clock=clock)
    assert not proxy.reading().idle               # no request yet, created just now
    clock.advance(61)
    assert proxy.reading().idle
    last["t"] = clock.t
    assert not proxy.reading().idle
    with Store(tmp_path / "ws.db") as store:
        from_store = ProxyIdle.from_store(store, 60)  # real clock
        assert not from_store.reading().idle
        store.record_turn(session_id="s", request_messages=[], status="ok")
        reading = from_store.reading()
        assert reading.available and not reading.idle and "last proxied request" in reading.detail
        store.execute("UPDATE turns SET created_at = created_at - 120")
        assert from_store.reading().idle


def test_a_reply_still_running_is_proxy_activity_in_every_process(tmp_path, monkeypatch):
    """A turn is recorded when its reply ends. A reply that runs longer than the idle threshold
    must not read as idle time: the proxy reports a request in flight to the workspace every few
    seconds, and the signal (on another connection, as another process has it) reads it."""
    import openai

    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import SkillLibrary

    monkeypatch.setattr(Proxy, "ACTIVITY_EVERY_S", 0.1)
    db = tmp_path / "ws.db"
    double = DoubleServer().start()
    store = Store(db)
    proxy = Proxy(ProxyConfig(upstream_url=double.url, retrieval="lexical", max_retries=0),
                  store, SkillLibrary(tmp_path / "skills", store)).start()
    try:
        with Store(db) as other:
            signal = ProxyIdle.from_store(other, 1.0)
            store.record_turn(session_id="earlier", request_messages=[], status="ok")
            store.execute("UPDATE turns SET created_at = created_at - 120")
            assert signal.reading().idle  # the last turn ended two minutes ago
            double.add(Reply("a long answer", delay=2.5))
            client = openai.OpenAI(base_url=proxy.url, api_key="k", max_retries=0, timeout=30)
            answer = threading.Thread(target=client.chat.completions.create, kwargs={
                "model": "m", "messages": [{"role": "user", "content": "think long"}]})
            answer.start()
            time.sleep(1.6)  # past the threshold, the reply still running
            reading = signal.reading()
            assert answer.is_alive() and not reading.idle, reading.detail
            answer.join(30)
            proxy.flush()
            assert len(other.query("SELECT id FROM turns")) == 2
        proxy.stop()
        assert store.query("SELECT * FROM proxy_activity") == []  # a stopped proxy's row goes
    finally:
        proxy.stop()
        double.stop()
        store.close()


# -- combination ----------------------------------------------------------------------------------
def test_combination_rules_any_and_all():
    clock = FakeClock(utc(2026, 11, 22, 23, 30))
    last = {"t": clock.t}
    sleep = SleepWindow("23:00", "07:00", "UTC", clock=clock)
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])
    proxy = ProxyIdle(60, clock=clock)  # unavailable: no proxy connected
    any_rule = Scheduler([sleep, keyboard, proxy], mode="any", clock=clock)
    all_rule = Scheduler([sleep, keyboard, proxy], mode="all", clock=clock)

    idle, reason = any_rule.combine(any_rule.readings())
    assert idle and "idle: sleep" in reason and "active: keyboard" in reason
    assert "ignored (unavailable): proxy" in reason
    assert not all_rule.combine(all_rule.readings())[0]
    clock.advance(120)  # keyboard idle too
    assert all_rule.combine(all_rule.readings())[0]
    clock.set(utc(2026, 11, 23, 12, 0))  # daytime, keyboard idle for hours
    assert any_rule.combine(any_rule.readings())[0]
    assert not all_rule.combine(all_rule.readings())[0]
    # no available signal: never idle
    nothing = Scheduler([proxy], clock=clock)
    assert nothing.combine(nothing.readings()) == (
        False, "no signal is available; ignored (unavailable): proxy")
    with pytest.raises(ValueError, match="choose 'any' or 'all'"):
        Scheduler([sleep], mode="most")
    with pytest.raises(ValueError, match="distinct name"):
        Scheduler([sleep, SleepWindow("01:00", "02:00", "UTC")])


# -- the state machine ----------------------------------------------------------------------------
class GatedTrainer:
    """A real (tiny) optimizer: one gradient step on (w - 3)^2 per call, each call waiting for a
    permit so the test decides when a step finishes."""

    def __init__(self, scheduler_ref: dict):
        self.w, self.calls, self.states_at_entry = 0.0, 0, []
        self.permits = threading.Semaphore(0)
        self.ref = scheduler_ref

    def step(self) -> dict:
        self.calls += 1
        self.states_at_entry.append(self.ref["scheduler"].state)
        assert self.permits.acquire(timeout=10), "the test never released this step"
        grad = 2 * (self.w - 3.0)
        self.w -= 0.25 * grad
        return {"loss": (self.w - 3.0) ** 2}


def test_a_user_back_during_a_step_stops_training_at_that_steps_boundary(tmp_path):
    """The next step started at once after one whose user came back: the signals were read
    only at the next poll (every 5 s), so a whole step more ran while the user worked."""
    clock = FakeClock(10_000.0)
    last = {"t": clock.t - 600}
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])

    def step():
        last["t"] = clock.t  # the user returns while this step runs
        return {"loss": 1.0}

    scheduler = Scheduler([keyboard], train_step=step, min_window_s=0, clock=clock,
                          store=Store(tmp_path / "ws.db"))
    scheduler.step_number = lambda: 41 + scheduler.steps  # the trainer's own count
    assert scheduler.tick() == "training"
    assert "starting at step 41" in scheduler.transitions[-1].reason
    assert scheduler.wait_for_training(10)
    assert scheduler.steps == 1  # no poll came between: the boundary read the signals
    assert scheduler.tick() == "waiting"
    assert "after step 41" in scheduler.transitions[-1].reason


def test_full_state_machine_pause_and_resume(tmp_path):
    clock = FakeClock(10_000.0)
    last = {"t": clock.t}
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])
    ref: dict = {}
    trainer = GatedTrainer(ref)
    store = Store(tmp_path / "ws.db")
    scheduler = Scheduler([keyboard], train_step=trainer.step, min_window_s=30, store=store,
                          clock=clock)
    ref["scheduler"] = scheduler

    assert scheduler.tick() == "waiting" and scheduler.transitions == []
    clock.advance(61)
    assert scheduler.tick() == "window_open"        # idle, but not for min_window_s yet
    clock.advance(10)
    last["t"] = clock.t                              # user back before training started
    assert scheduler.tick() == "waiting"
    assert trainer.calls == 0

    clock.advance(61)
    assert scheduler.tick() == "window_open"
    clock.advance(29)
    assert scheduler.tick() == "window_open"
    clock.advance(1)
    assert scheduler.tick() == "training"
    trainer.permits.release(2)
    wait_until(lambda: scheduler.steps == 2)
    assert scheduler.tick() == "training"           # still idle: keeps training
    w_after_2 = trainer.w
    # (the worker reads the signals at each step boundary: once step 3 has begun, the user's
    # return below lets it finish)
    wait_until(lambda: trainer.calls == 3)

    last["t"] = clock.t                              # the user returns during step 3
    assert scheduler.tick() == "pausing" and scheduler.should_stop()
    assert scheduler.tick() == "pausing"            # step 3 is still running
    trainer.permits.release(1)
    assert scheduler.wait_for_training(10)
    assert scheduler.tick() == "waiting"
    assert scheduler.steps == 3 and trainer.calls == 3  # stopped at the step boundary
    assert abs(trainer.w - 3.0) < abs(w_after_2 - 3.0)
    assert "after step 3" in scheduler.transitions[-1].reason

    clock.advance(60)
    assert scheduler.tick() == "window_open"
    clock.advance(30)
    assert scheduler.tick() == "training"
    assert not scheduler.should_stop()
    trainer.permits.release(2)
    wait_until(lambda: scheduler.steps == 5)        # the counter continues: 4, 5
    wait_until(lambda: trainer.calls == 6)          # step 6 begun
    assert scheduler.last_result["loss"] == pytest.approx((trainer.w - 3.0) ** 2)
    last["t"] = clock.t
    assert scheduler.tick() == "pausing"
    trainer.permits.release(1)
    assert scheduler.wait_for_training(10)
    assert scheduler.tick() == "waiting"
    assert scheduler.steps == 6 and trainer.calls == 6
    assert trainer.w == pytest.approx(3.0 - 3.0 * 0.5 ** 6)  # six real steps, state kept
    assert trainer.states_at_entry == ["training"] * 6  # no step ever began after a pause

    path = [(t.from_state, t.to_state) for t in scheduler.transitions]
    cycle = [("waiting", "window_open"), ("window_open", "training"),
             ("training", "pausing"), ("pausing", "waiting")]
    assert path == [("waiting", "window_open"), ("window_open", "waiting")] + cycle + cycle
    assert "window closed before training started" in scheduler.transitions[1].reason
    assert scheduler.transitions[2].signals["keyboard"]["idle"] is True

    stored = store.frame("scheduler_transitions").sort("id")
    assert list(zip(stored["from_state"], stored["to_state"])) == path
    assert stored["at"].to_list() == [t.at for t in scheduler.transitions]
    frame = scheduler.transitions_frame()
    assert frame.height == len(path) and frame["to_state"].to_list() == [p[1] for p in path]
    assert '"keyboard"' in frame["signals"][0]
    store.close()


def test_training_never_starts_while_active_unless_forced():
    clock = FakeClock(5000.0)
    last = {"t": clock.t}
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])
    w = {"value": 1.0, "steps": 0}

    def step():
        w["value"] *= 0.5
        w["steps"] += 1

    scheduler = Scheduler([keyboard], train_step=step, clock=clock, max_steps=3)
    for _ in range(3):
        clock.advance(10)
        last["t"] = clock.t
        assert scheduler.tick() == "waiting"
    assert w["steps"] == 0

    scheduler.force = True
    assert scheduler.tick() == "training"           # waiting -> window_open -> training at once
    assert scheduler.transitions[0].reason.startswith("forced")
    assert scheduler.wait_for_training(10)
    assert scheduler.tick() == "waiting"            # the user is active, yet nothing paused it
    assert w["steps"] == 3 == scheduler.steps
    assert "step budget of 3 reached" in scheduler.transitions[-1].reason
    assert scheduler.force is False                 # a forced run is used up
    clock.advance(120)                              # idle now, but the budget is spent
    assert scheduler.tick() == "waiting" and w["steps"] == 3


def test_nothing_to_train_and_failures_end_the_run_until_the_user_returns():
    clock = FakeClock(0.0)
    last = {"t": -1000.0}
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])
    outcomes = iter([None, False, RuntimeError("out of memory"), None])

    def step():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    scheduler = Scheduler([keyboard], train_step=step, clock=clock)
    assert scheduler.tick() == "training"
    assert scheduler.wait_for_training(10)
    assert scheduler.tick() == "waiting" and scheduler.steps == 1
    assert "nothing to train" in scheduler.transitions[-1].reason
    assert scheduler.tick() == "waiting"            # same idle period: not reopened
    last["t"] = clock.t                             # user comes and goes
    assert scheduler.tick() == "waiting"
    clock.advance(61)
    assert scheduler.tick() == "training"
    assert scheduler.wait_for_training(10)
    assert scheduler.tick() == "waiting"
    assert "training step 2 failed: RuntimeError: out of memory" in scheduler.transitions[-1].reason
    assert scheduler.status()["last_error"].endswith("out of memory")


def test_run_loop_and_stop_pause_training():
    steps = []

    def step():
        time.sleep(0.01)
        steps.append(len(steps) + 1)

    keyboard = KeyboardIdle(1, last_input=lambda: time.time() - 3600)  # real clock, long idle
    scheduler = Scheduler([keyboard], train_step=step, poll_s=0.02)
    thread = scheduler.run()
    wait_until(lambda: scheduler.steps >= 3)
    assert scheduler.status()["running"] and scheduler.state == "training"
    scheduler.stop(timeout=10)
    assert not thread.is_alive() and scheduler.state == "waiting"
    assert scheduler.steps == len(steps)
    tail = [(t.from_state, t.to_state, t.reason) for t in scheduler.transitions[-2:]]
    assert tail[0] == ("training", "pausing", "scheduler stopped")
    assert tail[1][:2] == ("pausing", "waiting")


def test_status_and_html():
    clock = FakeClock(utc(2026, 11, 22, 23, 30))
    scheduler = Scheduler([SleepWindow("23:00", "07:00", "UTC", clock=clock),
                           NotebookIdle(60, clock=clock)], clock=clock)
    scheduler.tick()
    status = scheduler.status()
    assert status["state"] == "window_open" and status["idle"] is True  # no train_step given
    assert [s["name"] for s in status["signals"]] == ["sleep", "notebook"]
    assert status["signals"][1]["available"] is False
    assert status["transitions"][0]["to_state"] == "window_open"
    clock.set(utc(2026, 11, 23, 8, 0))
    assert scheduler.status()["signals"][0]["idle"] is True          # as of the last tick
    assert scheduler.status(refresh=True)["signals"][0]["idle"] is False
    html = scheduler._repr_html_()
    assert "window_open" in html and "unavailable" in html and "<table>" in html


# -- configuration --------------------------------------------------------------------------------
def test_from_config_builds_signals(tmp_path):
    path = tmp_path / "cal.ics"
    path.write_text(ICS)
    clock = FakeClock(berlin(2026, 11, 9, 10, 30))
    with Store(tmp_path / "ws.db") as store:
        scheduler = from_config({
            "mode": "all", "min_window_s": 120, "max_steps": 7,
            "signals": {
                "sleep": {"start": "22:00", "end": "06:00", "tz": "Europe/Berlin"},
                "calendar": {"source": str(path), "refresh_s": 60, "tz": "Europe/Berlin"},
                "notebook": {"threshold_s": 300, "enabled": False},
                "keyboard": False,
                "proxy": {"threshold_s": 600},
            }}, store=store, clock=clock)
        assert [s.name for s in scheduler.signals] == ["sleep", "calendar", "proxy"]
        assert (scheduler.mode, scheduler.min_window_s, scheduler.max_steps) == ("all", 120, 7)
        readings = {r.name: r for r in scheduler.readings()}
        assert readings["calendar"].idle and not readings["sleep"].idle
        assert readings["proxy"].available                 # reads the store's turns
        assert from_config(None).signals == []
        forced = from_config({"signals": {"sleep": True}}, force=True)
        assert forced.force and isinstance(forced.signals[0], SleepWindow)

    with pytest.raises(ValueError, match="unknown scheduler setting 'sleep_start'"):
        from_config({"sleep_start": "23:00"})
    with pytest.raises(ValueError, match="'force' must be true or false, got 'false'"):
        from_config({"force": "false"})  # a string is truthy: it would train while in use
    with pytest.raises(ValueError, match="sleep signal's 'enabled' must be true or false"):
        from_config({"signals": {"sleep": {"enabled": "false"}}})
    with pytest.raises(ValueError, match="max_steps must be a non-negative integer"):
        from_config({"max_steps": True})
    with pytest.raises(ValueError, match="unknown scheduler signal 'mouse'"):
        from_config({"signals": {"mouse": {}}})
    with pytest.raises(ValueError, match="needs a 'source'"):
        from_config({"signals": {"calendar": {}}})
    with pytest.raises(ValueError, match="bad option for the sleep signal"):
        from_config({"signals": {"sleep": {"begin": "23:00"}}})
    with pytest.raises(ValueError, match="bad option for the proxy signal"):
        from_config({"signals": {"proxy": {"threshold": 5}}}, store=object())
    with pytest.raises(ValueError, match="'signals' must map signal names"):
        from_config({"signals": ["sleep"]})
    with pytest.raises(ValueError, match="options must be a mapping"):
        from_config({"signals": {"sleep": "23:00-07:00"}})
    with pytest.raises(ValueError, match="threshold must be a number"):
        from_config({"signals": {"keyboard": {"threshold_s": "ten"}}})


# -- adversarial input ----------------------------------------------------------------------------


def _finishes(fn, within: float = 60.0):
    """fn()'s result, failing the test (instead of hanging it) if it runs past ``within``."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"still running after {within}s"
    return box["value"]


def test_whole_day_sleep_window_and_unquoted_yaml_times(tmp_path):
    clock = FakeClock()
    day = SleepWindow("00:00", "24:00", "Europe/Berlin", clock=clock)
    evening = SleepWindow("19:00", "24:00", "UTC", clock=clock)
    for hour in range(24):
        clock.set(utc(2026, 3, 29, hour, 30))  # the day summer time starts in Berlin
        assert day.reading().idle
        assert evening.reading().idle is (hour >= 19)
    with pytest.raises(ValueError, match="HH:MM"):
        SleepWindow("24:00", "07:00", "UTC")
    # YAML 1.1 reads an unquoted 23:00 as the number 1380; the configuration file reads it as text
    path = tmp_path / "scheduler.yaml"
    path.write_text("signals:\n  sleep:\n    start: 23:00\n    end: 7:00\n    tz: UTC\n")
    config = load_config(str(path))
    assert config["signals"]["sleep"]["start"] == "23:00"
    clock.set(utc(2026, 11, 23, 6, 30))
    assert from_config(config, clock=clock).readings()[0].idle
    with pytest.raises(ValueError, match="got the number 1380; quote the time"):
        SleepWindow(1380, "07:00", "UTC")


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 24 * 60 - 1), end=st.integers(0, 24 * 60),
       when=st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2100, 1, 1),
                         timezones=st.just(timezone.utc)),
       zone=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
                             "Asia/Kathmandu", "Pacific/Chatham"]))
@example(start=0, end=1440, when=utc(2026, 3, 29, 1, 30), zone="Europe/Berlin")
@example(start=23 * 60, end=7 * 60, when=utc(2026, 10, 25, 1, 30), zone="Europe/Berlin")
def test_sleep_window_is_the_minutes_from_start_to_end(start, end, when, zone):
    if start == end:
        return
    window = SleepWindow(f"{start // 60:02d}:{start % 60:02d}", f"{end // 60:02d}:{end % 60:02d}",
                         zone, clock=lambda: when)
    local = when.astimezone(ZoneInfo(zone))
    minute = local.hour * 60 + local.minute
    # inside when fewer minutes have passed since the start than the window lasts (mod a day)
    assert window.reading().idle is ((minute - start) % 1440 < (end - start) % 1440 or end == 1440
                                     and minute >= start)


@pytest.mark.parametrize("config, message", [
    ({"min_window_s": float("nan")}, "min_window_s must be a finite number"),
    ({"poll_s": float("inf")}, "poll_s must be a finite number"),  # killed the loop thread
    ({"poll_s": float("nan")}, "poll_s must be a finite number"),  # a busy loop
    ({"signal_timeout_s": 0}, "signal_timeout_s must be more than 0"),
    ({"signals": {"keyboard": {"threshold_s": float("nan")}}}, "threshold must be a finite"),
    ({"signals": {"notebook": {"threshold_s": True}}}, "threshold must be a number .* got True"),
    ({"signals": {"proxy": {"threshold_s": -1}}}, "must not be negative"),
    ({"signals": {"calendar": {"source": "a.ics", "refresh_s": float("nan")}}}, "finite"),
    ({"signals": {"calendar": {"source": "a.ics", "timeout_s": -1}}}, "timeout must not be neg"),
    ({"signals": {"calendar": {"source": "a.ics", "timeout_s": 0}}}, "more than 0 seconds"),
    ({"signals": {"sleep": {"tz": 5}}}, "time zone must be an IANA name"),
])
def test_invalid_numbers_are_one_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        from_config(config)


def _calendar(*events: str) -> str:
    body = "".join(f"BEGIN:VEVENT\r\n{event.strip()}\r\nEND:VEVENT\r\n".replace("\n", "\r\n")
                   .replace("\r\r", "\r") for event in events)
    return f"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//t//EN\r\n{body}END:VCALENDAR\r\n"


def _event(uid: str, rule: str, start: str = "20260101T100000Z", end: str = "20260101T100001Z"):
    return f"UID:{uid}\nSUMMARY:{uid}\nDTSTART:{start}\nDTEND:{end}\n{rule}"


def test_recurrence_rules_with_absurd_counts_and_intervals_do_not_hang():
    when = utc(2026, 11, 23, 10, 30)
    text = _calendar(
        _event("secondly", "RRULE:FREQ=SECONDLY"),                       # minutes to reach today
        _event("counted", "RRULE:FREQ=SECONDLY;COUNT=999999999"),
        _event("interval-0", "RRULE:FREQ=DAILY;INTERVAL=0"),            # dateutil never returns
        _event("count-negative", "RRULE:FREQ=DAILY;COUNT=-3"),
        _event("huge-interval", "RRULE:FREQ=DAILY;INTERVAL=999999999"),
        _event("daily", "RRULE:FREQ=DAILY", "19000101T100000Z", "19000101T110000Z"),
    )
    series = _finishes(lambda: parse_calendar(text, BERLIN))
    assert [s.summary for s in series] == ["secondly", "counted", "huge-interval", "daily"]
    assert [name for name, _ in _finishes(lambda: busy_events(series, when))] == ["daily"]
    assert [s.too_many for s in series] == [True, True, False, False]


def test_recurrence_that_never_matches_is_walked_once(tmp_path):
    path = tmp_path / "never.ics"
    path.write_text(_calendar(_event("never", "RRULE:FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30")))
    clock = FakeClock(utc(2026, 11, 23, 10, 30))
    calendar = CalendarBusy(path, refresh_s=60, tz="UTC", clock=clock)
    assert not _finishes(calendar.reading).idle
    first = calendar.series
    # dateutil walked to the year 9999 once: the only occurrence is DTSTART itself ...
    assert first[0].ended and first[0].last == datetime(2026, 1, 1, 10, 0)
    clock.advance(61)
    assert not _finishes(calendar.reading, within=1.0).idle  # ... not again at every reading
    assert calendar.fetches == 2 and calendar.series is first   # the same text is not re-parsed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(freq=st.sampled_from(["DAILY", "WEEKLY", "MONTHLY", "YEARLY"]),
       interval=st.integers(1, 400), count=st.none() | st.integers(1, 5000),
       days_back=st.integers(0, 4000), minutes=st.integers(1, 3 * 24 * 60),
       offset=st.integers(-2 * 24 * 60, 2 * 24 * 60))
def test_recurring_events_agree_with_dateutil(freq, interval, count, days_back, minutes, offset):
    from dateutil.rrule import rrulestr

    when = datetime(2026, 11, 23, 10, 30)
    first = when - timedelta(days=days_back, minutes=offset)
    rule = f"FREQ={freq};INTERVAL={interval}" + (f";COUNT={count}" if count else "")
    end = first + timedelta(minutes=minutes)
    text = _calendar(_event("e", f"RRULE:{rule}", f"{first:%Y%m%dT%H%M%S}Z",
                            f"{end:%Y%m%dT%H%M%S}Z"))
    busy = bool(busy_events(parse_calendar(text, BERLIN), when.replace(tzinfo=timezone.utc)))
    starts = rrulestr(rule, dtstart=first).between(when - timedelta(minutes=minutes), when,
                                                   inc=True)
    assert busy is any(start <= when < start + timedelta(minutes=minutes) for start in starts)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=600) | st.text(max_size=600).map(
    lambda t: "BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\n" + t + "\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"))
def test_any_bytes_parse_or_fail_with_value_error(data):
    try:
        series = parse_calendar(data, BERLIN)
    except ValueError:
        return
    busy_events(series, utc(2026, 11, 23, 10, 30))


def test_calendar_stream_with_two_calendar_objects():
    one = _calendar(_event("a", "", "20261123T100000Z", "20261123T110000Z"))
    two = _calendar(_event("b", "", "20261124T100000Z", "20261124T110000Z"))
    series = parse_calendar(one + two, BERLIN)
    assert [name for name, _ in busy_events(series, utc(2026, 11, 24, 10, 30))] == ["b"]
    with pytest.raises(ValueError, match="not a valid iCalendar"):
        parse_calendar(one[:len(one) // 2], BERLIN)  # a file cut short while being written


def test_calendar_larger_than_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ical, "MAX_CALENDAR_BYTES", 200)
    path = tmp_path / "big.ics"
    path.write_text(ICS)
    reading = CalendarBusy(path, clock=FakeClock(), tz="UTC").reading()
    assert not reading.available and "larger than" in reading.detail
    server = _CalendarServer(ICS)
    try:
        reading = CalendarBusy(server.url, clock=FakeClock(), tz="UTC").reading()
        assert not reading.available and "larger than" in reading.detail
    finally:
        server.close()


def test_calendar_refreshes_after_the_clock_is_set_back(tmp_path):
    path = tmp_path / "cal.ics"
    path.write_text(ICS)
    clock = FakeClock(berlin(2026, 11, 9, 10, 30))
    calendar = CalendarBusy(path, refresh_s=900, tz="Europe/Berlin", clock=clock)
    assert calendar.reading().idle and calendar.fetches == 1
    clock.advance(-86_400)  # a wrong clock corrected by a day
    path.write_text(ICS.replace("BYDAY=MO", "BYDAY=SU"))
    assert calendar.reading().idle and calendar.fetches == 2  # Sunday 8 November, 10:30


def test_clock_set_back_does_not_hold_off_training():
    clock = FakeClock(10_000.0)
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: 0.0)
    scheduler = Scheduler([keyboard], train_step=lambda: False, min_window_s=30, clock=clock)
    assert scheduler.tick() == "window_open"
    clock.advance(-3600)  # the clock is corrected by an hour
    assert scheduler.tick() == "window_open"
    clock.advance(30)
    assert scheduler.tick() == "training"


class _HungSignal(Signal):
    """A signal whose reading blocks until released, as a stalled network share would."""

    name = "hung"

    def __init__(self):
        self.release, self.calls = threading.Event(), 0

    def reading(self) -> SignalReading:
        self.calls += 1
        self.release.wait(30)
        return SignalReading(self.name, True, True, "released")


def test_a_hung_signal_does_not_keep_training_after_the_user_is_back():
    clock = FakeClock(10_000.0)
    last = {"t": 0.0}
    keyboard = KeyboardIdle(60, clock=clock, last_input=lambda: last["t"])
    hung = _HungSignal()
    hung.release.set()
    ref: dict = {}
    trainer = GatedTrainer(ref)
    scheduler = Scheduler([keyboard, hung], train_step=trainer.step, clock=clock,
                          signal_timeout_s=0.2)
    ref["scheduler"] = scheduler
    assert scheduler.tick() == "training"
    hung.release.clear()                      # the signal hangs from now on ...
    last["t"] = clock.t                       # ... and the user comes back during step 1
    assert _finishes(scheduler.tick, within=10) == "pausing"
    reasons = {r.name: r.detail for r in scheduler.last_readings}
    assert reasons["hung"] == "unavailable: no answer within 0.2s"
    assert _finishes(scheduler.tick, within=10) == "pausing"
    assert hung.calls == 2                    # still hung: not read a second time meanwhile
    assert scheduler.last_readings[1].detail.startswith("unavailable: no answer for")
    trainer.permits.release(1)
    assert scheduler.wait_for_training(10)
    assert scheduler.tick() == "waiting" and scheduler.steps == 1
    assert [t.to_state for t in scheduler.transitions] == [
        "window_open", "training", "pausing", "waiting"]
    hung.release.set()
    wait_until(lambda: not scheduler._pending["hung"][0].is_alive())
    assert scheduler.readings()[1].detail == "released"
