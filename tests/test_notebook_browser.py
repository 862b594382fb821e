"""The tutorials as a person runs them: JupyterLab in headless Chromium (driven by Playwright)
opens each notebook of ``notebooks/`` (every ``*.ipynb`` there, a new one included), clears it,
runs all cells, and then

* no output is an error: no error or stderr output, no traceback, no "Error loading script"
  (a chart that wanted a CDN), no widget that failed to render, no widget showing an error;
* no output is a wall: none is taller than ``MAX_OUTPUT_PX`` (long outputs scroll in a frame);
* every widget control still answers after the last cell (which stops the proxy or closes the
  workspace): a generation picked in a skill diff shows that diff, a held proposal's "promote"
  says where the proposal stands, a buffers row opens its turn, a trace stepped to the next turn
  shows that turn, the scheduler's refresh reads the status again, an experiment's case opens
  with its replies, the evidence view's refresh reads the workspace again, a training chart is
  drawn; every widget the saved notebook shows is among those used;
* in the light and the dark theme (switched after the run): the controls answer again, and the
  outputs' text (widgets included) keeps a readable contrast against what is behind it.

With ``METACLAW_SCREENSHOTS=FOLDER`` each notebook is also photographed in each theme, cropped
to the notebook, into ``FOLDER/<notebook>-<theme>.png`` (``docs/images/README.md``).

One JupyterLab server serves all notebooks (one per pytest-xdist worker); each notebook gets a
browser tab and a kernel of its own, shut down after its test. Needs the ``playwright`` package,
JupyterLab with the widget extensions (the ``notebook`` extra) and Debian's Chromium at
``/usr/bin/chromium`` (``METACLAW_CHROMIUM`` names another binary); skipped without them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

playwright_sync = pytest.importorskip("playwright.sync_api")
pytest.importorskip("jupyterlab")
pytest.importorskip("anywidget")

CHROMIUM = Path(os.environ.get("METACLAW_CHROMIUM") or "/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian package 'chromium', or set "
                "METACLAW_CHROMIUM to a Chromium binary)", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
TOKEN = "metaclaw-browser-test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
#: Where the screenshots go (a folder), when set.
SCREENSHOTS = os.environ.get("METACLAW_SCREENSHOTS")
VIEWPORT = {"width": 1280, "height": 1000}
#: The tallest output a reader should meet, in CSS pixels; a longer one scrolls in its own frame.
MAX_OUTPUT_PX = 1600
#: The lowest contrast ratio (WCAG AA) allowed between an output's text and its background.
MIN_CONTRAST = 4.5
#: The cell a notebook's screenshot starts at (a snippet of its source); default: the first
#: cell that shows a widget.
SHOWCASE = {"03_slow_loop.ipynb": "monitor = %metaclaw train"}
#: Seconds for Run All: notebook 03 trains a tiny model for 20 steps.
RUN_ALL_S = 420

pytestmark = pytest.mark.timeout(RUN_ALL_S + 180)

#: The notebook on show (the others in the page, if any, are hidden).
NOTEBOOK_SHOWN = ".jp-NotebookPanel:not(.lm-mod-hidden)"

# JavaScript run in the page, against the JupyterLab application object.
NOTEBOOK_READY = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
    && panel.sessionContext.session.kernel;
  return Boolean(kernel && kernel.connectionStatus === "connected" && kernel.status === "idle"
    && panel.content && panel.content.widgets.length > 0);
}"""
# Every code cell ran, or one failed (Run All stops there), or the kernel died.
RUN_ALL_DONE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const code = panel.content.widgets.filter((c) => c.model.type === "code");
  const failed = code.some((c) => c.model.outputs.toJSON().some((o) => o.output_type === "error"));
  const status = panel.sessionContext.session.kernel.status;
  return status === "dead" || (status === "idle"
    && (failed || code.every((c) => c.model.executionCount !== null)));
}"""
# What a reader would take for an error, cell by cell: the outputs' data, and what is drawn.
PROBLEMS = """([maxHeight]) => {
  const said = ["Traceback (most recent call last)", "Error loading script",
    "Error displaying widget", "Javascript Error", "could not be drawn offline", "Model not found",
    "Failed to load model class"];
  const found = [];
  const cells = window.jupyterapp.shell.currentWidget.content.widgets;
  cells.forEach((cell, index) => {
    if (cell.model.type !== "code") return;
    const source = cell.model.sharedModel.getSource().split("\\n")[0].slice(0, 60);
    const say = (text) => found.push(`cell ${index} (${source}): ${text}`);
    if (cell.model.executionCount === null) say("did not run");
    for (const output of cell.model.outputs.toJSON()) {
      if (output.output_type === "error") say(`${output.ename}: ${output.evalue}`);
      if (output.output_type === "stream" && output.name === "stderr") say(`stderr: ${output.text}`);
    }
    for (const node of cell.node.querySelectorAll(".jp-OutputArea-output")) {
      for (const phrase of said) if (node.innerText.includes(phrase)) say(`shows "${phrase}"`);
      for (const error of node.querySelectorAll(".metaclaw-w .mc-error")) {
        say(`widget error: ${error.innerText}`);
      }
      const drawn = ".metaclaw-w, .vega-embed, .widget-box, .jupyter-widgets";
      if ((node.dataset.mimeType || "").includes("widget-view") && !node.querySelector(drawn)) {
        say("a widget output with no widget drawn in it");
      }
      const height = node.getBoundingClientRect().height;
      if (height > maxHeight) say(`an output ${Math.round(height)} px tall (a wall of output)`);
    }
  });
  return found;
}"""
# Text in the outputs (widgets included) whose contrast with what is behind it (the first opaque
# background up the tree, translucent ones blended over it) is below ``minimum`` (WCAG ratio).
LOW_CONTRAST = """([minimum]) => {
  const rgba = (css) => (css.match(/[\\d.]+/g) || []).map(Number).concat([1]).slice(0, 4);
  const over = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3]))
    .concat([1]);
  const behind = (node) => {
    const layers = [];
    for (let n = node; n && n.nodeType === 1; n = n.parentElement) {
      const colour = rgba(getComputedStyle(n).backgroundColor);
      if (colour[3] > 0) layers.push(colour);
      if (colour[3] >= 1) break;
    }
    return layers.reverse().reduce((under, top) => over(top, under), [255, 255, 255, 1]);
  };
  const luminance = (c) => {
    const [r, g, b] = c.slice(0, 3).map((v) => (v /= 255) <= 0.03928 ? v / 12.92
      : ((v + 0.055) / 1.055) ** 2.4);
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const low = [];
  const outputs = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output";
  for (const node of document.querySelectorAll(`${outputs} *`)) {
    const text = [...node.childNodes].some((t) => t.nodeType === 3 && t.textContent.trim());
    if (!text || !node.getClientRects().length || node.closest("svg")) continue;
    const style = getComputedStyle(node);
    if (style.visibility === "hidden" || Number(style.opacity) === 0) continue;
    const back = behind(node);
    const fore = over(rgba(style.color), back);
    const [hi, lo] = [luminance(fore), luminance(back)].sort((a, b) => b - a);
    const ratio = (hi + 0.05) / (lo + 0.05);
    if (ratio < minimum) {
      const under = `rgb(${back.slice(0, 3).map(Math.round)})`;
      low.push(`${ratio.toFixed(2)}: "${node.textContent.trim().slice(0, 40)}" `
        + `(${node.className || node.tagName}: ${style.color} on ${under})`);
    }
  }
  return [...new Set(low)].slice(0, 20);
}"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _lab_settings(folder: Path) -> None:
    """JupyterLab settings for the test: every cell in the page (no windowing: the checks and
    screenshots see all outputs), no news prompt, the light theme to begin with."""
    for extension, values in (("notebook-extension/tracker", {"windowingMode": "none"}),
                              ("apputils-extension/notification", {"fetchNews": "false"}),
                              ("apputils-extension/themes", {"theme": THEMES["light"]})):
        path = folder / "@jupyterlab" / f"{extension}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab serving copies of the notebooks from a temporary folder: its base URL."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    root = tmp / "lab"
    root.mkdir()
    for notebook in NOTEBOOKS:
        shutil.copy(notebook, root / notebook.name)
    _lab_settings(tmp / "settings")
    port = _free_port()
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"), "HF_HUB_OFFLINE": "1"}
    log_path = tmp / "jupyterlab.log"
    log = log_path.open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--ServerApp.token={TOKEN}", "--ServerApp.allow_root=True",
         f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
         "--LabApp.news_url=", "--ServerApp.port_retries=0"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start: " + log_path.read_text()[-2000:])
                time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless (Playwright gives it a new empty profile)."""
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


# -- the page ------------------------------------------------------------------------------------
def _open(browser, base: str, notebook: Path):
    """A tab with the notebook open in a workspace of its own (no other notebook restored, so
    no other kernel started), its kernel idle; page errors collect in ``page.errors``."""
    page = browser.new_page(viewport=VIEWPORT)
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(f"page error: {e}"))
    page.goto(f"{base}/lab/workspaces/{notebook.stem}/tree/{notebook.name}?reset&token={TOKEN}")
    page.wait_for_function(NOTEBOOK_READY, timeout=120_000)
    page.evaluate("() => { window.jupyterapp.shell.collapseLeft();"
                  " window.jupyterapp.shell.collapseRight(); }")
    return page


def _run_all(page) -> None:
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(RUN_ALL_DONE, timeout=RUN_ALL_S * 1000, polling=500)


def _set_theme(page, theme: str) -> None:
    name = THEMES[theme]
    page.evaluate("(name) => window.jupyterapp.commands.execute('apputils:change-theme',"
                  " {theme: name})", name)
    page.wait_for_function(
        "([name, light]) => document.body.dataset.jpThemeName === name"
        " && document.body.dataset.jpThemeLight === light",
        arg=[name, "true" if theme == "light" else "false"], timeout=30_000)


def _shut_down(page) -> None:
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
    page.close()


def _wait(page, script: str, arg, what: str, timeout: float = 30) -> None:
    try:
        page.wait_for_function(script, arg=arg, timeout=timeout * 1000)
    except playwright_sync.TimeoutError:
        pytest.fail(f"{what} (after {timeout:.0f} s)")


# -- the widgets' controls -------------------------------------------------------------------------
def _widget_text(widget) -> str:
    return " ".join(widget.inner_text().split())[:300]


def _check_skill_diff(page, widget, where: str) -> None:
    """Refresh, then pick another "from" generation: the diff of the new pair shows; a held
    proposal's "promote" either promotes it or says where it stands (decided by a later cell)."""
    widget.locator("button", has_text="refresh").first.click()
    old = widget.locator("select[aria-label='old generation']")
    new = widget.locator("select[aria-label='new generation']").input_value()
    current = old.input_value()
    offered = old.evaluate("s => [...s.options].map(o => o.value)")
    # another generation than the one shown, one that makes a change to show if there is
    choices = sorted((v for v in offered if v != current), key=lambda v: v == new)
    assert choices, f"{where}: the skill diff offers no other generation to compare"
    old.select_option(choices[0])
    summary = f"(generation {choices[0]} → {new})"
    _wait(page, "([w, text]) => w.querySelector('.mc-summary')"
          " && w.querySelector('.mc-summary').textContent.includes(text)",
          [widget.element_handle(), summary],
          f"{where}: picking generation {choices[0]} did not show its diff: {_widget_text(widget)}")
    assert widget.locator(".mc-error").count() == 0, f"{where}: {_widget_text(widget)}"

    held = widget.locator("details.mc-proposal-held")
    if held.count():
        card = held.first
        pid = card.get_attribute("data-proposal")
        card.locator("button.mc-promote").click()
        _wait(page, "([w, id]) => { const c = w.querySelector(`[data-proposal='${id}']`);"
              " return c && !c.classList.contains('mc-proposal-held'); }",
              [widget.element_handle(), pid],
              f"{where}: promoting proposal #{pid} changed nothing: {_widget_text(widget)}")
        said = " ".join(widget.locator(".mc-error, .mc-message").all_inner_texts())
        assert f"proposal #{pid}" in said and ("promoted" in said or "already" in said), (
            f"{where}: promoting proposal #{pid} said {said!r}")


