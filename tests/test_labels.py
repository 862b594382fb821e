"""Human labels: stored with who / when, beside the judge's verdict, ahead of the judge in the
support set; judge-human agreement; JSONL and Parquet exports."""

from __future__ import annotations

import json

import polars as pl
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metaclaw import buffers
from metaclaw.fastloop import labels
from metaclaw.skills import library
from metaclaw.skills.block import BLOCK_HEADER


def judged(add_buffer_turn, store, session, text, reward, response="ok"):
    turn_id = add_buffer_turn(session, text, reward=reward, response=response)
    buffers.refresh(store, [turn_id])
    return turn_id


def test_labels_round_trip_with_author_and_history(store, add_buffer_turn):
    turn = judged(add_buffer_turn, store, "s1", "Convert 5 miles", 1.0, "5 km")
    first = labels.label(store, turn, "fail", note="wrong factor", corrected="8.05 km",
                         author="alice")
    assert (first["verdict"], first["note"], first["corrected"], first["author"]) == \
        ("fail", "wrong factor", "8.05 km", "alice")
    assert first["created_at"] > 0
    labels.label(store, turn, True, author="bob")
    assert [r["author"] for r in labels.history(store, turn)] == ["alice", "bob"]
    assert labels.latest(store)[turn]["verdict"] == "pass"
    assert store.turn(turn)["human_label"] == "pass"
    table = labels.frame(store)
    assert table.row(0, named=True)["judge_verdict"] == "pass"
    assert table.row(0, named=True)["agree"] is True


def test_bad_labels_get_a_clear_error_and_store_nothing(store, add_buffer_turn):
    turn = judged(add_buffer_turn, store, "s1", "x", 1.0)
    with pytest.raises(labels.LabelError, match="'pass' or 'fail'"):
        labels.label(store, turn, "maybe")
    with pytest.raises(labels.LabelError, match="not in the store"):
        labels.label(store, 999, "pass")
    assert store.counts()["labels"] == 0


def test_a_human_label_takes_precedence_over_the_judge_in_the_support_set(store, add_buffer_turn):
    missed = judged(add_buffer_turn, store, "s1", "judge passed it", 1.0)
    false_alarm = judged(add_buffer_turn, store, "s1", "judge failed it", -1.0)
    assert [t["id"] for t in buffers.support_set(store)] == [false_alarm]
    labels.label(store, missed, "fail", author="alice")
    labels.label(store, false_alarm, "pass", author="alice")
    assert [t["id"] for t in buffers.support_set(store)] == [missed]
    # the query set holds both whatever their verdicts (a turn's set is decided when recorded)
    assert [t["id"] for t in buffers.query_set(store)] == [missed, false_alarm]


def test_agreement_per_session_and_overall(store, add_buffer_turn):
    for session, rewards, verdicts in (("a", [1, 1, -1], ["pass", "pass", "fail"]),
                                       ("b", [1, -1], ["fail", "fail"])):
        for reward, verdict in zip(rewards, verdicts):
            labels.label(store, judged(add_buffer_turn, store, session, "t", reward), verdict,
                         author="x")
    labels.label(store, add_buffer_turn("c", "unjudged"), "pass", author="x")
    result = labels.agreement(store)
    rows = {r["session_id"]: r for r in result.table.to_dicts()}
    assert set(rows) == {"a", "b"}  # an unjudged turn has nothing to agree with
    assert (rows["a"]["agree"], rows["a"]["rate"]) == (3, 1.0)
    assert (rows["b"]["agree"], rows["b"]["labelled"]) == (1, 2)
    assert result.overall["agree"] == 4 and result.overall["labelled"] == 5
    assert result.overall["rate"] == pytest.approx(0.8)
    assert -1 <= result.overall["kappa"] <= 1
    chart = result.chart().to_dict()
    assert "layer" in chart and "80%" in chart["title"]
    assert "4/5" in repr(result) and "<table>" in result._repr_html_()


