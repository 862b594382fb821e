"""MetaClaw-Bench under hostile or careless input: crafted file names and answers, bad data,
bad command-line values, a shared or foreign output folder, an unreachable model."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from metaclaw.bench.data import BenchDataError, load_benchmark, small_bench_dir
from metaclaw.bench.graders import CLIS
from metaclaw.bench.grading import extract_choice, run_check, score_choice
from metaclaw.bench.workspace import Workspace, execute_tool
from metaclaw.cli import main

DATA = small_bench_dir()


# ---------------------------------------------------------------- crafted file names
@pytest.mark.parametrize("name", sorted(CLIS))
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_checkers_have_no_help_flag_that_exits_0(name, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        CLIS[name](["some/file.json", flag])
    assert exc.value.code != 0


def test_a_file_name_holding_an_option_fails_the_check():
    """The round's command word-splits the name it globs: ``20260330_ -h .md`` used to hand the
    checker ``-h``, which printed help and exited 0, a pass without any metadata."""
    day = load_benchmark(DATA).day("day05")
    check = day.rounds[0]
    ws = Workspace.create(day.workspace_src, "day05")
    try:
        execute_tool(ws, "write_file", {"path": "day05/20260330_ -h .md", "content": "no metadata"})
        result = run_check(check, ws.root, initial_files=ws.initial_files)
        assert not result.passed
        assert "20260330_ -h .md" in result.stderr and "whitespace" in result.stderr
    finally:
        ws.cleanup()


@pytest.mark.parametrize("name", ["-rf.md", "a b.json", "sub/-x/ok.md", "tab\there.md"])
def test_names_with_whitespace_or_a_leading_dash_fail_any_check(tmp_path, name):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("x")
    result = run_check({"eval": {"command": "true", "expect_exit": 0}}, tmp_path, initial_files=[])
    assert not result.passed and repr(name) in result.stderr


def test_input_files_are_not_held_against_the_agent(tmp_path):
    (tmp_path / "a b.txt").write_text("given")
    result = run_check({"eval": {"command": "true"}}, tmp_path, initial_files=["a b.txt"])
    assert result.passed


# ---------------------------------------------------------------- multiple-choice answers
ROUND = {"eval": {"options": {k: k for k in "ABCDEF"}, "answer": ["A", "C"]}}


@pytest.mark.parametrize("reply", [r"\boxed{\text{A, C}}", r"\bbox{A and C}", r"\bbox{Answer: A,C}",
                                   r"\boxed{\mathrm{A,C}}", r"\bbox{A,C}", r"\bbox{a, c}",
                                   r"\bbox{A, C (both)}", r"\bbox{(A) and (C).}", r"\bbox{AC}"])
def test_only_standalone_option_letters_are_selected(reply):
    score = score_choice(reply, ROUND)
    assert score.selected == ["A", "C"] and score.passed, score


@pytest.mark.parametrize("reply", [r"no box", r"\bbox{}", r"\bbox{Answer: none}", r"\bbox{A,C"])
def test_a_box_without_letters_is_no_answer(reply):
    assert extract_choice(reply) is None


# ---------------------------------------------------------------- duplicated ids in the data
def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "bench"
    shutil.copytree(DATA, dst)
    return dst


def test_a_day_listed_twice_is_refused(tmp_path):
    root = _copy(tmp_path)
    tests = json.loads((root / "all_tests.json").read_text())
    tests["test"] = [tests["test"][0], tests["test"][1], tests["test"][0]]
    (root / "all_tests.json").write_text(json.dumps(tests))
    with pytest.raises(BenchDataError, match=r"day id 'day01' appears more than once"):
        load_benchmark(root)


def test_a_round_id_used_twice_in_a_day_is_refused(tmp_path):
    root = _copy(tmp_path)
    qfile = root / "eval" / "day02" / "questions.json"
    q = json.loads(qfile.read_text())
    q["rounds"][3]["id"] = q["rounds"][1]["id"]
    qfile.write_text(json.dumps(q))
    with pytest.raises(BenchDataError, match=rf"round id '{q['rounds'][1]['id']}' appears more than once"):
        load_benchmark(root)


# ---------------------------------------------------------------- malformed data files
def _edit_round(root: Path, **values) -> None:
    qfile = root / "eval" / "day01" / "questions.json"
    q = json.loads(qfile.read_text())
    q["rounds"][0].update(values)
    qfile.write_text(json.dumps(q))


def _edit_day(root: Path, **values) -> None:
    tests = json.loads((root / "all_tests.json").read_text())
    tests["test"][0].update(values)
    (root / "all_tests.json").write_text(json.dumps(tests))


def _break_questions_encoding(root: Path) -> None:
    (root / "eval" / "day01" / "questions.json").write_bytes(b"\xff\xfe{}")


def _questions_is_a_folder(root: Path) -> None:
    (root / "eval" / "day01" / "questions.json").unlink()
    (root / "eval" / "day01" / "questions.json").mkdir()


@pytest.mark.parametrize("damage, words", [
    (lambda root: _edit_round(root, feedback="well done"), "round r1: feedback must be an object"),
    (lambda root: _edit_round(root, update=5), "round r1: update must be a list"),
    (lambda root: _edit_day(root, preference_tags=3), "day day01: preference_tags must be a list"),
    (_break_questions_encoding, "questions.json is not UTF-8 text (byte 0)"),
    (_questions_is_a_folder, "questions.json cannot be read: Is a directory"),
])
def test_a_malformed_data_file_is_one_sentence_naming_it(tmp_path, capsys, damage, words):
    """These used to end in a traceback (TypeError), a message naming no file (a decode
    error), or a day that stopped in the middle of the run (feedback not an object)."""
    root = _copy(tmp_path)
    damage(root)
    assert main(["bench", "--data", str(root), "--days", "day01",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("metaclaw bench: ") and words in err[-1]
    assert not any("Traceback" in line for line in err)


def test_a_seed_transcript_with_odd_lines_is_read_around_them(tmp_path):
    """A JSON line that is not an object (``[1]``, ``"x"``) used to raise AttributeError; it is
    skipped like a line that is not JSON. A seed file that is not UTF-8 is named."""
    root = _copy(tmp_path)
    tests = json.loads((root / "all_tests.json").read_text())
    entry = tests["test"][0]
    seed = (root / "openclaw_state" / "agents" / entry.get("agent", "metaclaw_agent") / "sessions"
            / f"{entry['session']}.jsonl")
    before = load_benchmark(root).day("day01").seed_messages
    text = seed.read_text(encoding="utf-8")
    seed.write_text('[1]\n"x"\n' + text + '{"type": "message", "message": {"role": "user", '
                    '"content": [{"type": "text", "text": 5}]}}\n', encoding="utf-8")
    assert load_benchmark(root).day("day01").seed_messages == before
    seed.write_bytes(text.encode() + b"\xff\n")
    with pytest.raises(BenchDataError, match="is not UTF-8 text"):
        load_benchmark(root)


# ---------------------------------------------------------------- the output folder
def test_a_folder_no_run_wrote_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    assert main(["bench", "--days", "day01", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"metaclaw bench: {out} already holds files that no metaclaw run wrote; choose "
                   "an empty or new --out folder (nothing in it was changed)")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.txt"]


def test_an_earlier_runs_output_is_replaced_and_other_files_kept(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "--days", "day01", "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    old = (out / "run" / "rounds.jsonl").read_text()
    assert main(["bench", "--days", "day02", "--out", str(out)]) == 0
    rounds = [json.loads(line) for line in (out / "run" / "rounds.jsonl").read_text().splitlines()]
    assert {r["day"] for r in rounds} == {"day02"} and old
    assert (out / "notes.txt").read_text() == "mine"


def test_a_second_run_on_the_same_folder_fails_at_once(tmp_path):
    from metaclaw.bench.outdir import RUN_ENTRIES, OutDirError, claim_out_dir

    out = tmp_path / "out"
    with claim_out_dir(out, RUN_ENTRIES):
        with pytest.raises(OutDirError, match="another metaclaw run is writing to"):
            with claim_out_dir(out, RUN_ENTRIES):
                pass
        # another thread of this process is refused too (flock locks are per open file)
        errors = []
        thread = threading.Thread(target=lambda: _try_claim(out, errors))
        thread.start()
        thread.join()
        assert errors and "another metaclaw run" in errors[0]
    with claim_out_dir(out, RUN_ENTRIES):   # released when the first run ends
        pass


def _try_claim(out: Path, errors: list) -> None:
    from metaclaw.bench.outdir import RUN_ENTRIES, OutDirError, claim_out_dir

    try:
        with claim_out_dir(out, RUN_ENTRIES):
            pass
    except OutDirError as exc:
        errors.append(str(exc))


def test_two_bench_processes_on_one_folder(tmp_path):
    """The second process fails at once with one sentence; the first run's records are intact."""
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "metaclaw.cli", "bench", "--mode", "skills", "--out", str(out)]
    first = subprocess.Popen(cmd + ["--days", "day01,day02"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(400):
            if (out / "run").is_dir():
                break
            time.sleep(0.05)
        second = subprocess.run(cmd + ["--days", "day03"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1].startswith(
            f"metaclaw bench: another metaclaw run is writing to {out}")
    finally:
        assert first.wait(timeout=300) == 0, first.stderr.read()
    days = {json.loads(line)["day"] for line in (out / "run" / "rounds.jsonl").read_text().splitlines()}
    assert days == {"day01", "day02"}


# ---------------------------------------------------------------- resuming a stopped run
def _rounds(out: Path) -> list[str]:
    return (out / "run" / "rounds.jsonl").read_text(encoding="utf-8").splitlines()


def test_a_run_killed_midway_resumes_with_each_round_once(tmp_path, capsys):
    """kill -9 during the second day: ``--resume`` keeps the first day's records as they were
    (same session, not asked again) and the skill library, and runs the other days once."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "metaclaw.cli", "bench", "--mode", "skills", "--out", str(out),
           "--days", "day01,day02,day03"]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and run.poll() is None:
            if (out / "run" / "rounds.jsonl").is_file() and len(_rounds(out)) >= 7:
                break
            time.sleep(0.02)
        run.send_signal(signal.SIGKILL)
    finally:
        run.wait(timeout=60)
    before = _rounds(out)
    assert 7 <= len(before) < 15, "the run ended before it could be killed midway"
    first_day = [line for line in before if json.loads(line)["day"] == "day01"]
    assert len(first_day) == 5
    assert main(["bench", "--mode", "skills", "--out", str(out), "--days", "day01,day02,day03",
                 "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    after = _rounds(out)
    assert after[:5] == first_day                      # kept byte for byte
    records = [json.loads(line) for line in after]
    assert sorted((r["day"], r["round"]) for r in records) == sorted(
        {(r["day"], r["round"]) for r in records})      # each round once
    assert {r["day"] for r in records} == {"day01", "day02", "day03"} and len(records) == 15
    assert summary["rounds"] == 15 and summary["resumed_days"] == ["day01"]
    assert summary["evolve_events_note"].startswith("this part's evolutions only")


def test_ctrl_c_in_the_middle_of_a_day_stops_with_one_line_and_keeps_the_rounds(tmp_path,
                                                                               capsys):
    """Ctrl-C used to print a page of traceback (KeyboardInterrupt through asyncio). It now says
    where the finished rounds are and how to go on, exits 130, and the run resumes."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "metaclaw.cli", "bench", "--mode", "skills", "--out", str(out),
           "--days", "day01,day02"]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and run.poll() is None:
            if (out / "run" / "rounds.jsonl").is_file() and len(_rounds(out)) >= 2:
                break
            time.sleep(0.01)
        run.send_signal(signal.SIGINT)
        err = run.communicate(timeout=60)[1]
    finally:
        if run.poll() is None:
            run.kill()
    before = _rounds(out)
    assert 2 <= len(before) < 10, "the run ended before it could be interrupted"
    assert run.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"metaclaw bench: stopped by Ctrl-C; the rounds it finished are kept in {out}, and the "
        "same command with --resume goes on from them")
    assert main(["bench", "--mode", "skills", "--out", str(out), "--days", "day01,day02",
                 "--resume", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 10


def test_resume_refuses_another_mode_or_a_folder_without_a_run(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--days", "day01", "--out", str(out), "--resume"]) == 1
    assert "there is no earlier run to resume in" in capsys.readouterr().err
    assert main(["bench", "--days", "day01", "--out", str(out)]) == 0
    before = _rounds(out)
    assert main(["bench", "--mode", "skills", "--days", "day01", "--out", str(out),
                 "--resume"]) == 1
    assert ("is mode 'baseline' with model 'sim-agent'; resume it with the same --mode and "
            "--model") in capsys.readouterr().err
    assert _rounds(out) == before                       # nothing changed


def test_resume_reruns_an_unfinished_or_failed_day_and_ignores_a_cut_line(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "--days", "day01,day02,day03", "--out", str(out)]) == 0
    lines = _rounds(out)
    records = [json.loads(line) for line in lines]
    day02 = [i for i, r in enumerate(records) if r["day"] == "day02"]
    records[day02[0]]["error"] = "HTTP 503 from the model"        # day02 failed a round
    kept = [json.dumps(r) for i, r in enumerate(records) if r["day"] != "day03"]
    kept += [lines[i] for i, r in enumerate(records) if r["day"] == "day03"][:2]
    path = out / "run" / "rounds.jsonl"
    path.write_text("\n".join(kept) + '\n{"day": "day03", "rou', encoding="utf-8")
    assert main(["bench", "--days", "day01,day02,day03", "--out", str(out), "--resume"]) == 0
    after = [json.loads(line) for line in _rounds(out)]
    assert len(after) == 15 and not any(r.get("error") for r in after)
    assert [r["day"] for r in after[:5]] == ["day01"] * 5
    assert {r["session_id"] for r in after if r["day"] != "day01"}.isdisjoint(
        {r["session_id"] for r in records})               # day02 and day03 ran again
    path.write_text('not json\n{"day": "day01"}\n', encoding="utf-8")
    assert main(["bench", "--days", "day01", "--out", str(out), "--resume"]) == 1


def test_resume_with_fewer_days_refuses_rather_than_drop_the_others(tmp_path, capsys):
    """The resumed run rewrites rounds.jsonl with the selected days: a day of the earlier run
    left out of ``--days`` (or not in the benchmark at all) would vanish from it."""
    out = tmp_path / "out"
    assert main(["bench", "--days", "day01,day02", "--out", str(out)]) == 0
    before = _rounds(out)
    capsys.readouterr()
    assert main(["bench", "--days", "day02", "--out", str(out), "--resume"]) == 1
    assert "holds rounds of day01, which are not among the selected days" in \
        capsys.readouterr().err
    assert _rounds(out) == before                       # nothing changed


def test_resume_reads_replies_with_unicode_separators_and_a_line_cut_in_a_character(tmp_path,
                                                                                       capsys):
    """A reply holding U+2028 or U+0085 (written as they are, ensure_ascii=False) is one
    record, not two lines; a kill that cut the last line inside a multi-byte character leaves a
    run that resumes."""
    out = tmp_path / "out"
    assert main(["bench", "--days", "day01,day02", "--out", str(out)]) == 0
    records = [json.loads(line) for line in _rounds(out)]
    records[0]["reply"] = "first\u2028second\x85third"
    day01 = [json.dumps(r, ensure_ascii=False) + "\n" for r in records if r["day"] == "day01"]
    cut = json.dumps({**records[5], "reply": "日本語の返事"}, ensure_ascii=False).encode()
    path = out / "run" / "rounds.jsonl"
    path.write_bytes("".join(day01).encode() + cut[:cut.index("本".encode()) + 1])
    capsys.readouterr()
    assert main(["bench", "--days", "day01,day02", "--out", str(out), "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_days"] == ["day01"] and summary["rounds"] == 10
    assert json.loads(path.read_bytes().split(b"\n")[0])["reply"] == "first\u2028second\x85third"


# ---------------------------------------------------------------- command-line values
@pytest.mark.parametrize("argv, words", [
    (["bench", "--days", ",,"], "names no day"),
    (["demo", "--days", " , "], "names no day"),
    (["bench", "--top-k", "-1"], "--top-k: -1 is too small"),
    (["bench", "--budget-chars", "-5"], "--budget-chars: -5 is too small"),
    (["bench", "--votes", "0"], "--votes: 0 is too small"),
    (["bench", "--parallel", "0"], "--parallel: 0 is too small"),
    (["bench", "--min-score", "nan"], "not a finite number"),
    (["bench", "--train-steps", "-1"], "--train-steps: -1 is negative"),
])
def test_nonsense_values_are_usage_errors(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, words", [
    (["--min-score", "-0.5"], "lexical (BM25) scores are never negative"),
    (["--retrieval", "embedding", "--min-score", "5"], "outside -1..1"),
])
def test_a_min_score_the_retrieval_can_never_give_is_refused(tmp_path, capsys, argv, words):
    assert main(["bench", *argv, "--out", str(tmp_path / "o")]) == 2
    assert words in capsys.readouterr().err


def test_an_unreachable_model_is_an_error_not_a_zero_score(tmp_path, capsys):
    code = main(["bench", "--upstream", "http://127.0.0.1:9/v1", "--model", "m", "--days", "day01",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert err.startswith("metaclaw bench: every one of the 5 rounds failed with an error")
    assert "the first error was day01 r1: " in err


def test_a_mistyped_day_or_another_kinds_folder_leaves_the_earlier_output_as_it_was(
        tmp_path, capsys):
    """`--days day99` deleted the earlier run's results before it said the day was unknown;
    a bench run in a demo's folder (or the reverse) replaced its learned skills."""
    out = tmp_path / "b1"
    assert main(["bench", "--days", "day01", "--out", str(out)]) == 0
    before = (out / "run" / "summary.json").read_text()
    capsys.readouterr()
    assert main(["bench", "--days", "day99", "--out", str(out)]) == 1
    assert "unknown day(s) day99" in capsys.readouterr().err
    assert (out / "run" / "summary.json").read_text() == before
    assert main(["demo", "--days", "day01", "--out", str(out)]) != 0
    assert "holds a metaclaw bench run's output" in capsys.readouterr().err
    assert (out / "run" / "summary.json").read_text() == before
    fresh = tmp_path / "never"
    assert main(["bench", "--days", "day99", "--out", str(fresh)]) == 1
    assert not fresh.exists()  # nothing made for a run that cannot start
