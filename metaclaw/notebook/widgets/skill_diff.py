"""The skill diff (``widgets/skill_diff.js``): two skill generations compared, with the evidence
turns behind each change, and the proposals held for review."""

from __future__ import annotations

import contextlib
from typing import Any

import traitlets

from metaclaw.notebook.widgets.base import (CSS, SourceGone, _esc, _json_safe, _one_line,
                                            _reacts, _short, _WorkspaceWidget, esm,
                                            _fmt_reward, turn_previews)

def _skill_entry(skill: Any) -> dict[str, Any]:
    return {"name": skill.name, "description": skill.description, "category": skill.category,
            "use_when": skill.use_when, "example_asks": list(skill.example_asks),
            "anticipated_asks": list(skill.anticipated_asks),
            "near_miss_asks": list(skill.near_miss_asks), "markdown": skill.to_markdown()}


def diff_payload(diff: Any, store: Any) -> dict[str, Any]:
    """The data the diff widget shows, from a :class:`metaclaw.skills.library.SkillDiff`.

    Returns ``SkillDiff.to_dict()`` normalised for display: ``added`` / ``removed`` (name,
    description, category, use_when, example_asks, anticipated_asks, near_miss_asks, markdown),
    ``edited`` (name, description, use_when, the asks, unified_diff, before and after
    markdown), ``events`` (generation, op, skill_name, reason, evidence turn ids),
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
                    "anticipated_asks": list(e.after.anticipated_asks),
                    "near_miss_asks": list(e.after.near_miss_asks),
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


class SkillDiffWidget(_WorkspaceWidget):
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

    _esm = esm("skill_diff.js")
    _css = CSS

    generations = traitlets.List(traitlets.Dict()).tag(sync=True)
    old = traitlets.Int(0).tag(sync=True)
    new = traitlets.Int(0).tag(sync=True)
    mode = traitlets.Enum(("unified", "side-by-side"), default_value="unified").tag(sync=True)
    diff = traitlets.Dict().tag(sync=True)
    proposals = traitlets.List(traitlets.Dict()).tag(sync=True)
    proposal_action = traitlets.Dict().tag(sync=True)
    author = traitlets.Unicode("").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    follow = traitlets.Bool(False).tag(sync=True)
    latest = traitlets.Int(0).tag(sync=True)

    def __init__(self, library: Any, old: int | None = None, new: int | None = None, *,
                 mode: str = "unified", follow: bool = False, author: str | None = None,
                 **kwargs: Any):
        from metaclaw.skills.library import default_author

        self._library = library
        self._read_from(library.store)
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

    @_reacts("follow", failing="cannot follow the library")
    def _on_follow(self, change: Any) -> None:
        if change["new"]:
            self.refresh()

    def close(self) -> None:
        """Close the widget and stop following the library (a closed widget would otherwise
        recompute its diff on every new generation for as long as the library lives); the
        workspace it kept open after ``%metaclaw stop`` is closed with the last widget."""
        self._library.unsubscribe(self._on_generation)
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
        if self.old == self.new:  # a review of proposals: no diff to show
            held = sum(p['status'] == 'held' for p in self.proposals)
            parts = [f"<div><b>Skill library</b>: generation {self.new} &middot; "
                     + (f"{held} proposal(s) held for review" if held else
                        self._nothing_held()) + "</div>"]
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
                         f"{_esc(p['reason'])} &middot; {p['judge_calls']} judge votes</summary>"
                         f"{diffs}{cases_html({'decision': p['decision'], 'reason': p['reason'], 'cases': p['cases'], 'safety': p['safety'], 'judge_calls': p['judge_calls']})}"
                         "</details>")
        return "".join(parts)

    def _nothing_held(self) -> str:
        """What a view of one generation says when no proposal is held either."""
        if len(self.generations) > 1:
            return "no proposal held for review"
        return ("the library's only generation: nothing to compare yet, and no proposal held "
                "for review")

    def __repr__(self) -> str:
        s = self.diff.get("summary", {})
        # the held proposals too: the text form (nbconvert, CI logs, a terminal) of a widget
        # made to review one read as an empty diff
        held = [p for p in self.proposals if p.get("status") == "held"]
        proposals = "".join(
            f"; proposal #{p['id']} held: " + (", ".join(f"{d['op']} {d['name']}"
                                                        for d in p.get("diffs") or []) or "no change")
            for p in held)
        if self.old == self.new:  # a review of proposals
            return (f"SkillDiffWidget(generation {self.new}"
                    f"{proposals or ': ' + self._nothing_held()})")
        return (f"SkillDiffWidget(generation {self.old} -> {self.new}: +{s.get('added', 0)} added, "
                f"~{s.get('edited', 0)} edited, -{s.get('removed', 0)} removed"
                f"{', following' if self.follow else ''}{proposals})")


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


