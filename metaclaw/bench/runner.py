"""Run MetaClaw-Bench: days in parallel, rounds in order, every model call through ``base_url``.

    summary = run_bench("metaclaw-bench-small", "all", "baseline", base_url=proxy.url,
                        model="m", out_dir="runs/baseline", parallel=4)
    print(format_table(summary))

Each day gets a fresh workspace and its own session; each round's question carries the previous
round's feedback (``[Previous Feedback] ...``); after the last round the last feedback is sent on
its own, without tools, as the session's last call (``X-Session-Done``). A round is graded
right after the agent's reply. Writes ``<out_dir>/rounds.jsonl`` (one record per round, as rounds
finish), ``<out_dir>/days.jsonl`` (when each day started and ended, as days end) and
``<out_dir>/summary.json``.

Hooks (sync functions run in a worker thread, or ``async`` functions awaited):

- ``on_round(record)``: after each round is graded (progress displays);
- ``between_rounds(record)``: after each round except a day's last (judge + evolve in mode
  ``skills``/``full``);
- ``between_days(day_summary)``: after each day.

The runner is agnostic of ``mode``: it records it; the caller decides what ``base_url`` serves
(a proxy without skills for ``baseline``, with the fast loop for ``skills``, and so on).
Accuracy is over all rounds; file-check completion is over the file_check rounds only.
With ``resume=True`` a run stopped midway goes on: the days it finished are kept from its
``rounds.jsonl``, the others run again (a day is the unit: its rounds share one workspace).
A day's end (its ``between_days`` hook, then its line in ``days.jsonl``) is tracked apart from
its rounds: just before a day's last round is recorded, ``days.jsonl`` gets a line saying the
day's end has begun (``rounds_done_at``, no ``finished_at``), and the day's line with
``finished_at`` once its end is done. A day whose rounds were all recorded but whose end never
completed (the run was killed in its hook) has its end run by the resumed run, its rounds kept
as they are: nothing is recorded twice. (The day's closing call to the model, made just after
its last round, is not sent again: the conversation it closes went with the killed process.)
Every line is on disk (fsync) before the run goes on.
The summary then covers the whole run: the kept days' rounds, and a ``duration_s`` that adds the
time the earlier run spent on them (from its ``days.jsonl``) to this part's, or ``None`` with
``earlier_part_note`` saying why when the earlier run's records do not tell.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from metaclaw.bench.agent import AgentConfig, DayAgent
from metaclaw.bench.data import Day, load_benchmark, select_days
from metaclaw.bench.grading import (feedback_text, run_check, score_choice, standalone_feedback,
                                    with_feedback)
from metaclaw.bench.workspace import Workspace
from metaclaw.fileio import write_atomic
from metaclaw.jsonlib import jsonl_line

log = logging.getLogger(__name__)

MODES = ("baseline", "skills", "full")
CLOSING_MESSAGE = "That is all for today, thank you."


async def _call_hook(hook: Callable | None, arg: Any, errors: list[str], name: str) -> None:
    if hook is None:
        return
    try:
        if inspect.iscoroutinefunction(hook):
            await hook(arg)
        else:
            await asyncio.to_thread(hook, arg)
    except Exception as exc:  # a hook's failure must not lose the benchmark's results
        message = f"{name} hook failed: {type(exc).__name__}: {exc}"
        log.warning(message)
        errors.append(message)


def _ratio(num: float, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _stats(records: list[dict]) -> dict:
    fc = [r for r in records if r["type"] == "file_check"]
    mc = [r for r in records if r["type"] == "multi_choice"]
    return {
        "rounds": len(records),
        "passed": sum(bool(r["passed"]) for r in records),
        "accuracy": _ratio(sum(bool(r["passed"]) for r in records), len(records)),
        "file_check_rounds": len(fc),
        "file_check_passed": sum(bool(r["passed"]) for r in fc),
        "file_check_completion": _ratio(sum(bool(r["passed"]) for r in fc), len(fc)),
        "multi_choice_rounds": len(mc),
        "multi_choice_score": _ratio(sum(float(r["score"]) for r in mc), len(mc)),
        "errors": sum(1 for r in records if r.get("error")),
    }


def summarize(records: Iterable[dict], *, day_order: list[str] | None = None, **meta: Any) -> dict:
    """Totals and per-day figures from round records (``meta`` keys are copied in).

    ``accuracy`` = passed rounds / all rounds; ``file_check_completion`` = passed file checks /
    file_check rounds (not / all rounds); ``multi_choice_score`` = mean partial-credit score.
    Ratios are ``None`` when their denominator is 0.
    """
    records = list(records)
    order = day_order or sorted({r["day"] for r in records})
    per_day = []
    for day in order:
        rows = [r for r in records if r["day"] == day]
        if rows:
            per_day.append({"day": day, "arc": rows[0].get("arc", ""), **_stats(rows)})
    return {**meta, **_stats(records), "per_day": per_day}


def all_rounds_failed(summary: dict) -> str | None:
    """One sentence when every round of a run ended in an error (an unreachable or refusing
    model, say): the table of zeros would say nothing about the model. None otherwise."""
    if summary.get("rounds") and summary.get("errors") == summary["rounds"]:
        return (f"every one of the {summary['rounds']} rounds failed with an error, so the scores "
                f"measure nothing; the first error was {summary.get('first_error')}")
    return None


def judge_never_worked(summary: dict) -> str | None:
    """One sentence when a skills or full run's judge failed on every turn it was given: no
    failure reached the evolver, so no skill was learned and the scores are the baseline's
    under another name. None otherwise."""
    tally = summary.get("judge") or {}
    if tally.get("failed") and not tally.get("judged"):
        return (f"the judge failed on every turn ({tally['failed']}), so no skill was learned "
                f"and the scores measure the baseline; the first error was "
                f"{tally.get('first_error')}")
    return None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:5.1f}%"


def format_table(summary: dict) -> str:
    """A plain-text table: one line per day and a total line."""
    head = f"{'day':<8} {'rounds':>6} {'accuracy':>9} {'file-check':>11} {'multi-choice':>13} {'errors':>6}"
    lines = []
    title = " ".join(f"{k}={summary[k]}" for k in ("benchmark", "mode", "model") if summary.get(k))
    if title:
        lines.append(title)
    lines += [head, "-" * len(head)]
    for d in summary.get("per_day", []):
        lines.append(f"{d['day']:<8} {d['rounds']:>6} {_fmt(d['accuracy']):>9} "
                     f"{_fmt(d['file_check_completion']):>11} {_fmt(d['multi_choice_score']):>13} "
                     f"{d.get('errors', 0):>6}")
    lines.append("-" * len(head))
    lines.append(f"{'total':<8} {summary['rounds']:>6} {_fmt(summary['accuracy']):>9} "
                 f"{_fmt(summary['file_check_completion']):>11} {_fmt(summary['multi_choice_score']):>13} "
                 f"{summary.get('errors', 0):>6}")
    lines.append(f"accuracy over {summary['rounds']} rounds; file-check completion over "
                 f"{summary['file_check_rounds']} file_check rounds; multi-choice mean score over "
                 f"{summary['multi_choice_rounds']} rounds")
    if summary.get("judge"):
        tally = summary["judge"]
        lines.append(f"judge: {tally['judged']} turns judged"
                     + (f", {tally['failed']} failed ({tally['first_error']})" if tally["failed"]
                        else "")
                     + (f" ({summary['judge_note']})" if summary.get("judge_note") else ""))
    if summary.get("resumed_days"):
        kept = ", ".join(summary["resumed_days"])
        lines.append(f"resumed run: the totals and day lines include {kept}, kept from the "
                     "earlier run")
        if summary.get("resumed_day_ends"):
            lines.append(f"the earlier run was stopped in the end of "
                         f"{', '.join(summary['resumed_day_ends'])}; its end ran in this part")
        if summary.get("duration_s") is not None:
            lines.append(f"duration {summary['duration_s']} s for the whole run: "
                         f"{summary.get('earlier_duration_s')} s of the earlier run on {kept}, "
                         f"{summary.get('resumed_duration_s')} s in this part")
        else:
            lines.append(f"duration unknown: {summary.get('earlier_part_note')}")
    for failure in summary.get("day_failures") or []:
        lines.append(f"day failed: {failure}")
    for error in summary.get("hook_errors") or []:
        lines.append(f"hook error: {error}")
    return "\n".join(lines)


class ResumeError(ValueError):
    """An earlier run cannot be resumed as asked (the message says why and what to do)."""


def finished_days(path: Path, days: list[Day], mode: str, model: str) -> dict[str, list[dict]]:
    """The days an earlier run (its ``rounds.jsonl`` at ``path``) finished: day id -> its round
    records, for each day among ``days`` with a record for every round and no error. Days it
    left unfinished, or ended with an error, are not returned: a resumed run runs them again.

    A last line cut short (the run was killed while writing it) is ignored; a run of another
    ``mode`` or ``model``, a damaged line before the last, or records of a day not among
    ``days`` (the resumed run rewrites the file with the selected days only, so they would be
    lost) raise :class:`ResumeError`.
    """
    if not path.is_file():
        raise ResumeError(f"there is no earlier run to resume in {path.parent} (no {path.name}); "
                          "drop --resume to start a run")
    # Split on "\n" alone, as the records were written: str.splitlines() also splits on U+2028,
    # U+0085 and the like, which records written before jsonl_line escaped them hold raw.
    # Each line is decoded alone: a kill can cut the last one inside a multi-byte character.
    lines = path.read_bytes().split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    records: list[dict] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one too
            if number == len(lines):  # cut short by the kill
                break
            raise ResumeError(f"{path} line {number} is not a round record, so the earlier run "
                              "cannot be resumed; start a new run without --resume") from None
        if not isinstance(record, dict) or not {"day", "round", "mode", "model"} <= set(record) \
                or not isinstance(record["day"], str) or not isinstance(record["round"], str):
            raise ResumeError(f"{path} line {number} is not a round record, so the earlier run "
                              "cannot be resumed; start a new run without --resume")
        if (record["mode"], record["model"]) != (mode, model):
            raise ResumeError(f"the run in {path.parent} is mode {record['mode']!r} with model "
                              f"{record['model']!r}; resume it with the same --mode and --model, "
                              "or choose another --out folder")
        records.append(record)
    others = sorted({r["day"] for r in records} - {day.id for day in days})
    if others:
        raise ResumeError(f"the run in {path.parent} holds rounds of {', '.join(others)}, which "
                          "are not among the selected days, and resuming would drop them; resume "
                          "it with the same --days as that run, or choose another --out folder")
    finished: dict[str, list[dict]] = {}
    for day in days:
        rows = {r["round"]: r for r in records if r["day"] == day.id}
        if set(rows) >= {r.id for r in day.rounds} and not any(
                rows[r.id].get("error") for r in day.rounds):
            finished[day.id] = [rows[r.id] for r in day.rounds]
    return finished


def earlier_day_ends(path: Path, kept: dict[str, list[dict]]) -> tuple[dict[str, dict],
                                                                       dict[str, dict]]:
    """What the earlier run's ``days.jsonl`` at ``path`` says of the ends of the kept days (as
    :func:`finished_days` returns them): ``(ended, ending)``, each day id -> its line.

    ``ended``: the days whose end completed (their line has ``finished_at``); ``ending``: the
    days whose end began (a line with ``rounds_done_at`` only) but never completed, which a
    resumed run finishes. A kept day in neither was recorded before days' ends were tracked.
    A line that cannot be read, or that another run wrote (its ``run_id`` is not the one in the
    kept rounds' sessions), is skipped.
    """
    ended: dict[str, dict] = {}
    begun: dict[str, dict] = {}
    if not path.is_file():
        return ended, begun
    for line in path.read_bytes().split(b"\n"):
        try:
            record = json.loads(line.decode("utf-8"))
            day = record["day"]
            rounds = kept[day]
        except (ValueError, TypeError, KeyError):  # a cut or foreign line: nothing from it
            continue
        if not all(r.get("session_id") == f"bench-{record.get('run_id')}-{day}" for r in rounds):
            continue
        if "finished_at" in record:
            ended[day] = record
        elif "rounds_done_at" in record:
            begun[day] = record
    return ended, {day: record for day, record in begun.items() if day not in ended}


def _span(record: dict, end_key: str = "finished_at") -> dict | None:
    """``record`` as a timing (``started_at``, ``finished_at``: wall-clock seconds), or None when
    it holds none that can be trusted: a timing is left out rather than guessed."""
    try:
        started, finished = float(record["started_at"]), float(record[end_key])
    except (ValueError, TypeError, KeyError):
        return None
    if not 0 <= finished - started < math.inf:  # the clock was set back
        return None
    return {**record, "started_at": started, "finished_at": finished}


def earlier_day_spans(ended: dict[str, dict], ending: dict[str, dict]) -> dict[str, dict]:
    """When the earlier run worked on each kept day, from :func:`earlier_day_ends`: day id ->
    ``{started_at, finished_at, ...}``. A day whose end did not complete counts up to its last
    round; its end runs in the resumed part, whose own duration covers it.

    A kept day has none when its lines hold no timing that can be trusted (the clock was set
    back), or when the file was written before days were timed.
    """
    spans = {day: _span(record) for day, record in ended.items()}
    spans.update({day: _span(record, "rounds_done_at") for day, record in ending.items()})
    return {day: span for day, span in spans.items() if span is not None}


def _covered_seconds(spans: Iterable[dict]) -> float:
    """Wall-clock seconds covered by the spans: days that ran side by side count once."""
    total, end = 0.0, float("-inf")
    for start, finish in sorted((float(s["started_at"]), float(s["finished_at"])) for s in spans):
        if finish > end:
            total += finish - max(start, end)
            end = finish
    return total


def _timing(part_s: float, kept: dict[str, list[dict]], spans: dict[str, dict],
            order: list[str]) -> dict:
    """The summary's duration: this part's, plus the time the earlier run spent on the days it
    kept (or ``None``, with a note, when its records lack a kept day's timing)."""
    part_s = round(part_s, 3)
    if not kept:
        return {"duration_s": part_s}
    missing = [day for day in order if day in kept and day not in spans]
    if missing:
        return {"duration_s": None, "earlier_duration_s": None, "resumed_duration_s": part_s,
                "earlier_part_note": (
                    f"the earlier run's records hold no timing for {', '.join(missing)} (it was "
                    "stopped after the day's last round, or its days.jsonl was not written), so "
                    f"the whole run's duration is not known; this part took {part_s} s")}
    earlier = round(_covered_seconds(spans[day] for day in order if day in kept), 3)
    return {"duration_s": round(earlier + part_s, 3), "earlier_duration_s": earlier,
            "resumed_duration_s": part_s}


class _Writer:
    """Appends records (rounds, days) to a JSONL file as they finish (one event loop, so no
    lock). Each record is on disk before :meth:`write` returns: a resumed run trusts what the
    files say was done, so a record must not outlive, nor be outlived by, the work it stands for."""

    def __init__(self, path: Path, kept: Iterable[dict] = ()):
        # a resumed run's file starts with the days it keeps, written beside it and swapped in
        # whole, so that a kill at any moment leaves the earlier records there to resume again
        write_atomic(path, "".join(self.line(record) for record in kept), private=False)
        self.path = path
        self.fh = path.open("a", encoding="utf-8")

    @staticmethod
    def line(record: dict) -> str:
        return jsonl_line(record)

    def write(self, record: dict) -> None:
        self.fh.write(self.line(record))
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


async def run_day(day: Day, config: AgentConfig, *, run_id: str, mode: str,
                  grader_timeout: float = 60.0, on_record: Callable[[dict], None] | None = None,
                  between_rounds: Callable | None = None, hook_errors: list[str] | None = None,
                  keep_workspace: bool = False, workspace_parent: str | Path | None = None) -> list[dict]:
    """Run one day's rounds in order in a fresh workspace; returns the round records."""
    hook_errors = hook_errors if hook_errors is not None else []
    workspace = Workspace.create(day.workspace_src, day.id, parent=workspace_parent)
    session_id = f"bench-{run_id}-{day.id}"
    agent = DayAgent(config, workspace, day, session_id=session_id)
    records: list[dict] = []
    feedback: str | None = None
    try:
        for index, round_ in enumerate(day.rounds):
            question = with_feedback(feedback, round_.question)
            turn = await agent.ask(question)
            choice = None
            if round_.type == "file_check":
                check = await asyncio.to_thread(run_check, round_, workspace.root,
                                                timeout=grader_timeout,
                                                initial_files=workspace.initial_files)
                score, passed, grader = (1.0 if check.passed else 0.0), check.passed, check.to_dict()
            else:
                choice = score_choice(turn.reply, round_)
                score, passed, grader = choice.score, choice.passed, choice.to_dict()
            record = {
                "day": day.id, "round": round_.id, "index": index, "type": round_.type,
                "arc": day.arc, "score": round(score, 4), "passed": passed, "reply": turn.reply,
                "grader": grader, "error": turn.error, "question": question,
                "tool_calls": turn.tool_calls, "model_calls": turn.model_calls,
                "duration_s": round(turn.duration_s, 3), "session_id": session_id, "mode": mode,
                "model": config.model,
            }
            if keep_workspace:
                record["workspace"] = str(workspace.root)
            records.append(record)
            if on_record:
                on_record(record)
            feedback = feedback_text(round_, passed, choice) or None
            if index < len(day.rounds) - 1:
                await _call_hook(between_rounds, record, hook_errors, "between_rounds")
        await agent.finish(standalone_feedback(feedback) if feedback else CLOSING_MESSAGE)
    finally:
        await agent.aclose()
        if not keep_workspace:
            workspace.cleanup()
    return records


async def arun_bench(data_dir: str | Path, days: str | Iterable[str] | None = "all",
                     mode: str = "baseline", base_url: str = "", model: str = "",
                     out_dir: str | Path = "bench-out", parallel: int = 1, api_key: str | None = None,
                     on_round: Callable | None = None, between_rounds: Callable | None = None,
                     between_days: Callable | None = None, *, max_iterations: int = 20,
                     grader_timeout: float = 60.0, request_timeout: float = 120.0,
                     keep_workspaces: bool = False, resume: bool = False) -> dict:
    """The async form of :func:`run_bench` (same arguments, same result)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if not base_url:
        raise ValueError("base_url is required: the OpenAI-compatible URL of the proxy "
                         "(e.g. http://127.0.0.1:8000/v1)")
    if not model:
        raise ValueError("model is required: the model name to request")
    if int(parallel) < 1:
        raise ValueError(f"parallel must be at least 1, not {parallel}")
    bench = load_benchmark(data_dir)
    chosen = select_days(bench, days)
    out = Path(out_dir)
    kept = finished_days(out / "rounds.jsonl", chosen, mode, model) if resume else {}
    ended, ending = earlier_day_ends(out / "days.jsonl", kept) if kept else ({}, {})
    spans = earlier_day_spans(ended, ending)
    out.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(base_url=base_url, model=model, api_key=api_key,
                         max_iterations=max_iterations, timeout=request_timeout)
    run_id = uuid.uuid4().hex[:8]
    hook_errors: list[str] = []
    all_records = [record for day in chosen for record in kept.get(day.id, [])]
    writer = _Writer(out / "rounds.jsonl", all_records)
    # the kept days' lines carry over: a day's end, done or only begun, is known to the next
    # resume too (a kill while this part finishes a day's end leaves it to finish again)
    day_writer = _Writer(out / "days.jsonl", [record for d in chosen
                                              for record in (ended.get(d.id), ending.get(d.id))
                                              if record is not None])
    gate = asyncio.Semaphore(int(parallel))
    started = time.perf_counter()

    def on_record(record: dict) -> None:
        writer.write(record)
        all_records.append(record)
        if on_round is not None:
            try:
                on_round(record)
            except Exception as exc:
                hook_errors.append(f"on_round hook failed: {type(exc).__name__}: {exc}")

    failures: list[str] = []

    async def end_day(day: Day, rounds: list[dict], line: dict, **day_info: Any) -> None:
        """The day's end: its hook, then ``line``, the day's line that says the end is done."""
        await _call_hook(between_days,
                         {**summarize(rounds, day_order=[day.id])["per_day"][0], **day_info},
                         hook_errors, "between_days")
        day_writer.write(line)

    async def one_day(day: Day) -> None:
        async with gate:
            if day.id in ending:  # the earlier run recorded its rounds, then was stopped in its end
                begun = ending[day.id]
                # the line keeps the earlier run's id and its time on the day (up to the last
                # round): the rounds are that run's, and the time spent here is this part's
                await end_day(day, kept[day.id], {**begun, "finished_at": begun["rounds_done_at"],
                                                  "end_run_id": run_id}, resumed_end=True)
                return
            done: list[dict] = []
            begun = {"day": day.id, "run_id": run_id, "mode": mode, "model": model,
                     "started_at": round(time.time(), 3)}

            def record_round(record: dict) -> None:
                done.append(record)
                if len(done) == len(day.rounds):
                    # said before the last round is on file: a day whose rounds are all recorded
                    # always shows that its end began, so a resume knows to finish it
                    begun["rounds_done_at"] = round(time.time(), 3)
                    day_writer.write(begun)
                on_record(record)

            try:
                await run_day(day, config, run_id=run_id, mode=mode, grader_timeout=grader_timeout,
                              on_record=record_round, between_rounds=between_rounds,
                              hook_errors=hook_errors, keep_workspace=keep_workspaces)
            except Exception as exc:  # the day's remaining rounds count as failed, with the reason
                reason = f"the day stopped: {type(exc).__name__}: {exc}"
                failures.append(f"{day.id}: {reason}")
                ran = {r["round"] for r in done}
                for index, round_ in enumerate(day.rounds):
                    if round_.id not in ran:
                        record_round({"day": day.id, "round": round_.id, "index": index,
                                      "type": round_.type, "arc": day.arc, "score": 0.0,
                                      "passed": False, "reply": "", "grader": None, "error": reason,
                                      "mode": mode, "model": model})
            # the day's share of the run's time, which a resumed run adds to its own
            await end_day(day, done, {**begun, "finished_at": round(time.time(), 3)})

    try:
        await asyncio.gather(*(one_day(d) for d in chosen if d.id not in kept or d.id in ending))
    finally:
        writer.close()
        day_writer.close()
    summary = summarize(all_records, day_order=[d.id for d in chosen], benchmark=bench.name,
                        mode=mode, model=model, base_url=base_url, days=[d.id for d in chosen],
                        parallel=int(parallel), run_id=run_id,
                        **_timing(time.perf_counter() - started, kept, spans,
                                  [d.id for d in chosen]),
                        hook_errors=hook_errors, day_failures=failures,
                        resumed_days=[d.id for d in chosen if d.id in kept],
                        resumed_day_ends=[d.id for d in chosen if d.id in ending],
                        first_error=next((f"{r['day']} {r['round']}: {r['error']}"
                                          for r in all_records if r.get("error")), None),
                        rounds_file=str(out / "rounds.jsonl"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    return summary


def run_bench(data_dir: str | Path, days: str | Iterable[str] | None = "all", mode: str = "baseline",
              base_url: str = "", model: str = "", out_dir: str | Path = "bench-out", parallel: int = 1,
              api_key: str | None = None, on_round: Callable | None = None,
              between_rounds: Callable | None = None, between_days: Callable | None = None,
              **options: Any) -> dict:
    """Run the benchmark and return the summary dict (also written to ``<out_dir>/summary.json``).

    ``data_dir``: a MetaClaw-Bench folder; ``days``: ``"all"`` or ``"day01,day03"``; ``mode``:
    baseline | skills | full (recorded; the caller sets up ``base_url`` accordingly);
    ``parallel``: days run at once (rounds of a day always run in order). ``options``:
    ``max_iterations`` (model calls per round, 20), ``grader_timeout`` (s, 60),
    ``request_timeout`` (s, 120), ``keep_workspaces`` (False), ``resume`` (False: with True,
    the days an earlier run into ``out_dir`` finished without an error are kept, not run again,
    and the others run; see :func:`finished_days`. A kept day's ``between_days`` hook ran then,
    unless that run was stopped in it: then it runs now, once, with ``resumed_end: True`` in
    its day summary, and the day is named in ``resumed_day_ends``).

    Summary keys: ``rounds``, ``passed``, ``accuracy``, ``file_check_rounds``,
    ``file_check_completion``, ``multi_choice_rounds``, ``multi_choice_score``, ``errors``,
    ``per_day`` (list of per-day dicts with ``day``, ``accuracy``, ...), ``first_error`` (the
    first round's error, "<day> <round>: <error>", or None), ``resumed_days`` (days kept from
    the earlier run), ``duration_s`` (seconds, the whole run's: on a resumed run also
    ``earlier_duration_s`` and ``resumed_duration_s``, or ``None`` and ``earlier_part_note``
    when the earlier run's records lack a kept day's timing), plus run metadata.
    Works from a plain script and from a notebook (where an event loop is already running).
    """
    from metaclaw.aio import run_sync

    return run_sync(lambda: arun_bench(data_dir, days, mode, base_url, model, out_dir, parallel,
                                       api_key, on_round, between_rounds, between_days,
                                       **options), name="metaclaw-bench")
