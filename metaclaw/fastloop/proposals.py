"""Skill proposals: candidate changes the verification gate held back, and the record of every
promotion.

    from metaclaw.fastloop import proposals
    proposals.held(store)                          # what waits for review
    proposals.edit(store, 3, "miles-to-km", body="...", by="alice")
    proposals.promote(store, library, 3, by="alice")   # -> new generation
    proposals.discard(store, 4, by="alice", reason="too specific")
    proposals.revert(library, 7, by="alice")        # undo one (automatic) generation

A row of ``proposals`` holds the operations (``ops``: ``{"op", "name", "reason", "evidence",
"skill"}``), the failures they were written for (``support_ids``), the gate's per-case evidence
(``evidence``: a :class:`metaclaw.fastloop.gate.GateReport` dict), safety findings, the judge votes the
decision cost, its ``origin`` (``auto``: the fast loop; ``manual``: a person) and ``status``
(``held`` | ``promoted`` | ``discarded``), who decided and when, and the generation a promotion
created. Automatic promotions are recorded here too (``decided_by = 'gate'``), so every
generation the fast loop made has its evidence on file, and every automatic generation is marked
``automatic`` in its reason and undone by :func:`revert` in one call (``%metaclaw revert G``).
"""

from __future__ import annotations

import difflib
import html
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from metaclaw import buffers
from metaclaw.fastloop.gate import GateReport, cases_html, safety_check
from metaclaw.skills.library import (Skill, SkillConflict, SkillFormatError, SkillOp, default_author,
                                     oversize_reason)
from metaclaw.store import Store

HELD, PROMOTED, DISCARDED = "held", "promoted", "discarded"
AUTO_PREFIX = "automatic"


class ProposalError(RuntimeError):
    """A proposal cannot be found, edited, promoted or discarded (one sentence why)."""


def op_to_dict(op: SkillOp) -> dict[str, Any]:
    """An operation as stored, with the hash of the skill it was made from (``base``), so that
    promoting it later refuses to overwrite a change made to that skill since."""
    return {"op": op.op, "name": op.name, "reason": op.reason, "evidence": list(op.evidence),
            "skill": op.skill.to_dict() if op.skill is not None else None, "base": op.base}


def op_from_dict(data: dict[str, Any]) -> SkillOp:
    skill = Skill.from_dict(data["skill"]) if data.get("skill") else None
    return SkillOp(data["op"], skill, data["name"], data.get("reason") or "",
                   [int(i) for i in data.get("evidence") or []], data.get("base"))


@dataclass
class Proposal:
    """One row of ``proposals``, decoded."""

    id: int
    created_at: float
    origin: str
    status: str
    base_generation: int
    ops: list[SkillOp]
    support_ids: list[int]
    evidence: dict[str, Any]
    safety: list[dict[str, Any]]
    judge_calls: int
    reason: str
    history: list[dict[str, Any]] = field(default_factory=list)
    decided_by: str | None = None
    decided_at: float | None = None
    generation: int | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Proposal":
        return cls(int(row["id"]), row["created_at"], row["origin"], row["status"],
                   int(row["base_generation"]), [op_from_dict(o) for o in row["ops"]],
                   [int(i) for i in row["support_ids"]], row["evidence"] or {},
                   row["safety"] or [], int(row["judge_calls"] or 0), row["reason"] or "",
                   row["history"] or [], row["decided_by"], row["decided_at"],
                   row["generation"])

    @property
    def report(self) -> GateReport:
        return GateReport.from_dict(self.evidence) if self.evidence else GateReport(
            "hold", self.reason, self.base_generation)

    def diffs(self, library: Any) -> list[dict[str, Any]]:
        """Per operation: ``{op, name, description, reason, evidence, unified_diff}`` against the
        library's current skills."""
        out = []
        for op in self.ops:
            try:
                current = library.get(op.name)
            except Exception:  # not in the library (an add, or removed since)
                current = None
            before = current.to_markdown() if current is not None else ""
            after = op.skill.to_markdown() if op.skill is not None else ""
            text = "".join(difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True),
                fromfile=f"{op.name} (current)", tofile=f"{op.name} (proposed)"))
            out.append({"op": op.op, "name": op.name,
                        "description": op.skill.description if op.skill else "",
                        "reason": op.reason, "evidence": list(op.evidence),
                        "markdown": after, "unified_diff": text})
        return out

    def __repr__(self) -> str:
        return f"<{self}>"

    def __str__(self) -> str:
        ops = "; ".join(f"{op.op} {op.name}" for op in self.ops)
        by = f" by {self.decided_by}" if self.decided_by else ""
        gen = f" -> generation {self.generation}" if self.generation is not None else ""
        return (f"proposal #{self.id} ({self.origin}, {self.status}{by}{gen}): {ops} — "
                f"{self.reason} [{self.judge_calls} judge votes]")

    def _repr_html_(self) -> str:
        esc = html.escape
        ops = "".join(f"<li>{esc(op.op)} <b>{esc(op.name)}</b>: {esc(op.reason)}</li>"
                      for op in self.ops)
        return (f"<div><b>{esc(str(self))}</b><ul>{ops}</ul>{cases_html(self.evidence)}</div>")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def record(store: Store, ops: Iterable[SkillOp], *, origin: str, status: str,
           base_generation: int, support_ids: Iterable[int] = (),
           report: GateReport | None = None, reason: str = "", decided_by: str | None = None,
           generation: int | None = None) -> int:
    """Store a proposal row; returns its id."""
    report_dict = report.to_dict() if report is not None else {}
    now = time.time()
    return store._insert("proposals", {
        "created_at": now, "origin": origin, "status": status,
        "base_generation": int(base_generation), "ops": _dumps([op_to_dict(o) for o in ops]),
        "support_ids": _dumps(sorted({int(i) for i in support_ids})),
        "evidence": _dumps(report_dict), "safety": _dumps(report_dict.get("safety", [])),
        "judge_calls": int(report_dict.get("judge_calls", 0)),
        "reason": reason or report_dict.get("reason", ""), "history": "[]",
        "decided_by": decided_by, "decided_at": now if decided_by else None,
        "generation": generation})


