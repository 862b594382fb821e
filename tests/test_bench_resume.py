"""A resumed bench run's summary covers the whole run: the kept days' share of the time, taken
from what the earlier run wrote, plus the resumed part; never a figure of one part presented as
the whole."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metaclaw.bench.runner import format_table
from metaclaw.cli import main

DAYS = "day01,day02,day03"


def _day_ends(path: Path) -> list[dict]:
    """The lines of ``days.jsonl`` that say a day's end is done (the others say it began)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "finished_at" in r]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "out"
    assert main(["bench", "--days", DAYS, "--out", str(out)]) == 0
    return out


def _stopped_after(finished: Path, tmp_path: Path, days: set[str],
                   spans: dict[str, tuple[float, float]] | None) -> Path:
    """A copy of the finished run as a run stopped once ``days`` were done: only their rounds
    and day records are left, the day records moved to the given wall-clock ``spans`` (none
    at all when ``spans`` is None: a run from before days were timed)."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    run = out / "run"
    rounds = [line for line in (run / "rounds.jsonl").read_text().splitlines()
              if json.loads(line)["day"] in days]
    (run / "rounds.jsonl").write_text("".join(line + "\n" for line in rounds))
    (run / "summary.json").unlink()
    if spans is None:
        (run / "days.jsonl").unlink(missing_ok=True)
    else:
        records = _day_ends(run / "days.jsonl")
        kept = [{**r, "started_at": spans[r["day"]][0], "finished_at": spans[r["day"]][1]}
                for r in records if r["day"] in spans]
        (run / "days.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out


def _resume(out: Path) -> dict:
    assert main(["bench", "--days", DAYS, "--out", str(out), "--resume"]) == 0
    return json.loads((out / "run" / "summary.json").read_text())


def test_a_finished_run_records_when_each_day_ran(finished_run):
    summary = json.loads((finished_run / "run" / "summary.json").read_text())
    records = _day_ends(finished_run / "run" / "days.jsonl")
    assert sorted(r["day"] for r in records) == ["day01", "day02", "day03"]
    assert all(r["run_id"] == summary["run_id"] and r["finished_at"] >= r["started_at"]
               for r in records)
    assert "earlier_duration_s" not in summary and summary["duration_s"] >= 0


def test_the_duration_adds_the_kept_days_time_to_the_resumed_part(finished_run, tmp_path, capsys):
    out = _stopped_after(finished_run, tmp_path, {"day01"}, {"day01": (1000.0, 1042.5)})
    summary = _resume(out)
    assert summary["resumed_days"] == ["day01"] and summary["rounds"] == 15
    assert summary["earlier_duration_s"] == 42.5
    assert summary["duration_s"] == pytest.approx(42.5 + summary["resumed_duration_s"])
    table = capsys.readouterr().out
    assert "resumed run: the totals and day lines include day01, kept from the earlier run" in table
    assert (f"duration {summary['duration_s']} s for the whole run: 42.5 s of the earlier run "
            f"on day01, {summary['resumed_duration_s']} s in this part") in table
    # resumed again, the kept days' timings carry over to the next part
    days = _day_ends(out / "run" / "days.jsonl")
    assert [d["day"] for d in days][0] == "day01" and len(days) == 3


def test_days_that_ran_side_by_side_count_once(finished_run, tmp_path):
    out = _stopped_after(finished_run, tmp_path, {"day01", "day02"},
                         {"day01": (1000.0, 1040.0), "day02": (1010.0, 1050.0)})
    assert _resume(out)["earlier_duration_s"] == 50.0


def test_an_earlier_run_without_day_timings_gives_no_duration_but_says_why(finished_run,
                                                                          tmp_path, capsys):
    out = _stopped_after(finished_run, tmp_path, {"day01"}, None)
    summary = _resume(out)
    assert summary["duration_s"] is None and summary["earlier_duration_s"] is None
    assert summary["resumed_duration_s"] >= 0
    assert summary["earlier_part_note"].startswith("the earlier run's records hold no timing for "
                                                   "day01")
    assert f"duration unknown: {summary['earlier_part_note']}" in capsys.readouterr().out


def test_a_day_record_of_another_run_or_cut_short_is_not_taken(finished_run, tmp_path):
    """The timing must be of the run that recorded the kept rounds: a day record with another
    run id (left by a different run) or a line cut by a kill gives no figure."""
    out = _stopped_after(finished_run, tmp_path, {"day01", "day02"},
                         {"day01": (1000.0, 1040.0), "day02": (1040.0, 1080.0)})
    path = out / "run" / "days.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[0]["run_id"] = "someone"
    cut = json.dumps(records[1])
    path.write_text(json.dumps(records[0]) + "\n" + cut[:len(cut) // 2])
    summary = _resume(out)
    assert summary["duration_s"] is None
    assert "no timing for day01, day02" in summary["earlier_part_note"]


def test_the_table_of_a_run_that_was_not_resumed_says_nothing_of_an_earlier_part():
    summary = {"rounds": 0, "accuracy": None, "file_check_completion": None,
               "multi_choice_score": None, "file_check_rounds": 0, "multi_choice_rounds": 0,
               "duration_s": 1.0, "resumed_days": []}
    assert "earlier" not in format_table(summary) and "resumed" not in format_table(summary)


# A bench run in its own process whose between_days hook records each day it ends in
# ``effects`` (one line per call); with $STALL_IN_END_OF=<day> the hook of that day says so in
# ``<out>/stalled`` and waits, so the test can kill the process exactly there.
RUN = """
import json, os, sys, time
from pathlib import Path
from metaclaw.bench.data import small_bench_dir
from metaclaw.bench.runner import run_bench
from metaclaw.offline.simmodel import serve_sim_model