def test_exports_jsonl_in_openai_shapes_and_parquet(store, add_buffer_turn, tmp_path):
    good = judged(add_buffer_turn, store, "s1", "Say hi", 1.0, "Hi!")
    bad = judged(add_buffer_turn, store, "s1", "Convert 5 miles", -1.0, "5 km")
    store.update_turn(bad, request_messages=[
        {"role": "system", "content": "You are helpful.\n\n" + BLOCK_HEADER + "\n\n### x"},
        {"role": "user", "content": "Convert 5 miles"}])
    unlabelled = judged(add_buffer_turn, store, "s1", "other", 1.0)
    labels.label(store, good, "pass", author="alice")
    labels.label(store, bad, "fail", note="factor", corrected="8.05 km", author="alice")

    n = labels.export_jsonl(store, tmp_path / "ft.jsonl", session="s1", shape="chat")
    records = [json.loads(line) for line in (tmp_path / "ft.jsonl").read_text().splitlines()]
    assert n == len(records) == 2  # the unlabelled turn is not fit to train on
    assert records[0]["messages"][-1] == {"role": "assistant", "content": "Hi!"}
    assert records[1]["messages"][-1] == {"role": "assistant", "content": "8.05 km"}
    assert records[1]["messages"][0] == {"role": "system", "content": "You are helpful."}

    labels.export_jsonl(store, tmp_path / "eval.jsonl", turn_ids=[bad, unlabelled], shape="eval")
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["metadata"]["turn_id"] for e in evals] == [bad, unlabelled]
    assert evals[0]["ideal"] == "8.05 km" and evals[0]["metadata"]["human_verdict"] == "fail"
    assert evals[0]["metadata"]["judge_verdict"] == "fail" and evals[1]["ideal"] == "ok"
    assert evals[1]["metadata"]["human_verdict"] is None

    rows = labels.export_parquet(store, tmp_path / "turns.parquet", labelled_only=True)
    table = pl.read_parquet(tmp_path / "turns.parquet")
    assert rows == table.height == 2
    assert table["human_verdict"].to_list() == ["pass", "fail"]
    assert table["corrected"].to_list() == [None, "8.05 km"]
    with pytest.raises(ValueError, match="shape"):
        labels.export_records(store, shape="sft")


# -- hostile input ------------------------------------------------------------------------------
_ANY_TEXT = st.text(st.characters(exclude_categories=()) | st.sampled_from(
    ["\ud83d", "\x85", "\u2028", "\u2029", "\x1e", "\r", "\n", '"', "\\", ",", "="]),
    max_size=30)


def test_a_turn_whose_request_is_unreadable_is_not_exported(store, add_buffer_turn, caplog):
    """A labelled turn whose stored request is not valid JSON would export as a reply to no
    question (a fine-tuning record of the assistant message alone): it is left out, logged."""
    good = judged(add_buffer_turn, store, "s1", "Say hi", 1.0, "Hi!")
    bad = judged(add_buffer_turn, store, "s1", "Say bye", 1.0, "Bye!")
    for turn_id in (good, bad):
        labels.label(store, turn_id, "pass", author="alice")
    with store.transaction():
        store.execute("UPDATE turns SET request_messages = '[{' WHERE id = ?", (bad,))
    [chat] = labels.export_records(store, session="s1", shape="chat")
    assert chat["messages"][-2:] == [{"role": "user", "content": "Say hi"},
                                     {"role": "assistant", "content": "Hi!"}]
    [sample] = labels.export_records(store, session="s1", shape="eval")
    assert sample["metadata"]["turn_id"] == good
    assert f"turn {bad} is not exported" in caplog.text


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(note=_ANY_TEXT, corrected=_ANY_TEXT, author=_ANY_TEXT)
@example(note="half an emoji \ud83d", corrected="", author="ann")
@example(note="one\u2028two", corrected="8.05\x85km", author="ann")
def test_any_label_text_is_refused_with_a_reason_or_exported_exactly(
        store, add_buffer_turn, tmp_path, note, corrected, author):
    """Whatever a person types (half an emoji from a widget, Unicode line separators, quotes,
    formula-like text): a LabelError, or the label is stored and the eval export, read back
    with ``str.splitlines()`` as this project's own readers do, gives exactly one record per
    turn holding exactly that text."""
    turn = judged(add_buffer_turn, store, "s1", "Convert 5 miles", -1.0, "5 km")
    try:
        labels.label(store, turn, "fail", note=note, corrected=corrected, author=author)
    except labels.LabelError:
        assert any("\ud800" <= c <= "\udfff" for c in note + corrected + author)
        return
    path = tmp_path / "eval.jsonl"
    labels.export_jsonl(store, path, turn_ids=[turn], shape="eval")
    [record] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert record["metadata"]["note"] == note
    # a reply labelled fail is no reference answer: the corrected one, else none
    assert record["ideal"] == (corrected if corrected.strip() else "")
    assert record["metadata"]["reply"] == "5 km"
    assert record["metadata"]["author"] == ((author or library.default_author()).strip()
                                            or "unknown")


@pytest.mark.parametrize("turn_id", [True, 1.9, "abc", None, 10**30])
def test_a_turn_id_that_is_not_a_whole_number_is_refused(store, add_buffer_turn, turn_id):
    """``True`` and ``1.9`` used to label turn 1 silently; the others raised ValueError,
    TypeError or OverflowError from int() or SQLite."""
    judged(add_buffer_turn, store, "s1", "x", 1.0)
    with pytest.raises(labels.LabelError, match="positive whole number"):
        labels.label(store, turn_id, "fail")
    assert labels.latest(store) == {}


