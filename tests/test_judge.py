"""The PRM judge against the offline OpenAI-compatible double (real HTTP, real openai client)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from metaclaw.fastloop.judge import (JUDGE_RESPONSE_FORMAT, SECTION_FEEDBACK, SECTION_REPLY,
                                     SECTION_TASK, SECTION_TOOLS, Judge, aggregate,
                                     build_judge_messages, lease_turns, parse_judge_prompt,
                                     parse_verdict, release_turns, trim)
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.store import Store


def verdict(score: int, why: str = "because") -> Reply:
    return Reply(content=json.dumps({"score": score, "rationale": why}))


def add_turn(store: Store, session: str = "s1", user: str = "What is 2+2?", reply: str = "4",
             **fields) -> int:
    messages = fields.pop("messages", [{"role": "user", "content": user}])
    return store.record_turn(session_id=session, request_messages=messages, status="ok",
                             response=reply, skill_generation=0, **fields)


def judge_prompts(double: DoubleServer) -> list[str]:
    return [r["body"]["messages"][-1]["content"] for r in double.requests
            if r["path"].endswith("/chat/completions")]


# -- votes ------------------------------------------------------------------------------------
def test_majority_of_three_votes_is_stored_on_the_turn(store):
    with DoubleServer([verdict(1, "right"), verdict(1, "right"), verdict(-1, "wrong")]) as double:
        judge = Judge(double.url, "judge-model", votes=3)
        turn_id = add_turn(store)
        [result] = judge.judge_turns(store, [turn_id])
    assert result.score == 1 and result.ok
    assert sorted(v["score"] for v in result.votes) == [-1, 1, 1]
    assert (result.failed, result.unparsable) == (0, 0)
    assert result.rationale == "right"
    row = store.turn(turn_id)
    assert row["reward"] == 1.0
    assert row["judge_model"] == "judge-model"
    assert row["judge_rationale"] == "right"
    assert row["judged_at"] is not None
    assert sorted(v["score"] for v in row["judge_votes"]) == [-1, 1, 1]
    assert all(set(v) == {"score", "rationale", "error"} for v in row["judge_votes"])
    assert row["buffer_set"] == "query" and row["buffer_state"] == "live"


def test_a_turn_whose_request_is_unreadable_is_left_unjudged_and_the_others_are_judged(store):
    """A row whose stored request is not valid JSON (written by another program, a damaged
    page) neither stops the batch nor gets a verdict on a request the judge never saw."""
    with DoubleServer([verdict(1)] * 3) as double:
        judge = Judge(double.url, "judge-model", votes=1)
        good, bad = add_turn(store), add_turn(store, user="second")
        with store.transaction():
            store.execute("UPDATE turns SET request_messages = '[{' WHERE id = ?", (bad,))
        results = {r.turn_id: r for r in judge.judge_turns(store)}
        calls = len(judge_prompts(double))
    assert results[good].ok and store.turn(good)["reward"] == 1.0
    assert not results[bad].ok and "request_messages are not valid JSON" in results[bad].error
    assert store.turn(bad)["reward"] is None and calls == 1


def test_a_verdict_stored_meanwhile_is_kept_unless_rescoring(store):
    """A verdict another process stored while this judge's votes were in flight stands (the
    turn counts once); a rescore replaces it."""
    turn_id = add_turn(store)

    class RacedJudge(Judge):
        async def ajudge(self, turn, **kwargs):
            store.update_turn(turn_id, reward=1.0, judge_rationale="first")  # the other process
            return await super().ajudge(turn, **kwargs)

    with DoubleServer([verdict(-1, "late"), verdict(-1, "rescored")]) as double:
        judge = RacedJudge(double.url, "judge-model", votes=1)
        [late] = judge.judge_turns(store, [turn_id])
        assert late.ok and store.turn(turn_id)["judge_rationale"] == "first"
        judge.judge_turns(store, [turn_id], rescore=True)
    assert store.turn(turn_id)["judge_rationale"] == "rescored"
    assert store.turn(turn_id)["reward"] == -1.0
    assert store.turn(turn_id)["judge_lease_until"] is None


def test_a_judged_turn_or_one_being_judged_elsewhere_is_skipped_without_a_call(store, tmp_path):
    judged, leased, free = add_turn(store), add_turn(store), add_turn(store)
    store.update_turn(judged, reward=1.0)
    other = Store(store.target)  # another process's connection
    assert lease_turns(other, [judged, leased]) == {leased}
    with DoubleServer([verdict(1)] * 3) as double:
        results = Judge(double.url, "judge-model", votes=1).judge_turns(
            store, [judged, leased, free])
        assert len(double.requests) == 1  # only the free turn was judged
    assert [r.turn_id for r in results] == [judged, leased, free]
    assert [(r.ok, r.skipped, r.failed_call) for r in results] == [
        (False, "judged", False), (False, "leased", False), (True, "", False)]
    assert "judged meanwhile" in results[0].error and "rescore" in results[0].error
    assert "another process is judging it" in str(results[1])
    assert store.turn(leased)["reward"] is None and store.turn(free)["reward"] == 1.0
    release_turns(other, [leased])
    assert lease_turns(store, [leased]) == {leased}


def test_a_lease_past_its_end_is_taken_over(store):
    """The turns of a judge killed mid-run are judged by the next one once its lease ends."""
    turn_id = add_turn(store)
    assert lease_turns(store, [turn_id], seconds=-1) == {turn_id}  # ended at once
    with DoubleServer([verdict(1)]) as double:
        [result] = Judge(double.url, "judge-model", votes=1).judge_turns(store, [turn_id])
    assert result.ok and store.turn(turn_id)["judge_lease_until"] is None


def test_a_batch_longer_than_its_lease_keeps_its_turns(store):
    """A judge still scoring renews its leases, so a second process does not judge the same
    turns again once the first lease would have ended."""
    turn_id = add_turn(store)
    results: list = []
    with DoubleServer([Reply(content=json.dumps({"score": 1, "rationale": "ok"}),
                             delay=1.5)]) as double:
        judge = Judge(double.url, "judge-model", votes=1, timeout=10)
        judge.lease_s = 0.6
        worker = threading.Thread(target=lambda: results.extend(judge.judge_turns(store,
                                                                                  [turn_id])))
        worker.start()
        time.sleep(1.0)  # past the first lease's end, before the verdict
        assert lease_turns(Store(store.target), [turn_id]) == set()
        worker.join(timeout=30)
    assert [r.ok for r in results] == [True]
    assert store.turn(turn_id)["judge_lease_until"] is None


def test_a_lease_another_process_took_is_neither_renewed_nor_released(store):
    """A judge whose lease ran out unrenewed (its laptop slept through a renewal, say) and was
    taken by another process leaves that lease as it is: its renewals do not move the other's
    end, and its release at the end does not free the turn while the other still judges it."""
    import openai  # noqa: F401 - imported here, not on the judge's loop, where it would stall it

    turn_id = add_turn(store)
    other = Store(store.target)
    with DoubleServer([Reply(content="overloaded", status=500, delay=1.2)]) as double:
        judge = Judge(double.url, "judge-model", votes=1, retries=0, timeout=10)
        judge.lease_s = 0.6
        worker = threading.Thread(target=lambda: judge.judge_turns(store, [turn_id]))
        worker.start()
        deadline = time.monotonic() + 10
        while other.turn(turn_id)["judge_lease_until"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        # the first lease runs out unrenewed, and the other process takes the turn
        other.execute("UPDATE turns SET judge_lease_until = ? WHERE id = ?",
                      (time.time() - 1, turn_id))
        assert lease_turns(other, [turn_id], seconds=100.0) == {turn_id}
        until = other.turn(turn_id)["judge_lease_until"]
        time.sleep(0.5)  # renewal rounds of the first judge (every 0.15 s)
        assert other.turn(turn_id)["judge_lease_until"] == until
        worker.join(timeout=30)
    assert other.turn(turn_id)["reward"] is None  # the first judge's vote failed
    assert other.turn(turn_id)["judge_lease_until"] == until  # still the other's
    assert lease_turns(Store(store.target), [turn_id]) == set()


def test_a_cancel_as_a_batch_ends_is_not_swallowed(store):
    """The fast loop's stop cancels its judge calls: one cancelled while its batch stops
    renewing its leases ends cancelled, instead of going on as if it had finished."""
    import asyncio

    turn_id = add_turn(store)
    batches: list = []

    class StoppedRightAfter(Judge):
        def store_results(self, store, results, **kwargs):
            stored = super().store_results(store, results, **kwargs)
            asyncio.get_running_loop().call_soon(batches[0].cancel)  # lands in the cleanup
            return stored

    async def main() -> bool:
        judge = StoppedRightAfter(double.url, "judge-model", votes=1)
        batches.append(asyncio.ensure_future(judge.ajudge_turns(store, [turn_id])))
        try:
            await batches[0]
        except asyncio.CancelledError:
            return True
        finally:
            await judge.aclose()
        return False

    with DoubleServer([verdict(1)]) as double:
        assert asyncio.run(main())
    assert store.turn(turn_id)["judge_lease_until"] is None


def test_a_failed_judge_call_releases_its_lease(store):
    turn_id = add_turn(store)
    with DoubleServer([Reply(content="no", status=400)]) as double:
        [result] = Judge(double.url, "judge-model", votes=1, retries=0).judge_turns(
            store, [turn_id])
    assert result.failed_call and not result.skipped
    assert store.turn(turn_id)["judge_lease_until"] is None
    assert lease_turns(Store(store.target), [turn_id]) == {turn_id}


JUDGE_PROCESS = """
import sys
from metaclaw.fastloop.judge import Judge
from metaclaw.store import Store
store = Store(sys.argv[1])
sys.stdin.readline()  # both processes start judging together
results = Judge(sys.argv[2], "judge-model", votes=2).judge_turns(store)
print(sum(r.ok for r in results), sum(bool(r.skipped) for r in results), flush=True)
"""


def test_two_processes_judging_one_workspace_call_the_judge_once_per_turn(store):
    import subprocess
    import sys

    turns = [add_turn(store, session=f"s{i}", user=f"question {i}") for i in range(12)]
    with DoubleServer(lambda body: Reply(content=json.dumps({"score": 1, "rationale": "ok"}),
                                         delay=0.05)) as double:
        procs = [subprocess.Popen([sys.executable, "-c", JUDGE_PROCESS, str(store.target),
                                   double.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120)[0].split() for proc in procs]
        calls = len([r for r in double.requests if r["path"].endswith("/chat/completions")])
    assert all(proc.returncode == 0 for proc in procs)
    judged = sum(int(out[0]) for out in outputs)
    assert judged == len(turns) and calls == len(turns)  # both votes in one request, once
    assert all(store.turn(t)["reward"] == 1.0 for t in turns)


def test_tie_gives_zero_and_unparsable_vote_is_counted(store):
    replies = [verdict(1), verdict(-1), Reply(content="I would rather not say.")]
    with DoubleServer(replies) as double:
        result = Judge(double.url, "judge", votes=3).judge_turns(store, [add_turn(store)])[0]
    assert result.score == 0
    assert result.unparsable == 1 and result.failed == 0
    assert "tied" in result.rationale
    bad = [v for v in result.votes if v["score"] is None]
    assert len(bad) == 1 and bad[0]["error"].startswith("unparsable")


def test_two_votes_tie_is_zero(store):
    with DoubleServer([verdict(1), verdict(-1)]) as double:
        result = Judge(double.url, "judge", votes=2).judge_turns(store, [add_turn(store)])[0]
    assert result.score == 0 and result.failed == 0


def first_request_fails(status: int = 500, delay: float = 0.0):
    """A double function: the first request gets an error (or a delay), the rest a +1 verdict."""
    lock, seen = threading.Lock(), []

    def reply(body):
        with lock:
            seen.append(1)
            first = len(seen) == 1
        if first:
            return Reply(status=status, content="injected failure") if not delay else \
                Reply(delay=delay, content=json.dumps({"score": -1, "rationale": "slow"}))
        return verdict(1, "fine")
    return reply


def test_failed_vote_is_counted_not_zero(store):
    with DoubleServer(first_request_fails(500)) as double:  # a request per vote
        result = Judge(double.url, "judge", votes=3, retries=0, one_request=False).judge_turns(
            store, [add_turn(store)])[0]
    assert result.score == 1
    assert result.failed == 1 and result.unparsable == 0
    failed = [v for v in result.votes if v["score"] is None]
    assert "HTTP 500" in failed[0]["error"]
    assert len(result.votes) == 3


def test_failed_vote_is_retried(store):
    with DoubleServer(first_request_fails(500)) as double:  # a request per vote
        result = Judge(double.url, "judge", votes=3, retries=1, one_request=False).judge_turns(
            store, [add_turn(store)])[0]
        requests = len(double.requests)
    assert result.score == 1 and result.failed == 0
    assert [v["score"] for v in result.votes] == [1, 1, 1]
    assert requests == 4


def test_the_votes_of_a_turn_are_asked_in_one_request(store):
    """One prompt, sent and billed once: ``n`` choices are the votes; a failed request is
    retried whole, and fails all its votes only after its retries."""
    with DoubleServer([verdict(1), verdict(-1), verdict(1)]) as double:
        result = Judge(double.url, "judge", votes=3).judge_turns(store, [add_turn(store)])[0]
        bodies = [r["body"] for r in double.requests]
    assert [b["n"] for b in bodies] == [3]
    assert [v["score"] for v in result.votes] == [1, -1, 1] and result.score == 1
    with DoubleServer(first_request_fails(500)) as double:
        result = Judge(double.url, "judge", votes=3, retries=1).judge_turns(
            store, [add_turn(store)])[0]
        assert len(double.requests) == 2  # the failed request, then its retry
    assert result.score == 1 and result.failed == 0 and len(result.votes) == 3
    with DoubleServer([verdict(1)]) as double:
        Judge(double.url, "judge", votes=1).judge_turns(store, [add_turn(store)])
        assert "n" not in double.requests[0]["body"]  # one vote: a plain request


def test_a_server_that_refuses_n_gets_a_request_per_vote_from_then_on(store):
    def reply(body):
        if body.get("n", 1) > 1:
            return Reply(status=400, content="n must be 1 for this model")
        return verdict(1)

    with DoubleServer(reply) as double:
        judge = Judge(double.url, "judge", votes=3, retries=0)
        first = judge.judge_turns(store, [add_turn(store)])[0]
        assert judge.one_request is False and judge.structured is True
        before = len(double.requests)
        second = judge.judge_turns(store, [add_turn(store)])[0]
        later = [r["body"] for r in double.requests[before:]]
    assert first.score == 1 and first.failed == 0 and len(first.votes) == 3
    assert second.score == 1 and len(later) == 3 and all("n" not in b for b in later)


def test_a_client_error_not_about_n_keeps_the_votes_in_one_request(store):
    with DoubleServer(lambda body: Reply(status=400, content="the prompt is too long")) as double:
        judge = Judge(double.url, "judge", votes=3, retries=0, structured=False)
        result = judge.judge_turns(store, [add_turn(store)])[0]
        asked = [r["body"].get("n") for r in double.requests]
    assert result.score is None and result.failed == 3 and "too long" in result.error
    assert asked == [3, None, None, None] and judge.one_request is True


class _OneChoiceDouble(DoubleServer):
    """A server that ignores ``n`` (answers one choice), as some OpenAI-compatible ones do."""

    def _completion(self, body, replies):
        return super()._completion(body, replies[:1])


def test_a_server_that_ignores_n_gets_the_missing_votes_asked_one_by_one(store):
    with _OneChoiceDouble(lambda body: verdict(1)) as double:
        judge = Judge(double.url, "judge", votes=3, retries=0)
        first = judge.judge_turns(store, [add_turn(store)])[0]
        asked = [r["body"].get("n") for r in double.requests]
        assert judge.one_request is False
        second = judge.judge_turns(store, [add_turn(store)])[0]
        later = [r["body"].get("n") for r in double.requests[len(asked):]]
    assert asked == [3, None, None] and first.score == 1 and len(first.votes) == 3
    assert later == [None] * 3 and second.score == 1 and len(second.votes) == 3


def test_a_retry_waits_as_the_server_asks_and_a_client_error_is_not_retried(store):
    import time

    with DoubleServer([Reply(status=429, content="slow down", headers={"retry-after": "0.6"}),
                       verdict(1)]) as double:
        started = time.monotonic()
        result = Judge(double.url, "judge", votes=1, retries=1).judge_turns(
            store, [add_turn(store)])[0]
        waited = time.monotonic() - started
    assert result.score == 1 and waited >= 0.6
    with DoubleServer([Reply(status=401, content="bad key")] * 2) as double:
        result = Judge(double.url, "judge", votes=1, retries=1).judge_turns(
            store, [add_turn(store, session="s2")])[0]
        assert len(double.requests) == 1 and "HTTP 401" in result.error


def test_each_vote_has_its_own_timeout(store):
    with DoubleServer(first_request_fails(delay=4.0)) as double:
        judge = Judge(double.url, "judge", votes=3, timeout=0.5, retries=0, one_request=False)
        start = time.perf_counter()
        result = judge.judge_turns(store, [add_turn(store)])[0]
        elapsed = time.perf_counter() - start
    assert elapsed < 3.0, elapsed  # the slow vote was cut at its 0.5 s timeout, not waited 4 s
    assert result.score == 1 and result.failed == 1
    assert any("timed out" in (v["error"] or "") for v in result.votes)


def test_all_votes_failing_leaves_the_turn_unjudged_and_reports_why(store):
    with DoubleServer(lambda body: Reply(status=503, content="judge overloaded")) as double:
        turn_id = add_turn(store)
        result = Judge(double.url, "judge", votes=3, retries=1).judge_turns(store, [turn_id])[0]
        assert len(double.requests) == 2  # the 3 votes' request, and 1 retry
    assert result.score is None and not result.ok
    assert result.failed == 3
    assert "all 3 judge votes failed" in result.error and "503" in result.error
    assert "unjudged" in str(result)
    row = store.turn(turn_id)
    assert row["reward"] is None and row["judged_at"] is None and row["judge_votes"] is None


def test_unreachable_judge_is_reported(store):
    judge = Judge("http://127.0.0.1:9/v1", "judge", votes=2, retries=0, timeout=2)
    result = judge.judge_turns(store, [add_turn(store)])[0]
    assert result.score is None and result.failed == 2
    assert "connection" in result.error.lower()


# -- what the judge sees ----------------------------------------------------------------------
def tool_conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a file assistant.\n\n## Skills\n\nsecret skill"},
        {"role": "user", "content": "Rename report.txt to final.txt"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "move_file",
                         "arguments": '{"src": "report.txt", "dst": "final.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "error: report.txt not found"},
    ]


def test_judge_sees_tool_calls_results_reply_and_next_user_message(store):
    first = add_turn(store, messages=tool_conversation(), reply="Done, the file is renamed.")
    follow = tool_conversation() + [
        {"role": "assistant", "content": "Done, the file is renamed."},
        {"role": "user", "content": "No it is not, the tool said the file was not found!"}]
    add_turn(store, messages=follow, reply="Sorry.")
    with DoubleServer([verdict(-1, "claimed success after a failed tool call")] * 3) as double:
        [result] = Judge(double.url, "judge", votes=3).judge_turns(store, [first])
        prompts = judge_prompts(double)
        bodies = [r["body"] for r in double.requests]
    assert result.score == -1 and len(result.votes) == 3
    assert len(prompts) == 1 and bodies[0]["n"] == 3  # the votes in one request
    sections = parse_judge_prompt(prompts[0])
    assert sections[SECTION_TASK] == "[1] Rename report.txt to final.txt"
    assert 'move_file({"src": "report.txt", "dst": "final.txt"})' in sections[SECTION_TOOLS]
    assert "error: report.txt not found" in sections[SECTION_TOOLS]
    assert sections[SECTION_REPLY] == "Done, the file is renamed."
    assert sections[SECTION_FEEDBACK] == "No it is not, the tool said the file was not found!"
    assert f"=== {SECTION_FEEDBACK} ===" in prompts[0]
    assert "secret skill" not in prompts[0]  # system prompt (injected skills) is not judged
    assert all(b["response_format"] == JUDGE_RESPONSE_FORMAT for b in bodies)
    assert all(b["model"] == "judge" for b in bodies)


def test_reply_tool_calls_are_visible_and_no_feedback_section_without_next_turn(store):
    calls = [{"id": "c9", "type": "function",
              "function": {"name": "delete_all", "arguments": '{"path": "/"}'}}]
    turn_id = store.record_turn(session_id="s", request_messages=[
        {"role": "user", "content": "tidy my home folder"}], status="ok", response=None,
        tool_calls=calls)
    with DoubleServer([verdict(-1)] * 3) as double:
        Judge(double.url, "judge").judge_turns(store, [turn_id])
        prompt = judge_prompts(double)[0]
    sections = parse_judge_prompt(prompt)
    assert 'call in this reply: delete_all({"path": "/"}) [id c9]' in sections[SECTION_TOOLS]
    assert "tool calls above" in sections[SECTION_REPLY]
    assert SECTION_FEEDBACK not in sections


def test_long_inputs_are_trimmed_with_a_visible_marker(store):
    long_reply = "x" * 20_000
    turn_id = add_turn(store, reply=long_reply)
    with DoubleServer([verdict(0)] * 3) as double:
        Judge(double.url, "judge").judge_turns(store, [turn_id])
        prompt = judge_prompts(double)[0]
    reply = parse_judge_prompt(prompt)[SECTION_REPLY]
    assert "[... 16000 chars trimmed ...]" in reply
    assert len(reply) < 4200
    assert trim("abc", 10) == "abc"


def test_text_mode_parses_a_score_line(store):
    replies = [Reply(content="The reply is wrong.\nScore: -1\nRationale: it ignored the error")] * 3
    with DoubleServer(replies) as double:
        result = Judge(double.url, "judge", structured=False).judge_turns(
            store, [add_turn(store)])[0]
        bodies = [r["body"] for r in double.requests]
    assert result.score == -1 and result.rationale == "it ignored the error"
    assert all("response_format" not in b for b in bodies)


def test_falls_back_to_text_when_json_schema_is_rejected(store):
    def reply(body):
        if "response_format" in body:
            return Reply(status=400, content="response_format json_schema is not supported")
        return Reply(content='Verdict: {"score": 1, "rationale": "ok"}')
    with DoubleServer(reply) as double:
        judge = Judge(double.url, "judge", votes=3, retries=0)
        result = judge.judge_turns(store, [add_turn(store)])[0]
        assert judge.structured is False
        judge.judge_turns(store, [add_turn(store)])
        later = [r["body"] for r in double.requests[-1:]]
    assert result.score == 1 and result.failed == 0
    assert all("response_format" not in body for body in later)


# -- many turns -------------------------------------------------------------------------------
def test_judge_turns_runs_all_votes_concurrently_and_selects_unjudged(store):
    ids = [add_turn(store, session=f"s{i % 3}", user=f"question {i}") for i in range(10)]
    store.record_turn(session_id="x", request_messages=[{"role": "user", "content": "hi"}],
                      status="error", error="upstream down")
    with DoubleServer(lambda body: Reply(delay=0.4, content='{"score": 1, "rationale": "ok"}')) \
            as double:
        start = time.perf_counter()
        results = Judge(double.url, "judge", votes=3).judge_turns(store)  # unjudged ok main turns
        elapsed = time.perf_counter() - start
        assert len(double.requests) == 10  # each turn's 3 votes in one request
    assert [r.turn_id for r in results] == ids
    assert all(r.score == 1 for r in results)
    assert elapsed < 4.0, elapsed  # 30 requests of 0.4 s: 12 s one after another
    assert store.turns("reward IS NULL AND status = 'ok'") == []


def test_judge_turns_with_where_and_bounded_concurrency(store):
    a = add_turn(store, session="a")
    add_turn(store, session="b")
    with DoubleServer(lambda body: verdict(1)) as double:
        results = Judge(double.url, "judge", votes=3).judge_turns(
            store, where="session_id = ?", params=("a",), concurrency=1)
    assert [r.turn_id for r in results] == [a]


def test_bad_input_gets_a_clear_error(store):
    with pytest.raises(ValueError, match="votes must be an integer of at least 1"):
        Judge("http://127.0.0.1:9/v1", "judge", votes=0)
    judge = Judge("http://127.0.0.1:9/v1", "judge")
    with pytest.raises(ValueError, match="no turn with id 999"):
        judge.judge_turns(store, [999])
    error_turn = store.record_turn(session_id="e", request_messages=[], status="error")
    [result] = judge.judge_turns(store, [error_turn])
    assert result.score is None and "no reply to judge" in result.error


async def test_async_api_inside_a_running_loop(store):
    with DoubleServer([verdict(1)] * 6) as double:
        judge = Judge(double.url, "judge")
        results = await judge.ajudge_turns(store, [add_turn(store)])
        # the synchronous API also works while an event loop runs (as in a notebook)
        sync = judge.judge({"request_messages": [{"role": "user", "content": "q"}],
                            "response": "a"})
        await judge.aclose()
    assert results[0].score == 1
    assert sync.score == 1


# -- parsing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, score", [
    ('{"score": 1, "rationale": "good"}', 1),
    ('```json\n{"score": -1, "rationale": "bad"}\n```', -1),
    ('My verdict is {"score": 0, "rationale": "unclear"} as requested.', 0),
    ('{"score": "-1", "rationale": "bad"}', -1),
    ("**Score:** +1\nReason: fine", 1),
    ("score = 0", 0),
])
def test_parse_verdict_accepts_json_and_score_lines(text, score):
    assert parse_verdict(text)[0] == score


@pytest.mark.parametrize("text", ["", "helpful!", '{"score": 2, "rationale": "x"}',
                                  '{"score": true}', "Score: 5", '{"score": 1' + "0" * 400 + "}",
                                  "Score: 1" + "0" * 400])
def test_parse_verdict_rejects_what_it_cannot_read(text):
    with pytest.raises(ValueError):
        parse_verdict(text)


def test_aggregate_rules():
    ok = lambda s: {"score": s, "rationale": str(s), "error": None}  # noqa: E731
    assert aggregate([ok(1), ok(1), ok(-1)])[0] == 1
    assert aggregate([ok(1), ok(-1), ok(0)])[0] == 0
    assert aggregate([ok(-1), ok(-1), ok(1), ok(1)])[0] == 0
    failed = {"score": None, "rationale": "", "error": "HTTP 500: x"}
    assert aggregate([ok(-1), failed, failed])[:4] == (-1, "-1", 2, 0)
    assert aggregate([failed])[0] is None


def test_prompt_builder_round_trips():
    messages = build_judge_messages(
        {"request_messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
         "response": "hi"}, next_user="thanks")
    sections = parse_judge_prompt(messages[1]["content"])
    assert sections == {SECTION_TASK: "[1] hello", SECTION_TOOLS: "(no tool calls)",
                        SECTION_REPLY: "hi", SECTION_FEEDBACK: "thanks"}


def test_a_failed_call_is_explained_without_the_key_or_url_credentials():
    """A server's error may quote the key it was sent, and a URL may carry user:password."""
    from metaclaw.fastloop.llm import LLMClient, LLMStatusError

    client = LLMClient("http://team:pw-hunter2@127.0.0.1:9/v1", "sk-live-0123456789", 5.0)
    error = LLMStatusError(401, {}, json.dumps({"error": {
        "message": "Incorrect API key provided: sk-live-0123456789 (pw-hunter2)"}}).encode())
    text = client.explain(error)
    assert text.startswith("HTTP 401: Incorrect API key") and "sk-live" not in text
    assert "hunter2" not in text
    assert "hunter2" not in repr(Judge("http://team:pw-hunter2@127.0.0.1:9/v1", "m"))


