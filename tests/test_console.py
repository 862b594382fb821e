"""Progress and logging of the command line: bars on a terminal, nothing extra in a pipe unless
``-v``, ``-q`` silences; the core's progress events (judge, evolver, training step)."""

from __future__ import annotations

import logging
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from metaclaw import console
from metaclaw.progress import Progress, notify

DEMO = [sys.executable, "-m", "metaclaw", "demo", "--days", "day01"]


def _env() -> dict[str, str]:
    return {**os.environ, "TERM": "xterm-256color", "COLUMNS": "140", "HF_HUB_OFFLINE": "1"}


def _run_in_terminal(argv: list[str], timeout: float = 240.0) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; returns (status, what it
    showed)."""
    main, child = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child,
                            env=_env(), close_fds=True)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    return status, b"".join(chunks).decode("utf-8", "replace")


def test_demo_shows_progress_bars_on_a_terminal(tmp_path):
    status, shown = _run_in_terminal(DEMO + ["--out", str(tmp_path / "out")])
    assert status == 0, shown[-2000:]
    assert "baseline rounds" in shown and "skills rounds" in shown
    assert "5/5" in shown  # day01's five rounds, counted to the end
    assert "accuracy over 5 rounds" in shown  # the usual table still follows


def test_demo_in_a_pipe_prints_no_progress_unless_asked(tmp_path):
    quiet = subprocess.run(DEMO + ["--out", str(tmp_path / "a")], capture_output=True,
                           text=True, env=_env(), timeout=240)
    assert quiet.returncode == 0, quiet.stderr
    assert "rounds" not in quiet.stderr and "\x1b[" not in quiet.stdout + quiet.stderr
    verbose = subprocess.run(DEMO + ["-v", "--out", str(tmp_path / "b")], capture_output=True,
                             text=True, env=_env(), timeout=240)
    assert verbose.returncode == 0, verbose.stderr
    assert "INFO metaclaw.progress: baseline rounds: 5/5 (day01" in verbose.stderr
    assert quiet.stdout.splitlines()[-4:-1] == verbose.stdout.splitlines()[-4:-1]


def test_quiet_on_a_terminal_draws_no_bars(tmp_path):
    status, shown = _run_in_terminal([sys.executable, "-m", "metaclaw", "-q"] + DEMO[3:]
                                     + ["--out", str(tmp_path / "out")])
    assert status == 0, shown[-2000:]
    assert "baseline rounds" not in shown


def test_flags_go_before_or_after_the_command():
    from metaclaw.cli import build_parser

    for argv in (["-v", "turns"], ["turns", "-v"]):
        args = build_parser().parse_args(argv)
        assert args.verbose == 1 and not hasattr(args, "quiet")
    args = build_parser().parse_args(["-q", "turns"])
    assert args.quiet == 1


def test_setup_logging_levels():
    console.setup_logging(1)
    assert logging.getLogger("metaclaw").level == logging.INFO
    console.setup_logging(-1)
    assert logging.getLogger("metaclaw").level == logging.ERROR
    console.setup_logging(0)
    assert logging.getLogger("metaclaw").level == logging.WARNING
    ours = [h for h in logging.getLogger().handlers if isinstance(h, console._Stderr)]
    assert len(ours) == 1  # called three times, one handler


def test_log_lines_follow_a_replaced_stderr(monkeypatch):
    """A caller that replaces sys.stderr (a test's capture) never leaves the handler holding a
    closed stream."""
    import io

    console.setup_logging(0)
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("metaclaw.test").warning("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("metaclaw.test").warning("two")
    assert "WARNING metaclaw.test: two" in second.getvalue()


def test_progress_outside_a_terminal_is_silent_or_log_lines(caplog):
    with console.progress(0) as fn:
        assert fn is None
    with caplog.at_level(logging.INFO, logger="metaclaw.progress"):
        with console.progress(1) as fn:
            fn(Progress("judging turns", 2, 3, "turn #7: reward +1"))
    assert "judging turns: 2/3 (turn #7: reward +1)" in caplog.text


def test_a_failing_display_never_stops_the_work(caplog):
    def broken(event):
        raise RuntimeError("display gone")

    with caplog.at_level(logging.ERROR):
        for done in range(9):
            notify(broken, "x", done, 9)
    assert "display gone" in caplog.text
    # its traceback once, not once per update (a cell showed one per judged turn)
    assert caplog.text.count("Traceback") == 1
    notify(None, "x", 1)  # no display: nothing happens


def test_rounds_hook_counts_each_mode_apart():
    seen = []
    hook = console.rounds(seen.append, 2)
    hook({"mode": "baseline", "day": "day01", "round": "r1", "passed": True})
    hook({"mode": "skills", "day": "day01", "round": "r1", "passed": False})
    hook({"mode": "baseline", "day": "day01", "round": "r2", "error": "timeout"})
    assert [(p.task, p.done, p.total, p.detail) for p in seen] == [
        ("baseline rounds", 1, 2, "day01 r1: pass"), ("skills rounds", 1, 2, "day01 r1: fail"),
        ("baseline rounds", 2, 2, "day01 r2: error")]
    assert console.rounds(None, 5) is None


@pytest.mark.timeout(300)
def test_judge_and_evolver_report_progress(tmp_path):
    """The judge reports each turn; the evolver each phase, ending at its total."""
    from metaclaw.bench.data import small_bench_dir
    from metaclaw.demo import run_mode
    from metaclaw.fastloop.evolver import Evolver
    from metaclaw.fastloop.judge import Judge
    from metaclaw.offline.simmodel import serve_sim_model
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store

    sim = serve_sim_model()
    try:
        run_mode("baseline", small_bench_dir(), "day01", tmp_path / "run", sim.url, "sim-agent",
                 api_key_env="X", retrieval="lexical", top_k=3, min_score=0.0,
                 budget_chars=6000, parallel=1, judge_url=None, judge_model=None,
                 evolver_url=None, evolver_model=None, votes=1, evolve_every="round",
                 on_round=None)
        store = Store(tmp_path / "run" / "metaclaw.db")
        events: list[Progress] = []
        results = Judge(sim.url, "sim-judge", votes=1).judge_turns(store,
                                                                   on_progress=events.append)
        assert events[0].done == 0 and events[-1].done == events[-1].total == len(results) > 0
        assert all(e.task == "judging turns" for e in events)
        library = SkillLibrary(tmp_path / "run" / "skills", store)
        phases: list[Progress] = []
        Evolver(sim.url, "sim-evolver", library, store).evolve(on_progress=phases.append)
        assert phases[0].done == 0 and phases[-1].done == phases[-1].total
        assert [p.done for p in phases] == sorted(p.done for p in phases)
        store.close()
    finally:
        sim.stop()


def test_score_and_evolve_show_progress_on_a_terminal_and_none_in_a_pipe(tmp_path):
    """`metaclaw score` draws a bar per judged turn and `metaclaw evolve` one per phase on a
    terminal; in a pipe they print their results only (the simulated judge and evolver)."""
    from metaclaw.runtime import Runtime

    db, skills = tmp_path / "ws.db", tmp_path / "skills"
    runtime = Runtime.start(db_path=str(db), skills_dir=str(skills), simulated=True,
                            retrieval="lexical")
    try:
        client = runtime.client()
        messages = [{"role": "user", "content": "Write the meeting time 9:30 tomorrow into "
                                                "notes/standup.json as meeting_time."}]
        first = client.chat.completions.create(model="m", messages=messages,
                                               extra_headers={"X-Session-Id": "s1"})
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "[Previous Feedback] incorrect. All time "
                      "fields must use a full datetime with a timezone offset."}]
        client.chat.completions.create(model="m", messages=messages, extra_headers={
            "X-Session-Id": "s1", "X-Session-Done": "true"})
        runtime.proxy.flush()
        url = runtime.double.url
        base = [sys.executable, "-m", "metaclaw"]
        score = ["score", "--db", str(db), "--judge-url", url, "--judge-model", "sim-judge",
                 "--votes", "3"]
        evolve = ["evolve", "--db", str(db), "--skills", str(skills), "--evolver-url", url,
                  "--evolver-model", "sim-evolver"]
        piped = subprocess.run(base + score + ["--rescore"], capture_output=True, text=True,
                               env=_env(), timeout=120)
        assert piped.returncode == 0, piped.stderr
        assert "judging turns" not in piped.stdout + piped.stderr
        assert "\x1b[" not in piped.stdout + piped.stderr
        status, shown = _run_in_terminal(base + score + ["--rescore"], timeout=120)
        assert status == 0, shown[-2000:]
        assert "judging turns" in shown and "2/2" in shown
        status, shown = _run_in_terminal(base + evolve + ["--dry-run"], timeout=120)
        assert status == 0, shown[-2000:]
        assert "evolving" in shown and "proposal ready (dry run)" in shown
        piped = subprocess.run(base + evolve + ["--dry-run"], capture_output=True, text=True,
                               env=_env(), timeout=120)
        assert piped.returncode == 0, piped.stderr
        assert "evolving" not in piped.stdout + piped.stderr and "\x1b[" not in piped.stderr
    finally:
        runtime.stop()


def test_bench_and_training_show_progress_on_a_terminal_and_none_in_a_pipe(tmp_path):
    """`metaclaw bench` draws a bar per round; `metaclaw train` one per step, moving within the
    step while it samples (the tiny local model, a scripted judge)."""
    from metaclaw.offline.double import DoubleServer
    from test_cli import training_workspace

    base = [sys.executable, "-m", "metaclaw"]
    status, shown = _run_in_terminal(base + ["bench", "--days", "day01", "--out",
                                             str(tmp_path / "bench")])
    assert status == 0, shown[-2000:]
    assert "rounds" in shown and "5/5" in shown
    model, db, judge = training_workspace(tmp_path)
    with DoubleServer(judge) as double:
        train = base + ["train", "--db", str(db), "--backend", "local", "--base-model",
                        str(model), "--steps", "1", "--now", "--judge-url", double.url,
                        "--judge-model", "j", "--votes", "1", "--group-size", "2",
                        "--groups-per-step", "2", "--max-tokens", "4"]
        status, shown = _run_in_terminal(train, timeout=180)
        assert status == 0, shown[-2000:]
        assert "sampled group" in shown or "sampling" in shown
        assert "updating the weights" in shown or "done" in shown
        piped = subprocess.run(train, capture_output=True, text=True, env=_env(), timeout=180)
        assert piped.returncode == 0, piped.stderr
        assert "sampling" not in piped.stdout + piped.stderr and "\x1b[" not in piped.stderr


def test_serve_says_when_a_slow_retrieval_model_is_ready(monkeypatch, capsys):
    """A retriever whose model loads for a while after the proxy listens (a transformer): a line
    saying what is loading, then one when it is ready; a quick warm-up says nothing."""
    import threading
    import types

    from metaclaw import cli

    monkeypatch.setattr(cli, "SLOW_WARM_S", 0.05)
    quick = types.SimpleNamespace(retrieval_ready=threading.Event(), retrieval_warm_s=0.01,
                                  retriever=types.SimpleNamespace(model_id="static"))
    quick.retrieval_ready.set()
    cli._say_when_retrieval_is_ready(quick)
    assert capsys.readouterr().out == ""
    slow = types.SimpleNamespace(retrieval_ready=threading.Event(), retrieval_warm_s=None,
                                 retriever=types.SimpleNamespace(model_id="minilm"))

    def finish():
        time.sleep(0.3)
        slow.retrieval_warm_s = 0.3
        slow.retrieval_ready.set()

    threading.Thread(target=finish).start()
    cli._say_when_retrieval_is_ready(slow)
    out = capsys.readouterr().out.splitlines()
    assert out == ["preparing retrieval: loading minilm (turns wait for it) ...",
                   "retrieval ready (0.3 s)"]


def test_the_proxy_marks_its_retriever_ready_after_the_warm_up(tmp_path):
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store

    store = Store(tmp_path / "ws.db")
    with Proxy(ProxyConfig(retrieval="auto"), store,
               SkillLibrary(tmp_path / "skills", store)) as proxy:
        assert proxy.retrieval_ready.wait(30)
        assert proxy.retrieval_warm_s is not None and proxy.retrieval_warm_s >= 0
