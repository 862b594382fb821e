"""The documentation site builds in strict mode (a broken link, a missing page or an unresolved
API reference fails it) and holds what it is built from: every subcommand of the CLI's parser,
every notebook rendered with its saved outputs, and the Python API index."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# one strict build serves every test of this file; on a loaded 2-core machine it takes about a minute
pytestmark = pytest.mark.timeout(900)

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
for plugin in ("material", "mkdocs_jupyter", "mkdocstrings_handlers.python", "mkdocs_gen_files",
               "mkdocs_literate_nav"):
    pytest.importorskip(plugin, reason=f"{plugin} (docs extra) is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    yield out
    shutil.rmtree(out, ignore_errors=True)


def test_cli_reference_lists_every_subcommand(site: Path) -> None:
    from metaclaw.cli import build_parser

    page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    subcommands = [action for action in build_parser()._actions
                   if isinstance(action, argparse._SubParsersAction)][0].choices
    assert subcommands
    for name in subcommands:
        assert f'id="metaclaw-{name}"' in page, f"metaclaw {name} is missing from the CLI page"


def test_each_notebook_is_rendered_with_its_outputs(site: Path) -> None:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        page = site / "tutorials" / notebook.stem / "index.html"
        assert page.exists(), f"{notebook.name} is not rendered"
        assert "jp-OutputArea-output" in page.read_text(encoding="utf-8"), \
            f"{notebook.name} is rendered without its outputs"


def test_api_index_links_a_page_per_module(site: Path) -> None:
    import re

    api = site / "reference" / "api"
    index = (api / "index.html").read_text(encoding="utf-8")
    assert "metaclaw.cli" in index
    links = set(re.findall(r'href="([a-z0-9_/]+/)"', index))
    assert len(links) >= 10, "the API index lists too few modules"
    for link in links:
        assert (api / link / "index.html").exists(), f"the API index links a missing page {link}"
