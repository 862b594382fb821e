"""The notebook layer used the way people misuse it: magics run twice, a dead upstream, a second
process writing to the workspace while a widget is shown, megabyte tool results, diverged
training runs, a notebook started from another folder."""

import json
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from metaclaw.notebook.widgets import (MAX_CHART_STEPS, MAX_TEXT_CHARS, BufferWidget,
                                       SkillDiffWidget, TraceWidget, TrainingMonitor)
from metaclaw.store import Store
from test_magics import cell, fails, ip, line  # noqa: F401  (ip: the shell fixture)

REPO = Path(__file__).resolve().parent.parent


def _closed(store) -> bool:
    try:
        store.query("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


def test_start_twice_and_reload_ext_release_the_old_store(ip):
    first = line(ip, "start --db {ws}/m.db --skills {ws}/skills --retrieval lexical")
    second = line(ip, "start --db {ws}/m.db --skills {ws}/skills --retrieval lexical")
    assert second is not first and _closed(first.store)  # its file handles are not leaked
    assert not _closed(second.store)
    ip.run_line_magic("reload_ext", "metaclaw")
    assert _closed(second.store)


def test_a_chat_cell_against_a_dead_upstream_records_one_turn(ip):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    runtime = line(ip, f"start --upstream http://127.0.0.1:{dead}/v1 --model m --db {{ws}}/m.db "
                       "--skills {ws}/skills --retrieval lexical")
    said = fails(ip, "chat", "hello")  # one line: IPython shows a UsageError without traceback
    assert "cannot reach the upstream" in said and "\n" not in said
    runtime.proxy.flush()
    assert [t["status"] for t in runtime.store.turns()] == ["error"]  # not one per client retry


@pytest.mark.parametrize("option", ["--max-tokens 0", "--max-tokens -5", "--max-steps 0"])
def test_chat_limits_below_one_are_usage_errors(ip, option):
    runtime = line(ip, "start --db {ws}/m.db --skills {ws}/skills --retrieval lexical")
    assert "give a whole number, 1 or more" in fails(ip, f"chat {option}", "hello")
    runtime.proxy.flush()
    assert runtime.store.turns() == []


def test_the_scheduler_view_keeps_one_scheduler_and_stop_releases_it(ip):
    before = len(ip.events.callbacks["pre_run_cell"])
    line(ip, "start --db {ws}/m.db --skills {ws}/skills --retrieval lexical")
    views = [line(ip, "scheduler") for _ in range(3)]
    assert all(v.state == views[0].state for v in views)
    assert len(ip.events.callbacks["pre_run_cell"]) == before + 1  # not one per call
    line(ip, "stop")
    assert len(ip.events.callbacks["pre_run_cell"]) == before


def _record(store, session, text, **fields):
    return store.record_turn(session_id=session, status="ok", response="ok",
                             request_messages=[{"role": "user", "content": text}], **fields)


def test_trace_widget_refresh_shows_turns_another_process_recorded(tmp_path):
    kernel, other = Store(tmp_path / "m.db"), Store(tmp_path / "m.db")
    first = _record(kernel, "live", "one")
    trace = TraceWidget(kernel, "live")
    later = _record(other, "live", "two, recorded elsewhere")
    trace.step(1)
    assert trace.selected == first  # the widget's index is a snapshot...
    trace.refresh_requests += 1  # ...until its refresh button is pressed
    assert trace.total == 2 and trace.step(1)["id"] == later
    kernel.close()
    _record(other, "live", "three")
    trace.refresh_requests += 1  # a closed store: the widget reopens the workspace file
    assert trace.error == "" and trace.total == 3
    other.close()
    trace.close()


def test_skill_diff_refresh_shows_a_proposal_decided_elsewhere(tmp_path):
    from metaclaw.fastloop import proposals
    from metaclaw.fastloop.gate import GateReport
    from metaclaw.skills.library import Skill, SkillLibrary, SkillOp

    store = Store(tmp_path / "m.db")
    library = SkillLibrary(tmp_path / "skills", store)
    skill = Skill("miles-to-km", "Convert miles.", "math", "Multiply by 1.609.")
    pid = proposals.record(store, [SkillOp("add", skill, skill.name, "why", [])], origin="auto",
                           status="held", base_generation=library.generation, support_ids=[],
                           report=GateReport("hold", "fixes none", library.generation))
    widget = SkillDiffWidget(library)
    assert [p["status"] for p in widget.proposals] == ["held"]
    with Store(tmp_path / "m.db") as other:
        proposals.discard(other, pid, by="bob", reason="not needed")
    widget.refresh_requests += 1
    assert [(p["status"], p["decided_by"]) for p in widget.proposals] == [("discarded", "bob")]
    store.close()


def test_a_megabyte_tool_result_is_clipped_in_what_the_browser_gets(tmp_path):
    store = Store(tmp_path / "m.db")
    log = "A" * 2_000_000
    turn = store.record_turn(session_id="s", status="ok", response="done", request_messages=[
        {"role": "user", "content": "read the log"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read_file", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": log}])
    trace = TraceWidget(store, "s")
    buffers = BufferWidget(store)
    buffers.select(turn)
    for widget in (trace, buffers):
        state = json.dumps(widget.get_state(), default=str)
        assert len(state) < 10 * MAX_TEXT_CHARS and "more characters not shown" in state
        assert len(widget._repr_html_()) < 10 * MAX_TEXT_CHARS  # kept in the saved notebook
    tool = [m for m in trace.trace.turn(turn)["messages"] if m["role"] == "tool"][0]
    assert tool["text"] == log  # the Python side still has all of it
    store.close()


def test_training_monitor_with_an_infinite_loss_and_a_long_run(tmp_path):
    store = Store(tmp_path / "m.db")
    steps = 3 * MAX_CHART_STEPS
    with store.transaction():
        for i in range(steps):
            store.record_training_step(
                run_id="r", step=i, backend="local", policy_version=i, skill_generation=0,
                loss=float("inf") if i == 3 else 1.0 / (i + 1), reward_mean=0.1, groups=4,
                skipped_groups=0, tokens=100, wall_time_s=0.0 if i == 4 else 1.0)
    monitor = TrainingMonitor(store, poll=None)
    assert monitor.frame.height == steps  # every step stays available as data
    spec = monitor.chart().to_dict()
    values = spec["data"]["values"]
    drawn = sorted({v["step"] for v in values})
    assert len(drawn) <= MAX_CHART_STEPS + 1 and drawn[-1] == steps - 1  # the last step too
    assert "1 step in 3 drawn" in json.dumps(spec["title"])
    # valid JSON for the comm (no Infinity token), the infinite loss left out as a gap
    json.dumps(monitor.widget.get_state(), default=str, allow_nan=False)
    assert all(v["value"] != float("inf") for v in values)
    assert monitor.frame.filter(monitor.frame["step"] == 4)["tokens_per_s"].to_list() == [None]
    store.close()


def test_an_infinite_reward_does_not_make_the_widget_state_invalid_json(tmp_path):
    store = Store(tmp_path / "m.db")
    turn = _record(store, "s", "score me", reward=float("inf"))
    buffers = BufferWidget(store)
    buffers.select(turn)
    json.dumps(buffers.get_state(), default=str, allow_nan=False)
    json.dumps(TraceWidget(store, "s").get_state(), default=str, allow_nan=False)
    store.close()


def test_notebook_03_finds_its_results_file_from_any_working_directory(tmp_path):
    notebook = nbformat.read(REPO / "notebooks" / "03_slow_loop.ipynb", as_version=4)
    [source] = [c.source for c in notebook.cells
                if c.cell_type == "code" and "grpo_smollm2.json" in c.source]
    script = "import pathlib\n" + source
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "GRPO steps" in result.stdout
