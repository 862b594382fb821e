"""The scheduler view (``widgets/scheduler.js``): the scheduler's state, each idle signal's
reading, and a timeline of its states and transitions."""

from __future__ import annotations

import time
from typing import Any, Callable

import traitlets

from metaclaw.notebook.widgets.base import (CSS, SourceGone, _esc, _fmt_time, _json_safe,
                                            _one_line, _WorkspaceWidget, esm)

def plain_unavailable(detail: str) -> str:
    """Why a signal cannot be read, in plain words: ``"unavailable: pynput: RuntimeError: no X
    display (DISPLAY is not set); xscreensaver: ..."`` becomes ``"not available on this machine
    (no display)"``."""
    import re

    text = str(detail or "").strip()
    if text.lower().startswith("unavailable"):
        text = text[len("unavailable"):].lstrip(" :")
    low = text.lower()
    if "no x display" in low or "display is not set" in low or low == "no display":
        return "not available on this machine (no display)"
    if "input monitoring" in low:
        return ("not available: this process may not watch the keyboard (allow it under System "
                "Settings > Privacy & Security > Input Monitoring)")
    if "not attached to a notebook" in low:
        return "not available: not attached to this notebook's kernel"
    if "not connected to a proxy" in low:
        return "not available: there is no proxy to watch"
    if "no input has been recorded" in low:
        return "not available yet: no keyboard or mouse input seen"
    if low.startswith("no answer"):
        return "not available: it did not answer in time"
    first = text.split(";")[0].strip()
    first = re.sub(r"^[\w-]+: (?:[A-Za-z]+(?:Error|Exception): )?", "", first)
    return f"not available: {first}" if first else "not available"


def _signal_rows(signals: Any) -> list[dict[str, Any]]:
    """Normalise a status' signals (a list of readings or a ``{name: value}`` dict) to rows of
    ``{name, reading, detail}`` where ``reading`` is idle / active / unavailable or a value and
    ``detail`` is in plain words (an unavailable signal's technical reason is kept in ``raw``)."""
    if isinstance(signals, dict):
        items = [{"name": name, **(value if isinstance(value, dict) else {"value": value})}
                 for name, value in signals.items()]
    else:
        items = [s.as_dict() if hasattr(s, "as_dict") else dict(s) for s in signals or []]
    rows = []
    for item in items:
        detail = item.get("detail", "")
        row: dict[str, Any] = {"name": str(item.get("name", "?"))}
        if item.get("available") is False:
            row["reading"] = "unavailable"
            plain = plain_unavailable(detail)
            if plain != detail:
                row["raw"] = detail
            detail = plain
        elif "idle" in item:
            row["reading"] = "idle" if item["idle"] else "active"
        else:
            row["reading"] = item.get("value")
        row["detail"] = detail
        rows.append(row)
    return _json_safe(rows)


