"""The support and query buffers (``widgets/buffers.js``): the turns by generation, filterable,
with a drill-down into one turn."""

from __future__ import annotations

import json
import time
from typing import Any

import traitlets

from metaclaw.buffers import buffers_frame
from metaclaw.notebook.widgets.base import (CSS, SourceGone, _clip_texts, _esc, _fmt_reward,
                                            _fmt_time, _json_safe, _one_line, _reacts,
                                            _WorkspaceWidget, esm)

_TURN_DETAIL_FIELDS = (
    "id", "session_id", "turn_index", "created_at", "model", "status", "error", "skill_generation",
    "policy_version", "buffer_set", "buffer_state", "reward", "judge_model", "judge_votes",
    "judge_rationale", "request_messages", "response", "tool_calls", "finish_reason",
    "injected_skills")


class BufferWidget(_WorkspaceWidget):
    """The support and query sets by generation, filterable, with a drill-down into a turn.

    ``store``: a :class:`metaclaw.store.Store`. Filters (synced traitlets): ``set_filter``
    (``all`` | ``support`` | ``query`` | ``none``: turns in no buffer), ``state_filter`` (``all`` |
    ``live`` | ``consumed`` | ``purged``), ``generation_filter`` (a skill generation or ``None``),
    ``text_filter`` (case-insensitive, in the task text or the session id). ``rows`` holds the
    first ``max_rows`` matching turns, newest first; :attr:`frame` all of them as a polars frame.
    Setting ``selected`` to a turn id fills ``detail`` with that turn's request messages,
    response, tool calls and judge verdict.

    The rows are a **snapshot** taken when the widget was made (``taken_at``): later turns and
    generations do not change what it shows until :meth:`refresh` (or the front-end's refresh
    button) re-reads the store. It keeps working after ``%metaclaw stop`` and ``store.close()``.
    """

    _esm = esm("buffers.js")
    _css = CSS

    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    total = traitlets.Int(0).tag(sync=True)
    matched = traitlets.Int(0).tag(sync=True)
    generations = traitlets.List(traitlets.Int()).tag(sync=True)
    counts = traitlets.Dict().tag(sync=True)
    set_filter = traitlets.Enum(("all", "support", "query", "none"),
                                default_value="all").tag(sync=True)
    state_filter = traitlets.Enum(("all", "live", "consumed", "purged"),
                                  default_value="all").tag(sync=True)
    generation_filter = traitlets.Int(None, allow_none=True).tag(sync=True)
    text_filter = traitlets.Unicode("").tag(sync=True)
    selected = traitlets.Int(None, allow_none=True).tag(sync=True)
    detail = traitlets.Dict().tag(sync=True)
    max_rows = traitlets.Int(200).tag(sync=True)
    taken_at = traitlets.Float(0.0).tag(sync=True)

    def __init__(self, store: Any, *, set_filter: str = "all", state_filter: str = "all",
                 generation: int | None = None, text: str = "", max_rows: int = 200,
                 **kwargs: Any):
        import polars as pl

        self._read_from(store)
        self._all = pl.DataFrame()
        super().__init__(set_filter=set_filter, state_filter=state_filter,
                         generation_filter=generation, text_filter=text, max_rows=max_rows,
                         **kwargs)
        self._ready = True
        self.refresh()

    # -- data ---------------------------------------------------------------------------------
    def refresh(self) -> "BufferWidget":
        """Re-read the turns from the store and apply the filters; returns the widget."""
        import polars as pl

        try:
            frame = buffers_frame(self._store, all_turns=True)
        except SourceGone as exc:
            self.error = str(exc)
            return self
        except Exception as exc:
            self.error = f"cannot read the turns from the store: {_one_line(exc)}"
            return self
        self.taken_at = time.time()
        self._all = frame
        self.total = frame.height
        self.generations = sorted(int(g) for g in frame["skill_generation"].unique().drop_nulls())
        counts: dict[str, dict[str, int]] = {}
        grouped = (frame.filter(pl.col("set").is_not_null())
                   .group_by("set", "state").len().to_dicts())
        for row in grouped:
            counts.setdefault(row["set"], {})[row["state"] or "none"] = int(row["len"])
        self.counts = counts
        self.error = ""
        self._apply()
        if self.selected is not None:
            self._load_detail()
        return self

    @property
    def frame(self):
        """The turns matching the current filters as a ``polars.DataFrame``, oldest first.

        Columns: id, session_id, turn_type, set, state, skill_generation, reward, created_at, task.
        """
        import polars as pl

        frame = self._all
        if frame.is_empty():
            return frame
        if self.set_filter == "none":
            frame = frame.filter(pl.col("set").is_null())
        elif self.set_filter != "all":
            frame = frame.filter(pl.col("set") == self.set_filter)
        if self.state_filter != "all":
            frame = frame.filter(pl.col("state") == self.state_filter)
        if self.generation_filter is not None:
            frame = frame.filter(pl.col("skill_generation") == self.generation_filter)
        text = self.text_filter.strip().lower()
        if text:
            frame = frame.filter(
                pl.col("task").fill_null("").str.to_lowercase().str.contains(text, literal=True)
                | pl.col("session_id").fill_null("").str.to_lowercase()
                .str.contains(text, literal=True))
        return frame

    def _apply(self) -> None:
        frame = self.frame
        self.matched = frame.height
        shown = frame.reverse().head(max(self.max_rows, 0)) if frame.height else frame
        self.rows = _json_safe(shown.to_dicts())

    def _load_detail(self) -> None:
        if self.selected is None:
            self.detail = {}
            return
        try:
            turn = self._store.turn(int(self.selected))
        except SourceGone as exc:
            self.detail = {}
            self.error = str(exc)
            return
        except Exception as exc:  # noqa: BLE001 - said in the widget
            self.detail = {}
            self.error = f"cannot read turn #{self.selected}: {_one_line(exc)}"
            return
        if turn is None:
            self.detail = {}
            self.error = f"turn #{self.selected} is not in the store; pick a turn from the table"
            return
        self.error = ""
        self.detail = _clip_texts(_json_safe({k: turn.get(k) for k in _TURN_DETAIL_FIELDS}))

    @_reacts("set_filter", "state_filter", "generation_filter", "text_filter", "max_rows",
             failing="cannot filter the turns")
    def _on_filter(self, _change: Any) -> None:
        self._apply()

    @_reacts("selected", failing="cannot show the turn")
    def _on_selected(self, _change: Any) -> None:
        self._load_detail()

    def select(self, turn_id: int | None) -> dict[str, Any]:
        """Drill down into one turn (``None`` closes it); returns ``detail``."""
        self.selected = None if turn_id is None else int(turn_id)
        return self.detail

    # -- display ------------------------------------------------------------------------------
    def _repr_html_(self, limit: int = 50) -> str:
        filters = [f"set={self.set_filter}", f"state={self.state_filter}"]
        if self.generation_filter is not None:
            filters.append(f"generation={self.generation_filter}")
        if self.text_filter:
            filters.append(f"text={self.text_filter!r}")
        counts = " &middot; ".join(
            f"<b>{_esc(s)}</b>: " + ", ".join(f"{n} {_esc(state)}"
                                              for state, n in sorted(self.counts[s].items()))
            for s in sorted(self.counts)) or "no turn in a buffer yet"
        head = "".join(f"<th>{c}</th>" for c in
                       ("turn", "session", "set", "state", "gen", "reward", "time", "task"))
        body = "".join(
            f"<tr><td>#{r['id']}</td><td>{_esc(str(r['session_id']))}</td>"
            f"<td>{_esc(r['set'] or '—')}</td><td>{_esc(r['state'] or '—')}</td>"
            f"<td>{r['skill_generation']}</td><td>{_fmt_reward(r['reward'])}</td>"
            f"<td>{_fmt_time(r['created_at'])}</td><td>{_esc(r['task'] or '')}</td></tr>"
            for r in self.rows[:limit])
        parts = [f"<div class='metaclaw-buffers-static'><b>Buffers</b> ({_esc(', '.join(filters))}):"
                 f" {self.matched} of {self.total} turns &middot; {counts} &middot; "
                 f"<span style='color:#656d76'>snapshot of {_fmt_time(self.taken_at)}</span>"]
        if self.error:
            parts.append(f"<p style='color:#cf222e'>{_esc(self.error)}</p>")
        parts.append(f"<div style='overflow:auto;max-height:420px'><table><tr>{head}</tr>"
                     f"{body}</table></div>" if self.rows
                     else "<p>No turns match these filters.</p>")
        if self.matched > min(limit, len(self.rows)):
            parts.append(f"<p>(first {min(limit, len(self.rows))} of {self.matched}, newest "
                         "first; <code>widget.frame</code> holds them all)</p>")
        if self.detail:
            parts.append(_turn_html(self.detail))
        parts.append("</div>")
        return "".join(parts)

    def __repr__(self) -> str:
        return (f"BufferWidget({self.matched} of {self.total} turns, set={self.set_filter}, "
                f"state={self.state_filter}, generation={self.generation_filter})")


