"""The widgets as a person meets them after Run All: every control still works whatever later
cells did (stopped the proxy, started another, closed the store), a widget made to show a step
stays on that step unless asked to follow, and what it shows reads plainly. Plain Python: the
synced traitlets are what the front-end sets and reads."""

from __future__ import annotations

import base64
import json
import shutil
import sqlite3
import time

import pytest

from metaclaw.notebook import widgets
from metaclaw.notebook.widgets import (BufferWidget, SchedulerView, SkillDiffWidget, TraceWidget,
                                       TrainingMonitor)
from metaclaw.skills.library import Skill, SkillLibrary, SkillOp
from metaclaw.store import Store
from test_magics import cell, ip, line  # noqa: F401  (ip: the shell fixture)


def _closed(store) -> bool:
    try:
        store.query("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


def _skill(name: str, text: str = "Do it carefully.") -> Skill:
    return Skill(name=name, description=f"{name} rule", category="operations", body=text)


def _session(ip):
    """A workspace as a tutorial leaves it: two turns in session ``s``, generations 0-2."""
    runtime = line(ip, "start --db {ws}/m.db --skills {ws}/skills --starter-skills "
                       "--retrieval lexical")
    first = cell(ip, "chat --session s", "Before editing config.yaml keep a backup copy")
    second = cell(ip, "chat --session s", "Then record the meeting time 9:30 in the report")
    runtime.library.add(_skill("release-freeze-check"), reason="team convention")
    return runtime, first.turn["id"], second.turn["id"]


# -- 1 · widgets outlive the cells after them ---------------------------------------------------
def test_every_control_works_after_stop_and_a_second_start(ip):
    runtime, first, second = _session(ip)
    diff = line(ip, "diff 1 2")
    buffers = line(ip, "buffers")
    trace = line(ip, "trace s")
    scheduler = line(ip, "scheduler")
    line(ip, "stop")
    line(ip, "start --db {ws}/other.db --skills {ws}/other-skills --retrieval lexical")
    assert not _closed(runtime.store)  # kept open: widgets still show this workspace

    diff.old = 0  # the "from" picker
    assert diff.error == "" and diff.diff["old"] == 0 and len(diff.diff["added"]) == 9
    diff.refresh_requests += 1
    assert diff.error == ""
    buffers.selected = first  # a row clicked: its turn opens
    assert buffers.error == "" and buffers.detail["id"] == first
    buffers.state_filter = "purged"  # the new generation made them stale
    assert buffers.error == "" and buffers.matched == 2
    trace.step_request = {"delta": 1, "nonce": 1}  # the ▶ button
    assert trace.error == "" and trace.position == 1 and trace.detail["id"] == second
    scheduler.refresh_requests += 1
    assert scheduler.error == "" and scheduler.signals

    for widget in (diff, buffers, trace):
        widget.close()
    assert not _closed(runtime.store)  # the scheduler view still reads it
    scheduler.close()
    assert _closed(runtime.store)  # the last widget closed: no file handle left behind


def test_the_training_monitor_keeps_polling_after_stop(ip):
    runtime = line(ip, "start --db {ws}/m.db --skills {ws}/skills --retrieval lexical")
    monitor = TrainingMonitor(runtime.store, poll=0.05)
    line(ip, "stop")
    with Store(runtime.store.target) as trainer:  # a training process writing its steps
        trainer.record_training_step(run_id="r", step=0, backend="local", policy_version=1,
                                     skill_generation=0, loss=0.5, reward_mean=0.25, groups=4,
                                     skipped_groups=0, tokens=10, wall_time_s=1.0)
    deadline = time.time() + 10
    while time.time() < deadline and not monitor.steps:
        time.sleep(0.02)
    assert monitor.error == "" and [s["step"] for s in monitor.steps] == [0]
    monitor.stop()  # stops polling, keeps its chart
    assert monitor.widget.comm is not None
    monitor.close()
    assert _closed(runtime.store)


def test_a_closed_store_is_reopened_and_a_deleted_one_is_said_in_one_line(tmp_path):
    store = Store(tmp_path / "m.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(_skill("a"))
    library.add(_skill("b"))
    ids = [store.record_turn(session_id="s", status="ok", response=f"reply {i}",
                             request_messages=[{"role": "user", "content": f"ask {i}"}])
           for i in range(3)]
    diff, buffers, trace = SkillDiffWidget(library, 1, 2), BufferWidget(store), TraceWidget(store)
    store.close()  # a cell closed the workspace under the widgets

    diff.old = 0
    assert diff.error == "" and [s["name"] for s in diff.diff["added"]] == ["a", "b"]
    buffers.selected = ids[1]
    assert buffers.error == "" and buffers.detail["id"] == ids[1]
    trace.step_request = {"delta": 1, "nonce": 1}
    assert trace.error == "" and trace.detail["id"] == ids[1]

    for widget in (diff, buffers, trace):  # their own connections closed, as a cell would
        widget._reader.own.close()
    for path in tmp_path.glob("m.db*"):
        path.unlink()  # the workspace folder was removed
    gone = f"the workspace {tmp_path / 'm.db'} was deleted"
    diff.new = 1
    assert diff.error.startswith(f"cannot compare generations 0 and 1: {gone}")
    buffers.selected = ids[2]
    assert buffers.error.startswith(gone) and buffers.detail == {}
    trace.step_request = {"delta": 1, "nonce": 2}
    assert trace.error.startswith(gone)
    assert (trace.position, trace.detail["id"]) == (1, ids[1])  # the counter did not move alone
    for widget in (diff, buffers, trace):
        assert "\n" not in widget.error and "Traceback" not in widget.error
        widget.close()


def test_a_workspace_deleted_while_still_open_is_said_too(tmp_path):
    """`%metaclaw stop` keeps the store open while widgets show it: deleting the workspace then
    left every widget showing the deleted data as current, with no word of it."""
    store = Store(tmp_path / "m.db")
    store.record_turn(session_id="s", status="ok", response="reply",
                      request_messages=[{"role": "user", "content": "ask"}])
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(_skill("a"))
    widgets = [BufferWidget(store), TraceWidget(store), SkillDiffWidget(library, 0, 1)]
    for path in tmp_path.glob("m.db*"):
        path.unlink()
    gone = f"the workspace {tmp_path / 'm.db'} was deleted"
    for widget in widgets:
        widget.refresh()
        assert gone in widget.error, widget.error
        widget.close()
    store.close()


def test_a_workspace_named_by_a_relative_path_is_found_after_the_notebook_moves(
        tmp_path, monkeypatch):
    """`%metaclaw start` names .metaclaw/metaclaw.db relative to the notebook's folder: after a
    `%cd` every widget said the workspace was deleted."""
    monkeypatch.chdir(tmp_path)
    store = Store("m.db")
    store.record_turn(session_id="s", status="ok", response="reply",
                      request_messages=[{"role": "user", "content": "ask"}])
    trace = TraceWidget(store)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    trace.refresh()
    assert trace.error == "" and trace.total == 1
    trace.close()
    store.close()


# -- 2 · a widget shows what the text beside it says -------------------------------------------
def test_a_diff_made_for_one_step_stays_on_it_until_asked_to_follow(ip):
    runtime, _, _ = _session(ip)
    diff = line(ip, "diff 1 2")  # "the 1 -> 2 change"
    runtime.library.rollback(1)  # a later cell
    assert (diff.old, diff.new) == (1, 2) and diff.follow is False
    assert [s["name"] for s in diff.diff["added"]] == ["release-freeze-check"]
    assert diff.latest == 3 and [g["generation"] for g in diff.generations][-1] == 3
    assert "pinned to generation 1 → 2" in diff._repr_html_()
    assert "now generation 3" in diff._repr_html_()
    diff.follow = True  # the front-end's "follow" checkbox
    assert diff.new == 3
    followed = line(ip, "diff --follow")
    runtime.library.add(_skill("ask-first"))
    assert followed.follow and followed.new == 4 and "following" in followed._repr_html_()


def test_a_proposals_view_stays_as_shown_and_an_outdated_action_says_why(tmp_path):
    from metaclaw.fastloop import proposals
    from metaclaw.fastloop.gate import GateReport

    store = Store(tmp_path / "m.db")
    library = SkillLibrary(tmp_path / "skills", store)
    skill = _skill("miles-to-km", "Multiply by 1.609.")
    pid = proposals.record(store, [SkillOp("add", skill, skill.name, "why", [])], origin="auto",
                           status="held", base_generation=library.generation, support_ids=[],
                           report=GateReport("hold", "fixes none", library.generation))
    review = SkillDiffWidget(library)
    proposals.promote(store, library, pid, by="notebook-user")  # the next cell
    assert [p["status"] for p in review.proposals] == ["held"]  # as the text beside it says
    review.proposal_action = {"action": "promote", "id": pid, "nonce": 1}  # clicked afterwards
    assert review.error.startswith(f"proposal #{pid} is already promoted (by notebook-user)")
    assert [p["status"] for p in review.proposals] == ["promoted"]  # now where it stands
    review.close()
    store.close()


# -- 4 · outputs a person can read -------------------------------------------------------------
def test_generation_labels_tell_generations_apart(tmp_path):
    with Store(tmp_path / "m.db") as store:
        library = SkillLibrary(tmp_path / "skills", store)
        for name in ("iso-timestamps", "file-naming", "backup-first"):
            library.add(_skill(name), reason="evolver: 1 ops from 4 support turns")
        library.edit(_skill("file-naming", "Use YYYYMMDD_snake_case."), reason="evolver: 1 ops "
                     "from 4 support turns")
        widget = SkillDiffWidget(library)
        labels = [g["label"] for g in widget.generations]
        assert len(set(labels)) == len(labels)
        assert labels[1] == "1 · add · +iso-timestamps · 1 skill"
        assert labels[4] == "4 · edit · ~file-naming · 3 skills"
        assert widgets.generation_label({"generation": 7, "kind": "evolve", "skills": 9,
                                         "changes": ["+a", "+b", "~c", "−d"]}
                                        ) == "7 · evolve · +a, +b, ~c +1 more · 9 skills"
        widget.close()


def test_a_long_diff_is_a_summary_with_cards_opened_on_demand(tmp_path):
    with Store(tmp_path / "m.db") as store:
        library = SkillLibrary(tmp_path / "skills", store)
        for i in range(5):
            library.add(_skill(f"skill-{i}"))
        long = SkillDiffWidget(library, 0, 5)
        short = SkillDiffWidget(library, 4, 5)
        assert "<details open" not in long._repr_html_()
        assert "5 skills changed; open a card" in long._repr_html_()
        assert "<details open" in short._repr_html_()
        assert widgets.diff_html(long.diff).count("<details") == 5
        long.close()
        short.close()


def test_signal_availability_in_plain_words():
    raw = ("unavailable: pynput: RuntimeError: no X display (DISPLAY is not set); xscreensaver: "
           "RuntimeError: no X display (DISPLAY is not set); xprintidle: RuntimeError: "
           "xprintidle is not on PATH")
    assert widgets.plain_unavailable(raw) == "not available on this machine (no display)"
    assert widgets.plain_unavailable("unavailable: not attached to a notebook kernel (call attach("
                             "get_ipython()))") == ("not available: not attached to this "
                                                    "notebook's kernel")
    assert widgets.plain_unavailable("unavailable: xprintidle: RuntimeError: xprintidle is not on "
                             "PATH") == "not available: xprintidle is not on PATH"
    view = SchedulerView(lambda: {"state": "waiting", "signals": [
        {"name": "keyboard", "available": False, "idle": False, "detail": raw}]})
    [row] = view.signals
    assert row["detail"] == "not available on this machine (no display)" and row["raw"] == raw
    page = view._repr_html_()
    assert "<td>not available</td>" in page and "RuntimeError" not in page.split("title=")[0]


def test_chat_tool_calls_are_folded_with_indented_json(ip, tmp_path):
    line(ip, "start --sim --votes 1 --retrieval lexical --db {ws}/m.db --skills {ws}/skills")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "notes.txt").write_text("stand-up at 9:30 with Ana and Bo\n")
    turn = cell(ip, f"chat --workspace {tmp_path / 'files'}",
                "Please read notes.txt and save a summary as summary.json")
    page = turn._repr_html_()
    assert turn.tool_calls and page.count("<details") == len(turn.tool_calls) + 1
    n = len(turn.tool_calls)
    assert f"{n} tool call{'' if n == 1 else 's'}: " in page
    arguments = json.loads(turn.tool_calls[0]["function"]["arguments"])
    key = next(iter(arguments))
    assert f'{{\n  &quot;{key}&quot;: ' in page  # indented JSON, not one escaped line


def test_load_ext_draws_altair_charts_offline_as_png(ip):
    alt = pytest.importorskip("altair")
    pytest.importorskip("vl_convert")
    alt.renderers.enable("default")
    ip.run_line_magic("reload_ext", "metaclaw")
    try:
        assert alt.renderers.active == "metaclaw"
        chart = alt.Chart(alt.Data(values=[{"x": "a", "y": 1}, {"x": "b", "y": 2}])).mark_bar(
        ).encode(x="x:N", y="y:Q").properties(title="offline", width=120, height=80)
        data, metadata = chart._repr_mimebundle_()
        assert set(data) == {"image/png", "text/plain"}
        assert data["text/plain"] == "<chart: offline>"
        assert metadata["image/png"]["width"] >= 120  # shown at the chart's size, drawn at 2x
        # a picture drawn here: no script, nothing to fetch from a CDN
        assert base64.b64decode(data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
        alt.renderers.enable("svg")  # a notebook's own choice is kept
        ip.run_line_magic("reload_ext", "metaclaw")
        assert alt.renderers.active == "svg"
    finally:
        alt.renderers.enable("default")


# -- the same, as the front-end draws it (node, a minimal DOM) -----------------------------------
NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_front_end_shows_pin_collapsed_cards_and_sends_follow(tmp_path):
    from test_widgets import _render

    with Store(tmp_path / "m.db") as store:
        library = SkillLibrary(tmp_path / "skills", store)
        for i in range(5):
            library.add(_skill(f"skill-{i}"))
        widget = SkillDiffWidget(library, 0, 4)
        library.add(_skill("later"))
        out = _render(tmp_path, widget, "skill_diff.js", [
            {"attr": "aria-label", "value": "follow new generations", "event": "change",
             "checked": True}])
        assert "4 skills changed; open a card to read its text and evidence" in out["text"]
        assert "pinned to generation 0 → 4; the library has changed since (now generation 6)" \
            in out["text"]
        assert "4 · add · +skill-3 · 4 skills" in out["text"]  # the picker's labels
        assert ["follow", True] in out["sets"] and ["save"] in out["sets"]
        widget.follow = True  # what the comm delivers
        assert widget.new == 6 and "following the library" in _render(
            tmp_path, widget, "skill_diff.js")["text"]
        widget.close()


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_front_end_badge_names_who_scored_a_turn(tmp_path):
    from test_widgets import _render

    with Store(tmp_path / "m.db") as store:
        turn = store.record_turn(session_id="run", status="ok", response="Hypothesis: x",
                                 request_messages=[{"role": "user", "content": "plan it"}])
        store.update_turn(turn, reward=-1.0, judge_model="stage-check",
                          judge_rationale="missing line Metric:")
        trace = TraceWidget(store, "run")
        text = _render(tmp_path, trace, "trace.js")["text"]
        assert "stage-check fail" in text and "judge fail" not in text
        assert "not judged" not in text
        assert "no judge votes: the reward was recorded by stage-check — missing line Metric:" \
            in text
        assert "stage-check -1" in trace._repr_html_() and "judge -1" not in trace._repr_html_()
        trace.close()


def test_the_saved_training_chart_is_the_run_as_it_ended(ip, tmp_path, monkeypatch):
    """The monitor's output is updated as steps arrive, so a notebook saved after the run shows
    the whole run, not the empty chart it started as."""
    published = []
    monkeypatch.setattr(ip.display_pub, "publish",
                        lambda data, metadata=None, transient=None, update=False, **kw:
                        published.append((data, transient, update)))
    with Store(tmp_path / "m.db") as store:
        monitor = TrainingMonitor(store, poll=None)
        monitor.DISPLAY_EVERY_S = 0.0
        monitor._ipython_display_()
        [(first, transient, update)] = published
        assert not update and "image/png" not in first and transient["display_id"]
        for step in range(3):
            store.record_training_step(run_id="r", step=step, backend="local",
                                       policy_version=step, skill_generation=0, loss=-0.5,
                                       reward_mean=step / 3, groups=4, skipped_groups=0,
                                       tokens=10, wall_time_s=1.0)
        monitor.update()
        data, transient2, update = published[-1]
        assert update and transient2 == transient and data["image/png"]
        assert "step 2" in data["text/plain"]
        monitor.close()


def test_wide_tables_scroll_in_their_own_frame():
    import polars as pl

    from metaclaw.notebook.tables import scrolled

    frame = pl.DataFrame({"reply": ["x" * 500], "grader_says": ["y" * 300]})
    page = scrolled(frame, max_height=300)._repr_html_()
    assert page.startswith("<div class='metaclaw-scrolled' style='max-width:100%;overflow:auto;"
                           "max-height:300px'>") and "<table" in page
    assert repr(scrolled(frame)) == repr(frame)
    with pytest.raises(TypeError, match="a table with an HTML form"):
        scrolled(42)
