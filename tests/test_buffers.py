"""Support / query buffer rules on a real store and skill library."""

from __future__ import annotations

import polars as pl
import pytest

from metaclaw import buffers
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.store import Store


@pytest.fixture
def library(tmp_path, store):
    return SkillLibrary(tmp_path / "skills", store)


def turn(store: Store, generation: int, *, reward=None, session="s", status="ok",
         turn_type="main", text="do the thing") -> int:
    turn_id = store.record_turn(session_id=session, request_messages=[
        {"role": "system", "content": "sys"}, {"role": "user", "content": text}],
        status=status, response="reply", skill_generation=generation, turn_type=turn_type)
    if reward is not None:
        store.update_turn(turn_id, reward=float(reward))
    return turn_id


def state(store: Store, turn_id: int) -> tuple:
    row = store.turn(turn_id)
    return row["buffer_set"], row["buffer_state"]


def test_classification_of_the_current_generation(store, library):
    """Every successful main turn enters the query set once, whatever its judged outcome; the
    judged failures among them are the evolver's pending support evidence."""
    assert library.generation == 0
    fail = turn(store, 0, reward=-1)
    unclear = turn(store, 0, reward=0)
    good = turn(store, 0, reward=1)
    unjudged = turn(store, 0)
    side = turn(store, 0, turn_type="side", reward=-1)
    error = turn(store, 0, status="error")
    changes = buffers.refresh(store)
    assert changes == {"support": 0, "query": 4, "purged": 0}
    for t in (fail, unclear, good, unjudged):
        assert state(store, t) == ("query", "live")
    assert state(store, side) == (None, None)
    assert state(store, error) == (None, None)
    assert [t["id"] for t in buffers.support_set(store)] == [fail]
    assert [t["id"] for t in buffers.query_set(store)] == [fail, unclear, good, unjudged]
    # a higher threshold makes "unclear" a failure too, for the evolver; no turn changes set
    assert [t["id"] for t in buffers.support_set(store, threshold=0.5)] == [fail, unclear]
    store.update_turn(fail, reward=1.0)
    assert buffers.refresh(store) == {"support": 0, "query": 0, "purged": 0}
    assert state(store, fail) == ("query", "live")


def test_new_generation_consumes_support_and_purges_older_turns(store, library):
    fail_a = turn(store, 0, reward=-1)
    fail_b = turn(store, 0, reward=-1)
    good = turn(store, 0, reward=1)
    buffers.refresh(store)
    generation = library.add(Skill("new-skill", "learned from failures", body="do better"),
                             evidence=[fail_a])
    moved = buffers.advance(store, generation, consumed=[fail_a])
    assert moved == {"consumed": 1, "purged": 2}
    assert state(store, fail_a) == ("support", "consumed")
    assert state(store, fail_b) == ("query", "purged")  # served under a library that is gone
    assert state(store, good) == ("query", "purged")
    # everything is still in the store
    assert len(store.turns()) == 3
    # turns of the new generation enter live; late verdicts on old turns cannot revive them
    fresh = turn(store, generation, reward=-1)
    store.update_turn(good, reward=-1.0)
    buffers.refresh(store)
    assert state(store, fresh) == ("query", "live")
    assert state(store, good) == ("query", "purged")
    assert buffers.support_set(store) == buffers.support_set(store, generation)
    assert [t["id"] for t in buffers.support_set(store, generation)] == [fresh]
    assert [t["id"] for t in buffers.support_set(store, 0, state="consumed")] == [fail_a]
    assert [t["id"] for t in buffers.support_set(store, 0, state=None)] == [fail_a]
    assert buffers.query_set(store, 0) == []
    # idempotent
    assert buffers.advance(store, generation, consumed=[fail_a]) == {"consumed": 0, "purged": 0}


def test_a_trained_turn_is_never_reclassified(store, library):
    """A failure a GRPO step already trained on keeps its query set when it drives an
    evolution (it is purged with its generation, never turned into support)."""
    trained = turn(store, 0, reward=-1)
    untrained = turn(store, 0, reward=-1)
    buffers.refresh(store)
    buffers.mark_trained(store, [trained])
    buffers.mark_trained(store, [trained])
    assert store.turn(trained)["trained_steps"] == 2
    generation = library.add(Skill("s", "d", body="b"), evidence=[trained, untrained])
    assert buffers.advance(store, generation, consumed=[trained, untrained]) == {
        "consumed": 1, "purged": 1}
    assert state(store, trained) == ("query", "purged")
    assert state(store, untrained) == ("support", "consumed")


