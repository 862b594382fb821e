"""A tutorial as a person runs it: JupyterLab in headless Chromium (driven by Playwright) opens
``notebooks/01_quickstart.ipynb``, clears it, runs all cells, and then

* no output is an error or a traceback, and
* the skill diff widget drawn early in the notebook still answers after the last cell (which
  stops the proxy): another generation picked in its "from" menu shows the new diff.

Needs the ``playwright`` package, JupyterLab with the widget extensions (installed with the
``notebook`` extra) and Debian's Chromium at ``/usr/bin/chromium`` (``METACLAW_CHROMIUM`` names
another binary); skipped without them. About half a minute on two cores.
"""

from __future__ import annotations

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
NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"
TOKEN = "metaclaw-browser-test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]

pytestmark = pytest.mark.timeout(300)

# JavaScript run in the page, against the JupyterLab application object.
NOTEBOOK_READY = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
    && panel.sessionContext.session.kernel;
  return Boolean(kernel && kernel.connectionStatus === "connected" && kernel.status === "idle"
    && panel.content && panel.content.widgets.length > 0);
}"""
ALL_RUN = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const code = panel.content.widgets.filter((c) => c.model.type === "code");
  return panel.sessionContext.session.kernel.status === "idle"
    && code.every((c) => c.model.executionCount !== null);
}"""
PROBLEMS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const found = [];
  panel.content.widgets.forEach((cell, index) => {
    if (cell.model.type !== "code") return;
    for (const output of cell.model.outputs.toJSON()) {
      if (output.output_type === "error") found.push(`cell ${index}: ${output.ename}: ${output.evalue}`);
      if (output.output_type === "stream" && output.name === "stderr") found.push(`cell ${index} stderr: ${output.text}`);
      const text = JSON.stringify(output.data || output.text || "");
      if (text.includes("Traceback")) found.push(`cell ${index}: a traceback in the output`);
    }
  });
  return found;
}"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture()
def jupyterlab(tmp_path):
    """JupyterLab serving a copy of the notebook from a temporary folder: its base URL."""
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port = _free_port()
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), "HF_HUB_OFFLINE": "1"}
    settings = tmp_path / "settings" / "@jupyterlab"
    for extension, values in (("notebook-extension/tracker", {"windowingMode": "none"}),
                              ("apputils-extension/notification", {"fetchNews": "false"})):
        path = settings / f"{extension}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))  # every cell in the page; no news prompt
    log = (tmp_path / "jupyterlab.log").open("w")
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
                    pytest.fail("JupyterLab did not start: "
                                + (tmp_path / "jupyterlab.log").read_text()[-2000:])
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


def test_quickstart_after_run_all_has_no_error_and_a_live_diff_widget(jupyterlab, tmp_path):
    started = time.time()
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(f"{jupyterlab}/lab/tree/{NOTEBOOK.name}?token={TOKEN}")
            page.wait_for_function(NOTEBOOK_READY, timeout=120_000)
            page.evaluate("() => window.jupyterapp.commands.execute("
                          "'notebook:clear-all-cell-outputs')")
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(ALL_RUN, timeout=150_000, polling=500)

            assert page.evaluate(PROBLEMS) == []
            diff = page.locator(".metaclaw-skill-diff")
            assert diff.count() == 1
            summary = diff.locator(".mc-summary").first
            assert "(generation 1 → 2)" in summary.inner_text()  # pinned past the rollback
            assert "pinned to generation 1 → 2" in diff.inner_text()
            # after the last cell (%metaclaw stop): pick another "from" generation
            diff.locator("select[aria-label='old generation']").select_option("0")
            page.wait_for_function(
                "() => document.querySelector('.metaclaw-skill-diff .mc-summary').textContent"
                ".includes('(generation 0 → 2)')", timeout=30_000)
            assert "+9 added" in summary.inner_text()
            assert diff.locator(".mc-error").count() == 0
            diff.screenshot(path=str(tmp_path / "quickstart-diff-after-run-all.png"))
            assert errors == []
        finally:
            browser.close()
    assert time.time() - started < 240