out, resume = Path(sys.argv[1]), sys.argv[2] == "resume"

def between_days(day):
    if day["day"] == os.environ.get("STALL_IN_END_OF"):
        (out / "stalled").touch()
        time.sleep(600)
    with open(out / "effects", "a") as fh:
        fh.write(json.dumps(day) + "\\n")

sim = serve_sim_model()
try:
    run_bench(small_bench_dir(), "day01,day02,day03", "baseline", base_url=sim.url,
              model="sim-agent", out_dir=out / "run", between_days=between_days, resume=resume)
finally:
    sim.stop()
"""


def _run(out: Path, how: str, stall_in: str | None = None) -> None:
    """Run (``how``: "start" or "resume"); with ``stall_in`` kill it with SIGKILL while that
    day's end hook runs."""
    env = {**os.environ, "STALL_IN_END_OF": stall_in or ""}
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(out), how], env=env)
    if stall_in is None:
        assert proc.wait(timeout=300) == 0
        return
    deadline = time.monotonic() + 300
    while not (out / "stalled").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    (out / "stalled").unlink()


def test_a_run_killed_in_a_days_end_hook_runs_only_that_end_on_resume(tmp_path):
    """Killed while day02's between_days hook ran (all its rounds recorded), then killed again
    in the same hook of the resumed run: the next resume runs day02's end, once, without its
    rounds, and the whole run holds every round and every day's end exactly once."""
    out = tmp_path / "out"
    out.mkdir()
    _run(out, "start", stall_in="day02")
    first = [json.loads(line) for line in (out / "run" / "rounds.jsonl").read_text().splitlines()]
    assert {r["day"] for r in first} == {"day01", "day02"}  # day02's rounds were all on file
    _run(out, "resume", stall_in="day02")   # killed in the same end again
    _run(out, "resume")

    rounds = [json.loads(line) for line in (out / "run" / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 15 and len({(r["day"], r["round"]) for r in rounds}) == 15
    assert [r for r in rounds if r["day"] != "day03"] == first  # kept as they were, not re-run
    effects = [json.loads(line) for line in (out / "effects").read_text().splitlines()]
    assert [e["day"] for e in effects] == ["day01", "day02", "day03"]
    assert effects[1]["resumed_end"] is True and effects[1]["rounds"] == 5
    assert "resumed_end" not in effects[0] and "resumed_end" not in effects[2]

    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["rounds"] == 15 and summary["resumed_days"] == ["day01", "day02"]
    assert summary["resumed_day_ends"] == ["day02"]
    assert [d["rounds"] for d in summary["per_day"]] == [5, 5, 5]
    assert summary["duration_s"] is not None and summary["earlier_duration_s"] >= 0
    assert ("the earlier run was stopped in the end of day02; its end ran in this part"
            in format_table(summary))
    ends = _day_ends(out / "run" / "days.jsonl")
    assert [d["day"] for d in ends] == ["day01", "day02", "day03"]
    # day02's line names the run that recorded its rounds, so a later resume still times it
    assert ends[1]["run_id"] == first[-1]["session_id"].split("-")[1]


def test_resuming_a_run_whose_days_all_ended_runs_no_day_and_no_end_again(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _run(out, "start")
    _run(out, "resume")
    effects = [json.loads(line)["day"] for line in (out / "effects").read_text().splitlines()]
    assert effects == ["day01", "day02", "day03"]
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["resumed_days"] == ["day01", "day02", "day03"]
    assert summary["resumed_day_ends"] == [] and summary["rounds"] == 15


def test_mode_full_finds_the_killed_process_snapshots_for_a_resumed_night(tmp_path):
    """A resumed run that finishes a day's night (mode full) rewards file checks against the
    workspace snapshots the killed process left in the run's folder."""
    from metaclaw.bench.fullmode import FullMode

    full = FullMode.__new__(FullMode)   # only the snapshot lookup, without a policy to train
    full.snapshots, full.work_dir = {}, tmp_path
    (tmp_path / "snapshots" / "day02" / "r3").mkdir(parents=True)
    assert full._snapshot("day02", "r3") == tmp_path / "snapshots" / "day02" / "r3"
    assert full._snapshot("day02", "r4") is None


SKILLS_RUN = """
import os, sys, time
from pathlib import Path
from metaclaw.demo import run_mode
from metaclaw.offline.simmodel import serve_sim_model

out, data, days, resume = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "resume"

def on_round(record):
    if f"{record['day']}:{record['index']}" == os.environ.get("STALL_AT"):
        (out / "stalled").touch()
        time.sleep(600)

sim = serve_sim_model()
try:
    run_mode("skills", data, days, out, sim.url, "sim-agent",
             api_key_env="METACLAW_UPSTREAM_API_KEY", retrieval="lexical", top_k=3,
             min_score=None, budget_chars=6000, parallel=1, judge_url=sim.url,
             judge_model="sim-judge", evolver_url=sim.url, evolver_model="sim-evolver", votes=1,
             evolve_every="day", on_round=on_round, resume=resume)
finally:
    sim.stop()
"""


def killed_then_resumed_skills_run(out: Path, stall_at: str, data: Path | None = None,
                                   days: str = "day01,day02", between=lambda store: None):
    """A skills run of ``days`` (of the small benchmark, or ``data``) killed (SIGKILL) once
    ``stall_at`` ("day:round index") is recorded, then, after ``between(store)``, resumed to
    its end; returns the workspace's store."""
    from metaclaw.bench.data import small_bench_dir
    from metaclaw.store import Store

    out.mkdir()
    args = [sys.executable, "-c", SKILLS_RUN, str(out), str(data or small_bench_dir()), days]
    proc = subprocess.Popen([*args, "start"], env={**os.environ, "STALL_AT": stall_at})
    try:
        deadline = time.monotonic() + 300
        while not (out / "stalled").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never got there"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    with Store(out / "metaclaw.db") as store:
        between(store)
    done = subprocess.run([*args, "resume"], env={**os.environ, "STALL_AT": ""}, timeout=300)
    assert done.returncode == 0
    return Store(out / "metaclaw.db")


def test_a_skills_run_killed_mid_day_leaves_no_half_day_to_learn_from(tmp_path):
    """Killed after day02's second round: the resumed run runs day02 again in a new session;
    the killed attempt's turns are purged from the buffers, so the evolver and training never
    see the day twice."""
    store = killed_then_resumed_skills_run(tmp_path / "out", "day02:1")
    try:
        day02 = sorted(r["id"] for r in store.query(
            "SELECT id FROM sessions WHERE id LIKE 'bench-%-day02'"))
        assert len(day02) == 2  # the killed attempt and the resumed run's
        killed = next(s for s in day02 if store.query(
            "SELECT 1 FROM turns WHERE session_id = ? AND buffer_state = 'purged'", (s,)))
        states = {r["buffer_state"] for r in store.query(
            "SELECT buffer_state FROM turns WHERE session_id = ? AND status = 'ok' "
            "AND turn_type = 'main'", (killed,))}
        assert states == {"purged"}
        (event,) = store.events(kind="resume_settled")
        assert event["detail"]["purged"] >= 2
    finally:
        store.close()


def test_a_skills_run_killed_before_a_days_end_judges_that_days_turns_first(tmp_path):
    """Killed once day01's rounds were all recorded, before its end: the last turn was still
    waiting for its feedback in the killed process. The resumed run judges it before running
    day01's end, so the day's evolution sees every verdict."""
    store = killed_then_resumed_skills_run(tmp_path / "out", "day01:4")
    try:
        assert len(store.query("SELECT id FROM sessions WHERE id LIKE 'bench-%-day01'")) == 1
        assert not store.query("SELECT id FROM turns WHERE session_id LIKE 'bench-%-day01' "
                               "AND status = 'ok' AND turn_type = 'main' AND reward IS NULL")
        (event,) = store.events(kind="resume_settled")
        assert event["detail"]["judged"] >= 1 and event["detail"]["purged"] == 0
    finally:
        store.close()
