"""The trace of a session: lazy index, one turn in full, failures, the generation written for a
failure and the turns after it, labels from the widget."""

from __future__ import annotations

import pytest

from metaclaw import buffers
from metaclaw.fastloop import labels
from metaclaw.notebook.widgets import TraceWidget
from metaclaw.skills.block import BLOCK_HEADER
from metaclaw.skills.library import Skill, SkillLibrary, SkillOp
from metaclaw.trace import Trace, sessions, split_skill_block

SKILL = Skill("miles-to-km", "Convert miles to kilometers.", "math", "Multiply by 1.609.")


@pytest.fixture
def session(tmp_path, store):
    """Session s1: a tool-calling success, a failure, the generation written for it, a success
    served with it. Returns (library, ids)."""
    library = SkillLibrary(tmp_path / "skills", store)
    system = "You are helpful.\n\n" + BLOCK_HEADER + "\n\n### greet\nSay hello."
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}
    ids = [store.record_turn(
        session_id="s1", status="ok", response="Here it is.", model="agent",
        request_messages=[{"role": "system", "content": system},
                          {"role": "user", "content": "read the file"},
                          {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c1", "content": "file text"}],
        injected_skills=["greet"], reward=1.0,
        judge_votes=[{"score": 1, "rationale": "read it", "error": None}])]
    ids.append(store.record_turn(
        session_id="s1", status="ok", response="5 km", model="agent", reward=-1.0,
        request_messages=[{"role": "user", "content": "Convert 5 miles to km"}],
        judge_votes=[{"score": -1, "rationale": "wrong factor", "error": None}] * 2))
    buffers.refresh(store)
    generation = library.apply([SkillOp("add", SKILL, SKILL.name, "factor", [ids[1]])],
                               kind="evolve", reason="evolved")
    ids.append(store.record_turn(
        session_id="s1", status="ok", response="8.045 km", reward=1.0,
        skill_generation=generation, policy_version=2,
        request_messages=[{"role": "user", "content": "Convert 5 miles"}]))
    store.record_turn(session_id="other", status="ok", request_messages=[])
    return library, ids


def test_index_is_small_and_marks_failures(store, session):
    _library, ids = session
    trace = Trace(store, "s1")
    frame = trace.index()
    assert frame["id"].to_list() == ids and frame["failed"].to_list() == [False, True, False]
    assert frame["last_text"][1] == "Convert 5 miles to km"
    assert frame["tool_calls"].to_list() == [0, 0, 0] and frame["messages"][0] == 4
    assert trace.failures() == [ids[1]] and len(trace) == 3
    assert {s["id"] for s in sessions(store)} == {"s1", "other"}
    assert trace.votes_frame().height == 3
    with pytest.raises(LookupError, match="no session"):
        Trace(store, "nope")


def test_one_turn_in_full(store, session):
    _library, ids = session
    trace = Trace(store, "s1")
    first = trace.turn(ids[0])
    system = first["messages"][0]
    assert system["text"] == "You are helpful."
    assert system["skill_block"].startswith(BLOCK_HEADER)
    assert first["messages"][2]["tool_calls"][0] == {"id": "c1", "name": "read",
                                                     "arguments": '{"p": 1}',
                                                     "result": "file text"}
    assert first["retrieval"]["scores"] == [{"name": "greet", "score": None}]
    assert first["judge_votes"][0]["rationale"] == "read it"
    failure = trace.turn(ids[1])
    [written] = failure["written_for"]
    assert (written["generation"], written["skill_name"]) == (1, "miles-to-km")
    assert "Multiply by 1.609." in written["skill_markdown"]
    assert [a["id"] for a in failure["after"]] == [ids[2]]
    with pytest.raises(LookupError):
        trace.turn(ids[-1] + 1)
    assert split_skill_block("plain") == ("plain", None)


def test_a_jump_from_a_failure_whose_generation_served_no_turn_yet_says_so(store, session):
    _library, ids = session
    widget = TraceWidget(store, "s1")
    widget.step(1)
    widget.detail = {**widget.detail, "after": []}  # generation 1 written, no turn served since
    widget.jump("after")
    assert widget.message == "no turn has been served with generation 1, written for this " \
                             "turn, yet" and widget.selected == ids[1]


def test_widget_steps_filters_jumps_and_labels(store, session):
    _library, ids = session
    widget = TraceWidget(store, "s1", page_size=2, author="alice")
    assert widget.selected == ids[0] and len(widget.rows) == 2 and widget.total == 3
    widget.step(1)
    assert widget.selected == ids[1] and widget.detail["judge"] == "fail"
    widget.step(1)
    assert widget.selected == ids[2] and widget.offset == 2 and len(widget.rows) == 1
    widget.step(-1, failures=True)
    assert widget.selected == ids[1]
    widget.jump("after")
    assert widget.selected == ids[2] and widget.detail["policy_version"] == 2
    widget.failures_only = True
    assert widget.matched == 1 and widget.selected == ids[1]
    # the front-end's label form
    widget.set_state({"label_request": {"turn_id": ids[1], "verdict": "pass", "note": "fine",
                                        "corrected": "", "nonce": 1}})
    assert labels.latest(store)[ids[1]]["author"] == "alice"
    assert widget.failure_count == 0 and widget.detail == {}  # no failure is left to show
    widget.failures_only = False
    widget.set_state({"step_request": {"delta": 1, "nonce": 2}})
    assert widget.selected == ids[1] and widget.detail["human_label"] == "pass"
    assert "Trace of session s1" in widget._repr_html_()
    widget.session_id = "other"
    assert widget.total == 1


def test_index_survives_a_row_with_malformed_json(store):
    """One turn whose stored request_messages / tool_calls are not valid JSON (a corrupt or
    foreign-written row) must not make the whole session's index unreadable."""
    good = store.record_turn(session_id="m", status="ok", response="fine",
                             request_messages=[{"role": "user", "content": "hello"}])
    bad = store.record_turn(session_id="m", status="ok", response="yo",
                            request_messages=[{"role": "user", "content": "x"}])
    with store.transaction():
        store.execute("UPDATE turns SET request_messages = 'not json{', "
                          "tool_calls = '[broken' WHERE id = ?", (bad,))
    trace = Trace(store, "m")
    frame = trace.index()
    assert frame["id"].to_list() == [good, bad]
    assert frame["last_text"].to_list() == ["hello", None]
    assert frame["messages"].to_list() == [1, None]
    assert frame["tool_calls"].to_list() == [0, 0]


def test_a_turn_with_malformed_json_opens_with_its_columns_named(store, caplog):
    """Opening that turn in full shows what could be read and names the unreadable columns,
    instead of failing with a JSON error."""
    turn_id = store.record_turn(session_id="m", status="ok", response="the reply",
                                request_messages=[{"role": "user", "content": "x"}],
                                usage={"prompt_tokens": 3})
    with store.transaction():
        store.execute("UPDATE turns SET request_messages = '[{\"role\":', usage = '{1}' "
                          "WHERE id = ?", (turn_id,))
    turn = Trace(store, "m").turn(turn_id)
    assert turn["response"] == "the reply"
    assert turn["messages"] == [] and turn["usage"] is None
    assert sorted(turn["malformed_columns"]) == ["request_messages", "usage"]
    assert "malformed JSON" in caplog.text


def test_json_of_another_shape_reads_as_malformed(store, caplog):
    """Valid JSON of the wrong shape (a string where the messages list belongs, a number for
    the usage object) would be iterated or looked into by every reader: it reads as NULL and
    is named, like text that is not JSON."""
    turn_id = store.record_turn(session_id="m", status="ok", response="the reply",
                                request_messages=[{"role": "user", "content": "x"}])
    with store.transaction():
        store.execute("UPDATE turns SET request_messages = '\"hello\"', usage = '5', "
                          "tool_calls = 'null' WHERE id = ?", (turn_id,))
    row = store.turn(turn_id)
    assert row["request_messages"] is None and row["usage"] is None
    assert row["tool_calls"] is None  # JSON null is a NULL, not a malformed value
    assert sorted(row["malformed_columns"]) == ["request_messages", "usage"]
    assert Trace(store, "m").turn(turn_id)["messages"] == []


def test_sessions_count_failures_as_the_trace_does(tmp_path):
    """The session list counts a failure at the judge's threshold, as the trace marks it, and
    a person's verdict over the judge's."""
    from metaclaw.store import Store

    store = Store(tmp_path / "m.db")
    for reward, label in ((0.4, None), (-0.5, None), (0.9, "fail"), (-1.0, "pass")):
        store.record_turn(session_id="s", request_messages=[], status="ok", reward=reward,
                          human_label=label)
    store.record_turn(session_id="s", request_messages=[], status="error")
    trace = Trace(store, "s", threshold=0.5)
    marked = sum(trace.is_failure(row) for row in store.turns("session_id = 's'"))
    assert [s["failures"] for s in sessions(store, threshold=0.5)] == [marked] == [4]
    assert [s["failures"] for s in sessions(store)] == [3]


def test_a_turn_chosen_in_the_front_end_that_cannot_be_shown_moves_nothing(store, session):
    _library, ids = session
    widget = TraceWidget(store, "s1")
    shown = widget.detail
    widget.set_state({"selected": ids[-1] + 999})  # as the front-end sends a choice
    assert widget.selected == ids[0] and widget.detail == shown
    assert f"#{ids[-1] + 999}" in widget.error
    assert "3 turns" in repr(widget)