def get(store: Store, proposal_id: int) -> Proposal:
    rows = store.query("SELECT * FROM proposals WHERE id = ?", (int(proposal_id),))
    if not rows:
        raise ProposalError(f"there is no proposal #{proposal_id}; list them with metaclaw "
                            "proposals, %metaclaw proposals or proposals.all(store)")
    return Proposal.from_row(rows[0])


def all(store: Store, status: str | None = None) -> list[Proposal]:  # noqa: A001 - module API
    """Proposals (of one ``status``, default every one), oldest first."""
    if status is None:
        rows = store.query("SELECT * FROM proposals ORDER BY id")
    else:
        rows = store.query("SELECT * FROM proposals WHERE status = ? ORDER BY id", (status,))
    return [Proposal.from_row(r) for r in rows]


def held(store: Store) -> list[Proposal]:
    """The proposals waiting for review."""
    return all(store, HELD)


def frame(store: Store):
    """``proposals`` as a ``polars.DataFrame`` (one row per proposal, ops summarised)."""
    import polars as pl

    rows = all(store)
    schema = {"id": pl.Int64, "origin": pl.Utf8, "status": pl.Utf8,
              "base_generation": pl.Int64, "ops": pl.Utf8, "support_ids": pl.Utf8,
              "decision": pl.Utf8, "reason": pl.Utf8, "judge_calls": pl.Int64,
              "decided_by": pl.Utf8, "generation": pl.Int64, "created_at": pl.Float64}
    data = {
        "id": [p.id for p in rows], "origin": [p.origin for p in rows],
        "status": [p.status for p in rows], "base_generation": [p.base_generation for p in rows],
        "ops": ["; ".join(f"{o.op} {o.name}" for o in p.ops) for p in rows],
        "support_ids": [",".join(map(str, p.support_ids)) for p in rows],
        "decision": [p.evidence.get("decision") for p in rows],
        "reason": [p.reason for p in rows], "judge_calls": [p.judge_calls for p in rows],
        "decided_by": [p.decided_by for p in rows], "generation": [p.generation for p in rows],
        "created_at": [p.created_at for p in rows]}
    return pl.DataFrame(data, schema=schema).with_columns(  # a time a person reads
        pl.from_epoch((pl.col("created_at") * 1000).cast(pl.Int64), time_unit="ms"))


def proposed_support(store: Store, base_generation: int) -> set[int]:
    """The failures (support turn ids) any proposal made from ``base_generation`` was written
    for, held, promoted or discarded: the fast loop does not ask again for them alone."""
    rows = store.query("SELECT DISTINCT j.value AS id FROM proposals, "
                       f"{store.json_values('support_ids', 'j', 'int')} "
                       "WHERE base_generation = ? AND j.value IS NOT NULL", (int(base_generation),))
    return {int(r["id"]) for r in rows}


