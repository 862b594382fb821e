"""The CLI contract: `metaclaw serve`, `turns --json`, `skills list|diff|rollback`, `scheduler status`."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.skills.library import Skill

CLI = [sys.executable, "-m", "metaclaw"]


def run_cli(*args, env=None, check=True):
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"metaclaw {args} exited {proc.returncode}: {proc.stderr}")
    return proc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(proc, port, timeout=60.0):
    """Wait until the server process listens on ``port`` (fail with its stderr if it exits)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
    raise AssertionError(f"nothing listened on port {port} within {timeout} s")


def write_skill(root: Path, name: str, description: str, body: str):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text(Skill(name=name, description=description,
                                           category="ops", body=body).to_markdown())


@pytest.fixture()
def served(tmp_path):
    skills = tmp_path / "skills"
    write_skill(skills, "backup-before-modify", "Copy a file before changing it.",
                "Make a .bak copy of any file before you edit it.")
    write_skill(skills, "weather-small-talk", "Chat about the weather politely.",
                "Mention the forecast.")
    db = tmp_path / "ws.db"
    port = free_port()
    with DoubleServer([Reply("done, with a backup")]) as upstream:
        proc = subprocess.Popen(
            [str(a) for a in [*CLI, "serve", "--upstream", upstream.url, "--model", "double-model", "--port", port,
             "--skills", skills, "--db", db, "--token", "t0ken", "--retrieval", "lexical",
             "--top-k", "1"]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "METACLAW_UPSTREAM_API_KEY": "sk-secret-upstream-key"})
        wait_for_port(proc, port)
        try:
            yield {"port": port, "db": db, "skills": skills, "upstream": upstream}
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def test_serve_then_turns_and_skills(served):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key="t0ken")
    reply = client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "edit config.yaml, backup first"}],
        extra_headers={"X-Session-Id": "cli-s1"})
    assert reply.choices[0].message.content == "done, with a backup"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key="wrong",
                      max_retries=0).chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}])
    # the upstream saw the injected skill and the configured model, and the real key
    sent = served["upstream"].requests[-1]
    assert sent["body"]["model"] == "double-model"
    assert "Make a .bak copy" in sent["body"]["messages"][0]["content"]

    deadline = time.time() + 10
    rows = []
    while time.time() < deadline and not rows:
        rows = [json.loads(line) for line in
                run_cli("turns", "--db", served["db"], "--json").stdout.splitlines()]
        time.sleep(0.2)
    assert len(rows) == 1
    row = rows[0]
    assert row["session_id"] == "cli-s1" and row["turn_type"] == "main"
    assert row["injected_skills"] == ["backup-before-modify"]
    assert row["skill_generation"] == 0 and row["status"] == "ok"
    assert row["response"] == "done, with a backup"
    none = run_cli("turns", "--db", served["db"], "--type", "stage:plan")
    assert none.stdout == "" and "no turns of type 'stage:plan'" in none.stderr
    head, line = run_cli("turns", "--db", served["db"], "--type", "main").stdout.splitlines()
    assert head.split()[:6] == ["turn", "session", "type", "gen", "status", "verdict"]
    assert line.startswith("#") and " cli-s1 " in line and "backup-before-modify" in line
    bad = run_cli("turns", "--db", served["db"], "--type", "stage:Plan!", check=False)
    assert bad.returncode != 0 and "'stage:<name>'" in bad.stderr
    assert b"sk-secret-upstream-key" not in served["db"].read_bytes()
    assert b"t0ken" not in served["db"].read_bytes()


def test_skills_list_diff_rollback(tmp_path):
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "alpha", "First skill.", "line one\nline two")
    listed = [json.loads(l) for l in
              run_cli("skills", "list", "--skills", skills, "--db", db, "--json").stdout.splitlines()]
    assert [s["name"] for s in listed] == ["alpha"] and listed[0]["generation"] == 0

    (skills / "alpha" / "SKILL.md").write_text(
        Skill(name="alpha", description="First skill.", category="ops",
              body="line one\nline 2 edited").to_markdown())
    write_skill(skills, "beta", "Second skill.", "beta body")
    listed = [json.loads(l) for l in
              run_cli("skills", "list", "--skills", skills, "--db", db, "--json").stdout.splitlines()]
    assert {s["name"] for s in listed} == {"alpha", "beta"} and listed[0]["generation"] == 1

    diff = json.loads(run_cli("skills", "diff", 0, 1, "--skills", skills, "--db", db,
                              "--json").stdout)
    assert [s["name"] for s in diff["added"]] == ["beta"]
    assert diff["edited"][0]["name"] == "alpha"
    assert "+line 2 edited" in diff["edited"][0]["unified_diff"]
    assert diff["kind"] == "disk" and diff["reason"]  # what made the generation
    text = run_cli("skills", "diff", 0, 1, "--skills", skills, "--db", db).stdout
    assert "beta" in text and "alpha" in text
    assert text.startswith(f"generation 1 (disk): {diff['reason']}")
    # one generation: what it changed; none: what the latest changed
    assert run_cli("skills", "diff", 1, "--skills", skills, "--db", db).stdout == text
    assert run_cli("skills", "diff", "--skills", skills, "--db", db).stdout == text
    proc = run_cli("skills", "diff", 0, "--skills", skills, "--db", db, check=False)
    assert proc.returncode == 2 and "none before it" in proc.stderr

    out = json.loads(run_cli("skills", "rollback", 0, "--skills", skills, "--db", db,
                             "--json").stdout)
    assert out == {"rolled_back_to": 0, "generation": 2}
    assert not (skills / "beta").exists()
    assert "line two" in (skills / "alpha" / "SKILL.md").read_text()


