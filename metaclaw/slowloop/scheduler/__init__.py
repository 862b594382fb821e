"""The idle-gated training scheduler (OMLS: opportunistic meta-learning scheduler).

Weights are trained only while the user is away. Independent *signals* each answer "is the user
idle?"; a *combination rule* merges them into one answer; a small *state machine* opens a training
window, runs the trainer's ``train_step()`` in a background thread, pauses it at the next step
boundary when the user returns, and resumes it in the next window.

Signals (each returns a :class:`SignalReading`; each takes an injectable ``clock``, a callable
returning epoch seconds or an aware ``datetime``, so tests can drive time):

- :class:`SleepWindow`  local time inside ``start``-``end`` in a time zone (may wrap midnight;
  ``"00:00"``-``"24:00"`` is the whole day)
- :class:`KeyboardIdle` no keyboard/mouse input for ``threshold_s`` (pynput listeners, else the X
  screensaver idle time via python-xlib, else ``xprintidle``, else *unavailable*)
- :class:`CalendarBusy` an event of an iCalendar feed (file, or http(s)/webcal URL such as Google
  Calendar's secret iCal address) is happening now: the user is in a meeting, away from the
  computer, so the window is open. Recurring events (RRULE, RDATE, EXDATE, overridden instances),
  all-day events; refreshed every ``refresh_s``; a failed fetch keeps the last good calendar.
- :class:`NotebookIdle` no notebook cell has run for ``threshold_s`` (IPython cell events)
- :class:`ProxyIdle`    no request went through the proxy for ``threshold_s``

Combination rule (``mode``): ``"any"`` - the window is open when any *available* signal says idle;
``"all"`` - when every available signal says idle. Unavailable signals are ignored, and the reason
string of every decision says so. With no available signal the window never opens. Signals are
read side by side; one that raises, or has not answered within ``signal_timeout_s`` (15 s), reads
as unavailable, so a hung signal cannot keep training going after the user is back.

``min_window_s``: the combined answer must have stayed "idle" for at least this many seconds
before training starts (the state stays ``window_open`` meanwhile); this filters out short pauses.

States::

    waiting -> window_open -> training -> pausing -> waiting
    window_open -> waiting            (the window closed before training started)
    training -> waiting               (train_step returned False, failed, or max_steps reached;
                                       the window then reopens only after the user was back)

Training never starts or continues while the combined answer is "active", unless ``force`` is
set (``metaclaw train --now``). With a ``lease`` (the workspace's
:class:`~metaclaw.training_lease.TrainingLease`, as the slow loop gives it) a run starts only
while no other process trains the workspace: the window stays ``window_open`` meanwhile. Every transition is kept in memory and, when a store is given,
written with ``Store.record_transition``.

Layout: :mod:`.signals` (the clock and the sleep, keyboard, notebook and proxy signals),
:mod:`.ical` (the calendar signal), :mod:`.machine` (:class:`Scheduler`, :func:`from_config`).
Example::

    from metaclaw.slowloop.scheduler.machine import from_config
    scheduler = from_config({"signals": {"sleep": {"tz": "Europe/Berlin"},
                                         "keyboard": {"threshold_s": 600}}},
                            train_step=trainer.step, store=store)
    scheduler.run(poll_s=5)       # background thread; scheduler.stop() pauses training

May import: the shared modules (:mod:`metaclaw.redact` hides a calendar's address). Never the
rest of the slow loop or any other wing: the trainer's step, the store and the lease are handed
to it (checked by ``tests/test_architecture.py``).
"""

from metaclaw.slowloop.scheduler.ical import CalendarBusy, busy_events, parse_calendar
from metaclaw.slowloop.scheduler.machine import (DEFAULT_CONFIG, MODES, SIGNAL_TYPES, STATES,
                                                 Scheduler, Transition, from_config, load_config)
from metaclaw.slowloop.scheduler.signals import (Clock, KeyboardIdle, NotebookIdle, ProxyIdle,
                                                 Signal, SignalReading, SleepWindow, now_ts)

__all__ = [
    "DEFAULT_CONFIG", "MODES", "SIGNAL_TYPES", "STATES", "CalendarBusy", "Clock", "KeyboardIdle", "NotebookIdle",
    "ProxyIdle", "Scheduler", "Signal", "SignalReading", "SleepWindow", "Transition",
    "busy_events", "from_config", "load_config", "now_ts", "parse_calendar",
]