def _require_held(store: Store, proposal_id: int) -> Proposal:
    proposal = get(store, proposal_id)
    if proposal.status != HELD:
        raise ProposalError(f"proposal #{proposal.id} is already {proposal.status}"
                            + (f" (by {proposal.decided_by})" if proposal.decided_by else "")
                            + "; only held proposals can be changed")
    return proposal


def edit(store: Store, proposal_id: int, name: str, *, body: str | None = None,
         description: str | None = None, category: str | None = None,
         by: str | None = None) -> Proposal:
    """Change the skill an operation of a held proposal would write (the gate's evidence is
    kept; the edit is added to the proposal's history). Returns the updated proposal."""
    with store.transaction():  # read and write at once: a concurrent decision or edit waits
        return _edit(store, _require_held(store, proposal_id), name, body=body,
                     description=description, category=category, by=by or default_author())


def _edit(store: Store, proposal: Proposal, name: str, *, body: str | None,
          description: str | None, category: str | None, by: str) -> Proposal:
    ops = list(proposal.ops)
    for i, op in enumerate(ops):
        if op.name != name:
            continue
        if op.skill is None:
            raise ProposalError(f"operation {op.op} {name!r} removes a skill; there is no text "
                                "to edit (discard the proposal instead)")
        old = op.skill
        try:
            skill = Skill(name=old.name, description=old.description if description is None
                          else description, category=old.category if category is None
                          else category, body=old.body if body is None else body,
                          extra=old.extra)
        except SkillFormatError as exc:
            raise ProposalError(f"the edited skill {name!r} is invalid: {exc}") from exc
        if too_big := oversize_reason(skill):
            raise ProposalError(f"the edited skill {name!r} is invalid: {too_big}")
        ops[i] = SkillOp(op.op, skill, op.name, op.reason, list(op.evidence), op.base)
        changed = [k for k, v in (("body", body), ("description", description),
                                  ("category", category)) if v is not None]
        history = [*proposal.history, {"action": "edit", "skill": name, "fields": changed,
                                       "by": by, "at": time.time(), "before": old.to_dict()}]
        store._update("proposals", "id", proposal.id, {
            "ops": _dumps([op_to_dict(o) for o in ops]), "history": _dumps(history)})
        return get(store, proposal.id)
    raise ProposalError(f"proposal #{proposal.id} has no operation on {name!r}; it changes "
                        + ", ".join(repr(o.name) for o in ops))


def with_served_asks(library: Any, ops: list[SkillOp], threshold: float = 0.0) -> list[SkillOp]:
    """``ops`` with the asks each skill served well in the current generation (judged above
    ``threshold``, or labelled pass: :func:`metaclaw.buffers.served_asks`) added to its example
    asks: into the operation on it, or as an ``edit`` of its retrieval keys alone (``evidence``:
    those turns). They ride along with the generation the operations make anyway: a skill
    learns its keys without a generation of its own, which would purge the query set the slow
    loop trains on."""
    generation, skills = library.current()
    scopes = {skill.name: skill.scope for skill in skills}
    scopes.update((op.name, op.skill.scope) for op in ops if op.skill is not None)
    served = buffers.served_asks(library.store, generation, scopes=scopes, threshold=threshold)
    if not served:
        return ops
    out, touched = [], set()
    for op in ops:
        if op.skill is not None and op.op in ("add", "edit") and op.name in served:
            keyed = op.skill.with_retrieval_keys(ask for _, ask in served[op.name])
            op = SkillOp(op.op, keyed, op.name, op.reason, op.evidence, op.base)
        touched.add(op.name)
        out.append(op)
    for skill in skills:
        if skill.name in touched or skill.name not in served:
            continue
        keyed = skill.with_retrieval_keys(ask for _, ask in served[skill.name])
        if keyed is not skill:
            ids = [turn_id for turn_id, _ in served[skill.name]]
            out.append(SkillOp("edit", keyed, skill.name,
                               f"example asks from {len(ids)} turns it served well",
                               ids[:20], skill.content_hash))
    return out


