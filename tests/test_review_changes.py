"""Defects found in the crash-recovery changes (sweep, evolve lock, resumed bench runs),
each reproduced with real processes, sockets and SQLite."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from test_bench_resume import killed_then_resumed_skills_run


def _bench_with_days(tmp_path: Path, ids: dict[str, str]) -> Path:
    """A copy of the small benchmark whose days are renamed (``{old id: new id}``), in the
    order of ``ids``."""
    from metaclaw.bench.data import small_bench_dir

    data = tmp_path / "bench"
    shutil.copytree(small_bench_dir(), data)
    tests = json.loads((data / "all_tests.json").read_text())
    by_id = {entry["id"]: entry for entry in tests["test"]}
    tests["test"] = [{**by_id[old], "id": new, "eval": by_id[old].get("eval", old)}
                     for old, new in ids.items()]
    (data / "all_tests.json").write_text(json.dumps(tests))
    shared = data / "workspaces" / "shared"  # each day's input files, under its new id
    for old in ids:
        (shared / old).rename(shared / f"{old}.old")
    for old, new in ids.items():
        (shared / f"{old}.old").rename(shared / new)
    return data


def test_a_resumed_run_keeps_the_turns_of_a_day_whose_id_ends_like_another_days(tmp_path):
    """Days "x-day01" then "day01"; killed once x-day01's rounds were all recorded, before its
    end. day01 never began, so nothing is purged: x-day01's session (bench-RUN-x-day01) also
    ends in "-day01", and was taken for day01's, so the kept day's turns were purged before
    its end could evolve from them."""
    data = _bench_with_days(tmp_path, {"day01": "x-day01", "day02": "day01"})
    store = killed_then_resumed_skills_run(tmp_path / "out", "x-day01:4", data,
                                           "x-day01,day01")
    try:
        (event,) = store.events(kind="resume_settled")
        assert event["detail"]["purged"] == 0 and event["detail"]["judged"] >= 1
        # x-day01's end evolved from its failures: they are the first generation's support
        states = {r["buffer_state"] for r in store.query(
            "SELECT buffer_state FROM turns WHERE session_id LIKE 'bench-%-x-day01' "
            "AND turn_type = 'main' AND reward < 0")}
        assert states == {"consumed"}
    finally:
        store.close()


def test_a_run_resumed_long_after_the_kill_judges_no_turn_of_a_day_that_runs_again(tmp_path):
    """Killed after day02's second round and resumed more than the feedback wait (600 s)
    later: the turn the killed process was waiting on belongs to the abandoned attempt at
    day02, which runs again. The fast loop's first sweep started before the resume purged
    that attempt, and judged its turn: a judge call (three votes with a real model) for a
    verdict nothing reads."""
    waiting: list[int] = []

    def an_hour_later(store):
        waiting.extend(r["id"] for r in store.query(
            "SELECT id FROM turns WHERE session_id LIKE 'bench-%-day02' AND status = 'ok' "
            "AND turn_type = 'main' AND reward IS NULL"))
        store.execute("UPDATE turns SET created_at = created_at - 3600")

    data = _bench_with_days(tmp_path, {"day01": "day01", "day02": "day02"})
    store = killed_then_resumed_skills_run(tmp_path / "out", "day02:1", data, "day01,day02",
                                           an_hour_later)
    try:
        assert waiting
        rows = store.query(f"SELECT buffer_state, reward FROM turns WHERE id IN "
                           f"({','.join(map(str, waiting))})")
        assert {r["buffer_state"] for r in rows} == {"purged"}
        assert [r["reward"] for r in rows] == [None] * len(rows)
    finally:
        store.close()


def test_a_turn_served_while_another_process_committed_a_generation_is_recorded_purged(tmp_path):
    """The turn enters the buffers as it is recorded; a generation committed by another
    connection while its upstream call was in flight (after this proxy last looked, and after
    that evolution purged the older live turns) makes it purged, not live under a generation
    that is gone."""
    import threading

    import httpx

    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store

    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    in_flight = threading.Event()

    def slow(_body):
        in_flight.set()
        time.sleep(1.0)
        return Reply("done")

    with DoubleServer(slow) as upstream:
        proxy = Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical"), store,
                      library).start()
        try:
            answer = {}
            thread = threading.Thread(target=lambda: answer.update(reply=httpx.post(
                proxy.url + "/chat/completions", timeout=30, json={
                    "model": "m", "messages": [{"role": "user", "content": "hello"}]})))
            thread.start()
            assert in_flight.wait(10)
            other = Store(tmp_path / "metaclaw.db")  # another process's connection
            try:
                assert other.add_generation(snapshot={}, kind="manual", parent=0) == 1
            finally:
                other.close()
            thread.join(30)
            assert answer["reply"].status_code == 200
            proxy.flush()
            (turn,) = store.turns()
            assert turn["skill_generation"] == 0
            assert (turn["buffer_set"], turn["buffer_state"]) == ("query", "purged")
            # a turn served under the latest generation enters as live
            httpx.post(proxy.url + "/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "again"}]})
            proxy.flush()
            last = store.turns()[-1]
            assert last["skill_generation"] == 1 and last["buffer_state"] == "live"
        finally:
            proxy.stop()
            store.close()
