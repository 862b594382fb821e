"""Support and query buffers: which recorded turns feed the evolver and which may train weights.

As in the MetaClaw paper: the **query set** of skill generation ``G`` is the trajectories collected
after the adaptation that produced ``G``, served under ``G``, whatever their judged outcome (a
judged failure is not removed from it: it is exactly the signal RL needs); the **support set** is
the failures that drove an evolution; it never trains weights. Every task turn (``main`` or a
``stage:<name>`` of a pipeline, :func:`metaclaw.sessions.is_task_turn`; side calls never enter
the buffers) carries the skill generation that served it (``turns.skill_generation``); its
place in the buffers lives in two columns of ``turns``:

- ``buffer_set``   ``'support'`` | ``'query'`` | ``NULL`` (side turns, failed requests)
- ``buffer_state`` ``'live'`` | ``'consumed'`` | ``'purged'`` | ``NULL``

and ``turns.trained_steps`` counts the GRPO steps that trained on it.

The rules (one obvious place: :func:`classify`, :func:`refresh` and :func:`advance`):

1. A successful (``status = 'ok'``) task turn enters the query set when it is first classified
   (right after it is recorded): ``query / live``. Judging it changes nothing: its set was
   decided once.
2. The evolver's evidence is the judged failures (``reward < threshold``) among the live turns
   of the current generation (:func:`support_set`). When they produce a new generation ``G``,
   :func:`advance` marks them ``support / consumed``, unless a GRPO step already trained on one
   (``trained_steps > 0``, counted when the step claims its turns, before its gradient step:
   :func:`claim_for_training`): a trained turn is never reclassified; it stays ``query`` and is
   purged like the rest. Every other live turn served under a generation older than ``G``
   becomes ``purged`` (kept in the store, flagged, never trained on): it was served with skills
   that no longer exist.
3. A turn of an older generation that is classified late goes straight to ``purged``.
   ``consumed`` and ``purged`` are final.

So at any moment the query set (the slow loop's training buffer) is every live turn of the
current generation, and the support set of the next evolution is its judged failures.
:class:`metaclaw.fastloop.FastLoop` applies these rules on the automatic path;
:meth:`metaclaw.judge.Judge.judge_turns` and :meth:`metaclaw.evolver.Evolver.evolve` apply them
on the manual path.
"""

from __future__ import annotations

from typing import Any, Iterable

from metaclaw.sessions import TASK_TURNS_SQL, is_task_turn
from metaclaw.store import IN_IDS, Store, id_list

SUPPORT = "support"
QUERY = "query"
LIVE = "live"
CONSUMED = "consumed"
PURGED = "purged"
FINAL_STATES = (CONSUMED, PURGED)


def current_generation(store: Store) -> int:
    """The latest skill generation number in the store (0 when none was stored yet)."""
    latest = store.latest_generation()
    return 0 if latest is None else latest


#: A failure in SQL (one parameter: the judge threshold), the same rule as :func:`is_failure`.
FAILURE_SQL = ("(human_label = 'fail' OR (COALESCE(human_label, '') != 'pass' "
               "AND reward IS NOT NULL AND reward < ?))")


def is_failure(turn: dict[str, Any], threshold: float = 0.0) -> bool:
    """Whether a turn counts as a failure: a human label (``turns.human_label``, see
    :mod:`metaclaw.labels`) takes precedence over the judge's reward."""
    label = turn.get("human_label")
    if label in ("pass", "fail"):
        return label == "fail"
    reward = turn.get("reward")
    return reward is not None and float(reward) < threshold