def test_late_classified_turn_of_an_old_generation_is_purged(store, library):
    library.add(Skill("a-skill", "x", body="y"))
    late = turn(store, 0, reward=-1)
    buffers.refresh(store)
    assert state(store, late) == ("query", "purged")


def test_buffers_frame(store, library):
    empty = buffers.buffers_frame(store)
    assert empty.columns == ["id", "session_id", "turn_type", "set", "state", "skill_generation",
                             "reward", "created_at", "task"]
    assert empty.height == 0
    a = turn(store, 0, reward=-1, text="Please   convert\n5 miles " + "very " * 40)
    turn(store, 0, turn_type="side")
    buffers.refresh(store)
    frame = buffers.buffers_frame(store)
    assert frame.height == 1
    row = frame.row(0, named=True)
    assert row["id"] == a and row["set"] == "query" and row["state"] == "live"
    assert row["reward"] == -1.0 and row["skill_generation"] == 0
    assert row["task"].startswith("Please convert 5 miles very") and len(row["task"]) <= 80
    assert buffers.buffers_frame(store, all_turns=True).height == 2
    assert isinstance(frame, pl.DataFrame)
    assert buffers.buffer_counts(store) == {"query": {"live": 1}}


def test_task_previews_read_conversations_a_chunk_at_a_time(store, monkeypatch):
    """Each turn's preview is its last user message; the conversations are read a chunk of turns
    per query (never all at once), and a malformed one previews as nothing."""
    ids = [turn(store, 0, text=f"ask {i}") for i in range(7)]
    store.execute("UPDATE turns SET request_messages = '{oops' WHERE id = ?", (ids[3],))
    read = []
    query = store.query

    def counting(sql, params=()):
        if "request_messages" in sql:
            read.append(len(__import__("json").loads(params[0])))
        return query(sql, params)

    monkeypatch.setattr(store, "query", counting)
    previews = buffers.task_previews(store, [*ids, 999], chunk=3)
    assert read == [3, 3, 1]  # (999 is no turn: its conversation is not asked for)
    assert previews == {i: ("" if i == ids[3] else f"ask {n}") for n, i in enumerate(ids)}
    frame = buffers.buffers_frame(store, all_turns=True)
    assert frame["task"].to_list() == [previews[i] for i in ids]
    # a recorded ask is the preview (a framework's wrapping removed, as `turns --why` shows
    # it: the column showed Claude Code's system reminder), and its conversation is not read
    store.execute("UPDATE turns SET retrieval_query = 'write the status report' WHERE id = ?",
                  (ids[0],))
    read.clear()
    assert buffers.task_previews(store, ids[:3])[ids[0]] == "write the status report"
    assert read == [2]
    # a short follow-up's recorded query is the task it continues, then its ask: the ask shows
    store.execute("UPDATE turns SET retrieval_query = ? WHERE id = ?",
                  ("write the quarterly sales summary for the board\nuse ISO dates", ids[1]))
    assert buffers.task_previews(store, [ids[1]])[ids[1]] == "use ISO dates"


def test_stage_turns_enter_the_buffers_like_main_turns(store, library):
    """A pipeline's stage turns (``stage:<name>``) are task turns: in the query set once served,
    in the support set when judged failed, consumed by the evolution they drive; a side call
    of the same session never enters."""
    plan_fail = turn(store, 0, reward=-1, turn_type="stage:plan", session="run1")
    write_ok = turn(store, 0, reward=1, turn_type="stage:write", session="run1")
    main_fail = turn(store, 0, reward=-1, session="run1")
    side = turn(store, 0, reward=-1, turn_type="side", session="run1")
    assert buffers.refresh(store) == {"support": 0, "query": 3, "purged": 0}
    assert [t["id"] for t in buffers.query_set(store)] == [plan_fail, write_ok, main_fail]
    assert [t["id"] for t in buffers.support_set(store)] == [plan_fail, main_fail]
    assert state(store, side) == (None, None)
    assert buffers.classify(store.turn(side), generation=0) == (None, None)
    generation = library.add(Skill("plan-rules", "What a plan holds", body="b").with_stage("plan"),
                             evidence=[plan_fail])
    assert buffers.advance(store, generation, consumed=[plan_fail]) == {"consumed": 1,
                                                                        "purged": 2}
    assert state(store, plan_fail) == ("support", "consumed")
    assert state(store, write_ok) == ("query", "purged")
    frame = buffers.buffers_frame(store, all_turns=True)
    assert frame["turn_type"].to_list() == ["stage:plan", "stage:write", "main", "side"]