def state_segments(transitions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The periods spent in each state, from transitions (oldest first):
    ``[{state, start, end}]`` with ``end`` None for the current state."""
    segments = []
    for i, t in enumerate(transitions):
        end = transitions[i + 1]["at"] if i + 1 < len(transitions) else None
        segments.append({"state": t["to_state"], "start": t["at"], "end": end})
    return segments


class SchedulerView(_WorkspaceWidget):
    """The scheduler at a glance: current state, each signal's reading, and a timeline of states
    (training windows) and transitions.

    ``scheduler``: a :class:`metaclaw.slowloop.scheduler.Scheduler` or any callable returning a status
    dict like ``Scheduler.status()`` (``state``, ``signals``, optional ``transitions`` and other
    scalar fields). ``store``: where the transitions are read from (``scheduler_transitions``;
    default: the scheduler's store, else the status' in-memory transitions); for a
    :class:`~metaclaw.slowloop.scheduler.Scheduler` only this process's, as every process of a workspace
    runs a scheduler of its own. ``last``: how many
    transitions to show. :meth:`refresh` (or the front-end's button) reads everything again.
    """

    _esm = esm("scheduler.js")
    _css = CSS

    state = traitlets.Unicode("unknown").tag(sync=True)
    signals = traitlets.List(traitlets.Dict()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    transitions = traitlets.List(traitlets.Dict()).tag(sync=True)
    segments = traitlets.List(traitlets.Dict()).tag(sync=True)
    now = traitlets.Float(0.0).tag(sync=True)
    _refresh_failure = "could not refresh"

    def __init__(self, scheduler: Any, store: Any = None, *, last: int = 200,
                 clock: Callable[[], float] = time.time, **kwargs: Any):
        if callable(getattr(scheduler, "status", None)):
            self._status_fn = scheduler.status
            owner = scheduler
        elif callable(scheduler):
            self._status_fn = scheduler
            owner = getattr(scheduler, "__self__", None)
        else:
            raise TypeError("SchedulerView needs a Scheduler or a function returning its status "
                            f"dict, got {type(scheduler).__name__}")
        store = store if store is not None else getattr(owner, "store", None)
        self._read_from(store)
        from metaclaw.slowloop.scheduler.machine import Scheduler
        from metaclaw.store import this_process

        # a scheduler object is this process's: its timeline is not another process's
        self._process = this_process() if isinstance(owner, Scheduler) else None
        self._last, self._clock = int(last), clock
        super().__init__(**kwargs)
        self._ready = True
        self.refresh()

    def refresh(self) -> "SchedulerView":
        """Read the status and the transitions again; returns the view."""
        self.now = float(self._clock())
        try:
            status = dict(self._status_fn() or {})
        except Exception as exc:
            self.error = f"could not read the scheduler status: {exc}"
            return self
        errors = []
        self.state = str(status.get("state", "unknown"))
        self.signals = _signal_rows(status.get("signals"))
        self.summary = _json_safe({k: v for k, v in status.items()
                                   if k not in ("state", "signals", "transitions")
                                   and isinstance(v, (str, int, float, bool))})
        transitions = status.get("transitions") or []
        if self._reader is not None:
            mine = "" if self._process is None else "WHERE process = ? "
            try:
                transitions = list(reversed(self._store.query(
                    "SELECT at, from_state, to_state, reason FROM scheduler_transitions "
                    f"{mine}ORDER BY id DESC LIMIT ?",
                    (*([self._process] if self._process else []), self._last))))
            except SourceGone as exc:
                errors.append(str(exc))
            except Exception as exc:
                errors.append(f"could not read the transitions from the store: {_one_line(exc)}")
        rows = _json_safe([{k: t.get(k) for k in ("at", "from_state", "to_state", "reason")}
                           for t in transitions][-self._last:])
        self.transitions = rows
        self.segments = state_segments(rows)
        self.error = "; ".join(errors)
        return self

    def _repr_html_(self, limit: int = 20) -> str:
        signal_rows = "".join(
            f"<tr><td><b>{_esc(s['name'])}</b></td><td>"
            f"{'not available' if s['reading'] == 'unavailable' else _esc(str(s['reading']))}"
            f"</td><td{' title=' + chr(34) + _esc(str(s['raw'])) + chr(34) if s.get('raw') else ''}>"
            f"{_esc(str(s['detail'] or ''))}</td></tr>" for s in self.signals)
        summary = " &middot; ".join(f"{_esc(k)}: {_esc(str(v))}" for k, v in self.summary.items())
        windows = "".join(
            f"<tr><td>{_esc(s['state'])}</td><td>{_fmt_time(s['start'])}</td>"
            f"<td>{_fmt_time(s['end']) if s['end'] is not None else 'now'}</td>"
            f"<td>{_duration((s['end'] if s['end'] is not None else self.now) - s['start'])}"
            f"</td></tr>" for s in self.segments[-limit:])
        moves = "".join(
            f"<li>{_fmt_time(t['at'])}: {_esc(t['from_state'])} &rarr; {_esc(t['to_state'])}"
            f"{' &mdash; ' + _esc(t['reason']) if t.get('reason') else ''}</li>"
            for t in self.transitions[-limit:])
        parts = [f"<div class='metaclaw-scheduler-static'><b>Scheduler</b>: state "
                 f"<b>{_esc(self.state)}</b> (as of {_fmt_time(self.now)})"]
        if summary:
            parts.append(f"<p>{summary}</p>")
        if self.error:
            parts.append(f"<p style='color:#cf222e'>{_esc(self.error)}</p>")
        parts.append("<table><tr><th>signal</th><th>reads</th><th>detail</th></tr>"
                     f"{signal_rows}</table>" if self.signals else "<p>No signals configured.</p>")
        if self.segments:
            parts.append("<p><b>Timeline</b></p><table><tr><th>state</th><th>from</th><th>to</th>"
                         f"<th>duration</th></tr>{windows}</table>"
                         f"<p><b>Transitions</b></p><ul>{moves}</ul>")
        else:
            parts.append("<p>No transitions recorded yet.</p>")
        parts.append("</div>")
        return "".join(parts)

    def __repr__(self) -> str:
        return (f"SchedulerView(state={self.state!r}, signals={len(self.signals)}, "
                f"transitions={len(self.transitions)})")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