def test_skills_remove_takes_even_the_last_skill_out_and_rollback_brings_it_back(tmp_path):
    skills, db = tmp_path / "skills", tmp_path / "m.db"
    write_skill(skills, "alpha", "First skill.", "body")
    run_cli("skills", "list", "--skills", skills, "--db", db)  # generation 0 from the folder
    proc = run_cli("skills", "remove", "nope", "--skills", skills, "--db", db, check=False)
    assert proc.returncode == 2 and "no skill named nope" in proc.stderr
    said = run_cli("skills", "remove", "alpha", "--skills", skills, "--db", db).stdout
    assert "generation 1: removed alpha" in said and "rollback 0" in said
    assert not (skills / "alpha").exists()
    listed = run_cli("skills", "list", "--skills", skills, "--db", db, "--json").stdout
    assert "alpha" not in listed  # the empty folder is not filled again from the workspace
    run_cli("skills", "rollback", 0, "--skills", skills, "--db", db)
    assert (skills / "alpha" / "SKILL.md").exists()
    (tmp_path / "bad" / "x").mkdir(parents=True)
    (tmp_path / "bad" / "x" / "SKILL.md").write_text("---\nname: [unclosed\n---\nbody\n")
    imported = run_cli("skills", "import", "--from", tmp_path / "bad", "--skills", skills,
                       "--db", db, check=False)
    assert imported.returncode == 1 and "skipped" in imported.stderr
    assert "nothing imported: the library stays at generation 2" in imported.stdout


def test_clear_errors(tmp_path):
    proc = run_cli("turns", "--db", tmp_path / "missing.db", check=False)
    assert proc.returncode == 2 and "no MetaClaw database" in proc.stderr
    proc = run_cli("skills", "diff", 0, 1, 2, "--skills", tmp_path / "s", "--db",
                   tmp_path / "d.db", check=False)
    assert proc.returncode == 2 and "at most two generations" in proc.stderr
    proc = run_cli("skills", "rollback", 7, "--skills", tmp_path / "s", "--db", tmp_path / "d.db",
                   check=False)
    assert proc.returncode == 2 and "no MetaClaw database" in proc.stderr
    write_skill(tmp_path / "s", "alpha", "First skill.", "body")
    proc = run_cli("skills", "rollback", 7, "--skills", tmp_path / "s", "--db", tmp_path / "d.db",
                   check=False)
    assert proc.returncode == 1 and "7" in proc.stderr and "Traceback" not in proc.stderr


def test_scheduler_status_json(tmp_path):
    config = tmp_path / "sched.yaml"
    config.write_text("scheduler:\n  mode: any\n  signals:\n"
                      "    sleep: {start: '00:00', end: '23:59', tz: UTC}\n")
    status = json.loads(run_cli("scheduler", "status", "--json", "--config", config,
                                "--db", tmp_path / "none.db").stdout)
    assert status["state"] == "waiting"
    assert [s["name"] for s in status["signals"]] == ["sleep"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("signals:\n  telepathy: {}\n")
    proc = run_cli("scheduler", "status", "--config", bad, check=False)
    assert proc.returncode == 1 and "telepathy" in proc.stderr


def test_bench_json_summary_keys(tmp_path):
    out = run_cli("bench", "--days", "day01,day02", "--mode", "baseline", "--parallel", "2",
                  "--out", tmp_path / "b", "--json")
    summary = json.loads(out.stdout)
    for key in ("rounds", "file_check_rounds", "multi_choice_rounds", "accuracy",
                "file_check_completion", "multi_choice_score", "per_day"):
        assert key in summary
    assert summary["rounds"] == 10 and [d["day"] for d in summary["per_day"]] == ["day01", "day02"]
    assert summary["rounds"] == summary["file_check_rounds"] + summary["multi_choice_rounds"]
    lines = (tmp_path / "b" / "run" / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == 10 and {"day", "round", "type", "score", "passed"} <= set(json.loads(lines[0]))
    table = run_cli("bench", "--days", "day01", "--out", tmp_path / "c").stdout
    assert "day01" in table
    proc = run_cli("bench", "--mode", "full", "--days", "day01", "--out", tmp_path / "d",
                   check=False)
    assert proc.returncode == 2 and "--base-model" in proc.stderr
    proc = run_cli("demo", "--upstream", "http://127.0.0.1:9/v1", check=False)
    assert proc.returncode == 2 and "--model" in proc.stderr


def test_bench_fails_loudly_when_the_judge_never_worked(tmp_path):
    """A skills run whose judge failed on every turn learned nothing: its scores are the
    baseline's, so it says so and exits 1 instead of printing a table as if it had run."""
    proc = run_cli("bench", "--mode", "skills", "--days", "day01", "--judge-url",
                   "http://127.0.0.1:9/v1", "--judge-model", "j", "--out", tmp_path / "b",
                   check=False)
    assert proc.returncode == 1, proc.stderr
    assert "judge: 0 turns judged" in proc.stdout
    assert "the judge failed on every turn" in proc.stderr and "127.0.0.1" in proc.stderr
    ok = run_cli("bench", "--mode", "skills", "--days", "day01", "--out", tmp_path / "c", "--json")
    assert json.loads(ok.stdout)["judge"]["failed"] == 0


def _failed_then_feedback(runtime):
    """Two turns of one session: a task, then the user's feedback that it was wrong."""
    client = runtime.client()
    headers = {"X-Session-Id": "s1"}
    messages = [{"role": "user", "content": "Write the meeting time 9:30 tomorrow into "
                                            "day01/standup.json as meeting_time."}]
    first = client.chat.completions.create(model="m", messages=messages, extra_headers=headers)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "[Previous Feedback] incorrect. All time fields must "
                  "use a full datetime with timezone offset, e.g. 2026-03-16T09:30:00+08:00."}]
    client.chat.completions.create(model="m", messages=messages,
                                   extra_headers={**headers, "X-Session-Done": "true"})
    runtime.proxy.flush()