def _check_rows(page, widget, where: str, title: str = "Turn") -> None:
    """A row not open yet opens its turn: the detail pane under the table shows it."""
    row = widget.locator("tr.mc-row:not(.mc-selected)").first
    assert row.count(), f"{where}: the widget shows no row: {_widget_text(widget)}"
    turn = row.locator("td").first.inner_text()  # "#12"
    row.click()
    _wait(page, "([w, title]) => { const t = w.querySelector('.mc-detail .mc-title');"
          " return t && t.textContent === title; }", [widget.element_handle(), f"{title} {turn}"],
          f"{where}: clicking row {turn} did not open it: {_widget_text(widget)}")
    assert widget.locator(".mc-error").count() == 0, f"{where}: {_widget_text(widget)}"


def _check_buffers(page, widget, where: str) -> None:
    """A buffers row opens its turn, with the turn's messages."""
    _check_rows(page, widget, where)
    assert widget.locator(".mc-detail .mc-message").count() > 0, f"{where}: the turn is empty"


def _check_experiment(page, widget, where: str) -> None:
    """A case of the experiment opens with every variant's reply."""
    _check_rows(page, widget, where, title="Case: turn")


def _check_trace(page, widget, where: str) -> None:
    """The next turn (or, on the last one, the previous): the counter and the detail pane both
    move to it."""
    position = widget.locator(".mc-position").inner_text()  # "1 / 9"
    at, total = (int(n) for n in position.split(" / "))
    assert total > 0, f"{where}: the trace shows no turn: {_widget_text(widget)}"
    button, to = ("next turn", at + 1) if at < total else ("previous turn", at - 1)
    widget.locator(f"button[aria-label='{button}']").click()
    _wait(page, """([w, position]) => {
        const row = w.querySelector('.mc-trace-row.mc-selected');
        const head = w.querySelector('.mc-trace-detail .mc-summary b');
        return w.querySelector('.mc-position').textContent === position && row && head
          && head.textContent === `Turn ${row.querySelector('.mc-turn-id').textContent}`; }""",
          [widget.element_handle(), f"{to} / {total}"],
          f"{where}: the trace's {button} did not show turn {to} of {total}: "
          f"{_widget_text(widget)}")
    assert widget.locator(".mc-error").count() == 0, f"{where}: {_widget_text(widget)}"