def test_an_author_that_is_not_text_is_refused(store, add_buffer_turn):
    turn = judged(add_buffer_turn, store, "s1", "x", 1.0)
    with pytest.raises(labels.LabelError, match="author must be text"):
        labels.label(store, turn, "fail", author=7)
    assert labels.label(store, str(turn), "fail")["turn_id"] == turn  # "12" from a text box


def test_an_export_frame_holds_no_made_up_messages_for_a_malformed_row(tmp_path):
    """A row whose stored messages are not valid JSON (another program, a damaged page) is
    exported with no messages, not with the text "null" as if they were JSON."""
    from metaclaw.store import Store

    store = Store(tmp_path / "m.db")
    good = store.record_turn(session_id="s", request_messages=[{"role": "user", "content": "x"}],
                             status="ok", response="y")
    bad = store.record_turn(session_id="s", request_messages=[], status="ok", response="z")
    store.execute("UPDATE turns SET request_messages = '[{\"role\": ' WHERE id = ?", (bad,))
    frame = labels.export_frame(store).sort("id")
    assert frame["id"].to_list() == [good, bad]
    assert json.loads(frame["request_messages"][0]) == [{"role": "user", "content": "x"}]
    assert frame["request_messages"][1] is None


def test_a_reward_at_the_threshold_is_unclear_for_every_reader(store, add_buffer_turn):
    """One rule (metaclaw.turns.judge_verdict): below the threshold a failure, above it a pass,
    at it neither (a tie of the judge's votes: 0 at the default 0). The export, the agreement,
    the support set, the skills' served asks, the gate's guards and an experiment's failures
    read it alike; at a threshold of 0.75 a reward of 0.5 is a failure and not a success."""
    from metaclaw.fastloop import experiments
    from metaclaw.fastloop.gate import Gate
    from metaclaw.turns import judge_verdict

    assert [judge_verdict(r) for r in (-1, 0, 0.5, None)] == ["fail", "unclear", "pass", None]
    ids = [judged(add_buffer_turn, store, f"s{i}", f"ask {i}", r)
           for i, r in enumerate((-1.0, 0.0, 0.5, 1.0))]
    for turn in ids:
        store.update_turn(turn, injected_skills=["sk"], retrieval_query=f"q{turn}")
    labels.label(store, ids[1], "fail", author="alice")
    labels.label(store, ids[3], "pass", author="alice")
    records = {r["metadata"]["turn_id"]: r["metadata"]["judge_verdict"]
               for r in labels.export_records(store, shape="eval")}
    assert [records[i] for i in ids] == ["fail", "unclear", "pass", "pass"]
    agreement = labels.agreement(store)
    assert agreement.overall["labelled"] == 1 and agreement.overall["judge_unclear"] == 1
    assert "could not tell" in repr(agreement)
    assert [t["id"] for t in buffers.support_set(store)] == [ids[0], ids[1]]  # (alice: fail)
    for threshold, served in ((0.0, [ids[2], ids[3]]), (0.75, [ids[3]])):
        asks = buffers.served_asks(store, 0, threshold=threshold)
        assert [turn for turn, _ in asks["sk"]] == served
        assert not set(served) & {t["id"] for t in buffers.support_set(store,
                                                                       threshold=threshold)}

    class Judge:
        threshold = 0.0
    gate = Gate.__new__(Gate)
    gate.judge, gate.successes = Judge(), 10
    assert {t["id"] for t in gate.recent_successes(store)} == {ids[2], ids[3]}
    failures = experiments.dataset(store, "failing", failures=True)
    assert failures == [ids[0], ids[1]]  # the unclear one only for alice's fail label
    assert experiments.dataset(store, "failing", failures=True, threshold=0.75,
                               replace=True) == ids[:3]


def test_a_label_says_when_it_can_no_longer_feed_the_evolver(store, add_buffer_turn):
    """A person failing a turn whose generation was replaced (purged) or that an evolution
    already consumed is told the label feeds no evolution; a live turn's label says nothing
    more."""
    live = judged(add_buffer_turn, store, "s1", "live ask", 1.0)
    gone = add_buffer_turn("s2", "old ask", reward=1.0, set_="query", state="purged")
    assert labels.reach(labels.label(store, live, "fail")) == ""
    said = labels.reach(labels.label(store, gone, "fail"))
    assert said.startswith(" (purged: its generation 0 was replaced;") and "no evolution" in said
    assert labels.reach(labels.label(store, gone, "pass")) == ""