def test_a_training_claim_counts_only_while_it_lasts_and_once_committed(store, library):
    """A GRPO step's claim counts as training while it lasts; it becomes a trained step when
    the step commits it; an expired claim (its step died) counts as nothing, and another step
    may take the turn over."""
    a = turn(store, 0, reward=-1)
    b = turn(store, 0, reward=-1)
    buffers.refresh(store)
    assert buffers.claim_for_training(store, [a, b], "step-1") == {a, b}
    assert buffers.consumable(store, [a, b]) == []            # maybe training right now
    assert buffers.claim_for_training(store, [a], "step-2") == set()  # not twice at once
    assert buffers.commit_training_claim(store, "step-1") == {a, b}
    assert [store.turn(t)["trained_steps"] for t in (a, b)] == [1, 1]
    assert store.turn(a)["train_claim_by"] is None
    assert buffers.commit_training_claim(store, "step-1") == set()  # counted once

    c = turn(store, 0, reward=-1)
    buffers.refresh(store)
    assert buffers.claim_for_training(store, [c], "dead-step", seconds=-1.0) == {c}
    assert not buffers.is_trained(store.turn(c))              # expired: its step died
    assert buffers.consumable(store, [a, b, c]) == [c]
    assert buffers.claim_for_training(store, [c], "step-3") == {c}  # taken over
    assert buffers.renew_training_claim(store, "dead-step") == 0
    buffers.release_training_claim(store, "dead-step")        # not its claim any more
    assert store.turn(c)["train_claim_by"] == "step-3"
    buffers.release_training_claim(store, "step-3")
    assert store.turn(c)["train_claim_by"] is None and buffers.consumable(store, [c]) == [c]


@pytest.mark.sqlite_only  # looks into SQLite's own connection
def test_a_steps_claims_are_found_through_an_index_that_recording_does_not_write(store):
    """Renewing, committing and releasing a claim read the claimed turns only (they scanned
    every turn under the write lock); a turn without a claim has no entry in that index."""
    a = turn(store, 0, reward=1)
    buffers.refresh(store)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    try:
        buffers.claim_for_training(store, [a], "step-1")
        buffers.renew_training_claim(store, "step-1")
        buffers.commit_training_claim(store, "step-1")
        buffers.release_training_claim(store, "step-1")
    finally:
        store._db.set_trace_callback(None)
    by_claim = [s for s in statements if "WHERE train_claim_by" in s]
    assert len(by_claim) == 3
    for statement in by_claim:
        plan = " ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + statement))
        assert "USING" in plan and "INDEX turns_train_claim" in plan, (statement, plan)
    turn(store, 0)
    entries = store._db.execute("SELECT COUNT(*) FROM turns INDEXED BY turns_train_claim "
                                "WHERE train_claim_by IS NOT NULL").fetchone()[0]
    assert entries == 0


def test_an_expired_claim_is_dropped_when_its_turn_becomes_support(store, library):
    """A step that outlived its claim (a machine suspended mid-step) cannot count a turn an
    evolution has made support meanwhile: the commit leaves it out."""
    a = turn(store, 0, reward=-1)
    buffers.refresh(store)
    assert buffers.claim_for_training(store, [a], "stalled", seconds=-1.0) == {a}
    generation = library.add(Skill("s", "d", body="b"), evidence=[a])
    assert buffers.advance(store, generation, consumed=[a]) == {"consumed": 1, "purged": 0}
    assert state(store, a) == ("support", "consumed")
    assert buffers.renew_training_claim(store, "stalled") == 0
    assert buffers.commit_training_claim(store, "stalled") == set()
    assert store.turn(a)["trained_steps"] == 0