def _message_text(content: Any) -> str:
    from metaclaw.buffers import message_text

    return message_text(content)


def _readable_calls(calls: Any) -> Any:
    """Tool calls with their JSON arguments parsed (shown indented, not as one escaped line)."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        out.append(call)
    return out


def _turn_html(detail: dict[str, Any]) -> str:
    parts = [f"<details open><summary><b>Turn #{detail['id']}</b> &middot; session "
             f"{_esc(str(detail.get('session_id')))} &middot; generation "
             f"{detail.get('skill_generation')} &middot; {_esc(str(detail.get('buffer_set')))} / "
             f"{_esc(str(detail.get('buffer_state')))} &middot; reward "
             f"{_fmt_reward(detail.get('reward'))}</summary>"]
    if detail.get("judge_rationale"):
        parts.append(f"<p><i>Judge:</i> {_esc(detail['judge_rationale'])}</p>")
    for message in detail.get("request_messages") or []:
        parts.append(f"<div><b>{_esc(str(message.get('role')))}</b>"
                     f"<pre style='white-space:pre-wrap'>"
                     f"{_esc(_message_text(message.get('content')))}</pre></div>")
    parts.append(f"<div><b>response</b><pre style='white-space:pre-wrap'>"
                 f"{_esc(detail.get('response') or '')}</pre></div>")
    if detail.get("tool_calls"):
        parts.append(f"<div><b>tool calls</b><pre style='white-space:pre-wrap'>"
                     f"{_esc(json.dumps(_readable_calls(detail['tool_calls']), indent=2))}"
                     "</pre></div>")
    parts.append("</details>")
    return "".join(parts)


