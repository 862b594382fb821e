"""Notebook widgets: the skill diff, the support/query buffers, the training monitor and the
scheduler view.

Each widget is an `anywidget <https://anywidget.dev>`_ class holding only synced traitlets and
the path of its front-end module (``widgets/*.js`` + ``widgets/metaclaw.css``, shipped in the
package as ``metaclaw/_widgets``); all drawing happens in the front-end, so the widgets work in
JupyterLab, VS Code and Colab alike. Python recomputes the data when a synced choice changes
(``old`` / ``new`` of the diff, the buffer filters, the selected turn), so the state can be driven
and tested from plain Python without a browser.

Every widget also has a static HTML form (``_repr_html_``, included in its MIME bundle next to
the widget view) so nbconvert and GitHub show the tables and diffs when no widget runtime is
there.

    SkillDiffWidget(library, old=None, new=None, mode="unified")
    BufferWidget(store, set_filter="all", state_filter="all", generation=None, text="")
    TrainingMonitor(store, run_id=None, poll=1.0)     # live altair chart (JupyterChart)
    SchedulerView(scheduler_or_status_fn, store=None)
"""

from __future__ import annotations

import contextlib
import functools
import html
import json
import math
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

import anywidget
import traitlets

from metaclaw.buffers import buffers_frame, task_previews
from metaclaw.store import IN_IDS, id_list

#: The front-end modules: ``metaclaw/_widgets`` (a link to the top-level ``widgets/`` folder).
WIDGETS_DIR = Path(__file__).resolve().parent.parent / "_widgets"
CSS = WIDGETS_DIR / "metaclaw.css"

_esc = html.escape


def _short(text: str, limit: int = 100) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _json_safe(value: Any) -> Any:
    """``value`` made JSON-compatible (what a synced traitlet can carry). Infinities and NaN
    become None: JSON has no such numbers, and the kernel would send the front-end invalid JSON."""
    return json.loads(json.dumps(value, default=str), parse_constant=lambda _name: None)


#: The longest text a widget sends to the browser in one field. A turn can hold a tool result of
#: megabytes (a log file the agent read): sent whole it would slow the browser and, through the
#: static HTML, stay in the saved notebook. The store keeps the full text.
MAX_TEXT_CHARS = 20_000