def test_score_buffers_evolve_commands(tmp_path):
    from metaclaw.runtime import Runtime

    db, skills = tmp_path / "ws.db", tmp_path / "skills"
    runtime = Runtime.start(db_path=str(db), skills_dir=str(skills), simulated=True,
                            retrieval="lexical")
    try:
        _failed_then_feedback(runtime)
        url = runtime.double.url
        scored = [json.loads(l) for l in run_cli(
            "score", "--db", db, "--judge-url", url, "--judge-model", "sim-judge", "--votes", "3",
            "--json").stdout.splitlines()]
        assert [s["score"] for s in scored] == [-1, 0]
        assert all(len(s["votes"]) == 3 and s["failed"] == 0 for s in scored)
        again = run_cli("score", "--db", db, "--judge-url", url, "--judge-model", "sim-judge")
        assert "judged 0 of 0 turns" in again.stdout and "--rescore judges them again" in \
            again.stdout  # not a silent nothing
        rescored = run_cli("score", "--db", db, "--judge-url", url, "--judge-model", "sim-judge",
                           "--rescore")  # the summary counts the verdicts at its threshold
        assert ": 1 below 0 (failures), 0 above, 1 at it (unclear)" in rescored.stdout
        rows = [json.loads(l) for l in run_cli("buffers", "--db", db, "--json").stdout.splitlines()]
        assert [(r["set"], r["state"], r["skill_generation"], r["reward"]) for r in rows] == [
            ("query", "live", 0, -1.0), ("query", "live", 0, 0.0)]
        # the evolver's next evidence: the failures below the threshold given
        assert [r["next_evidence"] for r in rows] == [True, False]
        assert [json.loads(l)["next_evidence"] for l in run_cli(
            "buffers", "--db", db, "--json", "--threshold", 0.5).stdout.splitlines()] == [
            True, True]
        table = run_cli("buffers", "--db", db).stdout  # every column, a readable time
        header = table.splitlines()[1]
        assert all(name in header for name in ("id", "session_id", "turn_type", "set", "state",
                                                "skill_generation", "reward", "created_at", "task",
                                                "next_evidence"))
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", table)
        assert table.rstrip().endswith("2 turns in a buffer; --json for every field in full")
        newest = run_cli("buffers", "--db", db, "--last", 1).stdout
        assert newest.rstrip().endswith("2 turns in a buffer, the newest 1 shown (--last); "
                                        "--json for every field in full")
        assert [json.loads(l)["reward"] for l in run_cli(
            "buffers", "--db", db, "--json", "--last", 1).stdout.splitlines()] == [0.0]

        dry = json.loads(run_cli("evolve", "--db", db, "--skills", skills, "--evolver-url", url,
                                 "--evolver-model", "sim-evolver", "--dry-run", "--json").stdout)
        assert dry["status"] == "dry_run" and not any(skills.glob("*/SKILL.md"))
        done = json.loads(run_cli("evolve", "--db", db, "--skills", skills, "--evolver-url", url,
                                  "--evolver-model", "sim-evolver", "--json").stdout)
        assert done["status"] == "applied" and done["generation"] == 1
        assert any("+08:00" in p.read_text() for p in skills.glob("*/SKILL.md"))
        rows = [json.loads(l) for l in run_cli("buffers", "--db", db, "--json").stdout.splitlines()]
        assert [(r["set"], r["state"]) for r in rows] == [("support", "consumed"),
                                                          ("query", "purged")]
        proc = run_cli("score", "--db", db, check=False)
        assert proc.returncode == 2 and "--judge-url" in proc.stderr
    finally:
        runtime.stop()


def test_turns_picks_by_status_id_and_newest_and_events_counts_turns_not_served_whole(
        tmp_path):
    from metaclaw.store import Store

    db = tmp_path / "ws.db"
    store = Store(db)
    codex = "019a6f3e-3c1d-7b42-9e0f-5a8c2d4b6e10"  # a Codex session id: 36 characters
    judged = {"reward": -1.0, "judge_rationale": "The date is not\nin ISO form.",
              "retrieval_query": "ask 0\nsecond line"}  # the first turn's
    ids = [store.record_turn(session_id=session, request_messages=[
        {"role": "user", "content": f"ask {n}"}], status=status, response=f"reply {n}",
        error=None if status == "ok" else "the proxy stopped while this turn was in flight",
        **(judged if n == 0 else {}))
        for n, (session, status) in enumerate([("s1", "ok"), (codex, "cancelled"),
                                               ("s1", "error"), ("s1", "ok")])]

    def listed(*options):
        return run_cli("turns", "--db", db, *options).stdout.splitlines()

    head, *rows = listed()
    assert [row.split()[0] for row in rows] == [f"#{i}" for i in ids]
    assert {row.index(" main ") for row in rows} == {head.index(" type ")}  # lined up past
    # the long id, and with short ids only
    head, *rows = listed("--session", "s1")
    assert {row.index(" main ") for row in rows} == {head.index(" type ")}
    assert [r.split()[0] for r in listed("--status", "cancelled")[1:]] == [f"#{ids[1]}"]
    assert [r.split()[0] for r in listed("--last", "2")[1:]] == [f"#{ids[2]}", f"#{ids[3]}"]
    assert [r.split()[0] for r in listed("--id", ids[2])[1:]] == [f"#{ids[2]}"]
    assert [r.split()[0] for r in listed("--status", "ok", "--last", "1")[1:]] == [f"#{ids[3]}"]
    none = run_cli("turns", "--db", db, "--id", "999")
    assert none.stdout == "" and "no turns numbered 999" in none.stderr
    why = run_cli("turns", "--db", db, "--id", ids[0], "--why").stdout
    assert "judged: reward -1.00 (fail): The date is not in ISO form." in why  # why the judge failed it
    assert "query: ask 0 second line" in why  # on one line
    (row,) = [json.loads(line) for line in listed("--id", ids[0], "--json")]
    assert row["judge_rationale"] == "The date is not\nin ISO form." and "judge_votes" in row
    events = run_cli("events", "--db", db).stdout
    assert "loop failures (judge, evolver, training rewards, skill files): none" in events
    # the command it names opens this workspace, not the default one
    assert f"turns not served whole: cancelled 1, error 1 (metaclaw turns --db {db} --status" \
        in events


