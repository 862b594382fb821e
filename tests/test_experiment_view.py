"""The experiment and per-skill evidence views (metaclaw.notebook.experiment_view): their synced
state in plain Python, picking a variant, selecting a case and opening it in the trace view,
the static HTML, the front-end under node, and reading on after the store was closed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import traitlets

from metaclaw.fastloop import experiments as ex
from metaclaw.notebook.experiment_view import (
    EvidenceView, ExperimentView, evidence_view, show_experiment)
from metaclaw.notebook.widgets import WIDGETS_DIR, TraceWidget, release_store
from metaclaw.fastloop.replay import Replay
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.store import Store

NODE = shutil.which("node")
WRITE = {"id": "call_1", "type": "function", "function": {
    "name": "write_file",
    "arguments": json.dumps({"path": "report.json", "content": "2026-03-16T09:30:00+08:00"})}}
TASKS = ("Write the report with ISO dates", "Rename the invoices", "Back up the config first",
         "Summarise the meeting notes")


def _result(run: ex.Experiment, turn_id: int, variant: str, score: float | None,
            reply: str, skills=(), error=None, tool_calls=None) -> None:
    """Store one result as a run does (threshold 0: above it passes)."""
    replay = Replay(score, reply, tool_calls, error=error, votes=1,
                    vote_scores=[score] if score is not None else [],
                    upstream_failed=score is None, latency_ms=12.0, prompt_tokens=30,
                    completion_tokens=5, skills=list(skills))
    verdict = None if score is None else ("pass" if score > 0 else "fail")
    run._insert(turn_id, variant, replay, verdict, None)


@pytest.fixture()
def workspace(tmp_path):
    """Four task turns in two sessions, a library with one skill (generation 1), and an
    experiment gen:0 / gen:1 / none whose results were stored: gen:1 fixes two cases, loses
    none; ``none`` has one case not run yet and one upstream failure."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    ids = []
    for i, task in enumerate(TASKS):
        ids.append(store.record_turn(
            session_id=f"s{i % 2}", status="ok", response=f"reply {i}", reward=-1.0,
            request_messages=[{"role": "user", "content": task}], skill_generation=0))
    library.add(Skill(name="iso-dates", description="Write dates as ISO 8601",
                      body="Use 2026-03-16T09:30:00+08:00.\n"), reason="dates failed",
                evidence=ids[:1])
    ex.dataset(store, "held-back", turn_ids=ids)
    run = ex.Experiment.create(store, "old-vs-new", "held-back", ["gen:0", "gen:1", "none"])
    for turn_id, old, new in zip(ids, (-1, -1, 1, 0), (1, 1, 1, 0)):
        _result(run, turn_id, "gen:0", old, f"old reply {turn_id}")
        _result(run, turn_id, "gen:1", new, f"new reply {turn_id}", skills=["iso-dates"],
                tool_calls=[WRITE])
    _result(run, ids[0], "none", -1, "no skill reply")
    _result(run, ids[1], "none", None, "", error="upstream failed: connection refused")
    _result(run, ids[2], "none", 1, "no skill reply")
    yield store, library, ids
    store.close()