def _clip_texts(value: Any, limit: int = MAX_TEXT_CHARS) -> Any:
    """``value`` with every string longer than ``limit`` cut, saying how much was left out."""
    if isinstance(value, str):
        if len(value) <= limit:
            return value
        return value[:limit] + f"\n… [{len(value) - limit:,} more characters not shown]"
    if isinstance(value, dict):
        return {k: _clip_texts(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_clip_texts(v, limit) for v in value]
    return value


# -- what a widget reads, for as long as the kernel lives ----------------------------------------
class SourceGone(RuntimeError):
    """The workspace a widget read is gone (its database file was deleted, or it was an in-memory
    store that was closed): the widget keeps what it showed last and says so in one line."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:299] + "…"


def _is_closed(store: Any) -> bool:
    """Whether ``store``'s connection was closed (``Store.close()``)."""
    try:
        store.query("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


_readers_lock = threading.RLock()
#: live widgets by the store they read; a store in ``_close_when_unread`` is closed when its
#: last reader closes (``%metaclaw stop`` hands a store to the widgets still showing it).
_readers: "weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]]" = weakref.WeakKeyDictionary()
_close_when_unread: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _live_readers(store: Any) -> list[Any]:
    with _readers_lock:
        return [r for r in list(_readers.get(store, ())) if not getattr(r, "_released", False)]


def release_store(store: Any) -> bool:
    """Close ``store`` now unless a live widget reads it; otherwise it stays open for those
    widgets and is closed when the last of them is closed. Returns whether it was closed now.
    (``%metaclaw stop`` calls this: stopping the proxy does not pull the workspace from under
    the widgets still on the page.)"""
    with _readers_lock:
        if _live_readers(store):
            _close_when_unread.add(store)
            return False
        _close_when_unread.discard(store)
    store.close()
    return True


class _Reader:
    """The store a widget reads, kept usable for as long as the widget lives: when its
    connection was closed (by ``store.close()``), the widget reopens the same workspace file;
    when the file is gone, :class:`SourceGone` says so in one line."""

    def __init__(self, widget: Any, store: Any):
        self.held = store
        self.own: Any = None
        self._widget = weakref.ref(widget)
        with _readers_lock:
            _readers.setdefault(store, weakref.WeakSet()).add(widget)

    def store(self) -> Any:
        for store in (self.own, self.held):
            if store is not None and not _is_closed(store):
                return store
        path = Path(str(self.held.path))
        if str(self.held.path) == ":memory:":
            raise SourceGone("the workspace was an in-memory store and it was closed: what is "
                             "shown is all that is left of it")
        if not path.exists():
            raise SourceGone(f"the workspace {path} was deleted: what is shown is what this "
                             f"widget read last")
        from metaclaw.store import Store

        self.own = Store(path)
        return self.own

    def release(self) -> None:
        """The widget closed: close what it opened, and the store handed to it if it was the
        last reader."""
        widget = self._widget()
        with _readers_lock:
            readers = _readers.get(self.held)
            if readers is not None and widget is not None:
                readers.discard(widget)
            last = self.held in _close_when_unread and not _live_readers(self.held)
            if last:
                _close_when_unread.discard(self.held)
        if last:
            self.held.close()
        if self.own is not None:
            self.own.close()
            self.own = None


def _reports(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """For a handler of a front-end request: an error becomes the widget's one-line ``error``
    (the kernel log is where nobody looks) instead of an exception."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def handler(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except SourceGone as exc:
                self.error = str(exc)
            except Exception as exc:  # noqa: BLE001 - shown in the widget, the kernel goes on
                self.error = f"{what}: {_one_line(exc)}"
            return None
        return handler
    return wrap


def _fmt_reward(value: Any) -> str:
    if value is None:
        return "unjudged"
    value = float(value)
    return f"{value:+.0f}" if value.is_integer() else f"{value:+.2f}"


def _fmt_time(seconds: Any) -> str:
    if seconds is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(seconds)))


def turn_previews(store: Any, ids: Iterable[int]) -> dict[str, dict[str, Any]]:
    """Short descriptions of some turns: ``{str(id): {id, session_id, skill_generation, reward,
    task}}`` where ``task`` is the turn's last user message, shortened. Unknown ids are absent."""
    wanted = sorted({int(i) for i in ids})
    tasks = task_previews(store, wanted, limit=100)
    rows = store.query("SELECT id, session_id, skill_generation, reward FROM turns "
                       f"WHERE id {IN_IDS}", (id_list(wanted),))
    return {str(row["id"]): {
        "id": row["id"], "session_id": row["session_id"],
        "skill_generation": row["skill_generation"],
        "reward": None if row["reward"] is None else float(row["reward"]),
        "task": tasks.get(row["id"], "")} for row in rows}


class _StaticHTML:
    """Adds the widget's static HTML (``_repr_html_``) to its MIME bundle, next to the widget view."""

    def _repr_mimebundle_(self, **kwargs: Any):
        bundle = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
        data = dict(data)
        data["text/html"] = self._repr_html_()
        data["text/plain"] = repr(self)
        return data, metadata

    def _repr_html_(self) -> str:  # pragma: no cover - every widget overrides it
        raise NotImplementedError


class _ReadsWorkspace(_StaticHTML):
    """A widget that reads the workspace through a ``_reader`` (``None``: it reads none)."""

    def close(self) -> None:
        """Close the widget (and the workspace kept open for it after ``%metaclaw stop``, when
        it is the last widget showing it)."""
        self._released = True
        if getattr(self, "_reader", None) is not None:
            self._reader.release()
        super().close()  # type: ignore[misc]


# -- skill diff -------------------------------------------------------------------------------------
def _skill_entry(skill: Any) -> dict[str, Any]:
    return {"name": skill.name, "description": skill.description, "category": skill.category,
            "use_when": skill.use_when, "example_asks": list(skill.example_asks),
            "markdown": skill.to_markdown()}


def diff_payload(diff: Any, store: Any) -> dict[str, Any]:
    """The data the diff widget shows, from a :class:`metaclaw.skills.library.SkillDiff`.

    Returns ``SkillDiff.to_dict()`` normalised for display: ``added`` / ``removed`` (name,
    description, category, use_when, example_asks, markdown), ``edited`` (name, description,
    use_when, example_asks, unified_diff, before and after markdown), ``events`` (generation, op, skill_name, reason, evidence turn ids),
    ``turns`` (a preview of every evidence turn: task text and reward, by id) and ``summary``
    (the counts).
    """
    payload = _json_safe(diff.to_dict())
    events = [{"generation": int(e["generation"]), "op": e["op"], "skill_name": e["skill_name"],
               "reason": e.get("reason") or "",
               "evidence": [int(i) for i in (e.get("evidence") or [])],
               "created_at": e.get("created_at")} for e in diff.events]
    payload.update({
        "old": int(diff.old), "new": int(diff.new),
        "added": [_skill_entry(s) for s in diff.added],
        "removed": [_skill_entry(s) for s in diff.removed],
        "edited": [{"name": e.name, "description": e.after.description,
                    "use_when": e.after.use_when, "example_asks": list(e.after.example_asks),
                    "unified_diff": e.unified_diff, "before": e.before.to_markdown(),
                    "after": e.after.to_markdown()} for e in diff.edited],
        "events": events,
        "turns": turn_previews(store, (i for e in events for i in e["evidence"])),
        "summary": {"added": len(diff.added), "edited": len(diff.edited),
                    "removed": len(diff.removed)},
    })
    return payload


def _diff_lines_html(text: str) -> str:
    rows = []
    for line in (text or "").rstrip("\n").split("\n"):
        if line.startswith(("+++ ", "--- ")):
            style = "color:#656d76"
        elif line.startswith("+"):
            style = "background:#dafbe1;color:#1a7f37"
        elif line.startswith("-"):
            style = "background:#ffebe9;color:#cf222e"
        elif line.startswith("@@"):
            style = "color:#656d76"
        else:
            style = ""
        rows.append(f"<span style='{style}'>{_esc(line)}</span>")
    return "<pre style='white-space:pre-wrap;margin:4px 0'>" + "\n".join(rows) + "</pre>"


def _evidence_html(payload: dict[str, Any], name: str) -> str:
    events = [e for e in payload.get("events", []) if e["skill_name"] == name]
    if not events:
        return "<div><i>No recorded events for this skill in this range.</i></div>"
    turns = payload.get("turns", {})
    parts = ["<ul>"]
    for event in events:
        why = f" &mdash; {_esc(event['reason'])}" if event.get("reason") else ""
        parts.append(f"<li>{_esc(event['op'])} in generation {event['generation']}{why}")
        if event["evidence"]:
            parts.append("<ul>")
            for turn_id in event["evidence"]:
                turn = turns.get(str(turn_id))
                if turn is None:
                    parts.append(f"<li>turn #{turn_id} (not in the store)</li>")
                else:
                    parts.append(f"<li>turn #{turn_id} (reward {_fmt_reward(turn['reward'])}): "
                                 f"{_esc(turn['task'] or '(no user message)')}</li>")
            parts.append("</ul>")
        parts.append("</li>")
    parts.append("</ul>")
    return "".join(parts)


#: A diff with more changed skills than this shows each as a closed card (its summary line),
#: opened on demand; fewer are shown open.
OPEN_CARDS = 3


def diff_html(payload: dict[str, Any]) -> str:
    """Static HTML of a :func:`diff_payload`: every change with its text and evidence turns
    (each change a card; closed, one summary line each, when there are more than
    :data:`OPEN_CARDS`)."""
    if not payload:
        return "<div><b>Skill diff</b>: nothing to show.</div>"
    summary = payload.get("summary", {})
    parts = [f"<div class='metaclaw-skill-diff-static'><b>Skill diff: generation "
             f"{payload['old']} &rarr; {payload['new']}</b> &middot; "
             f"+{summary.get('added', 0)} added &middot; ~{summary.get('edited', 0)} edited "
             f"&middot; &minus;{summary.get('removed', 0)} removed"]
    if not any(summary.get(k) for k in ("added", "edited", "removed")):
        parts.append("<p>No changes between these generations.</p>")
    sections = (("added", "Added", lambda s: "\n".join(f"+{line}" for line in
                                                     s["markdown"].rstrip("\n").split("\n"))),
                ("edited", "Edited", lambda s: s["unified_diff"]),
                ("removed", "Removed", lambda s: "\n".join(f"-{line}" for line in
                                                         s["markdown"].rstrip("\n").split("\n"))))
    cards = sum(len(payload.get(key, [])) for key, _, _ in sections)
    if cards > OPEN_CARDS:
        parts.append(f"<p>{cards} skills changed; open a card to read its text and evidence.</p>")
    opened = " open" if cards <= OPEN_CARDS else ""
    for key, title, text_of in sections:
        for item in payload.get(key, []):
            parts.append(
                f"<details{opened}><summary>{title}: <b>{_esc(item['name'])}</b> &mdash; "
                f"{_esc(item.get('description') or '')}</summary>"
                f"{_diff_lines_html(text_of(item))}<div><b>Evidence</b></div>"
                f"{_evidence_html(payload, item['name'])}</details>")
    parts.append("</div>")
    return "".join(parts)


class SkillDiffWidget(_StaticHTML, anywidget.AnyWidget):
    """Pick two skill generations and see what changed, with the evidence turns behind it.

    ``library``: a :class:`metaclaw.skills.library.SkillLibrary`. ``old`` / ``new``: generation numbers
    (default: the latest generation and its parent). Synced traitlets: ``generations`` (rows of
    ``skill_generations`` with a ``label`` that tells them apart: kind, the skills changed, the
    number of skills), ``old``, ``new``, ``mode`` (``"unified"`` | ``"side-by-side"``), ``diff``
    (:func:`diff_payload`), ``error``, ``latest`` (the library's newest generation as last read).

    The widget is **pinned** to what it was made to show: a new generation, a proposal decided
    elsewhere, change nothing it shows (``latest`` moves, and the front-end says the library has
    changed since). With ``follow=True`` (a checkbox in the front-end, or ``%metaclaw diff
    --follow``) ``new`` moves to each new generation and the proposals are re-read as they
    change. :meth:`refresh` (or the front-end's refresh button) re-reads the generations and
    proposals now, which another process may have changed.

    The widget keeps working after ``%metaclaw stop`` (the workspace stays open while a widget
    shows it) and after ``store.close()`` (it reopens the workspace file).
    """

    _esm = WIDGETS_DIR / "skill_diff.js"
    _css = CSS

    generations = traitlets.List(traitlets.Dict()).tag(sync=True)
    old = traitlets.Int(0).tag(sync=True)
    new = traitlets.Int(0).tag(sync=True)
    mode = traitlets.Enum(("unified", "side-by-side"), default_value="unified").tag(sync=True)
    diff = traitlets.Dict().tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    proposals = traitlets.List(traitlets.Dict()).tag(sync=True)
    proposal_action = traitlets.Dict().tag(sync=True)
    author = traitlets.Unicode("").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    refresh_requests = traitlets.Int(0).tag(sync=True)
    follow = traitlets.Bool(False).tag(sync=True)
    latest = traitlets.Int(0).tag(sync=True)

    def __init__(self, library: Any, old: int | None = None, new: int | None = None, *,
                 mode: str = "unified", follow: bool = False, author: str | None = None,
                 **kwargs: Any):
        from metaclaw.fastloop.labels import default_author

        self._library = library
        self._ready = False
        self._released = False
        self._reader = _Reader(self, library.store)
        kwargs.setdefault("author", author or default_author())
        rows = self._generation_rows()
        numbers = [r["generation"] for r in rows]
        if new is None:
            new = numbers[-1] if numbers else 0
        if old is None:
            parent = next((r["parent"] for r in rows if r["generation"] == new), None)
            old = parent if parent is not None else max(new - 1, 0)
        super().__init__(generations=rows, old=int(old), new=int(new), mode=mode,
                         follow=bool(follow), latest=numbers[-1] if numbers else 0, **kwargs)
        self._ready = True
        self._recompute()
        self.refresh_proposals()
        library.subscribe(self._on_generation)

    # -- reading ----------------------------------------------------------------------------
    def _lib(self) -> Any:
        """The library, reading through an open connection to its workspace."""
        store = self._reader.store()
        if self._library.store is not store:  # its connection was closed: use the reopened one
            self._library.store = store
        return self._library

    def _generation_rows(self) -> list[dict[str, Any]]:
        library = self._lib()
        changes: dict[int, list[str]] = {}
        for event in library.store.query("SELECT generation, op, skill_name FROM skill_events "
                                         "ORDER BY id"):
            sign = {"add": "+", "edit": "~", "remove": "−"}.get(event["op"], "")
            changes.setdefault(int(event["generation"]), []).append(
                f"{sign}{event['skill_name']}")
        rows = []
        for r in library.generations():
            row = {k: r.get(k) for k in ("generation", "parent", "kind", "reason", "created_at",
                                         "skills", "events")}
            row["changes"] = changes.get(int(r["generation"]), [])
            row["label"] = generation_label(row)
            rows.append(row)
        return _json_safe(rows)

    @traitlets.validate("old", "new")
    def _check_generation(self, proposal: Any) -> int:
        value = int(proposal["value"])
        known = [r["generation"] for r in self.generations]
        if known and value not in known:
            self.generations = self._generation_rows()
            known = [r["generation"] for r in self.generations]
        if known and value not in known:
            raise traitlets.TraitError(
                f"skill generation {value} does not exist; choose one between {known[0]} and "
                f"{known[-1]}")
        return value

    @traitlets.observe("old", "new")
    def _on_choice(self, _change: Any) -> None:
        if self._ready:
            self._recompute()

    def _recompute(self) -> None:
        try:
            library = self._lib()
            diff = library.diff(self.old, self.new)
            payload = diff_payload(diff, library.store)
        except Exception as exc:  # shown in the widget; the library is left as it was
            self.error = f"cannot compare generations {self.old} and {self.new}: {_one_line(exc)}"
            self.diff = {}
            return
        self.error = ""
        self.diff = payload

    def _on_generation(self, generation: int) -> None:
        """A new generation: the pickers offer it and ``latest`` says so; only a following
        widget changes what it shows."""
        try:
            self.generations = self._generation_rows()
        except Exception as exc:  # noqa: BLE001 - said in the widget
            self.error = f"cannot read the skill generations: {_one_line(exc)}"
            return
        self.latest = max([int(generation)] + [r["generation"] for r in self.generations])
        if self.follow:
            self.refresh_proposals()
            if self.latest != self.new:
                self.new = self.latest

    @traitlets.observe("follow")
    @_reports("cannot follow the library")
    def _on_follow(self, change: Any) -> None:
        if self._ready and change["new"]:
            self.refresh()

    def close(self) -> None:
        """Close the widget and stop following the library (a closed widget would otherwise
        recompute its diff on every new generation for as long as the library lives); the
        workspace it kept open after ``%metaclaw stop`` is closed with the last widget."""
        self._library.unsubscribe(self._on_generation)
        self._released = True
        if getattr(self, "_reader", None) is not None:
            self._reader.release()
        super().close()

    def refresh(self) -> "SkillDiffWidget":
        """Re-read the generations and proposals (another process may have changed them) and
        recompute the diff; a following widget moves to the latest generation. Returns the
        widget."""
        try:
            library = self._lib()
            library.sync()  # adopts a newer generation (a following widget moves to it)
        except Exception as exc:  # e.g. the workspace file was deleted
            self.error = f"cannot read the skill library: {_one_line(exc)}"
            return self
        self.generations = self._generation_rows()
        self.latest = self.generations[-1]["generation"] if self.generations else 0
        self.refresh_proposals()
        if self.follow and self.new != self.latest:
            self.new = self.latest  # recomputes
        else:
            self._recompute()
        return self

    @traitlets.observe("refresh_requests")
    @_reports("cannot refresh")
    def _on_refresh_request(self, _change: Any) -> None:
        if self._ready:
            self.refresh()

    # -- proposals ------------------------------------------------------------------------------
    def refresh_proposals(self, limit: int = 20) -> list[dict[str, Any]]:
        """Re-read the proposals (held ones first, then the latest decided) with each one's diff
        against the current library and the gate's per-case evidence; returns them."""
        from metaclaw.fastloop import proposals as store_proposals

        try:
            library = self._lib()
            rows = store_proposals.all(library.store)
        except Exception as exc:  # e.g. a store from before proposals existed
            self.error = f"cannot read the proposals: {_one_line(exc)}"
            return []
        held = [p for p in rows if p.status == store_proposals.HELD]
        decided = [p for p in reversed(rows) if p.status != store_proposals.HELD]
        payload = []
        for p in (held + decided)[:limit]:
            payload.append({
                "id": p.id, "origin": p.origin, "status": p.status, "reason": p.reason,
                "judge_calls": p.judge_calls, "base_generation": p.base_generation,
                "generation": p.generation, "decided_by": p.decided_by,
                "decided_at": p.decided_at, "created_at": p.created_at,
                "decision": p.evidence.get("decision"), "cases": p.evidence.get("cases", []),
                "safety": p.safety, "support_ids": p.support_ids, "history": p.history,
                "diffs": p.diffs(library)})
        self.proposals = _json_safe(payload)
        return self.proposals

    def promote(self, proposal_id: int, note: str = "") -> int:
        """Promote a held proposal as the widget's ``author``; returns the new generation."""
        from metaclaw.fastloop import proposals as store_proposals

        library = self._lib()
        generation = store_proposals.promote(library.store, library, int(proposal_id),
                                             by=self.author or None, note=note)
        self.message = f"proposal #{proposal_id} promoted by {self.author}: generation {generation}"
        self.refresh_proposals()
        # promoted from this widget: it shows the generation just written
        self.generations = self._generation_rows()
        self.latest = max(int(generation), self.latest)
        self.new = int(generation)
        return generation

    def discard(self, proposal_id: int, reason: str = "") -> None:
        """Discard a held proposal as the widget's ``author``."""
        from metaclaw.fastloop import proposals as store_proposals

        store_proposals.discard(self._lib().store, int(proposal_id), by=self.author or None,
                                reason=reason)
        self.message = f"proposal #{proposal_id} discarded by {self.author}"
        self.refresh_proposals()

    def edit_proposal(self, proposal_id: int, name: str, *, body: str | None = None,
                      description: str | None = None) -> None:
        """Change the text a held proposal would write for skill ``name``."""
        from metaclaw.fastloop import proposals as store_proposals

        store_proposals.edit(self._lib().store, int(proposal_id), name, body=body,
                             description=description, by=self.author or None)
        self.message = f"proposal #{proposal_id}: {name} edited by {self.author}"
        self.refresh_proposals()

    @traitlets.observe("proposal_action")
    def _on_proposal_action(self, change: Any) -> None:
        request = change["new"] or {}
        if not self._ready or not request.get("action"):
            return
        try:
            action, pid = request["action"], int(request["id"])
            if action == "promote":
                self.promote(pid, note=str(request.get("note") or ""))
            elif action == "discard":
                self.discard(pid, reason=str(request.get("note") or ""))
            elif action == "edit":
                self.edit_proposal(pid, str(request["name"]), body=request.get("body"),
                                   description=request.get("description"))
            else:
                raise ValueError(f"unknown action {action!r}; use promote, discard or edit")
            self.error = ""
        except SourceGone as exc:
            self.error = str(exc)
        except Exception as exc:  # shown in the widget; the library is left as it was
            said = _one_line(exc)  # a ProposalError names the proposal already
            prefix = f"proposal #{request.get('id')}"
            self.error = said if said.startswith(prefix) else f"{prefix}: {said}"
            # a proposal decided since this view was made: show where it stands now
            with contextlib.suppress(Exception):
                self.refresh_proposals()

    def compare(self, old: int, new: int) -> "SkillDiffWidget":
        """Show the change from ``old`` to ``new`` (one recomputation); returns the widget."""
        self._ready = False
        try:
            self.old, self.new = int(old), int(new)
        finally:
            self._ready = True
        self._recompute()
        return self

    def _pin_line(self) -> str:
        if self.follow:
            return "following the library: “to” moves to each new generation"
        line = f"pinned to generation {self.old} → {self.new}"
        if self.latest > max(self.old, self.new):
            line += (f"; the library has changed since (now generation {self.latest}): tick "
                     "“follow” or press refresh to see it")
        return line

    def _repr_html_(self) -> str:
        from metaclaw.fastloop.gate import cases_html

        if self.error and not self.diff:
            return f"<div><b>Skill diff</b>: {_esc(self.error)}</div>"
        if self.old == self.new and self.proposals:  # a review of proposals: no diff to show
            parts = [f"<div><b>Skill library</b>: generation {self.new} &middot; "
                     f"{sum(p['status'] == 'held' for p in self.proposals)} proposal(s) held for "
                     "review</div>"]
        else:
            parts = [diff_html(self.diff),
                     f"<div style='color:#656d76;font-size:90%'>{_esc(self._pin_line())}</div>"]
        if self.error:
            parts.append(f"<p style='color:#cf222e'>{_esc(self.error)}</p>")
        for p in self.proposals:
            diffs = "".join(_diff_lines_html(d["unified_diff"]) for d in p["diffs"])
            parts.append(f"<details {'open' if p['status'] == 'held' else ''}><summary><b>Proposal "
                         f"#{p['id']}</b> ({_esc(p['origin'])}, {_esc(p['status'])}"
                         f"{' by ' + _esc(p['decided_by']) if p['decided_by'] else ''}) &mdash; "
                         f"{_esc(p['reason'])} &middot; {p['judge_calls']} judge calls</summary>"
                         f"{diffs}{cases_html({'decision': p['decision'], 'reason': p['reason'], 'cases': p['cases'], 'safety': p['safety'], 'judge_calls': p['judge_calls']})}"
                         "</details>")
        return "".join(parts)

    def __repr__(self) -> str:
        s = self.diff.get("summary", {})
        return (f"SkillDiffWidget(generation {self.old} -> {self.new}: +{s.get('added', 0)} added, "
                f"~{s.get('edited', 0)} edited, -{s.get('removed', 0)} removed"
                f"{', following' if self.follow else ''})")


def generation_label(row: dict[str, Any]) -> str:
    """A generation as a picker shows it: number, kind, the skills it changed (``+`` added,
    ``~`` edited, ``−`` removed; at most three named), and how many skills it holds."""
    changes = list(row.get("changes") or [])
    named = ", ".join(changes[:3]) + (f" +{len(changes) - 3} more" if len(changes) > 3 else "")
    if not named and row.get("reason"):
        named = _short(str(row["reason"]), 40)
    skills = row.get("skills")
    count = "" if skills is None else f" · {skills} skill{'' if skills == 1 else 's'}"
    named = f" · {named}" if named else ""
    return f"{row['generation']} · {row.get('kind') or '?'}{named}{count}"


# -- buffers ----------------------------------------------------------------------------------------
_TURN_DETAIL_FIELDS = (
    "id", "session_id", "turn_index", "created_at", "model", "status", "error", "skill_generation",
    "policy_version", "buffer_set", "buffer_state", "reward", "judge_model", "judge_votes",
    "judge_rationale", "request_messages", "response", "tool_calls", "finish_reason",
    "injected_skills")


class BufferWidget(_ReadsWorkspace, anywidget.AnyWidget):
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

    _esm = WIDGETS_DIR / "buffers.js"
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
    refresh_requests = traitlets.Int(0).tag(sync=True)
    max_rows = traitlets.Int(200).tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    taken_at = traitlets.Float(0.0).tag(sync=True)

    def __init__(self, store: Any, *, set_filter: str = "all", state_filter: str = "all",
                 generation: int | None = None, text: str = "", max_rows: int = 200,
                 **kwargs: Any):
        import polars as pl

        self._reader = _Reader(self, store)
        self._released = False
        self._ready = False
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

    @property
    def _store(self) -> Any:
        return self._reader.store()

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

    @traitlets.observe("set_filter", "state_filter", "generation_filter", "text_filter",
                       "max_rows")
    @_reports("cannot filter the turns")
    def _on_filter(self, _change: Any) -> None:
        if self._ready:
            self._apply()

    @traitlets.observe("selected")
    @_reports("cannot show the turn")
    def _on_selected(self, _change: Any) -> None:
        if self._ready:
            self._load_detail()

    @traitlets.observe("refresh_requests")
    @_reports("cannot refresh")
    def _on_refresh_request(self, _change: Any) -> None:
        if self._ready:
            self.refresh()

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


# -- trace ------------------------------------------------------------------------------------------
class TraceWidget(_ReadsWorkspace, anywidget.AnyWidget):
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

    _esm = WIDGETS_DIR / "trace.js"
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
    refresh_requests = traitlets.Int(0).tag(sync=True)
    author = traitlets.Unicode("").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)

    def __init__(self, store: Any, session: str | None = None, *, page_size: int = 100,
                 failures_only: bool = False, author: str | None = None,
                 threshold: float = 0.0, **kwargs: Any):
        from metaclaw.fastloop.labels import default_author
        from metaclaw.trace import Trace, sessions

        self._threshold = float(threshold)
        self._ready = False
        self._released = False
        self.trace = Trace(store, session, threshold=threshold)
        self._reader = _Reader(self, store)
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

    def _select(self, turn_id: int | None) -> None:
        visible = self._visible()
        ids = [r["id"] for r in visible]
        detail: dict[str, Any] = {}
        error = ""
        if turn_id is not None:  # read first: a turn that cannot be read moves nothing
            self._store  # noqa: B018 - an open connection for the trace (or SourceGone)
            try:
                detail = _clip_texts(_json_safe(self.trace.turn(int(turn_id))))
            except LookupError as exc:
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
            self.message = "no skill generation was written for this turn yet"
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
                           author=self.author or None, threshold=self._threshold)
        self.message = f"turn #{target} labelled {row['verdict']} by {row['author']}"
        self._reload()
        return row

    @traitlets.observe("session_id")
    @_reports("cannot open the session")
    def _on_session(self, change: Any) -> None:
        if not self._ready or change["new"] == self.trace.session_id:
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

    @traitlets.observe("failures_only")
    @_reports("cannot filter the turns")
    def _on_failures_only(self, _change: Any) -> None:
        if self._ready:
            self._reload()

    @traitlets.observe("offset", "page_size")
    @_reports("cannot page")
    def _on_page(self, _change: Any) -> None:
        if self._ready:
            self._page()

    @traitlets.observe("selected")
    def _on_selected(self, change: Any) -> None:
        if not self._ready:
            return
        try:
            self._select(change["new"])
        except Exception as exc:  # noqa: BLE001 - the selection stays where it was
            self._ready = False
            self.selected = change["old"]
            self._ready = True
            self.error = (str(exc) if isinstance(exc, SourceGone)
                          else f"cannot show turn #{change['new']}: {_one_line(exc)}")

    @traitlets.observe("step_request")
    @_reports("cannot step")
    def _on_step_request(self, change: Any) -> None:
        request = change["new"] or {}
        if not self._ready or not request:
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

        self.sessions = _json_safe(sessions(self._store, 200, self._threshold))
        self._reload()
        return self

    @traitlets.observe("refresh_requests")
    @_reports("cannot read the session from the store")
    def _on_refresh_request(self, _change: Any) -> None:
        if self._ready:
            self.refresh()

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
        return (f"TraceWidget(session {self.session_id!r}: {self.total} turns, "
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
                           + (f" <small>use when: {_esc(s['use_when'])}</small>"
                              if s.get("use_when") else "")
                           + (f" <small>{int(s['example_asks'])} example asks</small>"
                              if s.get("example_asks") else "")
                           for s in retrieval.get("scores") or [])
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


# -- training monitor -------------------------------------------------------------------------------
#: The metrics charted per training step: (column, title).
MONITOR_METRICS = (("loss", "loss"), ("reward_mean", "mean reward"),
                   ("skipped_groups", "skipped groups"), ("tokens_per_s", "tokens/s"))

#: The most steps a chart draws; a longer run draws every k-th step and the last. Every point
#: costs altair validation and bytes sent at each update: 10,000 steps took about 12 s per
#: update and 20 s for the static chart, with the kernel busy all along.
MAX_CHART_STEPS = 500

_offline_lock = threading.Lock()


def _enable_offline_charts() -> bool:
    """Make altair's ``JupyterChart`` load its JavaScript from vl-convert instead of a CDN
    (once per process). Returns False when vl-convert-python is missing."""
    from altair import JupyterChart

    with _offline_lock:
        try:
            JupyterChart.enable_offline()
        except ImportError:
            return False
        return True


class TrainingMonitor:
    """A live chart of a training run: loss, mean reward, skipped groups and tokens/s per step.

    ``store``: a :class:`metaclaw.store.Store`; ``run_id``: the run to chart (``None``: always
    the newest run in ``training_steps``). With ``poll`` (seconds, default 1) a background
    thread reads new ``training_steps`` rows and updates the chart in place, so the cell that
    displays the monitor returns at once while training runs elsewhere; ``poll=None`` updates
    only on :meth:`update` (also usable as a trainer's step callback: :meth:`on_step`).

    Displayed, it is an altair ``JupyterChart`` widget (:attr:`widget`, JavaScript bundled
    offline by vl-convert) plus a static HTML form (SVG chart + table) for nbconvert/GitHub.
    :meth:`chart` returns the altair chart itself, :attr:`frame` the steps as a polars frame.
    """

    def __init__(self, store: Any, run_id: str | None = None, *, poll: float | None = 1.0):
        if poll is not None and poll <= 0:
            raise ValueError(f"poll must be a positive number of seconds or None, got {poll!r}")
        self.store = store
        self._released = False
        self._reader = _Reader(self, store)
        self.follow_latest = run_id is None
        self.run_id = run_id
        self.poll = poll
        self.error = ""
        self._rows: list[dict[str, Any]] = []
        self._last_id = 0
        self._lock = threading.RLock()
        self._widget: Any = None
        self._display_id: str | None = None
        self._shown_steps, self._shown_at = 0, 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.update()
        if poll is not None:
            self.start()

    # -- data ---------------------------------------------------------------------------------
    def update(self) -> int:
        """Read new ``training_steps`` rows of the run; returns how many arrived.

        When following the newest run and a newer run starts, the chart switches to it.
        """
        with self._lock:
            store = self._reader.store()
            if self.follow_latest:
                latest = store.query(
                    "SELECT run_id FROM training_steps ORDER BY id DESC LIMIT 1")
                newest = latest[0]["run_id"] if latest else None
                if newest != self.run_id:
                    self.run_id, self._rows, self._last_id = newest, [], 0
            if self.run_id is None:
                return 0
            rows = store.query(
                "SELECT id, run_id, step, created_at, backend, policy_version, skill_generation, "
                "loss, reward_mean, reward_std, groups, skipped_groups, tokens, wall_time_s "
                "FROM training_steps WHERE run_id = ? AND id > ? ORDER BY id",
                (self.run_id, self._last_id))
            for row in rows:
                wall = row.get("wall_time_s")
                row["tokens_per_s"] = (float(row["tokens"]) / wall
                                       if wall and wall > 0 and row.get("tokens") is not None
                                       else None)
                self._rows.append(row)
                self._last_id = row["id"]
            if rows and self._widget is not None:
                self._widget.chart = self.chart()
        if rows:
            self._update_display()
        return len(rows)

    def on_step(self, *_args: Any, **_kwargs: Any) -> None:
        """A step callback for a trainer: reads the newest rows at once (arguments ignored)."""
        self.update()

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The charted steps (rows of ``training_steps`` plus ``tokens_per_s``), oldest first."""
        with self._lock:
            return [dict(r) for r in self._rows]

    @property
    def frame(self):
        """The charted steps as a ``polars.DataFrame``."""
        import polars as pl

        columns = ("run_id", "step", "created_at", "policy_version", "skill_generation", "loss",
                   "reward_mean", "reward_std", "groups", "skipped_groups", "tokens",
                   "wall_time_s", "tokens_per_s")
        schema = {"run_id": pl.Utf8, "step": pl.Int64, "created_at": pl.Float64,
                  "policy_version": pl.Int64, "skill_generation": pl.Int64, "loss": pl.Float64,
                  "reward_mean": pl.Float64, "reward_std": pl.Float64, "groups": pl.Int64,
                  "skipped_groups": pl.Int64, "tokens": pl.Int64, "wall_time_s": pl.Float64,
                  "tokens_per_s": pl.Float64}
        rows = self.steps
        return pl.DataFrame({c: [r.get(c) for r in rows] for c in columns}, schema=schema)

    # -- polling ------------------------------------------------------------------------------
    def start(self, poll: float | None = None) -> "TrainingMonitor":
        """Start (or keep) the background poller; returns the monitor."""
        if poll is not None:
            self.poll = poll
        if self.poll is None:
            self.poll = 1.0
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll_loop, name="metaclaw-training-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.update()
                self.error = ""
            except Exception as exc:  # e.g. the store was closed: stop polling, say why
                self.error = f"the training monitor stopped polling: {exc}"
                return

    def stop(self) -> None:
        """Stop the background poller (the chart keeps its last data)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._thread = None
        self._update_display(force=True)

    # -- the output it was displayed in -------------------------------------------------------
    #: Seconds between two updates of the displayed output's static form (a PNG drawn each time).
    DISPLAY_EVERY_S = 2.0

    def _ipython_display_(self) -> None:
        """Displayed with a display id, so that the output's static form (the PNG a notebook
        shows without a kernel, or before it is trusted) follows the run: a saved notebook
        carries the chart as it ended, not its first, empty state."""
        import uuid

        from IPython.display import display

        if self._display_id is None:
            self._display_id = uuid.uuid4().hex
        data, metadata = self._repr_mimebundle_()
        display(data, metadata=metadata, raw=True, display_id=self._display_id)
        self._shown_steps, self._shown_at = len(self._rows), time.monotonic()

    def _update_display(self, force: bool = False) -> None:
        if self._display_id is None or len(self._rows) == self._shown_steps:
            return
        if not force and time.monotonic() - self._shown_at < self.DISPLAY_EVERY_S:
            return
        from IPython.display import update_display

        try:
            data, metadata = self._repr_mimebundle_()
            update_display(data, metadata=metadata, raw=True, display_id=self._display_id)
        except Exception:  # noqa: BLE001 - the live chart itself is already up to date
            return
        self._shown_steps, self._shown_at = len(self._rows), time.monotonic()

    @property
    def polling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop polling and close the chart widget (its output goes blank; :meth:`stop` only
        stops polling and keeps the chart)."""
        self.stop()
        self._released = True
        self._reader.release()
        if self._widget is not None:
            self._widget.close()

    # -- chart --------------------------------------------------------------------------------
    def _title(self) -> str:
        if self.run_id is None:
            return "Training: waiting for the first step"
        rows = self._rows
        if not rows:
            return f"Training run {self.run_id}: no steps yet"
        last = rows[-1]
        bits = [f"step {last['step']}"]
        if last.get("loss") is not None:
            bits.append(f"loss {last['loss']:.4g}")
        if last.get("reward_mean") is not None:
            bits.append(f"mean reward {last['reward_mean']:.3g}")
        bits.append(f"policy v{last['policy_version']}")
        return f"Training run {self.run_id}: " + ", ".join(bits)

    def chart(self):
        """The altair chart of the run: one small panel per metric, step on the x axis."""
        import altair as alt

        with self._lock:
            stride = max(1, math.ceil(len(self._rows) / MAX_CHART_STEPS))
            rows = self._rows[::stride]
            if rows and rows[-1] is not self._rows[-1]:
                rows.append(self._rows[-1])
            # an infinite loss (a diverged step) is left out as a gap: JSON has no infinity
            values = [{"step": r["step"], "metric": title, "value": r[column]}
                      for r in rows for column, title in MONITOR_METRICS
                      if r.get(column) is not None and math.isfinite(r[column])]
            title = self._title()
            if stride > 1:
                title += f" (1 step in {stride} drawn)"
        order = [title_ for _, title_ in MONITOR_METRICS]
        base = alt.Chart(alt.Data(values=values)).mark_line(point=True).encode(
            x=alt.X("step:Q", title="step", axis=alt.Axis(tickMinStep=1)),
            y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
            color=alt.Color("metric:N", legend=None, sort=order),
            tooltip=[alt.Tooltip("metric:N"), alt.Tooltip("step:Q"),
                     alt.Tooltip("value:Q", format=".4g")],
        ).properties(width=260, height=130)
        return base.facet(
            facet=alt.Facet("metric:N", title=None, sort=order), columns=2,
        ).resolve_scale(y="independent").properties(title=title)

    @property
    def widget(self):
        """The live ``altair.JupyterChart`` widget (built on first use, JavaScript offline)."""
        with self._lock:
            if self._widget is None:
                from altair import JupyterChart

                _enable_offline_charts()
                self._widget = JupyterChart(self.chart())
            return self._widget

    def _repr_mimebundle_(self, **kwargs: Any):
        """The live chart widget, and for a notebook opened without a kernel (or not trusted
        yet, where JupyterLab shows no widget) the chart as a PNG drawn locally."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
        data, metadata = dict(data), dict(metadata or {})
        png = None
        if self._rows:
            from metaclaw.notebook.charts import png_bundle

            try:
                png = png_bundle(self.chart().to_dict())
            except Exception:  # noqa: BLE001 - the HTML table below still tells the story
                png = None
        if png is not None:
            data["image/png"] = png[0]["image/png"]
            metadata.update(png[1])
        else:
            data["text/html"] = self._repr_html_()
        data["text/plain"] = repr(self)
        return data, metadata

    def _repr_html_(self, limit: int = 10) -> str:
        svg = ""
        if self._rows:
            try:
                import vl_convert

                svg = vl_convert.vegalite_to_svg(self.chart().to_dict())
            except Exception:  # the table below still tells the story
                svg = ""
        rows = self.steps[-limit:]
        head = "".join(f"<th>{c}</th>" for c in ("step", "policy", "gen", "loss", "mean reward",
                                                  "skipped groups", "tokens/s"))

        def num(value: Any, fmt: str = ".4g") -> str:
            return "" if value is None else format(value, fmt)

        body = "".join(
            f"<tr><td>{r['step']}</td><td>v{r['policy_version']}</td>"
            f"<td>{r['skill_generation']}</td><td>{num(r.get('loss'))}</td>"
            f"<td>{num(r.get('reward_mean'))}</td><td>{r.get('skipped_groups')}</td>"
            f"<td>{num(r.get('tokens_per_s'), '.1f')}</td></tr>" for r in rows)
        table = (f"<table><tr>{head}</tr>{body}</table>" if rows else "<p>No steps yet.</p>")
        more = (f"<p>(last {len(rows)} of {len(self._rows)} steps)</p>"
                if len(self._rows) > len(rows) else "")
        return (f"<div class='metaclaw-training-static'><b>{_esc(self._title())}</b>"
                f"{svg}{table}{more}</div>")

    def __repr__(self) -> str:
        return f"TrainingMonitor(run_id={self.run_id!r}, steps={len(self._rows)}, " \
               f"polling={self.polling}): {self._title()}"


# -- scheduler --------------------------------------------------------------------------------------
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


class SchedulerView(_ReadsWorkspace, anywidget.AnyWidget):
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

    _esm = WIDGETS_DIR / "scheduler.js"
    _css = CSS

    state = traitlets.Unicode("unknown").tag(sync=True)
    signals = traitlets.List(traitlets.Dict()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    transitions = traitlets.List(traitlets.Dict()).tag(sync=True)
    segments = traitlets.List(traitlets.Dict()).tag(sync=True)
    now = traitlets.Float(0.0).tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    refresh_requests = traitlets.Int(0).tag(sync=True)

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
        self._released = False
        self._reader = _Reader(self, store) if store is not None else None
        from metaclaw.slowloop.scheduler.machine import Scheduler
        from metaclaw.store import this_process

        # a scheduler object is this process's: its timeline is not another process's
        self._process = this_process() if isinstance(owner, Scheduler) else None
        self._last, self._clock = int(last), clock
        self._ready = False
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
                transitions = list(reversed(self._reader.store().query(
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

    @traitlets.observe("refresh_requests")
    @_reports("could not refresh")
    def _on_refresh_request(self, _change: Any) -> None:
        if self._ready:
            self.refresh()

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


__all__ = ["SkillDiffWidget", "BufferWidget", "TraceWidget", "TrainingMonitor", "SchedulerView", "diff_payload",
           "diff_html", "turn_previews", "state_segments", "WIDGETS_DIR", "MONITOR_METRICS",
           "MAX_CHART_STEPS", "MAX_TEXT_CHARS"]
