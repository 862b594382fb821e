"""Support and query buffers: which recorded turns feed the evolver and which may train weights.

As in the MetaClaw paper: the **query set** of skill generation ``G`` is the trajectories collected
after the adaptation that produced ``G``, served under ``G``, whatever their judged outcome (a
judged failure is not removed from it: it is exactly the signal RL needs); the **support set** is
the failures that drove an evolution; it never trains weights. Every task turn (``main`` or a
``stage:<name>`` of a pipeline, :func:`metaclaw.proxy.sessions.is_task_turn`; side calls never enter
the buffers) carries the skill generation that served it (``turns.skill_generation``); its
place in the buffers lives in two columns of ``turns``:

- ``buffer_set``   ``'support'`` | ``'query'`` | ``NULL`` (side turns, failed requests)
- ``buffer_state`` ``'live'`` | ``'consumed'`` | ``'purged'`` | ``NULL``

and ``turns.trained_steps`` counts the GRPO steps that trained on it. A step in progress holds an
expiring claim on its turns (``turns.train_claim_by``, ``turns.train_claim_until``): a live
claim counts as trained (the step may be in its gradient step right now); the claim becomes a
count in ``trained_steps`` when the step's record is committed
(:func:`commit_training_claim`); a claim whose step died (``kill -9``, a power loss) expires and
counts as nothing.

The rules (one obvious place: :func:`classify`, :func:`refresh` and :func:`advance`):

1. A successful (``status = 'ok'``) task turn enters the query set when it is first classified
   (right after it is recorded): ``query / live``. Judging it changes nothing: its set was
   decided once.
2. The evolver's evidence is the judged failures (``reward < threshold``) among the live turns
   of the current generation (:func:`support_set`). When they produce a new generation ``G``,
   :func:`advance` marks them ``support / consumed``, unless a GRPO step trained on one or is
   training on it (``trained_steps > 0`` or a live claim: :data:`NOT_TRAINED_SQL`, claimed
   before the gradient step by :func:`claim_for_training`): a trained turn is never
   reclassified; it stays ``query`` and is purged like the rest. Every other live turn served
   under a generation older than ``G`` becomes ``purged`` (kept in the store, flagged, never
   trained on): it was served with skills that no longer exist.
3. A turn of an older generation that is classified late goes straight to ``purged``.
   ``consumed`` and ``purged`` are final.

So at any moment the query set (the slow loop's training buffer) is every live turn of the
current generation, and the support set of the next evolution is its judged failures.
:class:`metaclaw.fastloop.loop.FastLoop` applies these rules on the automatic path;
:meth:`metaclaw.fastloop.judge.Judge.judge_turns` and :meth:`metaclaw.fastloop.evolver.Evolver.evolve` apply them
on the manual path.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterable

from metaclaw.store import IN_IDS, Store, id_list
from metaclaw.turns import TASK_TURNS_SQL, is_task_turn

SUPPORT = "support"
QUERY = "query"
LIVE = "live"
CONSUMED = "consumed"
PURGED = "purged"
FINAL_STATES = (CONSUMED, PURGED)


#: Seconds a GRPO step's claim on its turns lasts unless renewed (:func:`renew_training_claim`;
#: the trainer renews it every third of this while the step runs).
TRAIN_CLAIM_S = 120.0

#: A turn no GRPO step has trained on or is training on (one parameter: the time now): no
#: committed step, and no claim, or only an expired one (its step died before committing).
NOT_TRAINED_SQL = ("(trained_steps = 0 AND (train_claim_until IS NULL "
                   "OR train_claim_until < ?))")


def is_trained(turn: dict[str, Any], now: float | None = None) -> bool:
    """Whether a GRPO step trained on ``turn`` (a ``turns`` row) or holds a live claim on it:
    the same rule as :data:`NOT_TRAINED_SQL`, negated."""
    if int(turn.get("trained_steps") or 0) > 0:
        return True
    until = turn.get("train_claim_until")
    return until is not None and float(until) >= (time.time() if now is None else now)


def current_generation(store: Store) -> int:
    """The latest skill generation number in the store (0 when none was stored yet)."""
    latest = store.latest_generation()
    return 0 if latest is None else latest


#: A failure in SQL (one parameter: the judge threshold), the same rule as :func:`is_failure`.
FAILURE_SQL = ("(human_label = 'fail' OR (COALESCE(human_label, '') != 'pass' "
               "AND reward IS NOT NULL AND reward < ?))")


#: A turn that went well (one parameter: the judge threshold): a person's pass, or a judged
#: reward above the threshold no person overruled (:func:`metaclaw.turns.judge_verdict`: at the
#: threshold the judge could not tell, neither a failure nor a success).
SUCCESS_SQL = ("(human_label = 'pass' OR (COALESCE(human_label, '') != 'fail' "
               "AND reward IS NOT NULL AND reward > ?))")


def served_asks(store: Store, generation: int, *, scopes: dict[str, str] | None = None,
                threshold: float = 0.0, limit: int = 2000) -> dict[str, list[tuple[int, str]]]:
    """For each skill, the ``(turn id, retrieval query)`` of the task turns of ``generation``
    it was injected into that went well (:data:`SUCCESS_SQL`), oldest first: asks the skill is
    known to serve, which become its example asks at the next generation
    (:func:`metaclaw.fastloop.proposals.apply_ops`). At most ``limit`` turns are read.

    A person's ask is one of their private data: it is learnt only by a skill private to that
    person (``scopes``: each skill's scope, shared where not given), never by one another
    person reads."""
    rows = store.query(
        f"SELECT id, injected_skills, retrieval_query, person FROM turns "
        f"WHERE skill_generation = ? "
        f"AND status = 'ok' AND retrieval_query IS NOT NULL AND retrieval_query != '' "
        f"AND injected_skills != '[]' AND {SUCCESS_SQL} ORDER BY id LIMIT ?",
        (generation, float(threshold), int(limit)))
    asks: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        for name in row["injected_skills"] or []:
            if row["person"] is None or (scopes or {}).get(name) == f"person:{row['person']}":
                asks.setdefault(name, []).append((int(row["id"]), row["retrieval_query"]))
    return asks


def is_failure(turn: dict[str, Any], threshold: float = 0.0) -> bool:
    """Whether a turn counts as a failure: a human label (``turns.human_label``, see
    :mod:`metaclaw.fastloop.labels`) takes precedence over the judge's reward."""
    label = turn.get("human_label")
    if label in ("pass", "fail"):
        return label == "fail"
    reward = turn.get("reward")
    return reward is not None and float(reward) < threshold


def classify(turn: dict[str, Any], *, generation: int) -> tuple[str | None, str | None]:
    """The ``(buffer_set, buffer_state)`` a turn row should have under the rules above.

    ``turn`` is a row of ``turns`` (as returned by ``Store.turn``); ``generation`` the current one.
    The set is decided once: a turn that already has one keeps it. Returns the turn's present
    values unchanged for final states and for turns that never enter the buffers (side turns,
    failed requests). Judging a turn does not move it between sets: the threshold is read
    where the support set is (:func:`support_set`).
    """
    present = (turn.get("buffer_set"), turn.get("buffer_state"))
    if not is_task_turn(turn.get("turn_type", "main")) or turn.get("status") != "ok":
        return present
    if present[1] in FINAL_STATES:
        return present
    wanted_set = present[0] or QUERY
    if int(turn.get("skill_generation") or 0) < generation:
        return wanted_set, PURGED
    return wanted_set, LIVE


def refresh(store: Store, turn_ids: Iterable[int] | None = None, *,
            generation: int | None = None) -> dict[str, int]:
    """Apply the buffer rules to some turns (default: every successful task turn not in a final
    state).

    Returns counts of the changes made: ``{"support": n, "query": n, "purged": n}``.
    """
    changes = {SUPPORT: 0, QUERY: 0, PURGED: 0}
    # read under the write lock: rows read before it could predate an evolution another
    # process commits meanwhile, and be written back live under a generation that is gone.
    # Only the columns the rules read: the conversations would hold the lock for long.
    columns = "SELECT id, turn_type, status, skill_generation, buffer_set, buffer_state FROM turns"
    with store.transaction():
        gen = current_generation(store) if generation is None else generation
        if turn_ids is None:
            rows = store.query(f"{columns} WHERE {TASK_TURNS_SQL} AND status = 'ok' "
                               "AND (buffer_state IS NULL OR buffer_state = 'live') ORDER BY id")
        else:
            rows = store.query(f"{columns} WHERE id {IN_IDS} ORDER BY id", (id_list(turn_ids),))
        for row in rows:
            new = classify(row, generation=gen)
            if new == (row.get("buffer_set"), row.get("buffer_state")):
                continue
            store.update_turn(row["id"], buffer_set=new[0], buffer_state=new[1])
            changes[PURGED if new[1] == PURGED else new[0]] += 1
    return changes


def advance(store: Store, generation: int, consumed: Iterable[int] = ()) -> dict[str, int]:
    """Move the buffers to a new generation ``generation``.

    ``consumed``: ids of the support turns (judged failures) that produced the generation: they
    become ``support / consumed``, except those a GRPO step trained on or holds a live claim
    on, which keep their ``query`` set and are purged. Every other live turn of an older
    generation is marked ``purged``. Idempotent. Returns ``{"consumed": n, "purged": n}``.
    """
    with store.transaction():
        ids = consumable(store, consumed)
        # an expired claim on a turn that becomes support is dropped with it: should its step
        # still be alive after all (a suspended laptop), it cannot count the turn as trained
        store.execute(f"UPDATE turns SET buffer_set = 'support', buffer_state = 'consumed', "
                      f"train_claim_by = NULL, train_claim_until = NULL WHERE id {IN_IDS}",
                      (id_list(ids),))
        cur = store.execute(
            "UPDATE turns SET buffer_state = 'purged' "
            "WHERE buffer_state = 'live' AND skill_generation < ?", (int(generation),))
        n_purged = cur.rowcount
    return {"consumed": len(ids), "purged": n_purged}


def consumable(store: Store, turn_ids: Iterable[int]) -> list[int]:
    """Those of ``turn_ids`` that :func:`advance` would mark ``support / consumed`` now: task
    turns still live (or not yet classified) that no GRPO step trained on or is training on
    (an expired claim is no training: :data:`NOT_TRAINED_SQL`)."""
    return [row["id"] for row in store.query(
        f"SELECT id FROM turns WHERE id {IN_IDS} AND buffer_set IS NOT NULL "
        f"AND {NOT_TRAINED_SQL} AND (buffer_state IS NULL OR buffer_state = 'live') "
        "ORDER BY id", (id_list(turn_ids), time.time()))]


def mark_trained(store: Store, turn_ids: Iterable[int]) -> None:
    """Count one GRPO step that trained on each of ``turn_ids`` (``turns.trained_steps``).
    A trained turn's buffer set is final: it stays in the query set."""
    store.execute(f"UPDATE turns SET trained_steps = trained_steps + 1 WHERE id {IN_IDS}",
                  (id_list(turn_ids),))


def new_claim_id(label: str = "step") -> str:
    """A fresh identity for one GRPO step's claim (``turns.train_claim_by``)."""
    return f"{label}/{uuid.uuid4().hex[:12]}"


def claim_for_training(store: Store, turn_ids: Iterable[int], claim_id: str | None = None,
                       seconds: float = TRAIN_CLAIM_S) -> set[int]:
    """Claim query turns for one GRPO step ``claim_id`` for ``seconds``: those of ``turn_ids``
    that are still live query turns of the latest skill generation, and that no other step
    holds a live claim on, get the claim, in one transaction with that check. Returns the ids
    claimed; the others must not be trained.

    The claim orders a training step against an evolution landing at the same moment: an
    evolution committed first makes the turns stale here (a newer generation exists, or
    :func:`advance` has already moved them); one committed after finds them claimed and leaves
    them in the query set. Either way no support turn trains weights. The claim counts as
    training until it expires; :func:`commit_training_claim` makes it a permanent count when
    the step is recorded, :func:`release_training_claim` drops it when the step trained
    nothing, and :func:`renew_training_claim` keeps it alive while the step runs."""
    claim_id = claim_id or new_claim_id()
    with store.transaction():
        now = time.time()
        claimed = {row["id"] for row in store.query(
            f"SELECT id FROM turns WHERE id {IN_IDS} AND buffer_set = 'query' "
            "AND buffer_state = 'live' AND skill_generation = ? AND (train_claim_until IS NULL "
            "OR train_claim_until < ? OR train_claim_by = ?)",
            (id_list(turn_ids), current_generation(store), now, claim_id))}
        store.execute(f"UPDATE turns SET train_claim_by = ?, train_claim_until = ? "
                      f"WHERE id {IN_IDS}", (claim_id, now + seconds, id_list(claimed)))
    return claimed


def renew_training_claim(store: Store, claim_id: str, seconds: float = TRAIN_CLAIM_S) -> int:
    """Extend step ``claim_id``'s claims to ``seconds`` from now (a step running longer than one
    claim). A claim another step took over after it expired, or one an evolution dropped, is
    not this step's any more and stays as it is. Returns how many were renewed."""
    return store.execute("UPDATE turns SET train_claim_until = ? WHERE train_claim_by = ?",
                         (time.time() + seconds, claim_id)).rowcount


def commit_training_claim(store: Store, claim_id: str) -> set[int]:
    """Count step ``claim_id`` in ``trained_steps`` on the turns it still holds a claim on and
    end the claim (call it in the transaction that records the step). Returns the turns
    counted; a turn the step claimed but no longer holds (its claim expired and an evolution
    made it support, or another step took it over) is not counted."""
    with store.transaction():
        held = {row["id"] for row in store.query(
            "SELECT id FROM turns WHERE train_claim_by = ?", (claim_id,))}
        store.execute(f"UPDATE turns SET trained_steps = trained_steps + 1, "
                      f"train_claim_by = NULL, train_claim_until = NULL WHERE id {IN_IDS}",
                      (id_list(held),))
    return held


def release_training_claim(store: Store, claim_id: str) -> None:
    """Drop step ``claim_id``'s claims without counting it (a step that trained nothing)."""
    store.execute("UPDATE turns SET train_claim_by = NULL, train_claim_until = NULL "
                  "WHERE train_claim_by = ?", (claim_id,))


def release_orphaned_claims(store: Store) -> int:
    """Drop every training claim in the store; returns how many turns had one.

    Call it only while holding the workspace's training lease
    (:class:`metaclaw.training_lease.TrainingLease`) with no step of this process running: a
    step claims turns only under that lease, so any claim left then was made by a trainer that
    died mid-step (``kill -9``). Waiting for it to expire would leave those turns untrainable,
    and every step of the next trainer empty, for up to :data:`TRAIN_CLAIM_S`."""
    return store.execute("UPDATE turns SET train_claim_by = NULL, train_claim_until = NULL "
                         "WHERE train_claim_by IS NOT NULL").rowcount


#: The evolver's next evidence among a generation's turns (one parameter: the threshold).
PENDING_SQL = f"buffer_state = 'live' AND {FAILURE_SQL}"


def support_set(store: Store, generation: int | None = None,
                state: str | None = LIVE, threshold: float = 0.0) -> list[dict[str, Any]]:
    """Support turns of ``generation`` (default: the current one), oldest first.

    ``state='live'`` (default): the evolver's next evidence: the failures among the live turns
    of the generation (they are still in its query set): turns a person labelled ``fail``, and
    turns the judge scored below ``threshold`` that no person labelled ``pass`` (a human label
    takes precedence over the judge, :func:`is_failure`). ``'consumed'``: the failures that drove an evolution. ``None``: both.
    """
    gen = current_generation(store) if generation is None else int(generation)
    pending = (PENDING_SQL, [float(threshold)])
    done = ("buffer_set = 'support' AND buffer_state = 'consumed'", [])
    if state == LIVE:
        where, params = pending
    elif state == CONSUMED:
        where, params = done
    elif state is None:
        where, params = f"(({pending[0]}) OR ({done[0]}))", pending[1]
    else:
        where, params = "buffer_set = 'support' AND buffer_state = ?", [state]
    return store.turns(f"skill_generation = ? AND {where}", [gen, *params])


def next_evidence(store: Store, threshold: float = 0.0) -> set[int]:
    """The ids of :func:`support_set`'s live turns (the evolver's next evidence), read alone."""
    rows = store.query(f"SELECT id FROM turns WHERE skill_generation = ? AND {PENDING_SQL}",
                       (current_generation(store), float(threshold)))
    return {int(row["id"]) for row in rows}


def query_set(store: Store, generation: int | None = None,
              state: str | None = LIVE) -> list[dict[str, Any]]:
    """Query turns of ``generation`` (default: the current one), whatever their judged outcome;
    ``state``: ``'live'`` (default), ``'purged'`` or ``None`` for all.

    The live query set of the current generation is the slow loop's training buffer.
    """
    gen = current_generation(store) if generation is None else int(generation)
    where, params = "buffer_set = ? AND skill_generation = ?", [QUERY, gen]
    if state is not None:
        where += " AND buffer_state = ?"
        params.append(state)
    return store.turns(where, params)


def message_text(content: Any) -> str:
    """Text of an OpenAI message ``content`` (a string or a list of content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif part.get("type") not in (None, "text"):
                    parts.append(f"[{part.get('type')}]")
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def last_user_text(messages: list[dict[str, Any]] | None) -> str:
    """The text of the last user message in ``messages`` ("" when there is none)."""
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message.get("content"))
    return ""


def task_previews(store: Store, turn_ids: Iterable[int], limit: int = 80,
                  chunk: int = 500) -> dict[int, str]:
    """``{turn id: what the user asked, shortened to limit characters}`` (unknown ids absent):
    the recorded ask (the last line of ``retrieval_query``: an agent framework's wrapping
    removed, as ``metaclaw turns --why`` shows it), else the last user message. The conversations, often
    tens of kB a turn, are read only for turns without a recorded ask, a chunk of turns at a
    time: read all at once, 20,000 turns took 862 MB for one refresh of a view."""
    ids = sorted({int(i) for i in turn_ids})
    previews = {}
    for first in range(0, len(ids), chunk):
        part = id_list(ids[first:first + chunk])
        unasked = []
        for row in store.query(f"SELECT id, retrieval_query FROM turns WHERE id {IN_IDS}",
                               (part,)):
            if row["retrieval_query"]:  # its last line is the ask (earlier ones: the task
                # a short follow-up continues, which the preview of its own turn shows)
                previews[row["id"]] = _short(row["retrieval_query"].rsplit("\n", 1)[-1], limit)
            else:
                unasked.append(row["id"])
        if unasked:
            for row in store.query(f"SELECT id, request_messages FROM turns WHERE id {IN_IDS}",
                                   (id_list(unasked),)):
                previews[row["id"]] = _short(last_user_text(row["request_messages"]), limit)
    return previews


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


FRAME_COLUMNS = {
    "id": "Int64", "session_id": "Utf8", "turn_type": "Utf8", "set": "Utf8", "state": "Utf8",
    "skill_generation": "Int64", "reward": "Float64", "created_at": "Float64", "task": "Utf8",
}


def buffers_frame(store: Store, *, all_turns: bool = False):
    """The buffers as a ``polars.DataFrame``, one row per turn, oldest first.

    Columns: ``id``, ``session_id``, ``turn_type``, ``set``, ``state``, ``skill_generation``,
    ``reward``, ``created_at``, ``task`` (the last user message, shortened). By default only
    turns that are in a buffer; ``all_turns=True`` lists every turn (``set`` / ``state`` null
    for the others).
    """
    import polars as pl

    where = "1=1" if all_turns else "buffer_set IS NOT NULL"
    rows = store.query(
        "SELECT id, session_id, turn_type, buffer_set, buffer_state, skill_generation, reward, "
        f"created_at FROM turns WHERE {where} ORDER BY id")
    tasks = task_previews(store, [r["id"] for r in rows])
    data = {
        "id": [r["id"] for r in rows],
        "session_id": [r["session_id"] for r in rows],
        "turn_type": [r["turn_type"] for r in rows],
        "set": [r["buffer_set"] for r in rows],
        "state": [r["buffer_state"] for r in rows],
        "skill_generation": [r["skill_generation"] for r in rows],
        "reward": [None if r["reward"] is None else float(r["reward"]) for r in rows],
        "created_at": [r["created_at"] for r in rows],
        "task": [tasks.get(r["id"], "") for r in rows],
    }
    schema = {name: getattr(pl, dtype) for name, dtype in FRAME_COLUMNS.items()}
    return pl.DataFrame(data, schema=schema)


def buffer_counts(store: Store) -> dict[str, dict[str, int]]:
    """``{set: {state: count}}`` over all turns in a buffer (for status displays)."""
    out: dict[str, dict[str, int]] = {}
    for row in store.query("SELECT buffer_set, buffer_state, COUNT(*) AS n FROM turns "
                           "WHERE buffer_set IS NOT NULL GROUP BY buffer_set, buffer_state"):
        out.setdefault(row["buffer_set"], {})[row["buffer_state"]] = int(row["n"])
    return out
