"""Notebook widgets: synced state in plain Python, static HTML fallbacks, and the front-end
modules (syntax-checked and rendered under node against a minimal DOM)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pytest
import traitlets

from metaclaw.notebook.widgets import (WIDGETS_DIR, BufferWidget, SchedulerView, SkillDiffWidget,
                                       TraceWidget, TrainingMonitor, state_segments)
from metaclaw.skills.library import Skill, SkillLibrary

REPO = Path(__file__).resolve().parent.parent
JS_FILES = ("skill_diff.js", "buffers.js", "scheduler.js", "trace.js")
NODE = shutil.which("node")


@pytest.fixture()
def library(tmp_path, store, add_buffer_turn):
    """Generations: 0 empty, 1 adds parse-dates (evidence t1), 2 edits it (evidence t2),
    3 adds cite-sources, 4 removes cite-sources."""
    lib = SkillLibrary(tmp_path / "skills", store)
    t1 = add_buffer_turn("s1", "Parse the date 03/04/2025 for the invoice", reward=-1.0,
               set_="support", state="consumed")
    lib.add(Skill(name="parse-dates", description="Parse dates without guessing",
                  body="Use ISO 8601.\nCheck time zones.\n"), reason="dates failed",
            evidence=[t1])
    t2 = add_buffer_turn("s2", "Convert 5pm PST to Berlin time", reward=-1.0, set_="support",
               state="consumed", generation=1)
    lib.edit(Skill(name="parse-dates", description="Parse dates without guessing",
                   body="Use ISO 8601.\nAlways convert to UTC before comparing.\n"),
             reason="time zone slip", evidence=[t2])
    lib.add(Skill(name="cite-sources", description="Cite every source", body="Link it.\n"),
            reason="missing citations", evidence=[])
    lib.remove("cite-sources", reason="too noisy")
    lib.test_turns = (t1, t2)  # type: ignore[attr-defined]
    return lib


# -- front-end files ---------------------------------------------------------------------------
def test_front_end_files_ship_with_the_package():
    assert (REPO / "metaclaw" / "_widgets").is_symlink()
    assert WIDGETS_DIR.resolve() == (REPO / "widgets").resolve()
    assert (WIDGETS_DIR / "metaclaw.css").read_text().count(".metaclaw-w") > 5
    for name in JS_FILES:
        source = (WIDGETS_DIR / name).read_text()
        assert "export default { render }" in source
        assert "function render({ model, el })" in source
        assert "model.save_changes()" in source
        for forbidden in ("http://", "https://", "import "):
            assert forbidden not in source, f"{name} must not load anything ({forbidden!r})"
    common = (WIDGETS_DIR / "common.js").read_text()
    assert str(SkillDiffWidget._esm) == common + "\n" + (WIDGETS_DIR / "skill_diff.js").read_text()
    assert str(BufferWidget._esm) == common + "\n" + (WIDGETS_DIR / "buffers.js").read_text()
    assert str(SchedulerView._css) == (WIDGETS_DIR / "metaclaw.css").read_text()


def test_the_dom_helper_is_defined_once_and_given_to_every_module():
    """``h()`` lives in ``common.js`` alone; every widget's module is sent after it."""
    from metaclaw.notebook.experiment_view import EvidenceView, ExperimentView

    sources = {path.name: path.read_text() for path in WIDGETS_DIR.glob("*.js")}
    assert [name for name, text in sources.items() if "function h(" in text] == ["common.js"]
    for forbidden in ("http://", "https://", "import ", "export "):
        assert forbidden not in sources["common.js"]
    for widget in (SkillDiffWidget, BufferWidget, TraceWidget, SchedulerView, ExperimentView,
                   EvidenceView):
        assert str(widget._esm).startswith(sources["common.js"])
        assert str(widget._esm).count("function h(") == 1


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.parametrize("name", JS_FILES)
def test_front_end_modules_parse(name):
    result = subprocess.run([NODE, "--check", str(WIDGETS_DIR / name)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- skill diff --------------------------------------------------------------------------------
def test_skill_diff_defaults_to_latest_change_and_recomputes_on_choice(library):
    t1, t2 = library.test_turns
    w = SkillDiffWidget(library)
    assert [g["generation"] for g in w.generations] == [0, 1, 2, 3, 4]
    assert (w.old, w.new) == (3, 4)
    assert [s["name"] for s in w.diff["removed"]] == ["cite-sources"]
    assert w.diff["added"] == [] and w.diff["edited"] == []

    w.old = 1  # what the front-end does with model.set("old", 1)
    assert w.diff["old"] == 1
    assert w.diff["removed"] == [] and w.diff["added"] == []
    edited = w.diff["edited"][0]
    assert edited["name"] == "parse-dates"
    assert "-Check time zones." in edited["unified_diff"]
    assert "+Always convert to UTC before comparing." in edited["unified_diff"]
    # evidence behind the edit: the turn ids with their task text and reward
    edit_event = next(e for e in w.diff["events"] if e["op"] == "edit")
    assert edit_event["evidence"] == [t2] and edit_event["reason"] == "time zone slip"
    assert w.diff["turns"][str(t2)]["task"] == "Convert 5pm PST to Berlin time"
    assert w.diff["turns"][str(t2)]["reward"] == -1.0

    w.compare(0, 1)
    assert [s["name"] for s in w.diff["added"]] == ["parse-dates"]
    assert w.diff["turns"][str(t1)]["task"].startswith("Parse the date 03/04/2025")
    assert w.diff["summary"] == {"added": 1, "edited": 0, "removed": 0}

    w.new = 0
    assert w.diff["summary"] == {"added": 0, "edited": 0, "removed": 0}
    assert w.error == ""

    w.mode = "side-by-side"
    with pytest.raises(traitlets.TraitError):
        w.mode = "sideways"
    with pytest.raises(traitlets.TraitError, match="generation 9 does not exist; choose one "
                                                   "between 0 and 4"):
        w.new = 9
    assert w.new == 0  # unchanged after the rejected choice


def test_skill_diff_follows_a_new_generation(library):
    w = SkillDiffWidget(library, follow=True)
    assert w.new == 4
    library.add(Skill(name="ask-first", description="Ask before acting", body="Ask.\n"))
    assert [g["generation"] for g in w.generations][-1] == 5
    assert w.new == 5 and w.old == 3
    assert {s["name"] for s in w.diff["added"]} == {"ask-first"}

    pinned = SkillDiffWidget(library, old=0, new=2, follow=False)
    library.remove("ask-first")
    assert pinned.new == 2 and len(pinned.generations) == 7


def test_a_closed_skill_diff_stops_following_the_library(library):
    w = SkillDiffWidget(library)
    w.close()
    library.add(Skill(name="ask-first", description="Ask before acting", body="Ask.\n"))
    assert [g["generation"] for g in w.generations][-1] == 4  # not recomputed once closed
    w.close()  # twice: nothing left to do


def test_skill_diff_static_html(library):
    t1, t2 = library.test_turns
    w = SkillDiffWidget(library, old=0, new=4)
    page = w._repr_html_()
    assert "Skill diff: generation 0 &rarr; 4" in page
    assert "parse-dates" in page and "Parse dates without guessing" in page
    assert "+Always convert to UTC before comparing." in page
    assert f"turn #{t1} (reward -1): Parse the date 03/04/2025" in page
    assert f"turn #{t2} (reward -1)" in page and "time zone slip" in page

    w.compare(1, 3)
    page = w._repr_html_()
    assert "Edited: <b>parse-dates</b>" in page and "Added: <b>cite-sources</b>" in page
    assert "-Check time zones." in page

    data, _meta = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/html"] == page
    assert data["text/plain"] == ("SkillDiffWidget(generation 1 -> 3: +1 added, ~1 edited, "
                                  "-0 removed)")


# -- buffers -----------------------------------------------------------------------------------
@pytest.fixture()
def buffered(store, add_buffer_turn):
    ids = {
        "sup_live": add_buffer_turn("alpha", "Book a flight to Lisbon", reward=-1.0,
                          set_="support", state="live", generation=1),
        "sup_consumed": add_buffer_turn("alpha", "Refund the hotel", reward=-1.0,
                              set_="support", state="consumed", generation=0),
        "query_live": add_buffer_turn("beta", "Book a table for two", reward=1.0, set_="query",
                            state="live", generation=1),
        "query_purged": add_buffer_turn("beta", "Summarise the meeting", reward=0.0,
                              set_="query", state="purged", generation=0),
        "none": add_buffer_turn("gamma", "Say hello"),
    }
    return ids


def test_buffer_filters_change_frame_and_rows(store, buffered, add_buffer_turn):
    w = BufferWidget(store)
    assert w.total == 5 and w.matched == 5
    assert isinstance(w.frame, pl.DataFrame)
    assert w.frame.columns == ["id", "session_id", "turn_type", "set", "state",
                               "skill_generation", "reward", "created_at", "task"]
    assert [r["id"] for r in w.rows] == sorted(buffered.values(), reverse=True)  # newest first
    assert w.counts == {"support": {"live": 1, "consumed": 1}, "query": {"live": 1, "purged": 1}}
    assert w.generations == [0, 1]

    w.set_filter = "support"
    assert w.frame["id"].to_list() == [buffered["sup_live"], buffered["sup_consumed"]]
    assert w.matched == 2 and len(w.rows) == 2
    w.state_filter = "consumed"
    assert w.frame["id"].to_list() == [buffered["sup_consumed"]]
    assert w.rows[0]["task"] == "Refund the hotel"
    w.set_filter, w.state_filter = "all", "all"
    w.generation_filter = 1
    assert sorted(w.frame["id"].to_list()) == sorted([buffered["sup_live"],
                                                      buffered["query_live"]])
    w.generation_filter = None
    w.text_filter = "BOOK"
    assert sorted(w.frame["id"].to_list()) == sorted([buffered["sup_live"],
                                                      buffered["query_live"]])
    w.text_filter = "beta"  # session ids match too
    assert set(w.frame["set"].to_list()) == {"query"}
    w.text_filter = ""
    w.set_filter = "none"
    assert w.frame["id"].to_list() == [buffered["none"]]
    with pytest.raises(traitlets.TraitError):
        w.set_filter = "training"

    w.set_filter = "all"
    w.max_rows = 2
    assert len(w.rows) == 2 and w.matched == 5

    new_id = add_buffer_turn("alpha", "Cancel the flight", reward=-1.0, set_="support",
                   state="live", generation=1)
    assert w.total == 5
    w.refresh_requests += 1  # the front-end's refresh button
    assert w.total == 6 and w.rows[0]["id"] == new_id
    assert w.counts["support"]["live"] == 2


def test_buffer_drill_down(store, buffered):
    w = BufferWidget(store, set_filter="query")
    target = buffered["query_live"]
    w.selected = target  # the front-end clicks a row
    assert w.detail["id"] == target
    assert w.detail["request_messages"][-1] == {"role": "user", "content": "Book a table for two"}
    assert w.detail["response"] == "ok" and w.detail["buffer_state"] == "live"
    store.update_turn(target, judge_rationale="booked correctly")
    w.refresh()
    assert w.detail["judge_rationale"] == "booked correctly"

    w.selected = 10_000
    assert w.detail == {} and "turn #10000 is not in the store" in w.error
    assert w.select(None) == {} and w.selected is None


def test_buffer_static_html(store, buffered):
    w = BufferWidget(store, set_filter="support")
    w.select(buffered["sup_live"])
    page = w._repr_html_()
    assert "Buffers</b> (set=support, state=all): 2 of 5 turns" in page
    assert "Book a flight to Lisbon" in page and "Refund the hotel" in page
    assert "Book a table for two" not in page.split("<details")[0]
    assert f"Turn #{buffered['sup_live']}" in page and "You are helpful." in page
    data, _ = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and data["text/html"] == page

    empty = BufferWidget(store, text="no such words")
    assert "No turns match these filters." in empty._repr_html_()


# -- training monitor --------------------------------------------------------------------------
def _step(store, run_id, step, **fields):
    values = dict(backend="local", policy_version=step, skill_generation=0, loss=1.0 / (step + 1),
                  reward_mean=0.2 * step, groups=4, skipped_groups=step % 2, tokens=800,
                  wall_time_s=2.0)
    values.update(fields)
    return store.record_training_step(run_id=run_id, step=step, **values)


def test_training_monitor_reads_new_steps(store):
    monitor = TrainingMonitor(store, poll=None)
    assert monitor.run_id is None and monitor.steps == []
    assert "waiting for the first step" in monitor._repr_html_()
    _step(store, "run-a", 0)
    _step(store, "run-a", 1)
    assert monitor.update() == 2
    assert monitor.run_id == "run-a"
    assert monitor.frame["tokens_per_s"].to_list() == [400.0, 400.0]
    assert monitor.update() == 0
    _step(store, "run-a", 2, wall_time_s=None)
    monitor.on_step({"step": 2})  # usable as a trainer's step callback
    assert monitor.frame["step"].to_list() == [0, 1, 2]
    assert monitor.frame["tokens_per_s"].to_list() == [400.0, 400.0, None]

    spec = monitor.chart().to_dict()
    values = spec["data"]["values"]
    assert {v["metric"] for v in values} == {"loss", "mean reward", "skipped groups", "tokens/s"}
    assert {"step": 2, "metric": "mean reward", "value": pytest.approx(0.4)} in values
    assert "step 2" in spec["title"]

    # following the newest run: a new run replaces the old one
    _step(store, "run-b", 0, loss=3.0)
    monitor.update()
    assert monitor.run_id == "run-b" and monitor.frame["loss"].to_list() == [3.0]
    pinned = TrainingMonitor(store, run_id="run-a", poll=None)
    assert pinned.frame.height == 3

    page = pinned._repr_html_()
    assert "Training run run-a: step 2" in page and "<svg" in page
    assert "<td>0.5</td>" in page  # step 1 loss
    assert "<td>400.0</td>" in page


def test_training_monitor_updates_live_widget_in_background(store):
    monitor = TrainingMonitor(store, poll=0.05)
    try:
        assert monitor.polling
        widget = monitor.widget  # the altair JupyterChart, JavaScript bundled offline
        assert "esm.sh" not in widget._esm and "https://" not in widget._esm[:2000]
        _step(store, "live", 0)
        _step(store, "live", 1, loss=0.25)
        deadline = time.time() + 10
        while time.time() < deadline and len(monitor.steps) < 2:
            time.sleep(0.02)
        assert len(monitor.steps) == 2
        deadline = time.time() + 5
        while time.time() < deadline and "step 1" not in widget.spec.get("title", ""):
            time.sleep(0.02)
        values = widget.spec["data"]["values"]
        assert {"step": 1, "metric": "loss", "value": 0.25} in values
        data, _ = monitor._repr_mimebundle_()
        assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == widget.model_id
        assert "Training run live: step 1" in data["text/plain"]
        assert data["image/png"] and "text/html" not in data  # the chart before trust
    finally:
        monitor.close()
    assert not monitor.polling
    with pytest.raises(ValueError, match="poll must be a positive number"):
        TrainingMonitor(store, poll=0)


# -- scheduler ---------------------------------------------------------------------------------
def test_scheduler_view_state_signals_and_timeline(store):
    from metaclaw.slowloop.scheduler.machine import Scheduler
    from metaclaw.slowloop.scheduler.signals import SleepWindow

    now = [datetime(2026, 1, 5, 23, 30, tzinfo=timezone.utc).timestamp()]
    clock = lambda: now[0]  # noqa: E731
    scheduler = Scheduler([SleepWindow("23:00", "07:00", "UTC", clock=clock)], store=store,
                          clock=clock)
    view = SchedulerView(scheduler, clock=clock)
    assert view.state == "waiting" and view.transitions == [] and view.segments == []
    assert "No transitions recorded yet." in view._repr_html_()

    scheduler.tick()
    now[0] += 9 * 3600  # 08:30: the sleep window has closed
    scheduler.tick()
    view.refresh_requests += 1  # the front-end's refresh button
    assert view.state == "waiting"
    assert view.signals == [{"name": "sleep", "reading": "active",
                             "detail": "08:30 UTC is outside 23:00-07:00"}]
    assert [(t["from_state"], t["to_state"]) for t in view.transitions] == [
        ("waiting", "window_open"), ("window_open", "waiting")]
    assert view.segments == [
        {"state": "window_open", "start": now[0] - 9 * 3600, "end": now[0]},
        {"state": "waiting", "start": now[0], "end": None}]
    assert view.summary["mode"] == "any" and view.now == now[0]

    page = view._repr_html_()
    assert "state <b>waiting</b>" in page and "outside 23:00-07:00" in page
    assert "window_open</td>" in page and "9.0 h" in page
    data, _ = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and data["text/html"] == page


def test_scheduler_view_from_a_status_function():
    calls = []

    def status():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("scheduler stopped")
        return {"state": "training", "steps": 3,
                "signals": {"keyboard": {"available": False, "idle": False,
                                         "detail": "no display"}, "battery": 0.8},
                "transitions": [{"at": 10.0, "from_state": "waiting", "to_state": "training",
                                 "reason": "forced"}]}

    view = SchedulerView(status, clock=lambda: 20.0)
    assert view.state == "training" and view.summary == {"steps": 3}
    assert view.signals == [{"name": "keyboard", "reading": "unavailable", "raw": "no display",
                             "detail": "not available on this machine (no display)"},
                            {"name": "battery", "reading": 0.8, "detail": ""}]
    assert view.segments == [{"state": "training", "start": 10.0, "end": None}]
    view.refresh()
    assert view.error == "could not read the scheduler status: scheduler stopped"
    assert view.state == "training"  # the last good reading stays
    with pytest.raises(TypeError, match="needs a Scheduler or a function"):
        SchedulerView(42)


def test_state_segments():
    assert state_segments([]) == []
    moves = [{"at": 1.0, "to_state": "window_open"}, {"at": 4.0, "to_state": "training"}]
    assert state_segments(moves) == [{"state": "window_open", "start": 1.0, "end": 4.0},
                                     {"state": "training", "start": 4.0, "end": None}]


# -- the front-end, executed under node against a minimal DOM -----------------------------------
HARNESS = r"""
class Node {
  constructor() { this.childNodes = []; this.parentNode = null; }
  append(...nodes) {
    for (let n of nodes) {
      if (!(n instanceof Node)) n = new Text(String(n));
      if (n.parentNode) n.parentNode.childNodes = n.parentNode.childNodes.filter((c) => c !== n);
      n.parentNode = this;
      this.childNodes.push(n);
    }
  }
  replaceChildren(...nodes) { for (const c of this.childNodes) c.parentNode = null; this.childNodes = []; this.append(...nodes); }
  get textContent() { return this.childNodes.map((c) => c.textContent).join(""); }
}
class Text extends Node { constructor(data) { super(); this.data = data; } get textContent() { return this.data; } }
class Element extends Node {
  constructor(tag) {
    super(); this.tagName = tag.toUpperCase(); this.attributes = {}; this.listeners = {};
    this.className = ""; const self = this;
    this.classList = { add: (...c) => { self.className = (self.className + " " + c.join(" ")).trim(); } };
  }
  setAttribute(k, v) { this.attributes[k] = v; }
  getAttribute(k) { return this.attributes[k]; }
  addEventListener(type, fn) { (this.listeners[type] ||= []).push(fn); }
  fire(type) { for (const fn of this.listeners[type] || []) fn({ target: this }); }
  findAll(pred, out = []) { for (const c of this.childNodes) { if (c instanceof Element) { if (pred(c)) out.push(c); c.findAll(pred, out); } } return out; }
}
globalThis.Node = Node;
globalThis.document = { createElement: (t) => new Element(t), createTextNode: (t) => new Text(t), activeElement: null };

const [modulePath, statePath] = process.argv.slice(2);
const state = JSON.parse(require("fs").readFileSync(statePath, "utf8"));
const handlers = {};
const sets = [];
const model = {
  get: (k) => state.values[k],
  set: (k, v) => { state.values[k] = v; sets.push([k, v]); },
  save_changes: () => sets.push(["save"]),
  on: (name, fn) => { (handlers[name] ||= []).push(fn); },
  off: (name, fn) => { handlers[name] = (handlers[name] || []).filter((f) => f !== fn); },
};
(async () => {
  const mod = await import(require("url").pathToFileURL(modulePath).href);
  const el = new Element("div");
  const cleanup = mod.default.render({ model, el });
  const before = el.textContent;
  for (const action of state.actions) {
    const node = el.findAll((n) => (action.attr ? n.getAttribute(action.attr) === action.value
      : n.tagName === "BUTTON" && n.textContent === action.text))[0];
    if (!node) throw new Error("no element for " + JSON.stringify(action));
    if (action.set !== undefined) node.value = action.set;
    if (action.checked !== undefined) node.checked = action.checked;
    node.fire(action.event);
  }
  const listeners = Object.values(handlers).reduce((n, l) => n + l.length, 0);
  cleanup();
  const left = Object.values(handlers).reduce((n, l) => n + l.length, 0);
  console.log(JSON.stringify({ text: before, sets, listeners, left, classes: el.className }));
})().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
"""


def _render(tmp_path, widget, js_name, actions=()):
    values = {k: v for k, v in widget.get_state().items() if not k.startswith("_")}
    values = json.loads(json.dumps(values, default=str))
    state_file = tmp_path / f"{js_name}.state.json"
    state_file.write_text(json.dumps({"values": values, "actions": list(actions)}))
    harness = tmp_path / "harness.cjs"
    harness.write_text(HARNESS)
    module = tmp_path / f"{js_name}.mjs"  # what the front-end gets: the shared helpers first
    module.write_text(str(widget._esm))
    assert str(widget._esm).endswith((WIDGETS_DIR / js_name).read_text())
    result = subprocess.run([NODE, str(harness), str(module), str(state_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["listeners"] > 0 and out["left"] == 0  # render subscribes, cleanup unsubscribes
    assert "metaclaw-w" in out["classes"]
    return out


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_front_end_renders_and_sends_choices(tmp_path, library, store):
    t1, t2 = library.test_turns
    diff = SkillDiffWidget(library, old=0, new=3, mode="side-by-side")
    out = _render(tmp_path, diff, "skill_diff.js", [
        {"attr": "aria-label", "value": "old generation", "event": "change", "set": "1"},
        {"attr": "aria-label", "value": "diff mode", "event": "change", "set": "unified"}])
    assert "+2 added" in out["text"] and "parse-dates" in out["text"]
    assert "cite-sources" in out["text"] and "Parse the date 03/04/2025" in out["text"]
    assert ["old", 1] in out["sets"] and ["mode", "unified"] in out["sets"]
    assert ["save"] in out["sets"]
    for key, value in (s for s in out["sets"] if len(s) == 2):  # what the comm would deliver
        setattr(diff, key, value)
    assert diff.old == 1 and [e["name"] for e in diff.diff["edited"]] == ["parse-dates"]
    out = _render(tmp_path, diff, "skill_diff.js")
    assert "+1 added" in out["text"] and "~1 edited" in out["text"]
    assert "Always convert to UTC before comparing." in out["text"]
    diff.mode = "side-by-side"  # both sides of the edit, old line next to the new one
    out = _render(tmp_path, diff.compare(1, 2), "skill_diff.js")
    assert "Check time zones.Always convert to UTC before comparing." in out["text"]

    buffers = BufferWidget(store)
    buffers.select(t2)
    out = _render(tmp_path, buffers, "buffers.js", [
        {"attr": "aria-label", "value": "set", "event": "change", "set": "support"},
        {"attr": "aria-label", "value": "generation", "event": "change", "set": "1"},
        {"text": "refresh", "event": "click"}])
    assert "Convert 5pm PST to Berlin time" in out["text"] and f"Turn #{t2}" in out["text"]
    assert "You are helpful." in out["text"]  # the drill-down shows the request messages
    assert ["set_filter", "support"] in out["sets"] and ["generation_filter", 1] in out["sets"]
    assert ["refresh_requests", 1] in out["sets"]

    now = [datetime(2026, 1, 5, 23, 30, tzinfo=timezone.utc).timestamp()]
    from metaclaw.slowloop.scheduler.machine import Scheduler
    from metaclaw.slowloop.scheduler.signals import SleepWindow

    scheduler = Scheduler([SleepWindow("23:00", "07:00", "UTC", clock=lambda: now[0])],
                          store=store, clock=lambda: now[0])
    scheduler.tick()
    out = _render(tmp_path, SchedulerView(scheduler), "scheduler.js",
                  [{"text": "refresh", "event": "click"}])
    assert "window_open" in out["text"] and "inside 23:00-07:00" in out["text"]
    assert ["refresh_requests", 1] in out["sets"]


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_trace_and_diff_front_ends_ask_python_to_refresh(tmp_path, library, store):
    """Both views can be brought up to date with what another process wrote since."""
    for widget, js_name in ((TraceWidget(store, "s2"), "trace.js"),
                            (SkillDiffWidget(library), "skill_diff.js")):
        out = _render(tmp_path, widget, js_name, [{"text": "refresh", "event": "click"}])
        assert ["refresh_requests", 1] in out["sets"] and ["save"] in out["sets"]