def test_state_after_construction(workspace):
    store, _, ids = workspace
    view = ExperimentView(store)  # the most recent experiment
    assert view.name == "old-vs-new" and view.experiments == ["old-vs-new"]
    assert view.dataset == "held-back" and view.variants == ["gen:0", "gen:1", "none"]
    assert view.variant == "gen:1"  # the second variant is compared with the first
    assert view.total == 4 and [r["turn_id"] for r in view.rows] == ids
    assert view.plan == "10 of 12 replays done, 2 still to run"  # a failed replay runs again
    summary = {s["variant"]: s for s in view.summary}
    assert summary["gen:0"]["mean_reward"] == pytest.approx(-0.25)
    new = summary["gen:1"]
    assert new["mean_reward"] == pytest.approx(0.75) and new["pass_rate"] == 0.75
    assert new["paired"] == 4 and new["diff_vs_first"] == pytest.approx(1.0)
    assert new["diff_low"] <= 1.0 <= new["diff_high"]
    assert new["mcnemar_p"] == pytest.approx(0.5)  # two fixed, none lost: exact p = 2 / 2^2
    assert summary == {s["variant"]: s for s in json.loads(json.dumps(view.summary))}
    first = view.rows[0]
    assert first["task"] == TASKS[0] and first["session_id"] == "s0"
    assert first["by"]["gen:0"] == {"score": -1.0, "verdict": "fail", "error": None,
                                    "upstream_failed": False}
    assert first["by"]["gen:1"]["verdict"] == "pass" and first["difference"] == 2.0
    assert "none" not in view.rows[3]["by"]  # not run yet: shown, without a result
    assert view.error == "" and view.taken_at > 0 and view.selected is None
    assert view.frame.height == 11
    assert show_experiment("old-vs-new", store=store, variant="none").variant == "none"
    with pytest.raises(ex.ExperimentError, match="no experiment 'nope' .there are: old-vs-new"):
        ExperimentView(store, "nope")


def test_no_experiment_yet_is_one_sentence(tmp_path):
    with Store(tmp_path / "empty.db") as store:
        with pytest.raises(ex.ExperimentError, match="no experiment in .* yet"):
            show_experiment(store=store)


def test_picking_a_variant_sorting_and_paging(workspace):
    store, _, ids = workspace
    view = ExperimentView(store, "old-vs-new", page_size=2)
    assert [r["turn_id"] for r in view.rows] == ids[:2]
    view.offset = 2
    assert [r["turn_id"] for r in view.rows] == ids[2:]
    view.variant = "none"  # what the front-end's picker sends
    assert view.offset == 0  # a new comparison starts at the first page
    assert [r["difference"] for r in view.case_rows()] == [0.0, None, 0.0, None]
    view.sort = "difference"
    view.pick("gen:1")
    assert [r["turn_id"] for r in view.case_rows()] == [ids[0], ids[1], ids[2], ids[3]]
    assert [r["difference"] for r in view.case_rows()] == [2.0, 2.0, 0.0, 0.0]
    with pytest.raises(traitlets.TraitError, match="variant 'gen:0' is the baseline .*"
                                                   "choose one of gen:1, none"):
        view.variant = "gen:0"  # the baseline is not compared with itself
    with pytest.raises(ValueError, match="variant 'gen:9' is not compared in experiment"):
        view.pick("gen:9")
    with pytest.raises(ValueError, match="variant 'gen:0' is the baseline the others are "
                                         "compared with; choose one of gen:1, none"):
        view.pick("gen:0")
    assert view.variant == "gen:1"


def test_selecting_a_case_and_opening_it_in_the_trace(workspace):
    store, _, ids = workspace
    view = ExperimentView(store)
    detail = view.select(ids[1])
    assert detail["turn_id"] == ids[1] and detail["task"] == TASKS[1]
    assert detail["recorded_reward"] == -1.0 and detail["recorded_response"] == "reply 1"
    by = {v["variant"]: v for v in detail["variants"]}
    assert by["gen:1"]["reply"] == f"new reply {ids[1]}" and by["gen:1"]["skills"] == ["iso-dates"]
    assert by["gen:1"]["votes"] == [1] and by["gen:0"]["verdict"] == "fail"
    assert by["gen:1"]["tool_calls"] == [WRITE] and by["gen:0"]["tool_calls"] is None
    assert by["none"]["upstream_failed"] and "connection refused" in by["none"]["error"]
    view.selected = 999  # what a stale front-end could send: said, the selection kept
    assert view.selected == ids[1] and "turn #999 is not a case" in view.error
    view.selected = ids[3]
    assert view.error == "" and {v["variant"]: v["run"] for v in view.detail["variants"]} == \
        {"gen:0": True, "gen:1": True, "none": False}

    trace = view.open_trace()
    assert isinstance(trace, TraceWidget) and view.trace is trace
    assert trace.session_id == "s1" and trace.selected == ids[3]
    view.selected = ids[1]  # same session: the trace view steps to the turn
    view.trace_requests += 1  # the front-end's "open in trace view" button
    assert view.trace is trace and trace.selected == ids[1]
    view.selected = ids[0]
    view.trace_requests += 1  # another session: a new trace view, the old one closed
    assert view.trace is not trace and view.trace.session_id == "s0"
    assert view.trace.selected == ids[0] and trace._released
    # the trace view travels with the widget's state as a reference to its own model
    assert view.get_state()["trace"] == f"IPY_MODEL_{view.trace.model_id}"
    view.close()
    assert view.trace._released