def test_a_retry_after_given_as_an_http_date_is_honoured():
    """RFC 9110 lets a server send Retry-After as a date: it is waited for (up to the cap)."""
    import email.utils

    from metaclaw.fastloop.llm import MAX_RETRY_WAIT_S, retry_delay

    class Limited(Exception):
        status_code = 429

        def __init__(self, after: str):
            self.response = type("Response", (), {"headers": {"retry-after": after}})()

    soon = email.utils.formatdate(time.time() + 7, usegmt=True)
    assert 5 <= retry_delay(Limited(soon), 0) <= 7
    assert retry_delay(Limited("Wed, 21 Oct 2099 07:28:00 GMT"), 0) == MAX_RETRY_WAIT_S
    assert retry_delay(Limited("Wed, 21 Oct 2015 07:28:00 GMT"), 0) == 0.0  # already passed
    assert 0.3 <= retry_delay(Limited("whenever"), 0) <= 0.7  # unreadable: the usual backoff


def test_a_reply_nested_past_the_parsers_stack_is_unparsable_not_a_crash():
    deep = '{"score": 1, "x": ' + "[" * 50000 + "]" * 50000 + "}"
    with pytest.raises(ValueError, match="no score found"):
        parse_verdict(deep)
    assert parse_verdict(deep + '\n{"score": -1, "rationale": "after"}') == (-1, "after")


