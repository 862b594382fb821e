"""MetaClaw-Bench: graders, scoring, workspace confinement, data loading, agent loop and runner.

The agent tests talk to a real local OpenAI-compatible double (metaclaw.offline.double.DoubleServer) whose
replies come from the answer key (oracle) or never act (idle): they test the runner, not a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metaclaw.bench import graders
from metaclaw.bench.agent import AgentConfig, DayAgent, system_prompt
from metaclaw.bench.data import BenchDataError, load_benchmark, select_days, small_bench_dir
from metaclaw.bench.grading import (FORMAT_ERROR, extract_choice, feedback_text, rewrite_command,
                                    run_check, score_choice, with_feedback)
from metaclaw.bench.oracle import idle_replies, oracle_replies
from metaclaw.bench.runner import format_table, run_bench, summarize
from metaclaw.bench.workspace import Workspace, execute_tool, tool_step

DATA = small_bench_dir()
TS = "2026-03-16T09:30:00+08:00"


def cli(name: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", f"metaclaw.bench.scripts.{name}", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ graders
class TestIso8601:
    def test_nested_list_paths_pass(self, tmp_path):
        write(tmp_path / "s.json", json.dumps({"meeting_time": TS, "action_items": [
            {"due_date": "2026-03-18T18:00:00+08:00"}, {"due_date": "2026-03-19T09:00:00.500+08:00"}]}))
        assert graders.check_iso8601(tmp_path / "s.json", ["meeting_time", "action_items[].due_date"])

    @pytest.mark.parametrize("value", ["2026-03-16 09:30:00", "2026-03-16T09:30:00Z",
                                       "2026-03-16T09:30:00+0800", "2026-13-16T09:30:00+08:00", 20260316])
    def test_bad_values_fail(self, tmp_path, value):
        write(tmp_path / "s.json", json.dumps({"items": [{"due": TS}, {"due": value}]}))
        verdict = graders.check_iso8601(tmp_path / "s.json", ["items[].due"])
        assert not verdict and "items[1].due" in verdict.reason

    @pytest.mark.parametrize("data, field, words", [
        ({"a": TS}, "b", "missing"),
        ({"items": []}, "items[].due", "empty list"),
        ({"items": {"due": TS}}, "items[].due", "not a list"),
        ({"items": [{"x": 1}]}, "items[].due", "items[0].due is missing"),
        ({"meta": "x"}, "meta.created_at", "not an object"),
    ])
    def test_missing_fields_fail(self, tmp_path, data, field, words):
        write(tmp_path / "s.json", json.dumps(data))
        verdict = graders.check_iso8601(tmp_path / "s.json", [field])
        assert not verdict and words in verdict.reason

    def test_unreadable_files_fail(self, tmp_path):
        assert "does not exist" in graders.check_iso8601(tmp_path / "nope.json", ["a"]).reason
        write(tmp_path / "bad.json", "{not json")
        assert "not valid JSON" in graders.check_iso8601(tmp_path / "bad.json", ["a"]).reason

    def test_cli_exit_codes(self, tmp_path):
        write(tmp_path / "d/s.json", json.dumps({"t": TS, "u": "yesterday"}))
        ok = cli("check_iso8601", "d/s.json", "t", cwd=tmp_path)
        assert (ok.returncode, ok.stdout.strip()) == (0, "PASS")
        bad = cli("check_iso8601", "d/s.json", "t", "u", cwd=tmp_path)
        assert bad.returncode == 1 and bad.stdout.startswith("FAIL: ") and "'yesterday'" in bad.stdout
        usage = cli("check_iso8601", "d/s.json", cwd=tmp_path)
        assert usage.returncode == 2 and "usage" in usage.stderr


class TestFilename:
    def test_single_file(self, tmp_path):
        assert graders.check_filename(write(tmp_path / "20260316_standup_notes.json", "{}"))
        for name in ["standup.json", "20260316_Standup.json", "20260316_notes.JSON", "2026-03-16_notes.md",
                     "notes_20260316.md", "20260316_1notes.md"]:
            assert not graders.check_filename(write(tmp_path / name, "x")), name
        assert "does not exist" in graders.check_filename(tmp_path / "20260316_gone.md").reason

    def test_dir_form_min_count_and_all_matching(self, tmp_path):
        d = tmp_path / "day03"
        write(d / "20260323_ci_build_report.json", "{}")
        assert graders.check_filename_dir(d, "json", exempt=set())
        verdict = graders.check_filename_dir(d, "json", 2, exempt=set())
        assert not verdict and "1 new .json file(s), at least 2" in verdict.reason
        write(d / "20260323_test_results.json", "{}")
        assert graders.check_filename_dir(d, "json", 2, exempt=set())
        write(d / "TestResults.json", "{}")
        verdict = graders.check_filename_dir(d, "json", 2, exempt=set())
        assert not verdict and "TestResults.json" in verdict.reason
        assert not graders.check_filename_dir(tmp_path / "missing", "json", exempt=set())
        assert not graders.check_filename_dir(d, "md", exempt=set())   # no .md file at all

    def test_dir_form_exempts_initial_files_from_the_manifest(self, tmp_path):
        write(tmp_path / "day03/README.md", "# inputs")
        write(tmp_path / "day03/20260323_review_summary.md", "x")
        manifest = write(tmp_path.parent / f"{tmp_path.name}-initial.json", json.dumps(["day03/README.md"]))
        plain = cli("check_filename", "--dir", "day03/", "--ext", "md", cwd=tmp_path)
        assert plain.returncode == 1 and "README.md" in plain.stdout
        exempt = cli("check_filename", "--dir", "day03/", "--ext", "md", cwd=tmp_path,
                     env={graders.INITIAL_FILES_ENV: str(manifest)})
        assert (exempt.returncode, exempt.stdout.strip()) == (0, "PASS")
        more = cli("check_filename", "--dir", "day03/", "--ext", "md", "--min-count", "2", cwd=tmp_path,
                   env={graders.INITIAL_FILES_ENV: str(manifest)})
        assert more.returncode == 1
        assert cli("check_filename", "--dir", "day03/", cwd=tmp_path).returncode == 2
        assert cli("check_filename", cwd=tmp_path).returncode == 2


class TestMetadata:
    def test_json_meta_object(self, tmp_path):
        good = {"meta": {"created_at": TS, "author": "metaclaw_agent", "status": "done"}, "content": {}}
        assert graders.check_metadata(write(tmp_path / "a.json", json.dumps(good)))
        for key, value, words in [("author", None, "lacks author"), ("status", "finished", "status"),
                                  ("created_at", "2026-03-16", "created_at")]:
            meta = dict(good["meta"])
            if value is None:
                del meta[key]
            else:
                meta[key] = value
            verdict = graders.check_metadata(write(tmp_path / "b.json", json.dumps({"meta": meta})))
            assert not verdict and words in verdict.reason
        verdict = graders.check_metadata(write(tmp_path / "c.json", json.dumps({"created_at": TS})))
        assert not verdict and "meta" in verdict.reason

    def test_markdown_front_matter(self, tmp_path):
        md = f"---\ncreated_at: {TS}\nauthor: metaclaw_agent\nstatus: in_progress\n---\n\n# Review\n"
        assert graders.check_metadata(write(tmp_path / "a.md", md))
        quoted = md.replace(TS, f'"{TS}"')
        assert graders.check_metadata(write(tmp_path / "q.md", quoted))
        assert not graders.check_metadata(write(tmp_path / "b.md", "# Review\n\ncreated_at: " + TS))
        assert not graders.check_metadata(write(tmp_path / "c.md", md.replace("status: in_progress\n", "")))

    def test_python_docstring_meta_section(self, tmp_path):
        py = (f'"""Parse logs.\n\nMeta:\n  created_at: {TS}\n  author: metaclaw_agent\n  status: done\n"""\n'
              "import re\n")
        assert graders.check_metadata(write(tmp_path / "a.py", py))
        assert not graders.check_metadata(write(tmp_path / "b.py", "# created_at: x\nimport re\n"))
        assert not graders.check_metadata(write(tmp_path / "c.py", py.replace("author: metaclaw_agent", "")))
        assert not graders.check_metadata(write(tmp_path / "d.py", "def broken(:\n"))

    def test_csv_first_line_comment_and_missing_file(self, tmp_path):
        csv = f"# meta: created_at={TS} author=metaclaw_agent status=done\nname,tasks\nBai,3\n"
        assert graders.check_metadata(write(tmp_path / "a.csv", csv))
        assert not graders.check_metadata(write(tmp_path / "b.csv", "name,tasks\nBai,3\n"))
        result = cli("check_metadata", "nope.md", cwd=tmp_path)
        assert result.returncode == 1 and "does not exist" in result.stdout


class TestBackup:
    def test_backup_made_before_the_change(self, tmp_path):
        f = write(tmp_path / "day07/api_docs.md", "v1")
        assert "does not exist" in graders.check_backup(f).reason
        write(tmp_path / "day07/api_docs.md.bak", "v1")
        verdict = graders.check_backup(f)
        assert not verdict and "same content" in verdict.reason
        f.write_text("v2")
        assert graders.check_backup(f)
        result = cli("check_backup", "day07/api_docs.md", cwd=tmp_path)
        assert (result.returncode, result.stdout.strip()) == (0, "PASS")


class TestDoneLog:
    def test_format_prefix_and_count(self, tmp_path):
        log = write(tmp_path / "done.log",
                    f"[DONE] {TS} | q1_metrics_analysis | Q1 metrics report written\n\n"
                    f"[DONE] 2026-03-16T10:00:00.250+08:00 | api_health_summary | Weekly API health\n")
        assert graders.check_done_log(log, min_entries=2)
        assert graders.check_done_log(log, task_prefix="api_health")
        verdict = graders.check_done_log(log, task_prefix="data_quality")
        assert not verdict and "data_quality" in verdict.reason
        assert "2 entries, at least 3" in graders.check_done_log(log, min_entries=3).reason

    @pytest.mark.parametrize("line, words", [
        (f"DONE {TS} | t1 | summary", "is not"),
        ("[DONE] 2026-03-16 09:30 | t1 | summary", "not ISO 8601"),
        (f"[DONE] {TS} | t1", "is not"),
        (f"[DONE] {TS} | task one | summary", "task_id"),
        (f"[DONE] {TS} | t1 |  ", "empty"),
        (f"[DONE] {TS} | t1 | " + "x" * 81, "longer than 80"),
    ])
    def test_malformed_lines_fail(self, tmp_path, line, words):
        log = write(tmp_path / "done.log", f"[DONE] {TS} | t0 | ok\n{line}\n")
        verdict = graders.check_done_log(log)
        assert not verdict and "line 2" in verdict.reason and words in verdict.reason

    def test_cli_min_count_alias_and_missing_log(self, tmp_path):
        write(tmp_path / "done.log", f"[DONE] {TS} | data_quality_audit | Audit done\n")
        assert cli("check_done_log", "done.log", "--task-prefix", "data_quality", cwd=tmp_path).returncode == 0
        assert cli("check_done_log", "done.log", "--min-entries", "1", "--min-count", "2",
                   cwd=tmp_path).returncode == 1
        missing = cli("check_done_log", "other.log", cwd=tmp_path)
        assert missing.returncode == 1 and "does not exist" in missing.stdout
        assert cli("check_done_log", "done.log", "--min-entries", "x", cwd=tmp_path).returncode == 2


# ------------------------------------------------------------------------------------ scoring
MC = {"type": "multi_choice", "eval": {"options": {k: k for k in "ABCDEF"}, "answer": ["A", "E"]}}


class TestScoring:
    def test_partial_credit(self):
        s = score_choice(r"I pick \bbox{A,B}", MC)          # FP: B, FN: E -> 1 - 2/6
        assert s.score == pytest.approx(1 - 2 / 6) and not s.passed and s.format_valid
        assert (s.false_positives, s.false_negatives) == (["B"], ["E"])
        assert score_choice(r"\bbox{E, A}", MC).passed
        assert score_choice(r"\bbox{A}", MC).score == pytest.approx(5 / 6)
        assert score_choice(r"\bbox{B,C,D,F}", MC).score == 0.0

    def test_no_box_is_a_format_error(self):
        s = score_choice("The answer is A and E.", MC)
        assert (s.score, s.passed, s.format_valid) == (0.0, False, False)
        assert extract_choice(r"\bbox{}") is None

    def test_first_box_counts_and_boxed_is_accepted(self):
        assert extract_choice(r"\bbox{B} ... on reflection \bbox{A,E}") == ["B"]
        assert score_choice(r"\boxed{A,E} (not \bbox{B})", MC).passed
        assert score_choice(r"\bbox{B} then \boxed{A,E}", MC).score == pytest.approx(1 - 3 / 6)

    def test_file_check_completion_is_over_file_check_rounds(self):
        records = [
            {"day": "day01", "type": "file_check", "score": 1.0, "passed": True},
            {"day": "day01", "type": "file_check", "score": 0.0, "passed": False},
            {"day": "day01", "type": "multi_choice", "score": 0.5, "passed": False},
            {"day": "day02", "type": "multi_choice", "score": 1.0, "passed": True},
        ]
        s = summarize(records)
        assert s["file_check_completion"] == 0.5          # not 1/4 (the upstream defect)
        assert s["accuracy"] == 0.5 and s["multi_choice_score"] == 0.75
        assert (s["rounds"], s["file_check_rounds"], s["multi_choice_rounds"]) == (4, 2, 2)
        day2 = s["per_day"][1]
        assert day2["day"] == "day02" and day2["file_check_completion"] is None and day2["accuracy"] == 1.0
        assert "day02" in format_table(s) and "file-check" in format_table(s)

    def test_feedback_protocol(self):
        from metaclaw.bench.data import Round

        r = Round("r2", "multi_choice", "Q?", MC["eval"],
                  {"correct": "Right.", "options": {"B": "B is wrong.", "E": "E is right."}})
        text = feedback_text(r, False, score_choice(r"\bbox{A,B}", r))
        assert "You missed option E: E is right." in text and "incorrectly selected option B" in text
        assert feedback_text(r, False, score_choice("no box", r)) == FORMAT_ERROR
        assert feedback_text(r, True, score_choice(r"\bbox{A,E}", r)) == "Right."
        assert with_feedback("Right.", "Next?") == "[Previous Feedback] Right.\n\nNext?"
        assert with_feedback(None, "Next?") == "Next?"


# ------------------------------------------------------------------------------------ grading commands
class TestGradingCommands:
    def test_rewrite_uses_packaged_checkers_and_this_python(self):
        cmd = ("python -c \"import sys\" && python scripts/check_iso8601.py $(python -c \"print('a')\") x "
               "&& python3 scripts/check_unknown.py y")
        out = rewrite_command(cmd, python="/opt/py/bin/python")
        assert "/opt/py/bin/python -S -P -m metaclaw.bench.scripts.check_iso8601 $(/opt/py/bin/python -S -P -c" in out
        assert out.startswith("/opt/py/bin/python -S -P -c")
        assert "/opt/py/bin/python -S -P scripts/check_unknown.py y" in out
        assert " python " not in f" {out} ".replace("/opt/py/bin/python", "")

    def test_agent_written_files_cannot_shadow_graders(self, tmp_path):
        f = write(tmp_path / "day07/api_docs.md", "v1")
        write(tmp_path / "scripts/check_backup.py", "print('PASS')\n")            # a forged checker
        write(tmp_path / "metaclaw/__init__.py", "raise SystemExit(0)\n")          # a forged package
        write(tmp_path / "json.py", "raise SystemExit(0)\n")                       # a forged stdlib module
        r = {"type": "file_check", "eval": {"command": "python scripts/check_backup.py day07/api_docs.md",
                                            "expect_exit": 0}}
        result = run_check(r, tmp_path)
        assert not result.passed and result.exit_code == 1 and "FAIL" in result.stdout
        inline = {"eval": {"command": "python -c \"import json,sys; sys.exit(3)\"", "expect_exit": 3}}
        assert run_check(inline, tmp_path).passed
        f.write_text("v2")
        write(tmp_path / "day07/api_docs.md.bak", "v1")
        assert run_check(r, tmp_path).passed

    def test_timeout_kills_the_command(self, tmp_path):
        r = {"eval": {"command": "python -c \"import time; time.sleep(30)\"", "expect_exit": 0}}
        result = run_check(r, tmp_path, timeout=0.5)
        assert not result.passed and result.timed_out and result.duration_s < 10


# ------------------------------------------------------------------------------------ workspace
@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    write(root / "AGENTS.md", "# Agent roles")
    write(root / "day01/input.txt", "raw notes")
    return Workspace(root)


def test_one_tool_step_runs_the_calls_and_adds_their_results_to_the_conversation(ws):
    """The step both agent loops take (the bench's and the notebook chat's)."""
    message = {"content": "", "tool_calls": [
        {"id": "c1", "function": {"name": "read_file", "arguments": '{"path": "day01/input.txt"}'}},
        {"id": "c2", "function": {"name": "list_dir", "arguments": None}}]}
    added, calls = tool_step(ws, message)
    assert [m["role"] for m in added] == ["assistant", "tool", "tool"]
    assert added[0]["tool_calls"][1]["function"]["arguments"] == "{}"
    assert "result" not in added[0]["tool_calls"][0]  # the history holds what the model said
    assert added[1] == {"role": "tool", "tool_call_id": "c1", "content": "raw notes"}
    assert calls[0]["result"] == "raw notes" and calls[1]["function"]["name"] == "list_dir"
    # without a workspace the calls are recorded, not run; a reply without calls ends the loop
    added, calls = tool_step(None, message)
    assert len(added) == 1 and all("result" not in c for c in calls)
    assert tool_step(ws, {"content": "done"}) == ([{"role": "assistant", "content": "done"}], [])
    # arguments given as an object go upstream as the JSON text the chat API expects
    added, _ = tool_step(ws, {"tool_calls": [{"id": "c3", "function": {
        "name": "read_file", "arguments": {"path": "day01/input.txt"}}}]})
    assert added[0]["tool_calls"][0]["function"]["arguments"] == '{"path": "day01/input.txt"}'
    assert added[1]["content"] == "raw notes"


class TestWorkspace:
    @pytest.mark.parametrize("path", ["../outside.txt", "day01/../../outside.txt", "/tmp/outside.txt",
                                      "~/outside.txt", ".."])
    def test_escaping_paths_are_refused(self, ws, tmp_path, path):
        for name, args in [("write_file", {"path": path, "content": "x"}), ("read_file", {"path": path}),
                           ("append_file", {"path": path, "content": "x"}), ("list_dir", {"path": path}),
                           ("copy_file", {"source": "day01/input.txt", "destination": path}),
                           ("copy_file", {"source": path, "destination": "day01/copy.txt"})]:
            result = execute_tool(ws, name, json.dumps(args))
            assert result.startswith("Error:"), (name, path, result)
        assert not (tmp_path / "outside.txt").exists()

    def test_symlinks_pointing_outside_are_refused(self, ws, tmp_path):
        secret = write(tmp_path / "secret/key.txt", "s3cret")
        os.symlink(tmp_path / "secret", ws.root / "day01/link_dir")
        os.symlink(secret, ws.root / "link_file")
        assert "outside the workspace" in execute_tool(ws, "read_file", {"path": "day01/link_dir/key.txt"})
        assert "outside the workspace" in execute_tool(ws, "read_file", {"path": "link_file"})
        assert execute_tool(ws, "write_file", {"path": "link_file", "content": "x"}).startswith("Error:")
        assert execute_tool(ws, "list_dir", {"path": "day01/link_dir"}).startswith("Error:")
        assert secret.read_text() == "s3cret"

    def test_tools_inside_the_workspace(self, ws):
        assert execute_tool(ws, "write_file", {"path": "day01/out/a.md", "content": "hello"}).startswith("Wrote")
        assert execute_tool(ws, "append_file", {"path": "day01/out/a.md", "content": " world"}).startswith("Appended")
        assert execute_tool(ws, "read_file", {"path": "day01/../day01/out/a.md"}) == "hello world"
        assert execute_tool(ws, "copy_file", {"source": "day01/input.txt",
                                              "destination": "day01/input.txt.bak"}).startswith("Copied")
        listing = execute_tool(ws, "list_dir", {"path": "day01"})
        assert listing.splitlines() == ["input.txt", "input.txt.bak", "out/"]
        assert execute_tool(ws, "list_dir", {}).splitlines() == ["AGENTS.md", "day01/"]

    def test_bad_calls_become_error_results(self, ws):
        assert "not valid JSON" in execute_tool(ws, "write_file", "{oops")
        assert "unknown tool" in execute_tool(ws, "exec", {"cmd": "ls"})
        assert "missing content" in execute_tool(ws, "write_file", {"path": "a"})
        assert "unknown mode" in execute_tool(ws, "read_file", {"path": "day01/input.txt", "mode": "r"})
        assert "does not exist" in execute_tool(ws, "read_file", {"path": "nope.txt"})
        assert "is a folder" in execute_tool(ws, "read_file", {"path": "day01"})
        assert "must be a string" in execute_tool(ws, "write_file", {"path": "a", "content": 3})
        assert "non-empty" in execute_tool(ws, "write_file", {"path": "", "content": "x"})
        assert "is a folder" in execute_tool(ws, "write_file", {"path": ".", "content": "x"})

    def test_fresh_day_copy_is_writable_and_holds_only_that_day(self):
        with Workspace.create(DATA / "workspaces/shared", "day07") as ws:
            names = sorted(p.name for p in ws.root.iterdir())
            assert names == ["AGENTS.md", "IDENTITY.md", "SOUL.md", "TOOLS.md", "USER.md", "day07"]
            assert "day07/api_docs.md" in ws.initial_files
            assert execute_tool(ws, "write_file", {"path": "day07/api_docs.md", "content": "new"}) \
                .startswith("Wrote")
            assert list(ws.context()) == ["AGENTS.md", "IDENTITY.md", "SOUL.md", "TOOLS.md", "USER.md"]
            root = ws.root
        assert not root.exists()
        with pytest.raises(ValueError, match="day99"):
            Workspace.create(DATA / "workspaces/shared", "day99")


# ------------------------------------------------------------------------------------ data
class TestData:
    def test_small_benchmark_counts(self):
        bench = load_benchmark(DATA)
        assert len(bench.days) == 12 and bench.rounds == 61
        assert sum(d.file_check_rounds for d in bench.days) == 36
        assert sum(d.multi_choice_rounds for d in bench.days) == 25
        assert bench.eval_dir == DATA.resolve() / "eval"
        assert bench.days[0].seed_messages[0]["role"] == "user"
        assert bench.day("day01").rounds[1].answer == ["A", "E"]

    def test_select_days(self):
        bench = load_benchmark(DATA)
        assert [d.id for d in select_days(bench, "day03,day01")] == ["day01", "day03"]
        assert len(select_days(bench, "all")) == 12
        with pytest.raises(BenchDataError, match="day42"):
            select_days(bench, "day01,day42")

    def test_full_benchmark_layout_and_errors(self, tmp_path):
        # the full benchmark uses the same format under another name (./benchmark/data/metaclaw-bench/...)
        import shutil

        root = tmp_path / "metaclaw-bench"
        (root / "eval").mkdir(parents=True)
        shutil.copytree(DATA / "eval/day01", root / "eval/day30")
        shutil.copytree(DATA / "workspaces/shared", root / "workspaces/shared")
        tests = {"name": "MetaClaw-Evolution-Bench", "eval_dir": "./benchmark/data/metaclaw-bench/eval",
                 "workspace_src": "./benchmark/data/metaclaw-bench/workspaces/shared",
                 "test": [{"id": "day30", "eval": "day30", "arc": "F"}]}
        write(root / "all_tests.json", json.dumps(tests))
        bench = load_benchmark(root)
        assert [d.id for d in bench.days] == ["day30"] and bench.rounds == 5 and bench.days[0].seed_messages == ()
        with pytest.raises(BenchDataError, match="all_tests.json"):
            load_benchmark(tmp_path)
        write(root / "eval/day30/questions.json", json.dumps({"rounds": [{"id": "r1", "type": "essay"}]}))
        with pytest.raises(BenchDataError, match="r1"):
            load_benchmark(root)


# ------------------------------------------------------------------------------------ agent + runner
@pytest.fixture
def bench():
    return load_benchmark(DATA)


class TestRunner:
    def test_oracle_scores_100_and_protocol_is_followed(self, bench, tmp_path):
        from metaclaw.offline.double import DoubleServer

        days = select_days(bench, "day07,day12")
        seen_rounds, between, day_summaries = [], [], []
        with DoubleServer(oracle_replies(days)) as upstream:
            summary = run_bench(DATA, "day07,day12", "skills", base_url=upstream.url, model="double-model",
                                out_dir=tmp_path / "out", parallel=2, on_round=seen_rounds.append,
                                between_rounds=between.append, between_days=day_summaries.append)
            requests = [r for r in upstream.requests if r["path"].endswith("/chat/completions")]
        assert summary["accuracy"] == 1.0 and summary["file_check_completion"] == 1.0
        assert summary["multi_choice_score"] == 1.0 and summary["rounds"] == 11
        assert summary["mode"] == "skills" and summary["errors"] == 0
        assert [d["day"] for d in summary["per_day"]] == ["day07", "day12"]
        assert len(seen_rounds) == 11 and len(between) == 9 and len(day_summaries) == 2
        lines = (tmp_path / "out/rounds.jsonl").read_text().splitlines()
        record = json.loads(lines[0])
        assert {"day", "round", "type", "score", "passed", "reply", "grader"} <= set(record)
        assert json.loads((tmp_path / "out/summary.json").read_text())["rounds"] == 11
        # sessions: one per day, the day's last call (and only it) marked done, context as system prompt
        by_session: dict[str, list] = {}
        for r in requests:
            headers = {k.lower(): v for k, v in r["headers"].items()}
            by_session.setdefault(headers["x-session-id"], []).append((headers, r["body"]))
        assert len(by_session) == 2
        for calls in by_session.values():
            assert [h.get("x-session-done") for h, _ in calls] == [None] * (len(calls) - 1) + ["true"]
            first = calls[0][1]["messages"]
            assert first[0]["role"] == "system" and "## AGENTS.md" in first[0]["content"]
            assert "Orion Tech" in first[0]["content"]
            assert first[1]["role"] == "user" and first[2]["role"] == "assistant"   # the seed exchange
            users = [m["content"] for m in calls[-1][1]["messages"] if m["role"] == "user"]
            assert users[2].startswith("[Previous Feedback] ")        # round 2 carries round 1's feedback
            assert users[-1].startswith("[Previous Feedback] ") and "tools" not in calls[-1][1]

    def test_idle_agent_scores_zero(self, bench, tmp_path):
        from metaclaw.offline.double import DoubleServer

        with DoubleServer(idle_replies()) as upstream:
            summary = run_bench(DATA, "day05,day09", "baseline", base_url=upstream.url, model="m",
                                out_dir=tmp_path / "out", parallel=2)
        assert summary["file_check_rounds"] == 6 and summary["file_check_completion"] == 0.0
        assert summary["multi_choice_score"] == 0.0 and summary["accuracy"] == 0.0

    def test_agent_cannot_escape_or_forge_graders(self, bench, tmp_path):
        from metaclaw.offline.double import DoubleServer, Reply

        escape = tmp_path / "escaped.txt"
        calls = [{"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(
                     {"path": str(escape), "content": "x"})}},
                 {"id": "c2", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(
                     {"path": "../../escaped.txt", "content": "x"})}},
                 {"id": "c3", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(
                     {"path": "scripts/check_backup.py", "content": "print('PASS')"})}}]

        def reply(body):
            acted = body["messages"][-1]["role"] == "tool"
            return Reply("ok") if acted or not body.get("tools") else Reply(tool_calls=calls)

        with DoubleServer(reply) as upstream:
            summary = run_bench(DATA, "day07", "baseline", base_url=upstream.url, model="m",
                                out_dir=tmp_path / "out")
        records = [json.loads(x) for x in (tmp_path / "out/rounds.jsonl").read_text().splitlines()]
        results = [c["result"] for c in records[0]["tool_calls"]]
        assert results[0].startswith("Error:") and "absolute" in results[0]
        assert results[1].startswith("Error:") and "outside the workspace" in results[1]
        assert not escape.exists() and not (tmp_path.parent / "escaped.txt").exists()
        assert records[0]["round"] == "r1" and not records[0]["passed"]       # forged checker ignored
        assert "FAIL" in records[0]["grader"]["stdout"]
        assert summary["file_check_completion"] == 0.0

    async def test_errors_are_clear_and_loop_is_bounded(self, bench, tmp_path):
        from metaclaw.offline.double import DoubleServer, Reply

        day = bench.day("day01")
        loop_call = [{"id": "c", "type": "function",
                      "function": {"name": "list_dir", "arguments": "{}"}}]
        with DoubleServer(lambda body: Reply(tool_calls=loop_call)) as upstream, \
                Workspace.create(day.workspace_src, "day01") as ws:
            agent = DayAgent(AgentConfig(base_url=upstream.url, model="m", max_iterations=3), ws, day,
                             session_id="s")
            turn = await agent.ask("go")
            await agent.aclose()
        assert turn.model_calls == 3 and "3 model calls" in turn.error and len(turn.tool_calls) == 3
        with DoubleServer([Reply("upstream exploded", status=500)] * 4) as upstream, \
                Workspace.create(day.workspace_src, "day01") as ws:
            agent = DayAgent(AgentConfig(base_url=upstream.url, model="m", max_retries=0), ws, day,
                             session_id="s")
            turn = await agent.ask("go")
            await agent.aclose()
            assert "## USER.md" in system_prompt(ws)
        assert "HTTP 500" in turn.error and "upstream exploded" in turn.error

    async def test_unreachable_model_and_running_event_loop(self, tmp_path):
        # run_bench works from inside a running event loop (notebooks) and reports connection errors
        summary = run_bench(DATA, "day04", "baseline", base_url="http://127.0.0.1:9/v1", model="m",
                            out_dir=tmp_path / "out", request_timeout=5)
        assert summary["rounds"] == 5 and summary["errors"] == 5 and summary["accuracy"] == 0.0
        record = json.loads((tmp_path / "out/rounds.jsonl").read_text().splitlines()[0])
        assert "could not reach the model at http://127.0.0.1:9/v1" in record["error"]
        with pytest.raises(ValueError, match="mode"):
            run_bench(DATA, "day04", "turbo", base_url="http://x/v1", model="m", out_dir=tmp_path)


def test_a_day_that_cannot_start_counts_as_failed(tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(DATA / "eval", root / "eval")
    for name in ("AGENTS.md", "USER.md"):
        write(root / "workspaces/shared" / name, (DATA / "workspaces/shared" / name).read_text())
    tests = json.loads((DATA / "all_tests.json").read_text())
    tests["test"] = tests["test"][:1]
    write(root / "all_tests.json", json.dumps(tests))                # day01's input folder is missing
    summary = run_bench(root, "all", "baseline", base_url="http://127.0.0.1:9/v1", model="m",
                        out_dir=tmp_path / "out")
    assert summary["rounds"] == 5 and summary["accuracy"] == 0.0 and summary["errors"] == 5
    assert "day01" in summary["day_failures"][0] and "no folder day01/" in summary["day_failures"][0]
    assert "day failed: day01" in format_table(summary)


def test_hooks_run_between_rounds_and_their_failures_are_reported(bench, tmp_path):
    from metaclaw.offline.double import DoubleServer

    days = select_days(bench, "day01")
    order = []

    async def between_days(day_summary):                      # async hooks are awaited
        order.append(("day", day_summary["day"], day_summary["accuracy"]))

    def between_rounds(record):                               # sync hooks run in a worker thread
        order.append(("round", record["round"]))
        raise RuntimeError("evolver unavailable")

    with DoubleServer(oracle_replies(days)) as upstream:
        summary = run_bench(DATA, "day01", "skills", base_url=upstream.url, model="m",
                            out_dir=tmp_path / "out", on_round=lambda r: order.append(("graded", r["round"])),
                            between_rounds=between_rounds, between_days=between_days)
    assert summary["accuracy"] == 1.0 and len(summary["hook_errors"]) == 4
    assert "between_rounds hook failed: RuntimeError: evolver unavailable" in summary["hook_errors"][0]
    assert order[:3] == [("graded", "r1"), ("round", "r1"), ("graded", "r2")]
    assert order[-2:] == [("graded", "r5"), ("day", "day01", 1.0)]
    assert "hook error" in format_table(summary)