def apply_ops(library: Any, ops: list[SkillOp], support_ids: Iterable[int], *, reason: str,
              base_generation: int | None = None, threshold: float = 0.0,
              then: Callable[[int], None] | None = None) -> tuple[int, dict[str, Any]]:
    """Apply ``ops`` as a new ``evolve`` generation and move the buffers (the support turns it
    learned from are consumed, older live turns purged), with ``then(generation)`` (the
    proposal's record), all in one transaction: a process killed midway leaves all of it or
    none. Returns the generation and the buffer changes: ``{"consumed": n, "purged": n,
    "consumed_ids": [...]}`` (support turns a GRPO step trained on meanwhile stay query
    turns). ``base_generation``: refuse (:class:`~metaclaw.skills.library.SkillConflict`) if the
    library has moved past it. ``threshold``: the judge's (:func:`with_served_asks`)."""
    moved: dict[str, Any] = {}
    ops = with_served_asks(library, ops, threshold)

    def with_the_generation(generation: int) -> None:
        moved["consumed_ids"] = buffers.consumable(library.store, support_ids)
        moved.update(buffers.advance(library.store, generation, consumed=support_ids))
        if then is not None:
            then(generation)

    try:
        generation = library.apply(ops, kind="evolve", reason=reason,
                                   base_generation=base_generation, then=with_the_generation)
    except SkillConflict:
        raise
    except SkillFormatError as exc:
        raise ProposalError(f"the proposal no longer applies to generation "
                            f"{library.generation} ({exc}); edit or discard it") from exc
    return generation, moved


def promote(store: Store, library: Any, proposal_id: int, *, by: str | None = None,
            allow_unsafe: bool = False, note: str = "", threshold: float = 0.0) -> int:
    """Promote a held proposal: its (possibly edited) operations become a new generation.

    The promotion records who promoted it, when, and on what evidence (the gate's cases stay on
    the row). The safety check runs again on the edited text; a finding refuses the promotion
    unless ``allow_unsafe``. ``threshold``: the judge's, above which a turn served well (its ask
    becomes an example ask of its skills, :func:`with_served_asks`). Returns the new
    generation.
    """
    proposal = _require_held(store, proposal_id)
    who = by or default_author()
    findings = safety_check(proposal.ops)
    if findings and not allow_unsafe:
        raise ProposalError(
            f"proposal #{proposal.id} carries unsafe instructions ("
            + "; ".join(str(f) for f in findings[:3]) + "); edit the skill or pass "
            "allow_unsafe=True if you have read it and mean it")
    gate = proposal.evidence
    evidence = (f"gate: {gate.get('decision')} — {gate.get('reason')}" if gate
                else "no gate evidence")
    reason = (f"promoted proposal #{proposal.id} by {who} ({evidence})"
              + (f"; note: {note}" if note else ""))

    def decide(generation: int) -> None:  # in the generation's transaction
        now = _require_held(library.store, proposal.id)  # not decided by another process since
        if [op_to_dict(o) for o in now.ops] != [op_to_dict(o) for o in proposal.ops]:
            raise ProposalError(f"proposal #{proposal.id} was edited while being promoted; "
                                "look at the edit, then promote it again")
        history = [*now.history, {"action": "promote", "by": who, "at": time.time(),
                                  "generation": generation, "note": note,
                                  "unsafe_allowed": bool(findings)}]
        library.store._update("proposals", "id", proposal.id, {
            "status": PROMOTED, "decided_by": who, "decided_at": time.time(),
            "generation": generation, "history": _dumps(history)})

    try:
        generation, _moved = apply_ops(library, proposal.ops, proposal.support_ids,
                                       reason=reason, threshold=threshold, then=decide)
    except (SkillConflict, ProposalError) as exc:
        # promoted or discarded by another process meanwhile: its operations then no longer
        # apply (an add of a skill it just added), which is not what happened; say what did
        _require_held(store, proposal.id)
        if isinstance(exc, ProposalError):
            raise
        raise ProposalError(f"proposal #{proposal.id} was made from a skill that has changed "
                            f"since ({exc}); edit it from the current skill or discard it"
                            ) from exc
    return generation


def discard(store: Store, proposal_id: int, *, by: str | None = None,
            reason: str = "") -> Proposal:
    """Discard a held proposal (kept on file with who discarded it and why)."""
    who = by or default_author()
    with store.transaction():  # read and write at once: a concurrent decision or edit waits
        proposal = _require_held(store, proposal_id)
        history = [*proposal.history, {"action": "discard", "by": who, "at": time.time(),
                                       "reason": reason}]
        store._update("proposals", "id", proposal.id, {
            "status": DISCARDED, "decided_by": who, "decided_at": time.time(),
            "history": _dumps(history)})
        return get(store, proposal.id)


