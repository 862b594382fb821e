"""The notebook widgets' front-ends rendered for real in headless Chromium (driven by Playwright).

Each test builds a widget's state in Python from a real store, serves a small page from a
temporary folder on a 127.0.0.1 ephemeral port, and renders the widget's ES module
(``widget._esm``, the text anywidget sends to the front-end) with its stylesheet. The page's
model object behaves like anywidget's: ``set`` changes the local value and fires
``change:<key>``, ``save_changes`` sends the pending changes. What the page sends is applied with
``Widget.set_state`` (what a comm message does) and the recomputed Python state is pushed back
to the page, so one test walks the whole round trip: click in the browser, Python reacts, the
browser shows the new state.

Needs the ``playwright`` Python package and Debian's Chromium at ``/usr/bin/chromium`` (no
browser download; ``METACLAW_CHROMIUM`` names another binary); the module is skipped without
them.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import struct
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

playwright_sync = pytest.importorskip("playwright.sync_api")

# Debian's Chromium by default; METACLAW_CHROMIUM names another Chromium or Chrome binary.
CHROMIUM = Path(os.environ.get("METACLAW_CHROMIUM") or "/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian package 'chromium', or set "
                "METACLAW_CHROMIUM to a Chromium binary)", allow_module_level=True)

from metaclaw.notebook.widgets import BufferWidget, SchedulerView, SkillDiffWidget  # noqa: E402
from metaclaw.skills.library import Skill, SkillLibrary, SkillOp  # noqa: E402
from metaclaw.store import Store  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]

# The page: the widget's stylesheet, an anywidget-like model holding the synced state, and the
# widget's module imported and rendered into #widget. ``window.mc`` is what the test talks to.
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<link rel="icon" href="data:,">
<style>body {{ margin: 8px; background: #fff; width: 900px; }}</style>
<style>{css}</style>
</head><body>
<div id="widget"></div>
<script type="module">
import widget from "./{module}";

const values = await (await fetch("./{state}")).json();
const handlers = {{}};
const emit = (name) => {{ for (const fn of [...(handlers[name] || [])]) fn(); }};
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
const mc = {{ sent: [], pending: {{}}, cleanup: null }};
mc.model = {{
  get: (key) => values[key],
  set: (key, value) => {{
    const changed = !same(values[key], value);
    values[key] = value;
    mc.pending[key] = value;
    if (changed) emit("change:" + key);
  }},
  save_changes: () => {{
    if (Object.keys(mc.pending).length) mc.sent.push(mc.pending);
    mc.pending = {{}};
  }},
  on: (name, fn) => {{ (handlers[name] ||= []).push(fn); }},
  off: (name, fn) => {{ handlers[name] = (handlers[name] || []).filter((f) => f !== fn); }},
}};
// State recomputed by Python, delivered the way a comm update is: changed keys fire change:.
mc.update = (state) => {{
  for (const [key, value] of Object.entries(state)) {{
    if (same(values[key], value)) continue;
    values[key] = value;
    emit("change:" + key);
  }}
}};
mc.takeSent = () => {{ const out = mc.sent; mc.sent = []; return out; }};
mc.listeners = () => Object.values(handlers).reduce((n, list) => n + list.length, 0);
window.mc = mc;
mc.cleanup = widget.render({{ model: mc.model, el: document.getElementById("widget") }});
mc.ready = true;
</script>
</body></html>
"""


# -- fixtures ----------------------------------------------------------------------------------
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder served over HTTP on 127.0.0.1 (ephemeral port): ``(folder, base_url)``."""
    root = tmp_path_factory.mktemp("widget-pages")
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless (Playwright gives it a new empty profile)."""
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


# -- helpers -----------------------------------------------------------------------------------
def _state(widget):
    """The widget's synced state as the front-end receives it (JSON, private keys left out)."""
    values = {k: v for k, v in widget.get_state().items() if not k.startswith("_")}
    return json.loads(json.dumps(values, default=str))


