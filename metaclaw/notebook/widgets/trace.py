"""The trace (``widgets/trace.js``): one session turn by turn, as the upstream saw each turn, with
the judge's votes beside the human labels."""

from __future__ import annotations

from typing import Any

import traitlets

from metaclaw.notebook.widgets.base import (CSS, SourceGone, _clip_texts, _esc, _fmt_reward,
                                            _json_safe, _reacts, _short, _WorkspaceWidget, esm)
from metaclaw.skills.retrieval import explain_held

class TraceWidget(_WorkspaceWidget):
    """One session turn by turn: each turn as the upstream saw it (the injected skill block
    highlighted), the retrieval query and scores, tool calls and results folded, the reply, the
    judge's votes with reasons beside the human labels, the skill generation and policy version.

    ``store``: a :class:`metaclaw.store.Store`; ``session``: a session id (default: the most
    recent). Lazy: ``rows`` holds one page (``page_size``) of short previews, ``detail`` only
    the selected turn (:class:`metaclaw.trace.Trace`). Step with :meth:`step` (or the front-end's
    buttons), ``failures_only`` filters the list and the stepping to failures; ``detail
    ["written_for"]`` names the generation written for a failure and ``detail["after"]`` the
    turns served after it (:meth:`jump`). Label the selected turn with :meth:`label` or the
    front-end's form (``label_request``). :meth:`refresh` (or the front-end's refresh button)
    re-reads the session: turns recorded or labelled since, by any process (until then the
    widget is a snapshot of the session as it was when made). Texts longer than
    ``MAX_TEXT_CHARS`` are cut in ``detail``; ``trace.turn(id)`` has them whole. :attr:`trace`
    gives the polars frames.
    """

    _esm = esm("trace.js")
    _css = CSS

    sessions = traitlets.List(traitlets.Dict()).tag(sync=True)
    session_id = traitlets.Unicode("").tag(sync=True)
    total = traitlets.Int(0).tag(sync=True)
    failure_count = traitlets.Int(0).tag(sync=True)
    failures_only = traitlets.Bool(False).tag(sync=True)
    page_size = traitlets.Int(100).tag(sync=True)
    offset = traitlets.Int(0).tag(sync=True)
    matched = traitlets.Int(0).tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    selected = traitlets.Int(None, allow_none=True).tag(sync=True)
    position = traitlets.Int(0).tag(sync=True)
    detail = traitlets.Dict().tag(sync=True)
    step_request = traitlets.Dict().tag(sync=True)
    label_request = traitlets.Dict().tag(sync=True)
    author = traitlets.Unicode("").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    _refresh_failure = "cannot read the session from the store"

    def __init__(self, store: Any, session: str | None = None, *, page_size: int = 100,
                 failures_only: bool = False, author: str | None = None,
                 threshold: float = 0.0, **kwargs: Any):
        from metaclaw.skills.library import default_author
        from metaclaw.trace import Trace, sessions

        self._threshold = float(threshold)
        self.trace = Trace(store, session, threshold=threshold)
        self._read_from(store)
        super().__init__(session_id=self.trace.session_id, page_size=int(page_size),
                         failures_only=failures_only, author=author or default_author(),
                         sessions=_json_safe(sessions(store, 200, threshold)), **kwargs)
        self._ready = True
        self._reload(select_first=True)

    # -- data ---------------------------------------------------------------------------------
    def _visible(self) -> list[dict[str, Any]]:
        rows = self.trace.rows()
        return [r for r in rows if r["failed"]] if self.failures_only else rows

    def _reload(self, select_first: bool = False) -> None:
        self._store  # noqa: B018 - an open connection for the trace (or SourceGone)
        rows = self.trace.rows(refresh=True)
        self.total = len(rows)
        self.failure_count = sum(1 for r in rows if r["failed"])
        visible = self._visible()
        self.matched = len(visible)
        if select_first or self.selected not in {r["id"] for r in visible}:
            target = visible[0]["id"] if visible else None
            self._select(target)
        else:
            self._select(self.selected)

    def _page(self) -> None:
        visible = self._visible()
        start = max(0, min(self.offset, max(len(visible) - 1, 0)))
        self.rows = _json_safe([{k: r.get(k) for k in (
            "id", "turn_index", "turn_type", "status", "skill_generation", "policy_version",
            "reward", "judge", "human_label", "failed", "tool_calls", "last_role", "last_text")}
            for r in visible[start:start + self.page_size]])

    @property
    def _store(self) -> Any:
        store = self._reader.store()
        if self.trace.store is not store:  # its connection was closed: read the reopened one
            self.trace.store = store
        return store

    def _select(self, turn_id: int | None, strict: bool = False) -> None:
        """Show ``turn_id``; ``strict``: a turn that cannot be read raises (LookupError) and
        moves nothing, as a choice made in the front-end must not."""
        visible = self._visible()
        ids = [r["id"] for r in visible]
        detail: dict[str, Any] = {}
        error = ""
        if turn_id is not None:  # read first: a turn that cannot be read moves nothing
            self._store  # noqa: B018 - an open connection for the trace (or SourceGone)
            try:
                detail = _clip_texts(_json_safe(self.trace.turn(int(turn_id))))
            except LookupError as exc:
                if strict:
                    raise
                error = str(exc)
        self._ready = False
        try:
            if turn_id is None:
                self.selected = None
                self.position = 0
            else:
                self.selected = int(turn_id)
                position = ids.index(int(turn_id)) if int(turn_id) in ids else 0
                self.position = position
                if not self.offset <= position < self.offset + self.page_size:
                    self.offset = (position // self.page_size) * self.page_size
        finally:
            self._ready = True
        self._page()
        self.detail = detail
        self.error = error

    # -- actions ------------------------------------------------------------------------------
    def select(self, turn_id: int | None) -> dict[str, Any]:
        """Show one turn (a turn of another session shows that session); returns ``detail``."""
        if turn_id is not None:
            row = self._store.turn(int(turn_id))
            if row is not None and row["session_id"] != self.session_id:
                self.session_id = row["session_id"]
            if self.failures_only and int(turn_id) not in self.trace.failures():
                self.failures_only = False
        self._select(turn_id)
        return self.detail

    def step(self, delta: int = 1, failures: bool = False) -> dict[str, Any]:
        """Move ``delta`` turns (negative: back), counting only failures when ``failures``;
        stays at the ends. Returns ``detail``."""
        rows = self._visible()
        if not rows:
            return self.detail
        ids = [r["id"] for r in rows]
        here = ids.index(self.selected) if self.selected in ids else -1
        if failures:
            marks = [i for i, r in enumerate(rows) if r["failed"]]
            if delta > 0:
                later = [i for i in marks if i > here]
                at = later[min(delta, len(later)) - 1] if later else here
            else:
                earlier = [i for i in marks if i < here]
                at = earlier[max(len(earlier) + delta, 0)] if earlier else here
        else:
            at = max(0, min(len(ids) - 1, here + delta))
        target = ids[at] if at >= 0 else self.selected
        self._select(target)
        return self.detail

    def jump(self, to: str = "after") -> dict[str, Any]:
        """From a failure: ``to="after"`` shows the first turn served with the generation written
        for it; ``to="generation"`` returns that generation's entry (its skill text)."""
        written = self.detail.get("written_for") or []
        if to == "generation":
            return written[0] if written else {}
        after = self.detail.get("after") or []
        if not after:
            generations = [w["generation"] for w in written if w["generation"] is not None]
            self.message = (f"no turn has been served with generation {generations[0]}, "
                            "written for this turn, yet" if generations else
                            "no skill generation was written for this turn yet" + (
                                " (a proposal citing it is held for review)" if written else ""))
            return self.detail
        if self.failures_only and not after[0]["failed"]:
            self._ready = False
            self.failures_only = False
            self._ready = True
        self._select(after[0]["id"])
        return self.detail

    def label(self, verdict: Any, note: str = "", corrected: str | None = None,
              turn_id: int | None = None) -> dict[str, Any]:
        """Label the selected turn (or ``turn_id``) as the widget's ``author``; returns the row."""
        from metaclaw.fastloop import labels

        target = self.selected if turn_id is None else int(turn_id)
        if target is None:
            raise ValueError("no turn is selected; select one before labelling")
        row = labels.label(self._store, target, verdict, note=note, corrected=corrected,
                           author=self.author or None)
        self.message = f"turn #{target} labelled {row['verdict']} by {row['author']}"
        self._reload()
        return row

    @_reacts("session_id", failing="cannot open the session")
    def _on_session(self, change: Any) -> None:
        if change["new"] == self.trace.session_id:
            return
        from metaclaw.trace import Trace

        try:
            self.trace = Trace(self._store, change["new"], threshold=self._threshold)
        except LookupError as exc:
            self.error = str(exc)
            return
        self._ready = False
        self.offset = 0
        self._ready = True
        self._reload(select_first=True)

    @_reacts("failures_only", failing="cannot filter the turns")
    def _on_failures_only(self, _change: Any) -> None:
        self._reload()

    @_reacts("offset", "page_size", failing="cannot page")
    def _on_page(self, _change: Any) -> None:
        self._page()

    @traitlets.observe("selected")
    def _on_selected(self, change: Any) -> None:
        if not self._ready:
            return
        try:
            self._select(change["new"], strict=True)
        except Exception as exc:  # noqa: BLE001 - the selection stays where it was
            self._selection_failed(change, exc, said=(SourceGone, LookupError))

    @_reacts("step_request", failing="cannot step")
    def _on_step_request(self, change: Any) -> None:
        request = change["new"] or {}
        if not request:
            return
        if request.get("jump"):
            self.jump(str(request["jump"]))
        else:
            self.step(int(request.get("delta", 1)), bool(request.get("failures")))

    @traitlets.observe("label_request")
    def _on_label_request(self, change: Any) -> None:
        request = change["new"] or {}
        if not self._ready or not request.get("verdict"):
            return
        try:
            self.label(request["verdict"], note=str(request.get("note") or ""),
                       corrected=request.get("corrected") or None,
                       turn_id=request.get("turn_id"))
            self.error = ""
        except Exception as exc:  # shown in the widget; nothing is stored
            self.error = f"the label was not stored: {exc}"

    def refresh(self) -> "TraceWidget":
        """Re-read the session (new turns, verdicts, labels); returns the widget."""
        from metaclaw.trace import sessions

        try:
            self.sessions = _json_safe(sessions(self._store, 200, self._threshold))
            self._reload()
        except SourceGone as exc:
            self.error = str(exc)
        return self

    # -- display ------------------------------------------------------------------------------
    def _repr_html_(self, limit: int = 30) -> str:
        head = "".join(f"<th>{c}</th>" for c in ("turn", "gen", "policy", "score", "human",
                                                  "last message"))
        body = "".join(
            f"<tr{_FAILED_ROW if r['failed'] else ''}><td>#{r['id']}</td>"
            f"<td>{r['skill_generation']}</td><td>v{r['policy_version']}</td>"
            f"<td>{_fmt_reward(r['reward'])}</td><td>{_esc(r['human_label'] or '')}</td>"
            f"<td>{_esc(_short(r['last_text'] or '', 90))}</td></tr>" for r in self.rows[:limit])
        parts = [f"<div class='metaclaw-trace-static'><b>Trace of session "
                 f"{_esc(self.session_id)}</b>: {self.total} turns, {self.failure_count} failed"
                 + (" (failures only)" if self.failures_only else ""),
                 f"<table><tr>{head}</tr>{body}</table>"]
        if self.detail:
            parts.append(_trace_turn_html(self.detail))
        parts.append("</div>")
        return "".join(parts)

    def __repr__(self) -> str:
        return (f"TraceWidget(session {self.session_id!r}: {self.total} "
                f"turn{'' if self.total == 1 else 's'}, "
                f"{self.failure_count} failed, selected #{self.selected})")


_FAILED_ROW = " style='background:#ffebe9'"


def _scorer(d: dict[str, Any]) -> str:
    """Who scored a turn: the judge when it left votes, else what recorded the reward (a
    pipeline's check, say); never "judge" beside "not judged"."""
    if d.get("judge_votes") or d.get("reward") is None:
        return "judge"
    return str(d.get("judge_model") or "score")


def _trace_turn_html(d: dict[str, Any]) -> str:
    parts = [f"<details open><summary><b>Turn #{d['id']}</b> &middot; generation "
             f"{d.get('skill_generation')} &middot; policy v{d.get('policy_version')} &middot; "
             f"{_esc(_scorer(d))} {_fmt_reward(d.get('reward'))} &middot; human "
             f"{_esc(str(d.get('human_label') or '—'))}</summary>"]
    retrieval = d.get("retrieval") or {}
    if retrieval.get("query") or retrieval.get("scores"):
        scores = ", ".join(f"{_esc(s['name'])}"
                           + (f" ({s['score']:.2f})" if s.get("score") is not None else "")
                           + (f" <small>not injected: below {s['below']:.2f}</small>"
                              if s.get("injected") is False else "")
                           + (f" <small>use when: {_esc(s['use_when'])}</small>"
                              if s.get("use_when") else "")
                           + (f" <small>{int(s['example_asks'])} example asks</small>"
                              if s.get("example_asks") else "")
                           + (f" <small>{int(s['anticipated_asks'])} anticipated asks</small>"
                              if s.get("anticipated_asks") else "")
                           + (f" <small>{int(s['near_miss_asks'])} near-miss asks</small>"
                              if s.get("near_miss_asks") else "")
                           for s in retrieval.get("scores") or [])
        held = explain_held({"retrieval_scores": retrieval.get("scores") or []})
        if held:
            scores += "".join(f"<br><small>{_esc(line)}</small>" for line in held)
        parts.append(f"<p><i>Retrieval</i>: {_esc(retrieval.get('query') or '')} &rarr; "
                     f"{scores or 'no skill'}</p>")
    for m in d.get("messages") or []:
        parts.append(f"<div><b>{_esc(str(m.get('role')))}</b><pre style='white-space:pre-wrap'>"
                     f"{_esc(m.get('text') or '')}</pre>")
        if m.get("skill_block"):
            parts.append("<pre style='white-space:pre-wrap;background:#fff8c5'>"
                         f"{_esc(m['skill_block'])}</pre>")
        parts.append("</div>")
    parts.append(f"<div><b>reply</b><pre style='white-space:pre-wrap'>"
                 f"{_esc(d.get('response') or '')}</pre></div>")
    for vote in d.get("judge_votes") or []:
        parts.append(f"<div>vote {_fmt_reward(vote.get('score'))}: "
                     f"{_esc(vote.get('rationale') or vote.get('error') or '')}</div>")
    if not d.get("judge_votes") and d.get("reward") is not None:
        parts.append(f"<div>no judge votes: the reward was recorded by {_esc(_scorer(d))}"
                     + (f" &mdash; {_esc(d['judge_rationale'])}" if d.get("judge_rationale")
                        else "") + "</div>")
    parts.append("</details>")
    return "".join(parts)


