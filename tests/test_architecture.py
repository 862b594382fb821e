"""The package's layout holds: its imports form no circle and point one way, down the wings.

The wings, lowest first (a module may import its own wing and the wings below it, never one
above it; see each package's ``__init__`` docstring and README's *Layout*):

0. the shared modules at the top of the package (``metaclaw/*.py`` below the outer layer:
   ``jsonlib``, ``aio``, ``turns``, ``redact``, ``progress``, ``store``, ``buffers``,
   ``training_lease``, ``fileio``, ``gctune``, ``jsontext``);
1. ``metaclaw.skills``: the skill format, the library, the skill block, retrieval;
2. ``metaclaw.protocols``: the wire formats;
3. ``metaclaw.proxy``: the request path;
4. ``metaclaw.fastloop``: judge, evolver, gate, proposals, labels;
5. ``metaclaw.slowloop``: GRPO, the policy, the backends, the scheduler;
6. ``metaclaw.offline``: the doubles, the simulated and small local models;
7. the outer layers: ``cli``, ``console``, ``argtypes``, ``runtime``, ``demo``, ``wire``, ``trace``,
   ``transcripts``, ``metaclaw.bench`` and ``metaclaw.notebook``.

Every import counts, at module level or inside a function (lazy imports keep start-up fast; they
do not make a circle or an upward arrow acceptable), except the code under
``if __name__ == "__main__":`` (a script's entry point runs as ``__main__``, not as the module).
"""

import ast
from pathlib import Path

import metaclaw

ROOT = Path(metaclaw.__file__).resolve().parent

WINGS = {"skills": 1, "protocols": 2, "proxy": 3, "fastloop": 4, "slowloop": 5, "offline": 6,
         "bench": 7, "notebook": 7}
OUTER = {"cli", "console", "argtypes", "runtime", "demo", "wire", "trace", "transcripts", "__main__"}
SHARED = {"jsonlib", "aio", "turns", "redact", "progress", "store", "buffers", "training_lease",
          "fileio", "gctune", "jsontext"}
#: ``metaclaw/__init__.py`` defines the ``%load_ext metaclaw`` hooks, which load the notebook
#: layer when IPython calls them.
ALLOWED_UP = {("metaclaw", "metaclaw.notebook.magics")}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if "data" in parts or parts[:3] == ["metaclaw", "bench", "scripts"]:
            continue  # benchmark input files and the graders' scripts, not the package's modules
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
        isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"


def _imports(tree: ast.AST):
    """Dotted names imported anywhere in ``tree`` but under ``if __name__ == "__main__":``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_main_guard(node):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of this package: line}."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        for line, name, names in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name != "metaclaw" and not name.startswith("metaclaw."):
                continue
            targets = [f"{name}.{n}" if f"{name}.{n}" in mods else name for n in names] or [name]
            for target in map(owner, targets):
                if target and target != mod:
                    graph[mod].setdefault(target, line)
    return graph


def rank(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return 0  # the package itself
    if parts[1] in WINGS:
        return WINGS[parts[1]]
    if parts[1] in OUTER:
        return 7
    assert parts[1] in SHARED, f"{mod}: a module outside the wings; place it in one"
    return 0


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circles():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_wings():
    upward = [f"{mod} -> {target} (line {line})"
              for mod, targets in sorted(import_graph().items())
              for target, line in sorted(targets.items())
              if rank(target) > rank(mod) and (mod, target) not in ALLOWED_UP]
    assert upward == []


def test_only_the_notebook_layer_imports_the_command_line():
    graph = import_graph()
    users = sorted(m for m, targets in graph.items() if "metaclaw.cli" in targets)
    assert users == ["metaclaw.__main__", "metaclaw.notebook.magics"]


#: The sentence every package's ``__init__`` docstring has: a paragraph that starts with it and
#: says what the package may import (and what never), e.g. "May import: the shared modules and
#: :mod:`metaclaw.skills`. Never the proxy, ... (checked by ``tests/test_architecture.py``)."
MAY_IMPORT = "May import:"

#: What the packages inside a wing or an outer layer import besides themselves, as their
#: docstrings say, where the wings' order above allows more: the allowed prefixes ...
ONLY = {"metaclaw.store": (), "metaclaw.slowloop.scheduler": (),
        "metaclaw.slowloop.backends": ("metaclaw.slowloop.causal_lm",)}
#: ... or the forbidden ones.
NEVER = {"metaclaw.bench": ("metaclaw.notebook", "metaclaw.cli", "metaclaw.demo",
                            "metaclaw.runtime"),
         "metaclaw.notebook.widgets": ("metaclaw.notebook.magics", "metaclaw.cli")}


def _packages() -> list[Path]:
    return sorted(p for p in ROOT.rglob("__init__.py") if "data" not in p.relative_to(ROOT).parts)


def _within(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def test_every_package_says_what_lives_there_and_what_it_may_import():
    missing = []
    for init in _packages():
        name = init.relative_to(ROOT.parent).as_posix()
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{name} has no docstring"
        if not any(line.startswith(MAY_IMPORT) for line in doc.splitlines()):
            missing.append(name)
    assert missing == [], (f"these package docstrings have no paragraph starting {MAY_IMPORT!r} "
                           "that says what the package may import")


def test_packages_import_what_their_docstrings_say():
    graph = import_graph()
    shared = tuple(f"metaclaw.{name}" for name in SHARED)
    wrong = []
    for package, allowed in ONLY.items():
        wrong += [f"{mod} -> {target}" for mod, targets in sorted(graph.items())
                  if _within(mod, package) for target in sorted(targets)
                  if not _within(target, package)
                  and not any(_within(target, ok) for ok in shared + allowed)]
    for package, forbidden in NEVER.items():
        wrong += [f"{mod} -> {target}" for mod, targets in sorted(graph.items())
                  if _within(mod, package) for target in sorted(targets)
                  if any(_within(target, no) for no in forbidden)]
    # the notebook layer is imported by nothing but the %load_ext hooks of metaclaw/__init__.py
    wrong += [f"{mod} -> {target}" for mod, targets in sorted(graph.items())
              if not _within(mod, "metaclaw.notebook") for target in targets
              if _within(target, "metaclaw.notebook") and (mod, target) not in ALLOWED_UP]
    assert wrong == []


def test_the_package_itself_and_the_bench_checkers_import_almost_nothing():
    top = ast.parse((ROOT / "__init__.py").read_text(encoding="utf-8"))
    at_import = [node for node in top.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(node) for node in at_import] == []  # the hooks import inside functions
    for script in sorted((ROOT / "bench" / "scripts").glob("*.py")):
        for _, name, _ in _imports(ast.parse(script.read_text(encoding="utf-8"))):
            assert not name.startswith("metaclaw") or name == "metaclaw.bench.graders", \
                f"{script.name} imports {name}"