class Rendered:
    """A widget rendered in a browser page, with the page's errors collected."""

    def __init__(self, page, widget, errors):
        self.page, self.widget, self.errors = page, widget, errors

    def text(self) -> str:
        return self.page.locator("#widget").inner_text()

    def sent(self) -> list[dict]:
        """The changes the front-end sent since the last call (one dict per save_changes)."""
        return self.page.evaluate("() => window.mc.takeSent()")

    def round_trip(self) -> list[dict]:
        """Apply what the front-end sent to the Python widget (``set_state``, as a comm message
        does), then deliver the recomputed Python state back to the page. Returns the messages."""
        messages = self.sent()
        for message in messages:
            self.widget.set_state(message)
        self.page.evaluate("state => window.mc.update(state)", _state(self.widget))
        return messages

    def screenshot(self, path: Path) -> Path:
        self.page.locator("#widget").screenshot(path=str(path))
        return path


def _render(browser, site, widget, module, name):
    root, base = site
    (root / module).write_text(str(widget._esm))
    (root / f"{name}.json").write_text(json.dumps(_state(widget)))
    (root / f"{name}.html").write_text(PAGE.format(
        title=name, css=str(widget._css), module=module, state=f"{name}.json"))
    page = browser.new_page(viewport={"width": 960, "height": 900})
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    page.goto(f"{base}/{name}.html")
    try:
        page.wait_for_function("() => window.mc && window.mc.ready === true")
    except playwright_sync.TimeoutError:
        pytest.fail(f"{module} did not render: {errors}")
    return Rendered(page, widget, errors)


def _finish(rendered, shot: Path):
    """Screenshot, cleanup check, and no error on the page; closes the page."""
    rendered.screenshot(shot)
    _check_png(rendered.page, shot)
    listeners = rendered.page.evaluate("() => window.mc.listeners()")
    rendered.page.evaluate("() => window.mc.cleanup()")
    assert listeners > 0 and rendered.page.evaluate("() => window.mc.listeners()") == 0
    assert rendered.errors == []
    rendered.page.close()


