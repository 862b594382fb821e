"""Pages generated at build time (mkdocs-gen-files): the CLI reference from the parser, the
Python API reference from the package as it is laid out, and the tutorials from notebooks/.

Nothing here names a module, a command or a notebook: each section follows what exists, so a
renamed module, a new subcommand or a new notebook shows up in the site without editing this file.
"""

from __future__ import annotations

import argparse
import ast
import os
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "metaclaw"
DOCS = ROOT / "docs"


def _cell(text: object) -> str:
    """``text`` made safe for one Markdown table cell."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text.replace("[", "\\[").replace("]", "\\]")  # not a link or a cross-reference


# -- the CLI --------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of ``parser``, in the parser's order."""
    found = []
    for action in parser._actions:  # argparse keeps no public list of subcommands
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | default | help |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0 and action.metavar != argparse.SUPPRESS:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
            if action.choices:
                name += " (" + " \\| ".join(f"`{c}`" for c in action.choices) + ")"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 \
            else f"`{default}`"
        help_text = (action.help or "").replace("%(default)s", str(default)).replace(
            "%(choices)s", ", ".join(map(str, action.choices or ())))
        if help_text == argparse.SUPPRESS:
            continue
        rows.append(f"| {name} | {_cell(shown)} | {_cell(help_text)} |")
    return rows if len(rows) > 2 else []


def cli_page() -> None:
    os.environ["COLUMNS"] = "100"  # the usage lines wrap the same on every machine
    for name in [n for n in os.environ if n.startswith("METACLAW_")]:
        del os.environ[name]  # defaults read from the environment (a token) stay out of the page
    from metaclaw.cli import build_parser

    parser = build_parser()
    lines = ["# Command line", "",
             "Generated from `metaclaw.cli.build_parser()` when the site is built: every command "
             "of `metaclaw` with its options and their help, as `metaclaw COMMAND --help` prints "
             "them.", "", f"{parser.description or ''}", "",
             "| command | what it does |", "|---|---|"]
    commands = _subparsers(parser)
    for name, help_text, _ in commands:
        lines.append(f"| [`metaclaw {name}`](#metaclaw-{name}) | {_cell(help_text)} |")
    lines.append("")

    def document(prefix: str, name: str, help_text: str, sub: argparse.ArgumentParser,
                 level: int) -> None:
        full = f"{prefix} {name}"
        anchor = full.replace(" ", "-")
        lines.extend([f"{'#' * level} `{full}` {{#{anchor}}}", ""])
        if help_text:
            lines.extend([help_text[0].upper() + help_text[1:] + ".", ""])
        if sub.description:
            lines.extend([sub.description, ""])
        lines.extend(["```text", sub.format_usage().strip(), "```", ""])
        lines.extend(_options_table(sub))
        lines.append("")
        if sub.epilog:
            lines.extend([sub.epilog, ""])
        for child, child_help, child_parser in _subparsers(sub):
            document(full, child, child_help, child_parser, min(level + 1, 6))

    for name, help_text, sub in commands:
        document("metaclaw", name, help_text, sub, 2)
    with mkdocs_gen_files.open("reference/cli.md", "w") as f:
        f.write("\n".join(lines))


# -- the Python API -------------------------------------------------------------------------
def _modules() -> list[tuple[str, ...]]:
    """The import paths (as tuples) of every public module of the package: folders without an
    ``__init__.py`` (data) and names starting with ``_`` (private) are left out."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        folders = path.parent.relative_to(ROOT).parts
        if not all((ROOT.joinpath(*folders[:i + 1]) / "__init__.py").exists()
                   for i in range(len(folders))):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        found.append(parts)
    return found


def _summary(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError):
        doc = None
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ")


def api_pages() -> None:
    nav = mkdocs_gen_files.Nav()
    index = ["# Python API", "",
             "Generated from the docstrings of the `metaclaw` package when the site is built, one "
             "page per module, following the package's layout.", "",
             "| module | what it is |", "|---|---|"]
    nav["Overview"] = "index.md"
    for parts in _modules():
        name = ".".join(parts)
        source = ROOT.joinpath(*parts).with_suffix(".py")
        if not source.exists():
            source = ROOT.joinpath(*parts) / "__init__.py"
        doc_path = Path(*parts[1:] or ("metaclaw",)).with_suffix(".md") if len(parts) > 1 \
            else Path("metaclaw.md")
        nav[parts] = doc_path.as_posix()
        with mkdocs_gen_files.open(Path("reference/api") / doc_path, "w") as f:
            f.write(f"# `{name}`\n\n::: {name}\n")
        mkdocs_gen_files.set_edit_path(Path("reference/api") / doc_path, source.relative_to(ROOT))
        index.append(f"| [`{name}`]({doc_path.as_posix()}) | {_cell(_summary(source))} |")
    with mkdocs_gen_files.open("reference/api/index.md", "w") as f:
        f.write("\n".join(index) + "\n")
    with mkdocs_gen_files.open("reference/api/SUMMARY.md", "w") as f:
        f.writelines(nav.build_literate_nav())


# -- the tutorials ----------------------------------------------------------------------------
def tutorial_pages() -> None:
    """Each notebook of notebooks/ as a page, with the outputs it was saved with (it is not run
    here), and the screenshots of docs/images/ that exist, on the tutorials' overview page."""
    nav = ["* [Overview](index.md)"]
    shots = ["", "## Screenshots", "",
             "Each notebook opened in JupyterLab after *Run All*, from its first widget on "
             "(light or dark to match the site's theme).", ""]
    found = False
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        target = f"tutorials/{notebook.name}"
        with mkdocs_gen_files.open(target, "wb") as f:
            f.write(notebook.read_bytes())
        mkdocs_gen_files.set_edit_path(target, notebook.relative_to(ROOT))
        title = notebook.stem.replace("_", " ")
        nav.append(f"* [{title}]({notebook.name})")
        images = [(theme, DOCS / "images" / f"{notebook.stem}-{theme}.png")
                  for theme in ("light", "dark")]
        images = [(theme, image) for theme, image in images if image.exists()]
        if images:
            found = True
            shots.extend([f"### [{title}]({notebook.name})", ""])
            # both when both exist, each shown with the theme it matches; else the one there is
            suffix = len(images) > 1
            for theme, image in images:
                shots.append(f"![{notebook.stem} after Run All ({theme} theme)](../images/"
                             f"{image.name}{'#only-' + theme if suffix else ''}){{ loading=lazy }}")
            shots.append("")
    with mkdocs_gen_files.open("tutorials/SUMMARY.md", "w") as f:
        f.write("\n".join(nav) + "\n")
    if found:
        with mkdocs_gen_files.open("tutorials/index.md", "a") as f:
            f.write("\n".join(shots))


cli_page()
api_pages()
tutorial_pages()