def test_score_skips_a_turn_another_process_is_judging(tmp_path):
    from metaclaw.fastloop.judge import lease_turns
    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.store import Store

    db = tmp_path / "ws.db"
    store = Store(db)
    ids = [store.record_turn(session_id="s", request_messages=[{"role": "user", "content": q}],
                             status="ok", response="4") for q in ("2+2?", "3+1?")]
    lease_turns(store, ids[:1])  # the other process
    with DoubleServer([Reply(json.dumps({"score": 1, "rationale": "right"}))]) as double:
        proc = run_cli("score", "--db", db, "--judge-url", double.url, "--judge-model", "j",
                       "--votes", "1")
    assert "judged 1 of 2 turns" in proc.stdout and "1 skipped" in proc.stdout
    assert f"turn {ids[0]}: skipped (another process is judging it" in proc.stdout
    assert store.query("SELECT * FROM events WHERE kind = 'judge_failed'") == []


def training_workspace(tmp_path):
    """The tiny local model, a workspace with two query-set turns, and a scripted judge (a
    ``DoubleServer`` handler) that rewards replies saying "yes"."""
    from metaclaw.fastloop.judge import SECTION_REPLY, parse_judge_prompt
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.store import Store

    model = write_tiny_model(tmp_path / "tiny")
    db = tmp_path / "ws.db"
    store = Store(db)
    for text in ("say yes", "answer yes or no"):
        store.record_turn(session_id="s", request_messages=[{"role": "user", "content": text}],
                          status="ok", response="no", buffer_set="query", buffer_state="live")
    store.close()

    def judge(body):
        reply = parse_judge_prompt(body["messages"][-1]["content"])[SECTION_REPLY]
        return Reply(json.dumps({"score": 1 if "yes" in reply.split() else -1,
                                 "rationale": "scripted"}))

    return model, db, judge


