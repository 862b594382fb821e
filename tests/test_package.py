"""Package-level promises: a light import, the layering, shipped data."""

import ast
import subprocess
import sys
from pathlib import Path

import metaclaw

ROOT = Path(metaclaw.__file__).resolve().parent
HEAVY = ("torch", "transformers", "peft", "tinker", "sentence_transformers", "altair",
         "IPython", "ipywidgets", "anywidget")


def test_import_metaclaw_and_its_core_modules_stays_light():
    code = ("import sys, metaclaw, metaclaw.store, metaclaw.skills.library, metaclaw.skills.retrieval, "
            "metaclaw.proxy.app, metaclaw.runtime, metaclaw.cli, metaclaw.fastloop.judge, "
            "metaclaw.fastloop.evolver, metaclaw.fastloop.loop, metaclaw.buffers, metaclaw.slowloop.grpo, metaclaw.slowloop.policy, "
            "metaclaw.slowloop.backends, metaclaw.slowloop.scheduler, metaclaw.bench; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_core_never_imports_the_notebook_layer():
    """Imports point downward: nothing outside metaclaw/notebook imports IPython, widgets or
    the notebook package (at module level or inside functions)."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "notebook" or rel == Path("__init__.py"):
            continue  # the notebook layer itself, and the %load_ext hooks (lazy imports)
        if "data" in rel.parts:  # benchmark input files, not our code
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in ("IPython", "ipywidgets", "anywidget") or \
                        name.startswith("metaclaw.notebook"):
                    offenders.append(f"{rel}: {name}")
    assert offenders == []


def test_shipped_files_exist():
    assert (ROOT / "bench" / "data" / "metaclaw-bench-small" / "all_tests.json").is_file()
    assert len(list((ROOT / "skills" / "starter_skills").glob("*/SKILL.md"))) >= 6
    for name in ("skill_diff.js", "buffers.js", "scheduler.js", "trace.js", "metaclaw.css"):
        assert (ROOT / "_widgets" / name).is_file()