def classify(turn: dict[str, Any], *, generation: int,
             threshold: float = 0.0) -> tuple[str | None, str | None]:
    """The ``(buffer_set, buffer_state)`` a turn row should have under the rules above.

    ``turn`` is a row of ``turns`` (as returned by ``Store.turn``); ``generation`` the current one.
    The set is decided once: a turn that already has one keeps it. Returns the turn's present
    values unchanged for final states and for turns that never enter the buffers (side turns,
    failed requests). ``threshold`` is accepted for callers that pass it; judging a turn does
    not move it between sets.
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


def refresh(store: Store, turn_ids: Iterable[int] | None = None, *, threshold: float = 0.0,
            generation: int | None = None) -> dict[str, int]:
    """Apply the buffer rules to some turns (default: every successful task turn not in a final
    state).

    Returns counts of the changes made: ``{"support": n, "query": n, "purged": n}``.
    """
    gen = current_generation(store) if generation is None else generation
    if turn_ids is None:
        rows = store.turns(f"{TASK_TURNS_SQL} AND status = 'ok' "
                           "AND (buffer_state IS NULL OR buffer_state = 'live')")
    else:
        rows = store.turns(f"id {IN_IDS}", (id_list(turn_ids),))
    changes = {SUPPORT: 0, QUERY: 0, PURGED: 0}
    with store.transaction():
        for row in rows:
            new = classify(row, generation=gen, threshold=threshold)
            if new == (row.get("buffer_set"), row.get("buffer_state")):
                continue
            store.update_turn(row["id"], buffer_set=new[0], buffer_state=new[1])
            changes[PURGED if new[1] == PURGED else new[0]] += 1
    return changes


def advance(store: Store, generation: int, consumed: Iterable[int] = ()) -> dict[str, int]:
    """Move the buffers to a new generation ``generation``.

    ``consumed``: ids of the support turns (judged failures) that produced the generation: they
    become ``support / consumed``, except those a GRPO step trained on, which keep their
    ``query`` set and are purged. Every other live turn of an older generation is marked
    ``purged``. Idempotent. Returns ``{"consumed": n, "purged": n}``.
    """
    with store.transaction():
        ids = consumable(store, consumed)
        store.execute(f"UPDATE turns SET buffer_set = 'support', buffer_state = 'consumed' "
                      f"WHERE id {IN_IDS}", (id_list(ids),))
        cur = store.execute(
            "UPDATE turns SET buffer_state = 'purged' "
            "WHERE buffer_state = 'live' AND skill_generation < ?", (int(generation),))
        n_purged = cur.rowcount
    return {"consumed": len(ids), "purged": n_purged}


def consumable(store: Store, turn_ids: Iterable[int]) -> list[int]:
    """Those of ``turn_ids`` that :func:`advance` would mark ``support / consumed`` now: task
    turns still live (or not yet classified) that no GRPO step trained on."""
    return [row["id"] for row in store.query(
        f"SELECT id FROM turns WHERE id {IN_IDS} AND buffer_set IS NOT NULL "
        "AND trained_steps = 0 AND (buffer_state IS NULL OR buffer_state = 'live') ORDER BY id",
        (id_list(turn_ids),))]


def mark_trained(store: Store, turn_ids: Iterable[int]) -> None:
    """Count one GRPO step that trained on each of ``turn_ids`` (``turns.trained_steps``).
    A trained turn's buffer set is final: it stays in the query set."""
    store.execute(f"UPDATE turns SET trained_steps = trained_steps + 1 WHERE id {IN_IDS}",
                  (id_list(turn_ids),))


def claim_for_training(store: Store, turn_ids: Iterable[int]) -> set[int]:
    """Claim query turns for one GRPO step: those of ``turn_ids`` that are still live query
    turns of the latest skill generation get the step counted (``turns.trained_steps``), in one
    transaction with that check. Returns the ids claimed; the others must not be trained.

    The claim orders a training step against an evolution landing at the same moment: an
    evolution committed first makes the turns stale here (a newer generation exists, or
    :func:`advance` has already moved them); one committed after finds them trained and leaves
    them in the query set. Either way no support turn trains weights."""
    with store.transaction():
        claimed = {row["id"] for row in store.query(
            f"SELECT id FROM turns WHERE id {IN_IDS} AND buffer_set = 'query' "
            "AND buffer_state = 'live' AND skill_generation = ?",
            (id_list(turn_ids), current_generation(store)))}
        mark_trained(store, claimed)
    return claimed


def release_training_claim(store: Store, turn_ids: Iterable[int]) -> None:
    """Undo :func:`claim_for_training` for a step that failed before training."""
    store.execute(f"UPDATE turns SET trained_steps = MAX(trained_steps - 1, 0) "
                  f"WHERE id {IN_IDS}", (id_list(turn_ids),))


def support_set(store: Store, generation: int | None = None,
                state: str | None = LIVE, threshold: float = 0.0) -> list[dict[str, Any]]:
    """Support turns of ``generation`` (default: the current one), oldest first.

    ``state='live'`` (default): the evolver's next evidence: the failures among the live turns
    of the generation (they are still in its query set): turns a person labelled ``fail``, and
    turns the judge scored below ``threshold`` that no person labelled ``pass`` (a human label
    takes precedence over the judge, :func:`is_failure`). ``'consumed'``: the failures that drove an evolution. ``None``: both.
    """
    gen = current_generation(store) if generation is None else int(generation)
    pending = (f"buffer_state = 'live' AND {FAILURE_SQL}", [float(threshold)])
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
        f"created_at, request_messages FROM turns WHERE {where} ORDER BY id")
    data = {
        "id": [r["id"] for r in rows],
        "session_id": [r["session_id"] for r in rows],
        "turn_type": [r["turn_type"] for r in rows],
        "set": [r["buffer_set"] for r in rows],
        "state": [r["buffer_state"] for r in rows],
        "skill_generation": [r["skill_generation"] for r in rows],
        "reward": [None if r["reward"] is None else float(r["reward"]) for r in rows],
        "created_at": [r["created_at"] for r in rows],
        "task": [_short(last_user_text(r["request_messages"])) for r in rows],
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