def test_train_now_then_runs_json(tmp_path):
    """`metaclaw train --now` on the query set with the local backend on the tiny model, judged
    by an OpenAI-compatible judge double; `metaclaw runs --json` shows the recorded steps."""
    from metaclaw.store import Store
    from metaclaw.training_lease import TrainingLease

    model, db, judge = training_workspace(tmp_path)
    args = ("train", "--db", db, "--backend", "local", "--base-model", model, "--steps", 2,
            "--now", "--judge-url", "http://127.0.0.1:9", "--judge-model", "j", "--votes", 1,
            "--group-size", 4, "--groups-per-step", 2, "--max-tokens", 6, "--lr", "0.01")
    lease = TrainingLease.for_store(Store(db))  # this process trains the workspace meanwhile
    assert lease.acquire("a test's training run")
    try:
        busy = run_cli(*args, check=False)
    finally:
        lease.release()
    assert busy.returncode != 0 and f"pid {os.getpid()} on " in busy.stderr
    assert "is training this workspace" in busy.stderr
    with DoubleServer(judge) as double:
        out = run_cli(*[double.url if a == "http://127.0.0.1:9" else a for a in args])
    assert "2 steps" in out.stdout
    steps = [json.loads(l) for l in run_cli("runs", "--db", db, "--json").stdout.splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert {"policy_version", "skill_generation", "loss", "reward_mean",
                "skipped_groups"} <= set(s) and s["backend"] == "local" and s["groups"] == 2
    assert (tmp_path / "train" / "latest.json").is_file()  # state kept for resuming
    proc = run_cli("train", "--db", db, "--base-model", tmp_path / "nope", "--now",
                   check=False)
    assert proc.returncode == 2 and "not a local model folder" in proc.stderr


def test_train_with_a_programmatic_reward_trains_without_a_judge(tmp_path):
    model, db, _ = training_workspace(tmp_path)
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def longer(prompt, text):\n    return float(len(text))\n")
    common = ("train", "--db", db, "--backend", "local", "--base-model", model, "--steps", 1,
              "--now", "--group-size", 4, "--groups-per-step", 2, "--max-tokens", 6,
              "--lr", "0.01")
    out = run_cli(*common, "--reward", f"{rewards}:longer").stdout
    assert "1 step (finished)" in out
    steps = [json.loads(l) for l in run_cli("runs", "--db", db, "--json").stdout.splitlines()]
    assert steps[-1]["loss"] is not None  # trained: the reward told the samples apart
    for bad, says in ((f"{rewards}:shorter", "has no function shorter"),
                      ("no_such_module_xyz:f", "cannot load no_such_module_xyz"),
                      ("longer", "module:function")):
        proc = run_cli(*common, "--reward", bad, check=False)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr


def test_train_waits_for_turns_and_stops_on_sigterm_as_on_ctrl_c(tmp_path):
    """It ended by itself when there was nothing to train yet (turns served later never
    trained), and SIGTERM (systemd, docker stop) killed it mid-step, after which `scheduler
    status` said `training` for good."""
    import signal

    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.store import Store

    model, db = write_tiny_model(tmp_path / "tiny"), tmp_path / "ws.db"
    Store(db).close()
    config = tmp_path / "always.yaml"
    config.write_text("mode: any\nmin_window_s: 0\nsignals:\n  sleep: {start: '00:00', "
                      "end: '24:00'}\n")
    proc = subprocess.Popen([*CLI, "train", "--db", str(db), "--backend", "local",
                             "--base-model", str(model), "--scheduler-config", str(config),
                             "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "j",
                             "--poll", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        said = ""
        deadline = time.monotonic() + 90
        while "nothing to train yet" not in said:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, said
            said += proc.stdout.readline()
        time.sleep(1.0)
        assert proc.poll() is None  # still waiting for turns
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err
    # no step ran: it does not claim to have saved one (it named a folder never written)
    assert "stopped before its first step finished; nothing was trained or saved" in err
    status = json.loads(run_cli("scheduler", "status", "--db", db, "--config", config,
                                "--json").stdout)
    assert status["state"] != "training" and not status["training"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    with Store(db) as store:  # a trainer killed mid-step (kill -9) leaves `training` last
        store.record_transition(from_state="waiting", to_state="training", reason="window open",
                                process=f"pid {gone.pid} on {socket.gethostname()}")
    Store(tmp_path / "fresh.db").close()
    assert run_cli("scheduler", "status", "--db", tmp_path / "fresh.db").stdout.startswith(
        "state: waiting (no scheduled trainer has run)")
    with Store(tmp_path / "fresh.db") as store:  # `train --now` trains with no scheduler
        store._insert("training_steps", {"run_id": "r", "step": 1, "created_at": 1.0e9,
                                         "backend": "local", "policy_version": 1,
                                         "skill_generation": 0})
    assert "no scheduled trainer has run; 1 training step recorded, the last at " in run_cli(
        "scheduler", "status", "--db", tmp_path / "fresh.db").stdout
    status = run_cli("scheduler", "status", "--db", db, "--scheduler-config", config).stdout
    assert status.startswith("state: waiting (the last scheduled trainer's")
    assert "no process holds the training lease" in status
    # the window is this command's reading, by the settings it was given: said so
    assert f"window by {config} (--config; a trainer may use others): " in status


def test_train_now_with_nothing_to_train_says_so_before_loading_the_model(tmp_path):
    """It loaded the model (20 s for SmolLM2), then said `0 steps` and exited 0."""
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.store import Store

    model, db = write_tiny_model(tmp_path / "tiny"), tmp_path / "ws.db"
    Store(db).close()
    proc = run_cli("train", "--db", db, "--backend", "local", "--base-model", model, "--now",
                   "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "j", check=False)
    assert proc.returncode == 2 and "nothing to train" in proc.stderr
    assert "serve turns through the proxy first" in proc.stderr


def test_train_now_with_a_judge_that_cannot_be_reached_says_so_and_fails(tmp_path):
    """It printed `skipped 1/1` and exited 0, `events` said no failures."""
    model, db, _ = training_workspace(tmp_path)
    proc = run_cli("train", "--db", db, "--backend", "local", "--base-model", model, "--steps",
                   1, "--now", "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "j",
                   "--votes", 1, "--group-size", 2, "--groups-per-step", 2, "--max-tokens", 4,
                   check=False)
    assert proc.returncode == 1 and "every step's reward calls failed" in proc.stderr
    assert "skipped: 2 whose reward call failed (" in proc.stdout
    events = run_cli("events", "--db", db).stdout
    assert "reward_failed: 1" in events and "training rewards" in events


def test_bench_full_mode_trains_and_serves_the_policy_between_days(tmp_path):
    """Mode full on two days with the tiny local model as the agent (it cannot do the tasks: the
    point is the wiring): the skills loop runs, every night with query data publishes at least
    one policy version trained on the day's graders' reward, the next day's turns are served by
    it, and the run is labelled with the policy that served it. A run that trains nothing
    fails this test."""
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.store import Store

    model = write_tiny_model(tmp_path / "tiny")
    run_cli("bench", "--mode", "full", "--days", "day01,day02", "--backend", "local",
            "--base-model", model, "--train-steps", 2, "--device", "cpu",
            "--out", tmp_path / "f", "--json")
    summary = json.loads((tmp_path / "f" / "run" / "summary.json").read_text())
    assert summary["rounds"] == 10
    assert summary["model"] == f"local:{model}" and summary["agent_model"] == "sim-agent"
    nights = summary["nights"]
    assert [n["day"] for n in nights] == ["day01", "day02"]
    for night in nights:
        assert night["query_turns"] >= 1 and night["graded_turns"] >= 1  # graders reward them
        assert night["steps"] >= 1 and night["published"] >= 1            # it trained
    store = Store(tmp_path / "f" / "metaclaw.db")
    steps = store.query("SELECT * FROM training_steps ORDER BY id")
    assert len(steps) == sum(n["steps"] for n in nights)
    assert all("zero_variance_groups" in s["metrics"] for s in steps)
    versions = store.query("SELECT version FROM policy_versions ORDER BY version")
    assert [v["version"] for v in versions] == list(range(1, summary["policy_version"] + 1))
    # day 2 was served by the policy published on night 1, and the label says so
    day2 = store.turns("session_id LIKE '%day02' AND turn_type = 'main'")
    assert day2 and {t["policy_version"] for t in day2} == {nights[0]["policy_version_after"]}
    served = summary["served_by"]["policy_versions_by_day"]
    assert served["day01"]["max"] == 0 and served["day02"]["min"] == nights[0]["policy_version_after"] >= 1
    # every agent turn was answered by the local policy: token ids and logprobs recorded
    agent = store.turns("turn_type = 'main' AND status = 'ok'")
    assert agent and all(t["completion_tokens_ids"] and t["completion_logprobs"] for t in agent)
    # trained turns are marked; the support set never trains
    trained = store.turns("trained_steps > 0")
    assert trained and all(t["buffer_set"] == "query" for t in trained)


def test_serve_sim_auto_evolve_holds_an_unverified_skill_for_review(tmp_path):
    """`metaclaw serve --sim --auto-evolve`: a failed turn plus the user's feedback ends the
    session, the fast loop judges and evolves in the server; the verification gate cannot
    measure a fix by replaying the call alone (the simulated judge needs the user's feedback),
    so the skill is held back as a proposal with its evidence instead of going live."""
    from metaclaw.fastloop import proposals
    from metaclaw.store import Store

    port = free_port()
    proc = subprocess.Popen([str(a) for a in [
        *CLI, "serve", "--sim", "--auto-evolve", "--port", port, "--retrieval", "lexical",
        "--db", tmp_path / "ws.db", "--skills", tmp_path / "skills"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(proc, port)
        deadline = time.time() + 60
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        session = {"X-Session-Id": "s1"}
        messages = [{"role": "user", "content": "Write the meeting time 9:30 tomorrow into "
                                                "day01/standup.json as meeting_time."}]
        first = client.chat.completions.create(model="x", messages=messages, extra_headers=session)
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "[Previous Feedback] incorrect. All time fields "
                      "must use a full datetime with timezone offset, e.g. 2026-03-16T09:30:00+08:00."}]
        client.chat.completions.create(model="x", messages=messages,
                                       extra_headers={**session, "X-Session-Done": "true"})
        held = []
        with Store(tmp_path / "ws.db") as store:
            while time.time() < deadline and not held:
                held = proposals.held(store)
                time.sleep(0.2)
            assert held and held[0].origin == "auto" and held[0].evidence["cases"]
            assert held[0].judge_calls > 0 and store.latest_generation() == 0
        raw = client.chat.completions.with_raw_response.create(
            model="x", messages=[{"role": "user", "content": "Put the due date Friday 5pm with a "
                                  "timestamp into tasks.json"}], extra_headers={"X-Session-Id": "s3"})
        assert raw.headers["x-metaclaw-skill-generation"] == "0"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    # the server says what the fast loop decided (no change, held, a new generation) and why
    # (held: in a sentence that says why and what to do: the simulated judge cannot score a
    # replay, so the gate cannot tell the replies apart)
    said = next(line for line in out.splitlines() if line.startswith("fast loop (session s1 "
                                                                      "ended): add "))
    assert "held back as proposal #1: the judge could not tell the replies apart" in said
    assert said.endswith(" promote 1` puts it live")
    assert "`metaclaw proposals --db " in said  # the command opens the proxy's workspace


def test_a_locked_workspace_or_an_unwritable_folder_is_a_one_line_error(tmp_path, monkeypatch,
                                                                         capsys):
    import sqlite3

    from metaclaw import cli
    from metaclaw.store import base as store_module

    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "alpha", "First skill.", "body")
    assert cli.main(["skills", "list", "--skills", str(skills), "--db", str(db)]) == 0
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.2)  # not the default 30 s of waiting
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process writing
    try:
        capsys.readouterr()
        assert cli.main(["skills", "rollback", "0", "--skills", str(skills), "--db", str(db)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("metaclaw skills: the workspace database") and "locked" in err
        assert err.count("\n") == 1
    finally:
        holder.rollback()
        holder.close()
    (tmp_path / "a-file").write_text("")
    assert cli.main(["skills", "list", "--skills", str(tmp_path / "a-file" / "skills"),
                     "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("metaclaw skills:") and "a-file" in err and err.count("\n") == 1


def test_failed_judge_and_evolver_calls_from_the_cli_are_recorded(tmp_path, capsys):
    from metaclaw import cli
    from metaclaw.store import Store

    db, skills = tmp_path / "ws.db", tmp_path / "skills"
    write_skill(skills, "alpha", "First skill.", "body")
    store = Store(db)
    store.record_turn(session_id="s", request_messages=[{"role": "user", "content": "q"}],
                      status="ok", response="a", buffer_set="support", buffer_state="live",
                      reward=-1.0)
    store.record_turn(session_id="s", request_messages=[{"role": "user", "content": "q2"}],
                      status="ok", response="a2")
    with DoubleServer(lambda body: Reply("I will not grade or write anything.")) as double:
        assert cli.main(["score", "--db", str(db), "--judge-url", double.url,
                         "--judge-model", "j", "--votes", "1"]) == 1
        assert cli.main(["evolve", "--db", str(db), "--skills", str(skills),
                         "--evolver-url", double.url, "--evolver-model", "e"]) == 1
    kinds = {row["kind"]: row for row in Store(db).events()}
    assert kinds["judge_failed"]["source"] == "cli" and "turn 2" in kinds["judge_failed"]["message"]
    assert "model 'e'" in kinds["evolve_failed"]["message"]
    capsys.readouterr()
    assert cli.main(["events", "--db", str(db)]) == 0
    assert "judge_failed: 1" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, says", [
    ("--port", "99999", "not a port"), ("--timeout", "-1", "not above 0"),
    ("--timeout", "nan", "not a finite number"), ("--top-k", "-1", "too small"),
    ("--budget-chars", "-5", "too small"), ("--context-window", "-5", "too small"),
    ("--min-score", "nan", "not a finite number"), ("--votes", "0", "too small"),
    ("--token", "", "the token is empty (an unset variable?)"),
    ("--token", "a b", "white space"),
])
def test_serve_refuses_impossible_numbers(tmp_path, option, value, says):
    """A value that would make every request fail, or inject nothing, is a usage error."""
    proc = run_cli("serve", "--db", tmp_path / "ws.db", option, value, check=False)
    assert proc.returncode == 2 and option in proc.stderr and says in proc.stderr
    assert not (tmp_path / "ws.db").exists()


def test_an_empty_token_variable_is_no_token_not_a_refusal(monkeypatch):
    from metaclaw import cli

    monkeypatch.setenv("METACLAW_PROXY_TOKEN", "")
    assert cli.build_parser().parse_args(["serve"]).token is None
    monkeypatch.setenv("METACLAW_PROXY_TOKEN", "s3cret")
    assert cli.build_parser().parse_args(["serve"]).token == "s3cret"


def test_serve_warns_when_the_token_variable_is_set_but_empty(tmp_path):
    """`export METACLAW_PROXY_TOKEN=$UNSET`: no token, and the one who starts it is told."""
    import os

    proc = subprocess.Popen(
        [*CLI, "serve", "--db", str(tmp_path / "ws.db"), "--skills", str(tmp_path / "skills"),
         "--port", "0", "--retrieval", "lexical"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "METACLAW_PROXY_TOKEN": ""})
    try:
        assert "MetaClaw proxy on" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "$METACLAW_PROXY_TOKEN is set but empty, so clients need no token" in err


def test_events_refuses_a_count_beyond_sqlite_integers(tmp_path):
    proc = run_cli("events", "--db", tmp_path / "ws.db", "--last", str(2**70), check=False)
    assert proc.returncode == 2 and "too large" in proc.stderr


def test_serve_on_port_0_prints_the_port_it_listens_on(tmp_path):
    proc = subprocess.Popen([*CLI, "serve", "--db", str(tmp_path / "ws.db"), "--skills",
                             str(tmp_path / "skills"), "--port", "0", "--retrieval", "lexical"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        banner = proc.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:(\d+)/v1)", banner)
        assert url and url.group(2) != "0", banner
        assert httpx.get(url.group(1).removesuffix("/v1") + "/healthz", timeout=10).is_success
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("value, says", [("-1", "not above 0"), ("0", "not above 0"),
                                         ("nan", "not a finite number")])
def test_train_refuses_a_learning_rate_that_cannot_train(tmp_path, capsys, value, says):
    """A negative rate would unlearn what the rewards favour, 0 would count steps that trained
    nothing: a usage error before anything is loaded."""
    from metaclaw import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--db", str(tmp_path / "ws.db"), "--lr", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lr" in err and says in err


def test_a_turn_that_called_tools_lists_them_as_its_reply():
    from metaclaw.cli import _reply_text

    row = {"response": "", "error": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}},
        {"type": "function_call", "name": "apply_patch"}]}
    assert _reply_text(row) == "[tool call: shell, apply_patch]"
    assert _reply_text({"response": "a\nb", "error": None, "tool_calls": []}) == "a b"
    assert _reply_text({"response": None, "error": "upstream 502", "tool_calls": None}) == "upstream 502"


def test_skills_lists_by_default_and_readers_do_not_create_a_workspace(tmp_path):
    missing = tmp_path / "none" / "metaclaw.db"
    for action in ([], ["list"], ["stats"], ["diff", "0", "1"]):
        proc = run_cli("skills", *action, "--db", missing, "--skills", tmp_path / "skills",
                       check=False)
        assert proc.returncode == 2 and "no MetaClaw database" in proc.stderr, proc.stderr
    assert not missing.parent.exists() and not (tmp_path / "skills").exists()


def test_a_reader_away_from_the_served_folder_reads_it_there_and_writes_nothing_where_it_runs(
        tmp_path):
    """`cd ~/repo && metaclaw skills` with $METACLAW_DB set: the library is read from the folder
    the workspace is served through, not copied into ./.metaclaw/skills."""
    from metaclaw.skills.library import starter_skills_dir

    served, repo, db = tmp_path / "ws" / "skills", tmp_path / "repo", tmp_path / "ws" / "w.db"
    run_cli("skills", "import", "--from", starter_skills_dir(), "--db", db, "--skills", served)
    repo.mkdir()
    listed = subprocess.run([*CLI, "skills"], capture_output=True, text=True, timeout=120,
                            cwd=repo, env={**os.environ, "METACLAW_DB": str(db)})
    assert listed.returncode == 0, listed.stderr
    assert f"8 skills in {served}" in listed.stdout
    assert list(repo.iterdir()) == []


def test_skills_import_names_what_it_skipped_and_brings_a_skills_other_files(tmp_path):
    """An upstream folder with a broken skill and a skill with scripts and a reference: the
    broken one is named on stderr (it vanished in silence), the other's files are copied beside
    its SKILL.md (the injected text points at them)."""
    source, served, db = tmp_path / "src", tmp_path / "skills", tmp_path / "w.db"
    good = source / "pdf-form-filling"
    (good / "scripts").mkdir(parents=True)
    (good / "SKILL.md").write_text("---\nname: pdf-form-filling\ndescription: Fill PDF forms "
                                   "with pypdf.\nlicense: Apache-2.0\n---\nRun "
                                   "`python scripts/list_fields.py`; see reference.md.\n")
    (good / "scripts" / "list_fields.py").write_text("print('fields')\n")
    (good / "reference.md").write_text("# Reference\n")
    (source / "bad-yaml").mkdir()
    (source / "bad-yaml" / "SKILL.md").write_text("---\nname: bad-yaml\ndescription: [x\n---\nb\n")
    done = run_cli("skills", "import", "--from", source, "--db", db, "--skills", served)
    assert "skipped" in done.stderr and "bad-yaml" in done.stderr
    assert (served / "pdf-form-filling" / "scripts" / "list_fields.py").is_file()
    assert (served / "pdf-form-filling" / "reference.md").read_text() == "# Reference\n"
    # nothing importable at all: a failure
    only_bad = tmp_path / "only-bad"
    (only_bad / "bad-yaml").mkdir(parents=True)
    (only_bad / "bad-yaml" / "SKILL.md").write_text("---\nname: [x\n---\nb\n")
    failed = run_cli("skills", "import", "--from", only_bad, "--db", db, "--skills", served,
                     check=False)
    assert failed.returncode == 1 and "skipped" in failed.stderr


def test_a_skills_path_that_is_a_file_is_named(tmp_path):
    """It said there was no database, about a workspace nobody asked for."""
    (tmp_path / "f").write_text("hi")
    proc = run_cli("skills", "--skills", tmp_path / "f", "--db", tmp_path / "w.db", check=False)
    assert proc.returncode == 2 and "is a file; give the skills folder" in proc.stderr


def test_why_says_what_the_context_budget_changed():
    from metaclaw.cli import _budget_said

    assert _budget_said({}) == "" and _budget_said({"window": 100, "cut": []}) == ""
    assert _budget_said({"window": 400, "cut": ["git-branch-names"]}) == (
        "cut git-branch-names to fit the 400-token window")
    assert _budget_said({"window": 200, "over_window": True, "cut": ["a"]}).startswith(
        "the request alone was over the 200-token window")
    assert _budget_said({"asked_output": 128000, "reserved_output": 16384}) == (
        "output asked 128000, asked upstream 16384 (the model's limit)")


def test_evolve_with_nothing_to_learn_from_records_no_failure(tmp_path, capsys):
    from metaclaw import cli
    from metaclaw.store import Store

    db, skills = tmp_path / "ws.db", tmp_path / "skills"
    write_skill(skills, "alpha", "First skill.", "body")
    assert cli.main(["skills", "--db", str(db), "--skills", str(skills)]) == 0
    assert cli.main(["evolve", "--db", str(db), "--skills", str(skills), "--evolver-url",
                     "http://127.0.0.1:9/v1", "--evolver-model", "e"]) == 0
    assert "no live support turns" in capsys.readouterr().out
    assert not [e for e in Store(db).events() if e["kind"] == "evolve_failed"]


def test_labels_revert_and_export_of_chosen_turns_from_the_cli(tmp_path, capsys):
    """What the notebook offers a person, the command line does too: label a turn, list the
    labels beside the judge, the agreement (an unclear verdict apart), revert the latest
    automatic generation (`serve --auto-evolve` runs without a notebook), export chosen turns."""
    from metaclaw import cli
    from metaclaw.fastloop import proposals
    from metaclaw.skills.library import SkillLibrary, SkillOp
    from metaclaw.store import Store

    db, skills = tmp_path / "ws.db", tmp_path / "skills"
    write_skill(skills, "alpha", "The alpha skill.", "Alpha body.")
    store = Store(db)
    library = SkillLibrary(skills, store)
    ids = [store.record_turn(session_id="s1", request_messages=[{"role": "user", "content": q}],
                             status="ok", response="done", reward=r)
           for q, r in (("one", -1.0), ("two", 0.0), ("three", 1.0))]
    assert cli.main(["label", str(ids[0]), "fail", "--db", str(db), "--note", "wrong unit",
                     "--by", "alice"]) == 0
    assert f"turn #{ids[0]} labelled fail by alice" in capsys.readouterr().out
    assert cli.main(["label", str(ids[1]), "pass", "--db", str(db), "--corrected", "2"]) == 0
    assert cli.main(["label", "999", "pass", "--db", str(db)]) == 2
    capsys.readouterr()
    assert cli.main(["turns", "--db", str(db), "--why"]) == 0
    out = capsys.readouterr().out  # the verdict in a word, a person's label over the judge's
    assert "human:fail" in out and "human:pass" in out and " pass " in out
    assert "judged: reward -1.00 (fail)" in out
    assert "labelled: fail by alice: wrong unit (it takes precedence over the judge)" in out
    assert cli.main(["turns", "--db", str(db), "--json", "--id", str(ids[0])]) == 0
    assert json.loads(capsys.readouterr().out)["human_label"] == "fail"
    assert cli.main(["labels", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "judge fail" in out and "agrees" in out and "judge unclear" in out
    assert cli.main(["labels", "--agreement", "--db", str(db), "--json"]) == 0
    overall = json.loads(capsys.readouterr().out.splitlines()[-1])["overall"]
    assert (overall["agree"], overall["labelled"], overall["judge_unclear"]) == (1, 1, 1)
    out_file = tmp_path / "two.jsonl"
    assert cli.main(["export", str(out_file), "--db", str(db), "--turns", f"{ids[1]}",
                     "--shape", "eval"]) == 0
    [record] = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert record["ideal"] == "2" and record["metadata"]["judge_verdict"] == "unclear"
    assert cli.main(["export", str(out_file), "--db", str(db), "--turns", f"{ids[2]}",
                     "--shape", "eval"]) == 0  # judged pass, no label: the reply is the ideal
    assert json.loads(out_file.read_text())["ideal"] == "done"
    calls = [{"id": "c1", "type": "function", "function": {"name": "write", "arguments": "{}"}}]
    tooled = store.record_turn(session_id="s2", request_messages=[{"role": "user", "content": "w"}],
                               status="ok", response="", reward=1.0, tool_calls=calls)
    assert cli.main(["export", str(out_file), "--db", str(db), "--turns", f"{tooled}",
                     "--shape", "eval"]) == 0  # a reply of tool calls: the calls
    record = json.loads(out_file.read_text())
    assert json.loads(record["ideal"]) == calls and record["metadata"]["tool_calls"] == calls
    assert cli.main(["export", str(out_file), "--db", str(db), "--turns", f"{ids[0]}",
                     "--shape", "eval"]) == 0  # labelled fail: no reference answer
    assert json.loads(out_file.read_text())["ideal"] == ""
    for bad in (["--turns", "x"], ["--turns", ","], ["--turns", f"{ids[1]},999"],
                ["--turns", f"{ids[1]}", "--session", "s1"]):
        assert cli.main(["export", str(out_file), "--db", str(db), *bad]) == 2
    assert "no turn with id 999" in capsys.readouterr().err
    base = library.generation
    new = library.apply([SkillOp("add", Skill(name="beta", description="The beta skill.",
                                              body="Beta body."))], kind="evolve", reason="auto")
    proposals.record(store, [], origin="auto", status=proposals.PROMOTED, base_generation=base,
                     decided_by="gate", generation=new)
    capsys.readouterr()
    argv = ["skills", "revert", "--db", str(db), "--skills", str(skills), "--by", "bob"]
    assert cli.main(argv) == 0
    assert f"reverted (revert generation {new}" in capsys.readouterr().out
    assert "beta" not in SkillLibrary(skills, Store(db))
    assert cli.main(argv) == 2  # reverted already: none left to revert, said so
    assert "none the gate promoted without a person, or each reverted already" in \
        capsys.readouterr().err
    assert cli.main(argv[:2] + [str(new)] + argv[2:]) == 2
    assert f"generation {new} was reverted already, by generation {new + 1}" in \
        capsys.readouterr().err
    assert cli.main(argv[:2] + ["0"] + argv[2:]) == 2  # the initial library: nothing to revert
    assert "initial library" in capsys.readouterr().err
    assert cli.main(argv + ["0"]) == 2  # the generation after the options: read all the same
    assert "initial library" in capsys.readouterr().err


def test_serve_says_what_the_fast_loop_decided_in_sentences():
    """`metaclaw serve` prints the fast loop's outcomes as sentences, not as field dumps."""
    from metaclaw.cli import _loop_said
    from metaclaw.fastloop.loop import FastLoopEvent

    def said(kind, generation=1, **detail):
        return _loop_said(FastLoopEvent(kind, 0.0, generation=generation, detail=detail))

    assert said("evolve_no_change", trigger="session idle", support=[19, 20],
                reason="nothing to add") == ("the evolver changed nothing for the failures "
                                             "#19, #20 (session idle): nothing to add")
    assert said("generation", 2, purged=8) == (
        "generation 2 is live; 8 turns of older generations left the query set (never trained "
        "on)")
    assert said("evolved", 3, trigger="rate", ops=["add iso-dates"], support=[4],
                reason="dates") == "generation 3 (rate): add iso-dates, from the failures #4; dates"
    assert "=" not in said("evolve_failed", error="timeout") + said("keys_written",
                                                                     written=["a", "b"])