def _check_png(page, path: Path):
    """``path`` is a real, non-blank PNG: signature, size, and decoded by the browser itself
    into an image of several colours."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 300 and height >= 100, (width, height)
    colours = page.evaluate("""async (src) => {
        const img = new Image(); img.src = src; await img.decode();
        const canvas = document.createElement("canvas");
        canvas.width = img.width; canvas.height = img.height;
        const ctx = canvas.getContext("2d"); ctx.drawImage(img, 0, 0);
        const px = ctx.getImageData(0, 0, img.width, img.height).data;
        const seen = new Set();
        for (let i = 0; i < px.length && seen.size < 64; i += 4) {
          seen.add(px[i] << 16 | px[i + 1] << 8 | px[i + 2]);
        }
        return seen.size;
    }""", "data:image/png;base64," + base64.b64encode(data).decode())
    assert colours >= 8, f"{path.name} looks blank ({colours} colours)"


# -- skill diff --------------------------------------------------------------------------------
@pytest.fixture()
def library(tmp_path, store, add_buffer_turn):
    """Generation 1 adds parse-dates (evidence t1) and cite-sources; generation 2 edits
    parse-dates (evidence t2), removes cite-sources and adds ask-first."""
    lib = SkillLibrary(tmp_path / "skills", store)
    t1 = add_buffer_turn("s1", "Parse the date 03/04/2025 for the invoice", reward=-1.0,
               set_="support", state="consumed")
    lib.apply([SkillOp("add", Skill(name="parse-dates", description="Parse dates without guessing",
                                    body="Use ISO 8601.\nCheck time zones.\n"),
                       reason="dates failed", evidence=[t1]),
               SkillOp("add", Skill(name="cite-sources", description="Cite every source",
                                    body="Link it.\n"), reason="missing citations")],
              kind="add", reason="first lessons")
    t2 = add_buffer_turn("s2", "Convert 5pm PST to Berlin time", reward=-1.0, set_="support",
               state="consumed", generation=1)
    edited = Skill(name="parse-dates", description="Parse dates without guessing",
                   body="Use ISO 8601.\nAlways convert to UTC before comparing.\n")
    lib.apply([SkillOp("edit", edited, reason="time zone slip", evidence=[t2]),
               SkillOp("remove", name="cite-sources", reason="too noisy"),
               SkillOp("add", Skill(name="ask-first", description="Ask before acting",
                                    body="Ask.\n").with_retrieval_keys(
                                        ["delete the old branches"], use_when="risky changes",
                                        anticipated=["clean up the repo", "is it safe to drop?"]),
                       reason="acted too early")],
              kind="edit", reason="second lessons")
    lib.test_turns = (t1, t2)  # type: ignore[attr-defined]
    return lib


def test_skill_diff_renders_and_round_trips(browser, site, library, tmp_path):
    t1, t2 = library.test_turns
    widget = SkillDiffWidget(library)
    assert (widget.old, widget.new, widget.mode) == (1, 2, "unified")
    r = _render(browser, site, widget, "skill_diff.js", "skill_diff")
    page = r.page

    text = r.text()
    assert "+1 added" in text and "~1 edited" in text and "−1 removed" in text
    assert "(generation 1 → 2)" in text
    cards = page.locator("details.mc-card")
    assert cards.count() == 3
    assert cards.nth(0).locator("summary").inner_text().startswith("added ask-first")
    assert cards.nth(1).locator("summary").inner_text().startswith("edited parse-dates")
    assert cards.nth(2).locator("summary").inner_text().startswith("removed cite-sources")
    # the edit's unified diff, one line per div, with the stylesheet's colours applied
    deleted = page.locator(".mc-card-edit .mc-diff-unified .mc-del")
    added = page.locator(".mc-card-edit .mc-diff-unified .mc-add")
    assert deleted.all_inner_texts() == ["-Check time zones."]
    assert added.all_inner_texts() == ["+Always convert to UTC before comparing."]
    background = added.first.evaluate("n => getComputedStyle(n).backgroundColor")
    assert background == "rgba(46, 160, 67, 0.15)"
    # the evidence behind the edit: the event, its reason, the turn's task and reward
    evidence = page.locator(".mc-card-edit .mc-evidence")
    assert "edit generation 2 — time zone slip" in evidence.inner_text()
    turn = evidence.locator("li").first
    assert turn.locator(".mc-turn-id").inner_text() == f"#{t2}"
    assert turn.locator(".mc-task").inner_text() == "Convert 5pm PST to Berlin time"
    assert turn.locator(".mc-reward.mc-bad").inner_text() == "-1"
    assert "remove generation 2 — too noisy" in page.locator(".mc-card-remove").inner_text()
    assert "+Ask." in page.locator(".mc-card-add .mc-diff-unified").inner_text()
    # what retrieval matches the skill on; each count's tooltip lists its asks
    keys = page.locator(".mc-card-add .mc-keys")
    assert keys.inner_text() == "use when: risky changes · 1 example ask · 2 anticipated asks"
    assert keys.locator("span").nth(1).get_attribute("title") == \
        "clean up the repo\nis it safe to drop?"

    # switch to side-by-side: the page redraws at once, the choice is sent to Python
    page.select_option("select[aria-label='diff mode']", "side-by-side")
    pair = page.locator(".mc-card-edit table.mc-diff-sbs tr", has=page.locator("td.mc-del"))
    assert pair.count() == 1
    assert pair.locator("td.mc-del").inner_text() == "Check time zones."
    assert pair.locator("td.mc-add").inner_text() == "Always convert to UTC before comparing."
    assert r.round_trip() == [{"mode": "side-by-side"}]
    assert widget.mode == "side-by-side"
    r.screenshot(tmp_path / "skill_diff_side_by_side.png")

    # choose another old generation: Python recomputes the diff, the page shows the new one
    page.select_option("select[aria-label='old generation']", "0")
    assert r.round_trip() == [{"old": 0}]
    assert (widget.old, widget.new) == (0, 2)
    assert sorted(s["name"] for s in widget.diff["added"]) == ["ask-first", "parse-dates"]
    assert widget.diff["removed"] == [] and widget.diff["edited"] == []
    page.wait_for_function("() => document.querySelector('.mc-summary')"
                           ".textContent.includes('generation 0 → 2')")
    text = r.text()
    assert "+2 added" in text and "~0 edited" in text and "−0 removed" in text
    assert page.locator("details.mc-card-edit").count() == 0
    parse_dates = page.locator("details.mc-card-add", has_text="parse-dates")
    assert "+Always convert to UTC before comparing." in parse_dates.inner_text()
    # both events on parse-dates in this range, each with its evidence turn
    assert parse_dates.locator(".mc-turn-id").all_inner_texts() == [f"#{t1}", f"#{t2}"]
    assert "Parse the date 03/04/2025 for the invoice" in parse_dates.inner_text()
    assert page.locator("select[aria-label='old generation']").input_value() == "0"

    _finish(r, tmp_path / "skill_diff.png")


# -- buffers -----------------------------------------------------------------------------------
def test_buffers_render_filter_and_drill_down(browser, site, store, tmp_path, add_buffer_turn):
    ids = {
        "sup_live": add_buffer_turn("alpha", "Book a flight to Lisbon", reward=-1.0,
                          set_="support", state="live", generation=1,
                          response="Booked TAP 123 for Friday."),
        "sup_consumed": add_buffer_turn("alpha", "Refund the hotel", reward=-1.0,
                              set_="support", state="consumed", generation=0),
        "query_live": add_buffer_turn("beta", "Book a table for two", reward=1.0, set_="query",
                            state="live", generation=1),
        "query_purged": add_buffer_turn("beta", "Summarise the meeting", reward=0.0,
                              set_="query", state="purged", generation=0),
        "none": add_buffer_turn("gamma", "Say hello"),
    }
    widget = BufferWidget(store)
    r = _render(browser, site, widget, "buffers.js", "buffers")
    page = r.page

    rows = page.locator("tr.mc-row")
    assert rows.count() == 5
    by_task = {}
    for i in range(5):
        cells = rows.nth(i).locator("td").all_inner_texts()
        by_task[cells[7]] = cells
    assert by_task["Book a flight to Lisbon"][:6] == [
        f"#{ids['sup_live']}", "alpha", "support", "live", "1", "-1"]
    assert by_task["Refund the hotel"][2:4] == ["support", "consumed"]
    assert by_task["Book a table for two"][2:6] == ["query", "live", "1", "+1"]
    assert by_task["Summarise the meeting"][2:4] == ["query", "purged"]
    assert by_task["Say hello"][2:4] == ["—", "—"]
    summary = page.locator(".mc-summary").inner_text()
    assert "support: 1 live · 1 consumed · 0 purged" in summary
    assert "query: 1 live · 0 consumed · 1 purged" in summary
    assert "showing 5 of 5 matching (5 turns)" in summary
    assert page.locator(".mc-badge.mc-state-purged").inner_text() == "purged"

    # filter to the support set in the browser: Python refilters, the page shows two rows
    page.select_option("select[aria-label='set']", "support")
    assert r.round_trip() == [{"set_filter": "support"}]
    assert widget.set_filter == "support" and widget.matched == 2
    page.wait_for_function("() => document.querySelectorAll('tr.mc-row').length === 2")
    assert sorted(page.locator("tr.mc-row td.mc-task").all_inner_texts()) == [
        "Book a flight to Lisbon", "Refund the hotel"]
    assert page.locator("select[aria-label='set']").input_value() == "support"

    # click a row: the turn is selected, Python loads its messages, the drill-down opens
    page.locator("tr.mc-row", has_text="Book a flight to Lisbon").click()
    assert r.round_trip() == [{"selected": ids["sup_live"]}]
    assert widget.detail["id"] == ids["sup_live"]
    detail = page.locator(".mc-detail")
    detail.wait_for()
    assert f"Turn #{ids['sup_live']}" in detail.inner_text()
    assert "support / live" in detail.inner_text()
    messages = detail.locator(".mc-message")
    roles = messages.locator(".mc-role")
    assert roles.all_text_contents() == ["system", "user", "assistant"]
    assert roles.all_inner_texts() == ["SYSTEM", "USER", "ASSISTANT"]  # the stylesheet's caps
    assert messages.locator("pre.mc-content").all_inner_texts() == [
        "You are helpful.", "Book a flight to Lisbon", "Booked TAP 123 for Friday."]
    assert "mc-selected" in page.locator("tr.mc-row", has_text="Lisbon").get_attribute("class")
    r.screenshot(tmp_path / "buffers_detail.png")

    # type in the text box: the filter is sent after a pause in typing (debounced)
    page.locator("input[aria-label='text filter']").press_sequentially("refund", delay=20)
    page.wait_for_function("() => window.mc.sent.some((m) => m.text_filter === 'refund')")
    messages = r.round_trip()
    assert messages[-1] == {"text_filter": "refund"}
    assert all(list(m) == ["text_filter"] for m in messages)
    assert widget.matched == 1
    page.wait_for_function("() => document.querySelectorAll('tr.mc-row').length === 1")
    assert page.locator("tr.mc-row td.mc-task").inner_text() == "Refund the hotel"

    # close the drill-down
    page.locator(".mc-detail button", has_text="close").click()
    assert r.round_trip() == [{"selected": None}]
    assert widget.selected is None and widget.detail == {}
    assert page.locator(".mc-detail").count() == 0

    _finish(r, tmp_path / "buffers.png")


# -- scheduler ---------------------------------------------------------------------------------
def test_scheduler_view_renders_and_refreshes(browser, site, store, tmp_path):
    from metaclaw.slowloop.scheduler.machine import Scheduler
    from metaclaw.slowloop.scheduler.signals import ProxyIdle, SleepWindow

    start = datetime(2026, 1, 5, 23, 30, tzinfo=timezone.utc).timestamp()
    now = [start]
    clock = lambda: now[0]  # noqa: E731  (a fake clock the test moves)
    last_request = [start - 60]
    scheduler = Scheduler([SleepWindow("23:00", "07:00", "UTC", clock=clock),
                           ProxyIdle(600, lambda: last_request[0], clock=clock)],
                          store=store, clock=clock)
    scheduler.tick()  # 23:30: inside the sleep window
    now[0] += 9 * 3600  # 08:30: the window has closed
    last_request[0] = now[0] - 5
    scheduler.tick()
    view = SchedulerView(scheduler, clock=clock)
    assert view.state == "waiting"
    r = _render(browser, site, view, "scheduler.js", "scheduler")
    page = r.page

    assert page.locator(".mc-badge.mc-big").inner_text() == "waiting"
    signals = {}
    for row in page.locator("tbody").first.locator("tr").all():
        name, reads, detail = row.locator("td").all_inner_texts()
        signals[name] = (reads, detail)
    assert signals["sleep"] == ("active", "08:30 UTC is outside 23:00-07:00")
    assert signals["proxy"][0] == "active"
    assert page.locator("tbody").first.locator("td.mc-bad").count() == 2
    assert "Transitions (2)" in r.text()
    segments = page.locator(".mc-timeline .mc-segment")
    assert segments.count() == 2
    assert "mc-state-window_open" in segments.nth(0).get_attribute("class")
    assert "9.0 h" in segments.nth(0).get_attribute("title")
    moves = page.locator(".mc-scroll tbody tr")
    assert [m.locator("td").all_inner_texts()[1:3] for m in moves.all()] == [
        ["window_open", "waiting"], ["waiting", "window_open"]]  # newest first
    assert page.locator(".mc-legend").inner_text().split() == ["window_open", "waiting"]

    # that night: the window opens again; the refresh button makes Python read it
    now[0] = start + 24 * 3600
    scheduler.tick()
    assert view.state == "waiting"  # not re-read yet
    page.locator("button", has_text="refresh").click()
    assert r.round_trip() == [{"refresh_requests": 1}]
    assert view.state == "window_open"
    page.wait_for_function("() => document.querySelector('.mc-badge.mc-big')"
                           ".textContent === 'window_open'")
    text = r.text()
    assert "inside 23:00-07:00" in text and "Transitions (3)" in text
    assert page.locator(".mc-timeline .mc-segment").count() == 3
    # both signals now say idle: the sleep window, and no proxy request for 15 hours
    assert page.locator("tbody").first.locator("td.mc-good").all_inner_texts() == ["idle", "idle"]

    _finish(r, tmp_path / "scheduler.png")


# -- trace -------------------------------------------------------------------------------------
def test_trace_renders_steps_labels_and_jumps(browser, site, store, tmp_path):
    from metaclaw.fastloop import labels
    from metaclaw.notebook.widgets import TraceWidget
    from metaclaw.skills.block import BLOCK_HEADER

    library = SkillLibrary(tmp_path / "skills", store)
    call = {"id": "c1", "type": "function", "function": {"name": "read_file",
                                                         "arguments": '{"path": "a.txt"}'}}
    first = store.record_turn(
        session_id="s1", status="ok", response="The file says hi.", reward=1.0,
        request_messages=[
            {"role": "system", "content": f"You are helpful.\n\n{BLOCK_HEADER}\n\n### greet\nHi."},
            {"role": "user", "content": "What does a.txt say?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "hi"}],
        injected_skills=["greet"],
        judge_votes=[{"score": 1, "rationale": "answered from the file", "error": None}])
    failed = store.record_turn(
        session_id="s1", status="ok", response="5 km", reward=-1.0,
        request_messages=[{"role": "user", "content": "Convert 5 miles to km"}],
        judge_votes=[{"score": -1, "rationale": "wrong factor", "error": None}])
    generation = library.apply([SkillOp("add", Skill("miles-to-km", "Convert miles.", "math",
                                                     "Multiply by 1.609."),
                                        reason="factor", evidence=[failed])],
                               kind="evolve", reason="evolved")
    later = store.record_turn(session_id="s1", status="ok", response="8.045 km", reward=1.0,
                              skill_generation=generation,
                              request_messages=[{"role": "user", "content": "Convert 5 miles"}])
    widget = TraceWidget(store, "s1", author="alice")
    r = _render(browser, site, widget, "trace.js", "trace")
    page = r.page

    assert page.locator(".mc-trace-row").count() == 3
    assert page.locator(".mc-trace-row.mc-failed").count() == 1
    block = page.locator(".mc-skill-block")
    assert BLOCK_HEADER.split("\n")[0] in block.inner_text()
    assert "injected skill block" in block.inner_text()
    assert block.evaluate("n => getComputedStyle(n).backgroundColor") == "rgba(212, 167, 44, 0.18)"
    folded = page.locator("details.mc-tool-call").first
    assert folded.get_attribute("open") is None and "read_file(" in folded.inner_text()
    assert "answered from the file" in page.locator(".mc-vote").inner_text()
    assert "greet" in page.locator(".mc-scores").inner_text()

    # next failure: Python steps, the page shows the failed turn and its judge's reason
    page.click("button[aria-label='next failure']")
    assert r.round_trip()[0]["step_request"]["failures"] is True
    assert widget.selected == failed
    page.wait_for_function(f"() => document.querySelector('.mc-trace-detail b').textContent"
                           f" === 'Turn #{failed}'")
    assert "wrong factor" in page.locator(".mc-vote").inner_text()
    assert "generation 1 (evolve): add miles-to-km" in page.locator(".mc-written").inner_text()

    # label it from the form: stored with the widget's author, shown beside the judge
    page.fill("input[aria-label='label note']", "judge was right")
    page.fill("textarea[aria-label='corrected answer']", "8.045 km")
    page.click("button.mc-fail")
    r.round_trip()
    [row] = labels.history(store, failed)
    assert (row["verdict"], row["note"], row["corrected"], row["author"]) == \
        ("fail", "judge was right", "8.045 km", "alice")
    page.wait_for_function("() => document.querySelectorAll('.mc-label').length === 1")
    assert "human fail" in page.locator(".mc-trace-detail .mc-summary").inner_text()

    # jump to the turns served after the generation written for it
    page.click("button.mc-jump")
    r.round_trip()
    assert widget.selected == later
    page.wait_for_function(f"() => document.querySelector('.mc-trace-detail b').textContent"
                           f" === 'Turn #{later}'")
    assert "skill generation 1" in page.locator(".mc-trace-detail .mc-summary").inner_text()
    # click a row in the list
    page.locator(f".mc-trace-row[data-turn='{first}']").click()
    assert r.round_trip() == [{"selected": first}]
    # a turn recorded by another process appears when the refresh button is pressed
    with Store(store.target) as other:
        other.record_turn(session_id="s1", status="ok", response="done", request_messages=[
            {"role": "user", "content": "recorded by another process"}])
    page.locator("button", has_text="refresh").click()
    assert r.round_trip() == [{"refresh_requests": 1}]
    page.wait_for_function("() => document.querySelectorAll('.mc-trace-row').length === 4")
    assert "recorded by another process" in page.locator(".mc-trace-list").inner_text()
    _finish(r, tmp_path / "trace.png")


# -- proposals beside the skill diff -------------------------------------------------------------
def test_held_proposal_is_reviewed_edited_and_promoted_from_the_widget(browser, site, store,
                                                                       tmp_path):
    from metaclaw.fastloop import proposals
    from metaclaw.fastloop.gate import GateReport

    library = SkillLibrary(tmp_path / "skills", store)
    library.add(Skill("greet", "Greet the user.", body="Say hello."))
    failure = store.record_turn(session_id="s", status="ok", request_messages=[], reward=-1.0)
    success = store.record_turn(session_id="s", status="ok", request_messages=[], reward=1.0)
    candidate = Skill("miles-to-km", "Convert miles to kilometers.", "math",
                      "Multiply by 1.609. SHOUT the answer.")
    report = GateReport("hold", "the candidate regresses 1 recent success", library.generation,
                        cases=[{"turn_id": failure, "kind": "failure", "before": -1, "after": 1,
                                "before_reply": "5 km", "after_reply": "8.045 km",
                                "error": None, "outcome": "fixed"},
                               {"turn_id": success, "kind": "success", "before": 1, "after": -1,
                                "before_reply": "Hello!", "after_reply": "HELLO!!",
                                "error": None, "outcome": "regressed"}], judge_calls=12,
                        replays=4)
    pid = proposals.record(store, [SkillOp("add", candidate, candidate.name, "factor",
                                           [failure])], origin="auto", status="held",
                           base_generation=library.generation, support_ids=[failure],
                           report=report)
    widget = SkillDiffWidget(library, author="alice")
    r = _render(browser, site, widget, "skill_diff.js", "proposals")
    page = r.page

    card = page.locator(f"details.mc-proposal[data-proposal='{pid}']")
    assert card.get_attribute("open") is not None
    assert "12 judge votes" in card.locator(":scope > summary").inner_text()
    assert "+Multiply by 1.609. SHOUT the answer." in card.locator(".mc-diff-unified").inner_text()
    rows = card.locator("tr.mc-case")
    assert rows.count() == 2
    assert rows.nth(1).locator("td.mc-case-regressed").inner_text() == "regressed"
    assert "HELLO!!" in rows.nth(1).inner_text()

    # edit the text, save: Python stores the edit, the diff shows the new text
    card.locator("details.mc-edit summary").click()
    card.locator("textarea.mc-edit-body").fill("Multiply by 1.609.")
    card.locator("button.mc-save-edit").click()
    [message] = r.round_trip()
    assert message["proposal_action"]["action"] == "edit"
    assert proposals.get(store, pid).ops[0].skill.body == "Multiply by 1.609."
    page.wait_for_function("() => !document.querySelector('.mc-proposal .mc-diff-unified')"
                           ".textContent.includes('SHOUT')")

    # promote it: a new generation, recorded with who promoted it; the evidence stays
    page.fill(f"input[aria-label='note for proposal {pid}']", "edited out the shouting")
    card.locator("button.mc-promote").click()
    r.round_trip()
    assert library.get("miles-to-km").body == "Multiply by 1.609."
    done = proposals.get(store, pid)
    assert (done.status, done.decided_by, done.generation) == ("promoted", "alice",
                                                                library.generation)
    assert done.evidence["cases"] == report.cases and done.judge_calls == 12
    assert "edited out the shouting" in store.generation(library.generation)["reason"]
    page.wait_for_function("() => document.querySelector('.mc-proposal summary').textContent"
                           ".includes('promoted by alice')")
    assert page.locator("button.mc-promote").count() == 0
    assert widget.new == library.generation  # the diff followed the new generation
    _finish(r, tmp_path / "proposals.png")
