"""Hostile input around the judge: replies a judge model should not give, rows another program
wrote, a second process writing at the same moment (real HTTP, real SQLite, real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fault_upstream import FaultUpstream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaclaw import buffers
from metaclaw.fastloop import labels
from metaclaw.fastloop.judge import Judge, parse_verdict
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.store import Store
from metaclaw.trace import Trace

KEY = "sk-judge-0123456789abcdef"
SCORES = st.sampled_from([-1, 0, 1])


def add_turn(store: Store, user: str = "What is 2+2?", session: str = "s1", **fields) -> int:
    return store.record_turn(session_id=session, status="ok", response="5", skill_generation=0,
                             request_messages=[{"role": "user", "content": user}], **fields)


def judge_one(store: Store, replies: list[Reply], votes: int = 1, **options):
    turn_id = add_turn(store)
    with DoubleServer(replies) as double:
        judge = Judge(double.url, "judge-model", api_key=KEY, votes=votes, structured=False,
                      **options)
        [result] = judge.judge_turns(store, [turn_id])
    return result, store.turn(turn_id)


# -- scores that are not -1, 0 or 1 -----------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(number=st.one_of(
    st.floats(min_value=-1.9, max_value=1.9).filter(lambda x: x not in (-1.0, 0.0, 1.0)),
    st.sampled_from([0.8, 0.5, -0.5, 1.5, 0.05])),
    form=st.sampled_from(["{:g}", "{:.2f}", "{:.1f}"]),
    label=st.sampled_from(["Score", "score", "**Score:**"]))
def test_a_fractional_score_line_is_unparsable_never_its_first_digit(number, form, label):
    """'Score: 0.8' (a probability) read as 0, or 'Score: 1.5' read as +1, would be a score the
    judge never gave."""
    written = form.format(number)
    if written.lstrip("+-").rstrip("0").rstrip(".") in ("1", "0", ""):  # rounds to a real score
        return
    sep = "" if label.endswith(":**") else ":"
    with pytest.raises(ValueError, match="score must be -1, 0 or 1"):
        parse_verdict(f"{label}{sep} {written}\nRationale: looks fine")


@pytest.mark.parametrize("line", ["Score: 1/5", "Score: 1 / 10", "score: 1 out of 10",
                                  "Score: 1,5", "Score: 0.8"])
def test_a_score_on_another_scale_is_not_stored(store, line):
    result, row = judge_one(store, [Reply(content=f"{line}\nRationale: poor answer")])
    assert result.score is None and "score must be -1, 0 or 1" in result.error
    assert row["reward"] is None and row["judge_votes"] is None


@pytest.mark.parametrize("text, score", [("Score: 1.", 1), ("Score: -1, wrong unit", -1),
                                         ("Score: 0.0\nReason: unclear", 0)])
def test_a_score_line_ending_a_sentence_is_still_read(text, score):
    assert parse_verdict(text)[0] == score


# -- reasoning models -------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(draft=SCORES, final=SCORES, tag=st.sampled_from(["think", "THINK", "thinking", "reasoning"]),
       opening=st.booleans(), as_line=st.booleans())
def test_a_draft_verdict_in_the_thinking_is_not_the_verdict(draft, final, tag, opening, as_line):
    """A reasoning model served without a reasoning parser leaves its thinking in the text (its
    opening tag sometimes in the prompt, as DeepSeek-R1's template does): the verdict is what
    follows the thinking."""
    drafted = f"Score: {draft}" if as_line else json.dumps({"score": draft, "rationale": "draft"})
    thinking = f"The user asked for 2+2. First guess:\n{drafted}\nLet me check again."
    reply = (f"<{tag}>" if opening else "") + thinking + f"</{tag}>\n" + json.dumps(
        {"score": final, "rationale": "final"})
    assert parse_verdict(reply) == (final, "final")


def test_a_reasoning_model_cut_while_thinking_gives_no_verdict_and_says_why(store):
    cut = '<think>Looks right: {"score": 1, "rationale": "draft"}. But wait, 2+2 is'
    result, row = judge_one(store, [Reply(content=cut, finish_reason="length")], max_tokens=64)
    assert result.score is None and row["reward"] is None
    assert "only its reasoning" in result.error and "max_tokens=64" in result.error


def test_a_thinking_judge_is_stored_with_its_final_verdict(store):
    reply = ('<think>{"score": 1, "rationale": "draft"} no: the answer 5 is wrong</think>\n'
             '{"score": -1, "rationale": "2+2 is 4, not 5"}')
    result, row = judge_one(store, [Reply(content=reply)])
    assert result.score == -1 and row["reward"] == -1.0
    assert row["judge_rationale"] == "2+2 is 4, not 5"


# -- several verdicts -------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(first=SCORES, second=SCORES, as_line=st.booleans(),
       prose=st.text(st.characters(blacklist_characters="{}<>", blacklist_categories=("Cs",)),
                     max_size=40))
def test_a_reply_with_two_different_scores_has_no_verdict(first, second, as_line, prose):
    def one(score: int) -> str:
        return f"Score: {score}" if as_line else json.dumps({"score": score, "rationale": "r"})

    reply = f"{one(first)}\n{prose.replace(chr(10), ' ')} On reflection:\n{one(second)}"
    if first == second:
        assert parse_verdict(reply)[0] == first
    else:
        with pytest.raises(ValueError, match="different scores"):
            parse_verdict(reply)


def test_a_verdicts_own_details_are_not_a_second_verdict():
    assert parse_verdict('{"score": 1, "rationale": "ok", "detail": {"score": -1}}') == (1, "ok")
    assert parse_verdict('{"verdict": {"score": -1, "rationale": "nested"}}') == (-1, "nested")


def test_two_scores_from_one_vote_are_counted_unparsable_not_a_score(store):
    reply = '{"score": 1, "rationale": "first"}\nActually: {"score": -1, "rationale": "second"}'
    result, row = judge_one(store, [Reply(content=reply), Reply(content=json.dumps(
        {"score": -1, "rationale": "wrong"}))], votes=2)
    assert result.score == -1 and result.unparsable == 1 and row["reward"] == -1.0


# -- huge replies -----------------------------------------------------------------------------
def test_a_huge_degenerate_reply_costs_about_what_reading_that_much_json_does():
    """A judge looping on '{"score": 1, "rationale": {"score": ...' without closing: every brace
    read to the end of the reply made one vote cost seconds of CPU on the judge's event loop."""
    hostile = '{"score": 1, "rationale": ' * 12000  # ~310 kB, never closed
    plain = json.dumps([{"score": 1, "rationale": "x" * 10}] * 9000)  # about as long, valid

    def seconds(action) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            action()
            best = min(best, time.perf_counter() - start)
        return best

    def hostile_parse():
        with pytest.raises(ValueError, match="no score found"):
            parse_verdict(hostile)

    assert seconds(hostile_parse) < 50 * seconds(lambda: json.loads(plain))


# -- failures and secrets ---------------------------------------------------------------------
def test_a_gateway_error_answered_with_status_200_is_a_failed_vote_retried_and_named(store):
    """Some gateways answer an upstream failure with HTTP 200 and an error body: it is not an
    empty verdict, it is a failed call (retried), reported with the gateway's message."""
    upstream = FaultUpstream()
    upstream.json_body = {"error": {"message": f"quota exceeded for key {KEY}",
                                    "type": "insufficient_quota"}}
    turn_id = add_turn(store, user="fault=json_200")
    with upstream:
        judge = Judge(f"http://127.0.0.1:{upstream.port}/v1", "judge-model", api_key=KEY,
                      votes=1, retries=1, structured=False)
        [result] = judge.judge_turns(store, [turn_id])
        attempts = len(upstream.requests)
    assert attempts == 2 and result.failed == 1 and result.unparsable == 0
    assert "quota exceeded" in result.error and KEY not in result.error
    assert store.turn(turn_id)["reward"] is None


def test_the_judges_key_quoted_in_a_reply_is_not_stored(store):
    """A misconfigured gateway may answer "invalid key sk-..." as the reply's text: the votes
    stored on the turn (and shown in traces and exports) must not carry the key."""
    replies = [Reply(content=json.dumps({"score": 1, "rationale": "fine"})),
               Reply(content=json.dumps({"score": 1, "rationale": f"key {KEY} works"})),
               Reply(content=f"Incorrect API key provided: {KEY}")]
    result, row = judge_one(store, replies, votes=3)
    assert result.score == 1 and result.unparsable == 1
    stored = json.dumps(row["judge_votes"]) + str(row["judge_rationale"]) + str(result)
    assert KEY not in stored and "***" in stored


def test_a_long_rationale_is_trimmed_with_a_marker(store):
    result, row = judge_one(store, [Reply(content=json.dumps(
        {"score": 1, "rationale": "good " * 20000}))], max_tokens=None)
    assert result.score == 1 and len(row["judge_rationale"]) < 2200
    assert "chars trimmed" in row["judge_rationale"]


# -- rows written by another program ----------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["score", "rationale", "error", "x"]), inner, max_size=4),
    max_leaves=10)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(votes=st.lists(JSON_VALUES, max_size=4))
