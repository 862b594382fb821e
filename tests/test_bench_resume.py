"""A resumed bench run's summary covers the whole run: the kept days' share of the time, taken
from what the earlier run wrote, plus the resumed part; never a figure of one part presented as
the whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from metaclaw.bench.runner import format_table
from metaclaw.cli import main

DAYS = "day01,day02,day03"


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
        records = [json.loads(line) for line in (run / "days.jsonl").read_text().splitlines()]
        kept = [{**r, "started_at": spans[r["day"]][0], "finished_at": spans[r["day"]][1]}
                for r in records if r["day"] in spans]
        (run / "days.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out


def _resume(out: Path) -> dict:
    assert main(["bench", "--days", DAYS, "--out", str(out), "--resume"]) == 0
    return json.loads((out / "run" / "summary.json").read_text())


def test_a_finished_run_records_when_each_day_ran(finished_run):
    summary = json.loads((finished_run / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (finished_run / "run" / "days.jsonl").read_text()
               .splitlines()]
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
    days = [json.loads(line) for line in (out / "run" / "days.jsonl").read_text().splitlines()]
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