def test_a_later_conversation_that_only_shares_the_session_is_no_reaction():
    """A trimmed history still counts as the reaction where the later turn holds this turn's
    ask or reply; a new conversation under the same session name (a notebook's chat after a
    kernel restart, a second notebook) does not."""
    from metaclaw.fastloop.judge import next_user_message

    turn = {"request_messages": [{"role": "user", "content": "Convert 5 miles to km"}],
            "response": "8.05 km"}
    unrelated = {"request_messages": [
        {"role": "user", "content": "No, that's wrong: always back up files first."}]}
    assert next_user_message(turn, [unrelated]) is None
    trimmed = {"request_messages": [  # the client dropped the system prompt and older turns
        {"role": "assistant", "content": "8.05 km"}, {"role": "user", "content": "In miles?"}]}
    assert next_user_message(turn, [trimmed]) == "In miles?"
    summarised = {"request_messages": [
        {"role": "user", "content": "[summary of earlier work]"},
        {"role": "user", "content": "Convert 5 miles to km"},
        {"role": "assistant", "content": "(compacted)"}, {"role": "user", "content": "Thanks"}]}
    assert next_user_message(turn, [summarised]) == "Thanks"
    compacted = {"request_messages": [  # Claude Code's /compact: a summary, then the next ask
        {"role": "user", "content": "This session is being continued: ..."},
        {"role": "user", "content": "No, that is wrong: use miles"}]}
    assert next_user_message(turn, [compacted]) == "No, that is wrong: use miles"