def test_static_html(workspace):
    store, _, ids = workspace
    view = ExperimentView(store)
    view.select(ids[0])
    page = view._repr_html_()
    assert "Experiment old-vs-new" in page and "difference vs gen:0" in page
    assert "+1.00" in page and "0.5" in page  # the difference and McNemar's p
    assert TASKS[0] in page and f"new reply {ids[0]}" in page and "not run" in page
    assert "write_file({&quot;path&quot;: &quot;report.json&quot;" in page
    assert "pinned: results as of" in page
    bundle, _ = view._repr_mimebundle_()
    assert bundle["text/html"] == page and "ExperimentView('old-vs-new'" in bundle["text/plain"]


def test_refresh_and_follow_read_new_results(workspace):
    store, _, ids = workspace
    view = ExperimentView(store, poll=0.05)
    run = ex.Experiment.open(store, "old-vs-new")
    _result(run, ids[3], "none", 1, "late reply")
    assert "none" not in view.rows[3]["by"]  # pinned
    view.refresh_requests += 1
    assert view.rows[3]["by"]["none"]["score"] == 1.0 and view.plan.endswith("1 still to run")
    view.follow = True
    _result(run, ids[1], "none", -1, "retried")
    import time

    deadline = time.time() + 10
    while view.rows[1]["by"]["none"]["score"] != -1.0 and time.time() < deadline:
        time.sleep(0.05)
    assert view.rows[1]["by"]["none"]["score"] == -1.0 and view.plan == "12 of 12 replays done"
    view.close()
    assert not view.follow


def test_works_after_the_store_is_closed_or_stopped(workspace, tmp_path):
    store, library, ids = workspace
    view = ExperimentView(store)
    stopped = ExperimentView(store)
    # %metaclaw stop hands the store to the widgets still showing it: it stays open for them
    assert release_store(store) is False
    stopped.select(ids[0])
    assert stopped.detail["turn_id"] == ids[0] and stopped.error == ""
    # store.close(): the view reopens the workspace file
    store.close()
    view.variant = "none"
    view.select(ids[2])
    assert view.error == "" and view.detail["task"] == TASKS[2]
    view.refresh()
    assert view.error == "" and view.total == 4
    assert view.open_trace().selected == ids[2]
    view.close()
    stopped.close()
    # an in-memory workspace cannot be reopened: one line, what is shown is kept
    memory = Store(":memory:")
    memory.record_turn(session_id="m", status="ok", response="x", reward=-1.0,
                       request_messages=[{"role": "user", "content": "task"}])
    ex.dataset(memory, "d", failures=True)
    ex.Experiment.create(memory, "m", "d", ["none", "current"])
    gone = ExperimentView(memory)
    memory.close()
    gone.refresh()
    assert "in-memory store and it was closed" in gone.error and gone.total == 1
    gone.close()