def supersede(store: Store, proposal_id: int) -> list[int]:
    """Discard the older automatic proposals still held that held proposal ``proposal_id`` makes
    redundant: made from the same generation, from failures it was made from too (a burst of
    failures made one after another, each from the failures so far), changing no skill it does
    not change. Returns their ids; each keeps the reason on file."""
    new = get(store, proposal_id)
    if new.status != HELD or new.origin != "auto":
        return []
    support, touched = set(new.support_ids), {op.name for op in new.ops}
    gone = []
    for old in held(store):  # older ones only, about the same skills (none else is lost)
        if old.id < new.id and old.origin == "auto" \
                and old.base_generation == new.base_generation \
                and set(old.support_ids) <= support and {op.name for op in old.ops} <= touched:
            try:
                discard(store, old.id, by="fast loop",
                        reason=f"superseded by proposal #{new.id}, made from the same failures "
                               "and later ones")
            except ProposalError:  # decided meanwhile by someone else: theirs stands
                continue
            gone.append(old.id)
    return gone


def automatic_generations(store: Store) -> list[int]:
    """Generations promoted by the gate without a person (newest last)."""
    rows = store.query("SELECT generation FROM proposals WHERE origin = 'auto' AND "
                       "status = 'promoted' AND decided_by = 'gate' AND generation IS NOT NULL "
                       "ORDER BY generation")
    return [int(r["generation"]) for r in rows]


def revert(library: Any, generation: int | None = None, *, by: str | None = None) -> int:
    """Undo one generation's changes on top of the current library (later changes to other
    skills stay): each skill it touched goes back to its version in the generation's parent
    (default: the latest generation the gate promoted without a person that no revert has
    undone yet, :func:`automatic_generations`). Refuses when a later generation changed one of
    those skills again. Returns the new generation (kind ``rollback``)."""
    reverted = {int(found.group(1)): int(row["generation"]) for row in library.store.query(
                    "SELECT generation, reason FROM skill_generations WHERE kind = 'rollback' "
                    "ORDER BY generation")
                for found in [re.match(r"revert generation (\d+) ", row["reason"] or "")]
                if found}
    if generation is not None and int(generation) in reverted:
        raise ProposalError(f"generation {generation} was reverted already, by generation "
                            f"{reverted[int(generation)]}")
    if generation is None:
        automatic = [g for g in automatic_generations(library.store) if g not in reverted]
        if not automatic:
            raise ProposalError("no automatic generation left to revert (none the gate "
                                "promoted without a person, or each reverted already); name "
                                "the generation to revert")
        generation = automatic[-1]
    row = library.store.generation(int(generation))
    if row is None:
        raise ProposalError(f"there is no skill generation {generation}")
    if row["parent"] is None:
        raise ProposalError(f"generation {generation} is the initial library; nothing to revert")
    before = library.snapshot(int(row["parent"]))
    after = library.snapshot(int(generation))
    current = {s.name: s for s in library.skills()}
    ops: list[SkillOp] = []
    why = f"revert generation {generation} ({row['reason']}) by {by or default_author()}"
    for name in sorted(set(before) | set(after)):
        if before.get(name) == after.get(name):
            continue
        if current.get(name) != after.get(name):
            raise ProposalError(f"skill {name!r} changed again after generation {generation}; "
                                "roll back to an earlier generation instead "
                                "(metaclaw skills rollback G)")
        # made from the version checked above: a change another process commits before the
        # revert takes the write lock is then refused, not written over
        base = after[name].content_hash if name in after else None
        if name in before and name in current:
            ops.append(SkillOp("edit", before[name], name, why, base=base))
        elif name in before:
            ops.append(SkillOp("add", before[name], name, why))
        else:
            ops.append(SkillOp("remove", None, name, why, base=base))
    if not ops:
        raise ProposalError(f"generation {generation} changed no skill; nothing to revert")
    try:
        return library.apply(ops, kind="rollback", reason=why)
    except SkillFormatError as exc:  # a SkillConflict, or an add of a name added meanwhile
        raise ProposalError(f"a skill generation {generation} changed was changed again while "
                            f"reverting it ({exc}); roll back to an earlier generation instead "
                            "(metaclaw skills rollback G)") from exc
