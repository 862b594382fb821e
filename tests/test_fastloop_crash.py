"""The fast loop across crashes and processes: what one process left unjudged or unevolved is
finished by the next, once, and two processes of a workspace do not do the same work twice.

Real parts throughout: a proxy process killed with SIGKILL, SQLite files shared by several
connections, a lock file; one offline double (tests/test_fastloop.py's ``Models``) plays the
agent's upstream, the judge and the evolver.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from metaclaw.fastloop import proposals
from metaclaw.fastloop.evolver import Evolver
from metaclaw.fastloop.gate import Gate
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.loop import FastLoop
from metaclaw.offline.double import DoubleServer
from metaclaw.skills.library import SkillLibrary
from metaclaw.skills.retrieval import LexicalRetriever
from metaclaw.store import Store
from test_fastloop import Models, kinds, rig  # noqa: F401 - the rig fixture
from waiting import wait_until

CHILD = textwrap.dedent("""
    import sys, time, openai
    from metaclaw.fastloop.evolver import Evolver
    from metaclaw.fastloop.loop import FastLoop
    from metaclaw.fastloop.judge import Judge
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.retrieval import LexicalRetriever
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store

    url, folder = sys.argv[1], sys.argv[2]
    store = Store(folder + "/metaclaw.db")
    library = SkillLibrary(folder + "/skills", store)
    proxy = Proxy(ProxyConfig(upstream_url=url, model="agent", retrieval="lexical"), store,
                  library, retriever=LexicalRetriever()).start()
    judge = Judge(url, "judge", votes=1, timeout=5)
    loop = FastLoop(store, library, judge, Evolver(url, "evolver", library, store, judge=judge,
                    dedupe_threshold=None), feedback_wait=600).attach(proxy)
    client = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
    for session in ("a", "b"):
        client.chat.completions.create(model="agent", extra_headers={"X-Session-Id": session},
            messages=[{"role": "user", "content": "Convert 5 miles to kilometers"}])
    proxy.flush()
    while sum(e.kind == "turn" for e in loop.events) < 2:
        time.sleep(0.01)
    print("waiting", flush=True)  # both turns wait for feedback, in this process's memory
    time.sleep(600)
""")


def judge_calls(double: DoubleServer) -> list[dict]:
    return [r for r in double.requests if r["body"]["model"] == "judge"]


def make_loop(tmp_path, url: str, **options) -> FastLoop:
    """A fast loop of its own process-like kind: its own connection, library, judge, evolver."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    judge = Judge(url, "judge", votes=1, timeout=5)
    evolver = Evolver(url, "evolver", library, store, judge=judge, dedupe_threshold=None)
    options.setdefault("gate", Gate(judge, url, "agent", retriever=LexicalRetriever()))
    loop = FastLoop(store, library, judge, evolver, **options)
    loop.SWEEP_S = 0.2
    return loop


@pytest.fixture
def double():
    models = Models()
    server = DoubleServer(models).start()
    server.models_brain = models
    yield server
    server.stop()