def test_evidence_view(workspace):
    store, library, ids = workspace
    # turns that had the skill and turns whose ask it matches that did not
    for score in (1.0, 1.0, -1.0):
        store.record_turn(session_id="later", status="ok", response="ok", reward=score,
                          request_messages=[{"role": "user", "content": "Write ISO dates"}],
                          injected_skills=["iso-dates"], retrieval_query="Write ISO dates",
                          skill_generation=1)
    view = evidence_view(store, library)  # the proxy's default retriever
    assert isinstance(view, EvidenceView) and view.generation == 1
    [row] = view.rows
    assert row["skill"] == "iso-dates" and row["injected"] == 3 and row["judged_with"] == 3
    assert row["reward_with"] == pytest.approx(1 / 3) and row["suggestion"] == ""
    assert isinstance(row["last_used"], float)  # seconds, for the front-end
    assert view.suggestions == [] and view.stats.height == 1
    page = view._repr_html_()
    assert "Per-skill evidence" in page and "observational" in page and "iso-dates" in page
    assert view.propose() == [] and "no new proposal" in view.message
    # a near duplicate: a suggestion to merge, filed only as a held proposal
    library.add(Skill(name="iso-dates-2", description="Write dates as ISO 8601",
                      body="Use 2026-03-16T09:30:00+08:00.\n"))
    view.refresh_requests += 1
    assert {s["suggestion"] for s in view.suggestions} == {"merge"}
    assert all(s["reason"].startswith("merge ") for s in view.suggestions)
    view.propose_requests += 1
    assert view.message.startswith("filed proposal") and library.generation == 2
    from metaclaw.fastloop import proposals

    assert {p.status for p in proposals.held(store)} == {proposals.HELD}
    store.close()  # reopened by the view
    assert view.refresh().error == ""
    view.close()


# -- the front-end -------------------------------------------------------------------------
def test_front_end_files_ship_with_the_package():
    source = (WIDGETS_DIR / "experiment.js").read_text()
    assert "export default { render }" in source and "model.save_changes()" in source
    for forbidden in ("http://", "https://", "import "):
        assert forbidden not in source
    css = (WIDGETS_DIR / "experiment.css").read_text()
    assert ".metaclaw-experiment" in css and ".metaclaw-evidence" in css
    assert ExperimentView._css == (WIDGETS_DIR / "metaclaw.css").read_text() + "\n" + css


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_front_end_renders_and_sends_choices(workspace, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_widgets import _render

    store, library, ids = workspace
    view = ExperimentView(store)
    view.select(ids[0])
    out = _render(tmp_path, view, "experiment.js", [
        {"attr": "aria-label", "value": "variant", "event": "change", "set": "none"},
        {"attr": "aria-label", "value": "sort", "event": "change", "set": "difference"},
        {"text": "open in trace view", "event": "click"},
        {"text": "next ▶", "event": "click"},
        {"text": "refresh", "event": "click"}])
    text = out["text"]
    assert "old-vs-new" in text and "difference vs gen:0" in text and "(baseline)" in text
    assert TASKS[0] in text and f"new reply {ids[0]}" in text and "not run" in text
    assert "McNemar p" in text and "0.500" in text
    assert "tool call write_file" in text and '"path": "report.json"' in text
    assert ["variant", "none"] in out["sets"] and ["sort", "difference"] in out["sets"]
    assert ["trace_requests", 1] in out["sets"] and ["refresh_requests", 1] in out["sets"]
    assert ["save"] in out["sets"]
    for key, value in (s for s in out["sets"] if len(s) == 2 and s[0] != "offset"):
        setattr(view, key, value)  # what the comm would deliver
    assert view.variant == "none" and view.trace is not None and view.trace.selected == ids[0]
    view.close()

    evidence = EvidenceView(store, library, compare=False)
    out = _render(tmp_path, evidence, "experiment.js", [{"text": "refresh", "event": "click"}])
    assert "Per-skill evidence" in out["text"] and "iso-dates" in out["text"]
    assert ["refresh_requests", 1] in out["sets"]
    evidence.close()


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_front_end_module_parses():
    result = subprocess.run([NODE, "--check", str(WIDGETS_DIR / "experiment.js")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
