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
                                   r"\bbox{A, C (both)}", r"\bbox{(A) and (C).}"])
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