def test_turns_a_killed_proxy_left_waiting_are_judged_by_the_next_loops_once(tmp_path, double):
    child = subprocess.Popen([sys.executable, "-c", CHILD, double.url, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert child.stdout.readline().strip() == "waiting"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    with Store(tmp_path / "metaclaw.db") as store:
        turns = [t["id"] for t in store.turns()]
        assert len(turns) == 2 and all(t["reward"] is None for t in store.turns())
    assert judge_calls(double) == []

    # two processes start on the workspace at once: each turn is judged, by one of them
    loops = [make_loop(tmp_path, double.url, feedback_wait=0, every_n=0, failure_rate=None,
                       on_session_end=False) for _ in range(2)]
    try:
        for loop in loops:
            loop.start()
        store = loops[0].store
        wait_until(lambda: all(t["reward"] is not None for t in store.turns()),
                   what="the killed process's turns judged")
        time.sleep(0.5)  # a few more sweeps: nothing is judged again
        assert sorted(e.turn_id for loop in loops for e in loop.events
                      if e.kind == "judged") == turns
        assert len(judge_calls(double)) == 2
        assert all(t["reward"] == -1.0 for t in store.turns())
    finally:
        for loop in loops:
            loop.stop()
            loop.store.close()


def test_a_turn_the_judge_failed_on_is_judged_once_the_judge_is_back(rig, monkeypatch):
    monkeypatch.setattr(FastLoop, "SWEEP_S", 0.1)
    rig.judge.retries = 0
    rig.models.judge_fails = True
    loop = rig.make_loop(every_n=0, failure_rate=None, on_session_end=False, feedback_wait=0)
    rig.chat("down", [], "Convert 5 miles to kilometers")
    [turn] = rig.store.turns()
    # the judge is still down: retried after about 0.1 s, then 0.2 s, 0.4 s, ...
    wait_until(lambda: kinds(loop).count("judge_failed") >= 3, what="retries")
    time.sleep(0.3)
    assert kinds(loop).count("judge_failed") <= 4  # growing pauses, not one call per sweep
    assert rig.store.turn(turn["id"])["reward"] is None
    rig.models.judge_fails = False
    wait_until(lambda: rig.store.turn(turn["id"])["reward"] is not None, timeout=10,
               what="the turn judged once the judge answers again")
    assert rig.store.turn(turn["id"])["reward"] == -1.0


def test_a_failure_a_killed_process_did_not_evolve_from_is_evolved_on_start_once(rig):
    # what a kill -9 between the verdict and the evolution leaves: the session ended, its
    # failure judged, no generation made from it
    rig.chat("s1", [], "Convert 7 miles to kilometers", done=True)
    rig.judge.judge_turns(rig.store)
    [turn] = rig.store.turns()
    assert turn["reward"] == -1.0
    start = rig.library.generation

    loop = rig.make_loop(every_n=0, failure_rate=None, on_session_end=True, feedback_wait=60)
    wait_until(lambda: "evolved" in kinds(loop), what="the evolution on start")
    event = next(e for e in loop.events if e.kind == "evolved")
    assert event.detail["trigger"] == "session s1 ended (found on start)"
    assert rig.library.generation == start + 1
    loop.stop()

    again = rig.make_loop(every_n=0, failure_rate=None, on_session_end=True, feedback_wait=60)
    again.wait_idle()
    assert rig.library.generation == start + 1  # once
    assert "evolve_started" not in kinds(again)


def test_failures_a_held_proposal_was_made_from_are_not_proposed_again_after_a_restart(rig):
    rig.chat("s1", [], "Convert 7 miles to kilometers", done=True)
    rig.judge.judge_turns(rig.store)
    # no gate: the candidate is held back for review
    loop = rig.make_loop(every_n=0, failure_rate=None, on_session_end=True, feedback_wait=60,
                         gate=None)
    wait_until(lambda: "evolve_held" in kinds(loop), what="a held proposal")
    loop.stop()
    restarted = rig.make_loop(every_n=0, failure_rate=None, on_session_end=True,
                              feedback_wait=60, gate=None)
    restarted.wait_idle()
    assert len(proposals.held(rig.store)) == 1
    assert "evolve_started" not in kinds(restarted)


def test_two_processes_do_not_evolve_from_the_same_failures_at_once(tmp_path, double):
    models = double.models_brain
    setup = make_loop(tmp_path, double.url)
    store = setup.store
    # a judged failure in an ended session, left for the loops that start next
    turn = store.record_turn(session_id="s", status="ok", response="7 miles is 7 km.",
                             request_messages=[{"role": "user",
                                                "content": "Convert 7 miles to kilometers"}])
    store.mark_session_done("s")
    setup.judge.judge_turns(store)
    setup.store.close()
    models.evolver_delay = 1.0  # the first evolver call is slow: both loops are in it at once

    loops = [make_loop(tmp_path, double.url, every_n=0, failure_rate=None, on_session_end=True,
                       feedback_wait=60) for _ in range(2)]
    try:
        for loop in loops:
            loop.start()
        wait_until(lambda: any("evolved" in kinds(loop) for loop in loops), timeout=20,
                   what="an evolution")
        for loop in loops:
            loop.wait_idle()
        evolver_calls = [r for r in double.requests if r["body"]["model"] == "evolver"]
        assert len(evolver_calls) == 1
        assert [g["generation"] for g in loops[0].store.query(
            "SELECT generation FROM skill_generations WHERE kind = 'evolve'")] == [1]
        assert proposals.held(loops[0].store) == []  # no stale candidate left for review
        assert loops[0].store.turn(turn)["buffer_state"] == "consumed"
    finally:
        for loop in loops:
            loop.stop()
            loop.store.close()


def test_a_backlog_of_many_sessions_is_judged_within_the_loops_concurrency(tmp_path):
    """40 one-turn sessions left without a verdict: the first sweep judges them all, but keeps
    about ``concurrency`` judge calls in flight (it sent all 40 at once)."""
    import threading

    from metaclaw.offline.double import Reply

    arrivals: list[float] = []
    lock = threading.Lock()

    def verdict(_body):
        with lock:
            arrivals.append(time.monotonic())
        return Reply("Score: 1", delay=0.5)

    with DoubleServer(verdict) as judge_double:
        with Store(tmp_path / "metaclaw.db") as store:
            for i in range(40):
                store.record_turn(session_id=f"s{i}", request_messages=[
                    {"role": "user", "content": f"task {i}"}], status="ok", response="done",
                    skill_generation=0, turn_type="main")
        loop = make_loop(tmp_path, judge_double.url, feedback_wait=0, every_n=0,
                         failure_rate=None, on_session_end=False, concurrency=8, gate=None)
        try:
            loop.start()
            wait_until(lambda: all(t["reward"] is not None for t in loop.store.turns()),
                       timeout=30, what="the backlog judged")
        finally:
            loop.stop()
            loop.store.close()
    first = arrivals[0]
    assert len(arrivals) == 40
    assert sum(at - first < 0.3 for at in arrivals) <= 8  # no more than 8 calls at once