def _check_refresh(page, widget, where: str) -> None:
    """Refresh reads the workspace again: the view is drawn anew from what the kernel sent."""
    widget.evaluate("w => { w.firstElementChild.dataset.before = 'refresh'; }")
    widget.locator("button", has_text="refresh").first.click()
    _wait(page, "w => w.firstElementChild && !w.firstElementChild.dataset.before",
          widget.element_handle(), f"{where}: refresh got no answer")
    assert widget.locator(".mc-error").count() == 0, f"{where}: {_widget_text(widget)}"


def _check_scheduler(page, widget, where: str) -> None:
    """Refresh reads the status again (the view is drawn anew: its "as of" time moved)."""
    _check_refresh(page, widget, where)
    assert widget.locator(".mc-badge.mc-big").inner_text().strip(), f"{where}: no state shown"


def _check_chart(page, chart, where: str) -> None:
    """An altair chart widget is drawn (vega's canvas or SVG), with no error."""
    _wait(page, "c => c.querySelector('canvas, svg.marks')", chart.element_handle(),
          f"{where}: the chart widget was not drawn: {' '.join(chart.inner_text().split())}")


def _check_progress(page, bar, where: str) -> None:
    """A long magic's progress bar (an ipywidgets bar and label) shows its work done: the bar
    full, the label naming the last step."""
    _wait(page, "b => { const p = b.querySelector('.progress-bar');"
          " return p && p.style.width === '100%'; }", bar.element_handle(),
          f"{where}: the progress bar did not reach its end")
    label = bar.locator("xpath=following-sibling::*[contains(@class, 'widget-label')]")
    assert label.count() and label.first.inner_text().strip(), f"{where}: the bar has no label"