def test_votes_written_by_another_program_open_in_the_trace(store, votes):
    """One vote that is not ``{"score": -1|0|1, "rationale": str, "error": str|None}`` stopped
    the session's vote table from opening (AttributeError, or polars refusing a float score)."""
    turn_id = add_turn(store, session="hostile")
    with store.transaction():
        store.execute("UPDATE turns SET judge_votes = ? WHERE id = ?",
                          (json.dumps(votes), turn_id))
    trace = Trace(store, "hostile")
    frame = trace.votes_frame().filter(turn_id=turn_id)
    shown = trace.turn(turn_id)["judge_votes"]
    readable = [v for v in votes if isinstance(v, dict)]
    assert frame.height == len(shown) == len(readable)
    for vote, row in zip(readable, frame.to_dicts()):
        score = vote.get("score")
        if type(score) is int and score in (-1, 0, 1):
            assert row["score"] == score
        assert row["score"] in (-1, 0, 1, None)
        assert row["rationale"] is None or isinstance(row["rationale"], str)


def test_a_turn_whose_messages_are_not_messages_is_not_exported(store, caplog):
    """A fine-tuning file with a message that is a bare string is refused whole by the
    fine-tuning service; the turn is left out with a warning naming it."""
    good, odd = add_turn(store, user="good"), add_turn(store, user="odd")
    with store.transaction():
        store.execute("UPDATE turns SET request_messages = ? WHERE id = ?",
                          (json.dumps(["hello", 5, {"role": "user", "content": "q"}]), odd))
    for turn_id in (good, odd):
        labels.label(store, turn_id, "pass")
    for shape in ("chat", "eval"):
        records = labels.export_records(store, shape=shape)
        assert len(records) == 1
        messages = records[0]["messages"] if shape == "chat" else records[0]["input"]
        assert all(isinstance(m, dict) for m in messages)
    assert f"turn {odd} is not exported" in caplog.text


# -- two processes ----------------------------------------------------------------------------
def test_a_refresh_waiting_behind_an_evolution_classifies_by_the_new_generation(store, tmp_path):
    """Another process commits a new skill generation while a refresh waits for the write lock:
    the refresh must not write back what it read before (a turn of the old generation, live)."""
    assert store.add_generation(snapshot={}, kind="initial") == 0
    turn_id = add_turn(store)  # served under generation 0, recorded, not yet classified
    ready = tmp_path / "ready"
    evolver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from metaclaw import buffers
        from metaclaw.store import Store
        store = Store({str(store.target)!r})
        with store.transaction():
            generation = store.add_generation(snapshot={{}}, kind="evolve")
            buffers.advance(store, generation)
            Path({str(ready)!r}).write_text("holding")
            time.sleep(1.5)
        """)], cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert evolver.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        buffers.refresh(store, [turn_id])  # waits for the evolution to commit
    finally:
        assert evolver.wait(timeout=60) == 0
    assert buffers.current_generation(store) == 1
    assert (store.turn(turn_id)["buffer_set"], store.turn(turn_id)["buffer_state"]) == (
        "query", "purged")
    assert buffers.query_set(store, generation=0) == []