#: The widgets by the class their front-end gives them, and how to use their controls.
CONTROLS = {".metaclaw-skill-diff": _check_skill_diff, ".metaclaw-buffers": _check_buffers,
            ".metaclaw-trace": _check_trace, ".metaclaw-scheduler": _check_scheduler,
            ".metaclaw-experiment": _check_experiment, ".metaclaw-evidence": _check_refresh,
            ".vega-embed": _check_chart, ".widget-hprogress": _check_progress}


def _check_controls(page, notebook: Path, theme: str) -> int:
    """Use every widget's controls once; returns how many widgets were used."""
    used = 0
    for selector, check in CONTROLS.items():
        widgets = page.locator(f"{NOTEBOOK_SHOWN} {selector}")
        for index in range(widgets.count()):
            widget = widgets.nth(index)
            widget.scroll_into_view_if_needed()
            check(page, widget, f"{notebook.name}, {theme} theme, {selector} #{index + 1}")
            used += 1
    return used


# -- screenshots ---------------------------------------------------------------------------------
def _screenshot(page, notebook: Path, theme: str, folder: Path) -> Path:
    """The notebook as it shows from its showcase cell on, cropped to the notebook, as a PNG
    of at most 256 colours (a tenth of the bytes of the browser's own)."""
    snippet = SHOWCASE.get(notebook.name)
    page.evaluate("""(snippet) => {
        const panel = window.jupyterapp.shell.currentWidget;
        const cells = panel.content.widgets;
        const cell = cells.find((c) => snippet ? c.model.sharedModel.getSource().includes(snippet)
          : c.node.querySelector(".metaclaw-w, .vega-embed")) || cells[0];
        panel.content.activeCellIndex = cells.indexOf(cell);
        cell.node.scrollIntoView({block: "start"});
    }""", snippet)
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    box = page.locator(f"{NOTEBOOK_SHOWN} .jp-WindowedPanel-outer").bounding_box()
    png = page.screenshot(clip=box, animations="disabled", caret="hide")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{notebook.stem}-{theme}.png"
    try:
        from PIL import Image

        with Image.open(io.BytesIO(png)) as image:
            out = io.BytesIO()
            image.quantize(256, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
            png = out.getvalue()
    except ImportError:  # the browser's PNG as it is
        pass
    path.write_bytes(png)
    return path


# -- the test ------------------------------------------------------------------------------------
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_tutorial_after_run_all_in_light_and_dark(notebook, jupyterlab, browser):
    page = _open(browser, jupyterlab, notebook)
    try:
        _set_theme(page, "light")
        _run_all(page)
        assert page.evaluate(PROBLEMS, [MAX_OUTPUT_PX]) == []
        folder = Path(SCREENSHOTS) if SCREENSHOTS else None
        for theme in ("light", "dark"):  # the notebook as Run All left it
            _set_theme(page, theme)
            _check_contrast(page, theme)
            if folder is not None:
                _screenshot(page, notebook, theme, folder)
        for theme in ("dark", "light"):  # then every control, in each theme
            _set_theme(page, theme)
            used = _check_controls(page, notebook, theme)
            _check_contrast(page, theme)
        assert page.evaluate(PROBLEMS, [MAX_OUTPUT_PX]) == []
        assert page.errors == []
        saved = _saved_widgets(notebook)
        assert used >= saved, (f"{notebook.name}: the saved notebook shows {saved} widgets, "
                               f"{used} were drawn and used (a new kind of widget needs a check "
                               "in CONTROLS)")
    finally:
        _shut_down(page)


def _check_contrast(page, theme: str) -> None:
    low = page.evaluate(LOW_CONTRAST, [MIN_CONTRAST])
    assert low == [], f"{theme} theme, output text hard to read:\n" + "\n".join(low)


def _saved_widgets(notebook: Path) -> int:
    """How many outputs of the committed notebook are widget views."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum("application/vnd.jupyter.widget-view+json" in output.get("data", {})
               for cell in cells for output in cell.get("outputs", []))
