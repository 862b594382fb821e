"""The benchmark's convention checkers (MetaClaw-Bench contracts, see the data's CHECKERS.md).

Each ``check_*`` function takes paths relative to the current working directory (the day's
workspace when the runner grades a round) and returns a :class:`Verdict`; it never raises for
bad files, only for programming errors. Each ``cli_*`` function parses a command line, prints
``PASS`` or ``FAIL: <reason>`` and returns the exit code: 0 pass, 1 fail, 2 bad usage. The
modules in ``metaclaw.bench.scripts`` are thin wrappers over the ``cli_*`` functions.

The five conventions:

1. ISO 8601 timestamps with the +08:00 offset (``check_iso8601``)
2. file names ``YYYYMMDD_snake_case.ext`` (``check_filename``, ``check_filename_dir``)
3. metadata ``created_at`` / ``author`` / ``status`` in every output file (``check_metadata``)
4. a ``.bak`` copy before modifying a file (``check_backup``)
5. one ``[DONE] <time> | <task_id> | <summary>`` line per finished task in ``done.log``
   (``check_done_log``)

The graders live in the installed package, outside the agent's writable workspace.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from datetime import datetime
from typing import Any, Sequence

ISO_8601 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?\+08:00$")
FILENAME = re.compile(r"^\d{8}_[a-z][a-z0-9_]*\.[a-z0-9]+$")
DONE_LINE = re.compile(r"^\[DONE\]\s+(?P<time>[^|]*?)\s*\|\s*(?P<task>[^|]*?)\s*\|\s*(?P<summary>[^|]*?)\s*$")
TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
STATUSES = ("pending", "in_progress", "done")
MAX_SUMMARY_CHARS = 80

#: Environment variable naming a JSON file (outside the workspace) that lists the files present
#: when the day began, as paths relative to the workspace. ``check_filename_dir`` exempts them:
#: input files such as ``README.md`` are not the agent's outputs.
INITIAL_FILES_ENV = "METACLAW_BENCH_INITIAL_FILES"


class Verdict:
    """The result of one check: ``passed`` and, when it failed, one sentence saying why.

    (A plain class rather than a dataclass: the checkers start as fresh processes, and every
    import counts.)
    """

    __slots__ = ("passed", "reason")

    def __init__(self, passed: bool, reason: str = ""):
        self.passed = bool(passed)
        self.reason = reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Verdict) and (self.passed, self.reason) == (other.passed, other.reason)

    def __repr__(self) -> str:
        return f"Verdict(passed={self.passed}, reason={self.reason!r})"

    def __str__(self) -> str:
        return "PASS" if self.passed else f"FAIL: {self.reason}"

    def __bool__(self) -> bool:
        return self.passed


def _read_text(path: str | os.PathLike) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _ok() -> Verdict:
    return Verdict(True)


def _fail(reason: str) -> Verdict:
    return Verdict(False, reason)


def is_iso8601(value: Any) -> bool:
    """True when ``value`` is a string like ``2026-03-16T09:30:00+08:00`` naming a real instant."""
    if not isinstance(value, str) or not ISO_8601.match(value):
        return False
    plain = re.sub(r"\.\d+", "", value)  # fromisoformat rejects some fraction lengths on 3.11
    try:
        datetime.fromisoformat(plain)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# 1. ISO 8601 timestamps
# --------------------------------------------------------------------------------------------

def field_values(data: Any, path: str) -> list[tuple[str, Any]]:
    """Every value at a dotted field path, as ``(concrete_path, value)`` pairs.

    ``a.b`` walks objects; ``items[].due`` walks every element of the list ``items``.
    Raises ``KeyError`` (message = the reason) when a field is missing or has the wrong shape.
    """
    if not path or any(part == "" for part in path.split(".")):
        raise KeyError(f"field path {path!r} is malformed (use dotted names like a.b or items[].due)")
    current: list[tuple[str, Any]] = [("", data)]
    for part in path.split("."):
        is_list = part.endswith("[]")
        name = part[:-2] if is_list else part
        walked: list[tuple[str, Any]] = []
        for where, obj in current:
            here = f"{where}.{name}" if where else name
            if not isinstance(obj, dict):
                raise KeyError(f"{where or 'the document'} is not an object, so {here} is missing")
            if name not in obj:
                raise KeyError(f"field {here} is missing")
            value = obj[name]
            if is_list:
                if not isinstance(value, list):
                    raise KeyError(f"field {here} is not a list")
                if not value:
                    raise KeyError(f"field {here} is an empty list")
                walked.extend((f"{here}[{i}]", item) for i, item in enumerate(value))
            else:
                walked.append((here, value))
        current = walked
    return current


def _load_json(path: str | os.PathLike) -> tuple[Any, str | None]:
    try:
        text = _read_text(path)
    except FileNotFoundError:
        return None, f"{path} does not exist"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path} cannot be read ({exc})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})"


def check_iso8601(path: str | os.PathLike, fields: Sequence[str]) -> Verdict:
    """Every value at each field path of the JSON file is an ISO 8601 +08:00 timestamp."""
    data, error = _load_json(path)
    if error:
        return _fail(error)
    for field in fields:
        try:
            values = field_values(data, field)
        except KeyError as exc:
            return _fail(f"{path}: {exc.args[0]}")
        for where, value in values:
            if not is_iso8601(value):
                return _fail(f"{path}: {where} = {value!r} is not ISO 8601 with +08:00 "
                             "(expected like 2026-03-16T09:30:00+08:00)")
    return _ok()


# --------------------------------------------------------------------------------------------
# 2. file names
# --------------------------------------------------------------------------------------------

def check_filename(path: str | os.PathLike) -> Verdict:
    """The file exists and its name is ``YYYYMMDD_snake_case.ext``."""
    name = os.path.basename(os.fspath(path))
    if not os.path.isfile(path):
        return _fail(f"{path} does not exist or is not a file")
    if not FILENAME.match(name):
        return _fail(f"{name} does not match YYYYMMDD_snake_case.ext (e.g. 20260316_standup_notes.json)")
    return _ok()


def initial_files_from_env() -> set[str]:
    """The workspace-relative paths listed in the file named by ``METACLAW_BENCH_INITIAL_FILES``."""
    manifest = os.environ.get(INITIAL_FILES_ENV)
    if not manifest:
        return set()
    try:
        return {os.path.normpath(p) for p in json.loads(_read_text(manifest))}
    except (OSError, ValueError, TypeError):
        return set()


def check_filename_dir(directory: str | os.PathLike, ext: str, min_count: int = 1,
                       exempt: set[str] | None = None) -> Verdict:
    """At least ``min_count`` files with extension ``ext`` in ``directory``, all well named.

    ``exempt``: paths (relative to the working directory) of files that were there before the
    agent started (inputs such as ``README.md``); they neither count nor fail. Defaults to the
    manifest named by ``METACLAW_BENCH_INITIAL_FILES`` (empty when unset).
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return _fail(f"{directory} is not a directory")
    ext = ext.lower().lstrip(".")
    exempt = initial_files_from_env() if exempt is None else {os.path.normpath(p) for p in exempt}
    candidates = sorted(
        name for name in os.listdir(directory)
        if os.path.isfile(os.path.join(directory, name))
        and os.path.splitext(name)[1].lower() == f".{ext}"
        and os.path.normpath(os.path.join(directory, name)) not in exempt
    )
    bad = [name for name in candidates if not FILENAME.match(name)]
    if bad:
        return _fail(f"{', '.join(bad)} in {directory} does not match YYYYMMDD_snake_case.{ext} "
                     f"(e.g. 20260316_weekly_report.{ext})")
    if len(candidates) < min_count:
        return _fail(f"{directory} has {len(candidates)} new .{ext} file(s), at least {min_count} needed")
    return _ok()


# --------------------------------------------------------------------------------------------
# 3. metadata
# --------------------------------------------------------------------------------------------

def _front_matter(text: str) -> dict | None:
    lines = text.lstrip("\ufeff").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for i in range(1, len(lines)):
        if lines[i].strip() in ("---", "..."):
            import yaml  # pyyaml is a core dependency; BaseLoader keeps every scalar a string

            try:
                data = yaml.load("\n".join(lines[1:i]), Loader=yaml.BaseLoader)
            except yaml.YAMLError:
                return None
            return data if isinstance(data, dict) else None
    return None


def _docstring_meta(text: str) -> dict | None:
    try:
        doc = ast.get_docstring(ast.parse(text))
    except (SyntaxError, ValueError):
        return None
    if not doc:
        return None
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().rstrip(":").lower() == "meta" and line.strip().endswith(":"):
            meta: dict[str, str] = {}
            for entry in lines[i + 1:]:
                if not entry.strip():
                    if meta:
                        break
                    continue
                m = re.match(r"^\s*-?\s*([A-Za-z_]+)\s*:\s*(.*?)\s*$", entry)
                if not m:
                    break
                meta[m.group(1)] = m.group(2).strip("'\"")
            return meta
    return None


def _comment_meta(text: str) -> dict | None:
    """``# meta: created_at=... author=... status=...`` on the first line (CSV and other text)."""
    first = text.lstrip("\ufeff").split("\n", 1)[0].strip()
    m = re.match(r"^(?:#|//|--)\s*meta\s*:\s*(.*)$", first, re.IGNORECASE)
    if not m:
        return None
    pairs = re.findall(r"([A-Za-z_]+)\s*=\s*(\"[^\"]*\"|'[^']*'|\S+)", m.group(1))
    return {key: value.strip("'\"") for key, value in pairs}


def extract_metadata(path: str | os.PathLike) -> tuple[dict | None, str]:
    """The file's metadata block and where it was looked for (``(None, where)`` when absent)."""
    text = _read_text(path)
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"valid JSON ({exc.msg} at line {exc.lineno})"
        meta = data.get("meta") if isinstance(data, dict) else None
        return (meta if isinstance(meta, dict) else None), "a top-level \"meta\" object"
    if suffix in (".md", ".markdown"):
        return _front_matter(text), "a YAML front matter block (--- at the first line)"
    if suffix == ".py":
        return _docstring_meta(text), "a \"Meta:\" section in the module docstring"
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.load(text, Loader=yaml.BaseLoader)
        except yaml.YAMLError:
            data = None
        meta = data.get("meta") if isinstance(data, dict) else None
        return (meta if isinstance(meta, dict) else None), "a top-level meta mapping"
    return _comment_meta(text), "a first-line comment \"# meta: created_at=... author=... status=...\""


def check_metadata(path: str | os.PathLike) -> Verdict:
    """The file carries ``created_at`` (ISO 8601 +08:00), ``author`` and ``status``.

    JSON: a top-level ``meta`` object; Markdown: YAML front matter; Python: a ``Meta:`` section of
    the module docstring; YAML: a top-level ``meta`` mapping; other text (CSV, ...): a first-line
    comment ``# meta: created_at=... author=... status=...``.
    """
    if not os.path.isfile(path):
        return _fail(f"{path} does not exist or is not a file")
    try:
        meta, where = extract_metadata(path)
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(f"{path} cannot be read ({exc})")
    if meta is None:
        return _fail(f"{path} has no metadata: expected {where}")
    missing = [k for k in ("created_at", "author", "status") if k not in meta]
    if missing:
        return _fail(f"{path}: metadata lacks {', '.join(missing)}")
    if not is_iso8601(meta["created_at"]):
        return _fail(f"{path}: created_at = {meta['created_at']!r} is not ISO 8601 with +08:00")
    if not isinstance(meta["author"], str) or not meta["author"].strip():
        return _fail(f"{path}: author is empty")
    if meta["status"] not in STATUSES:
        return _fail(f"{path}: status = {meta['status']!r} is not one of {', '.join(STATUSES)}")
    return _ok()


# --------------------------------------------------------------------------------------------
# 4. backups
# --------------------------------------------------------------------------------------------

def check_backup(path: str | os.PathLike) -> Verdict:
    """``<file>.bak`` exists and differs from ``<file>`` (backed up before the change)."""
    bak = f"{os.fspath(path)}.bak"
    if not os.path.isfile(path):
        return _fail(f"{path} does not exist")
    if not os.path.isfile(bak):
        return _fail(f"{bak} does not exist (copy the file to {os.path.basename(bak)} before "
                     "modifying it)")
    try:
        with open(path, "rb") as a, open(bak, "rb") as b:
            same = a.read() == b.read()
    except OSError as exc:
        return _fail(f"cannot read {path} or its backup ({exc})")
    if same:
        return _fail(f"{bak} has the same content as {path}: either the file was not modified "
                     "or the backup was taken after the change")
    return _ok()


# --------------------------------------------------------------------------------------------
# 5. done log
# --------------------------------------------------------------------------------------------

def parse_done_log(text: str) -> tuple[list[dict], list[str]]:
    """``(entries, problems)``: valid ``[DONE]`` entries and one message per malformed line."""
    entries: list[dict] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        m = DONE_LINE.match(line.strip())
        if not m:
            problems.append(f"line {number} is not '[DONE] <time> | <task_id> | <summary>'")
        elif not is_iso8601(m["time"]):
            problems.append(f"line {number}: time {m['time']!r} is not ISO 8601 with +08:00")
        elif not TASK_ID.match(m["task"]):
            problems.append(f"line {number}: task_id {m['task']!r} is not one word like data_export_q1")
        elif not m["summary"]:
            problems.append(f"line {number}: the summary is empty")
        elif len(m["summary"]) > MAX_SUMMARY_CHARS:
            problems.append(f"line {number}: summary is longer than {MAX_SUMMARY_CHARS} characters")
        else:
            entries.append({"line": number, "time": m["time"], "task_id": m["task"],
                            "summary": m["summary"]})
    return entries, problems


def check_done_log(path: str | os.PathLike, task_prefix: str | None = None,
                   min_entries: int = 1) -> Verdict:
    """At least ``min_entries`` well-formed lines, none malformed, one task id with the prefix."""
    try:
        text = _read_text(path)
    except FileNotFoundError:
        return _fail(f"{path} does not exist (append one line per finished task to "
                     f"{os.path.basename(os.fspath(path))})")
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(f"{path} cannot be read ({exc})")
    entries, problems = parse_done_log(text)
    if problems:
        return _fail(f"{path}: {problems[0]}")
    if len(entries) < min_entries:
        return _fail(f"{path} has {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
                     f"at least {min_entries} needed")
    if task_prefix and not any(e["task_id"].startswith(task_prefix) for e in entries):
        return _fail(f"{path} has no entry whose task_id starts with {task_prefix!r}")
    return _ok()


# --------------------------------------------------------------------------------------------
# command lines (exit 0 pass, 1 fail, 2 bad usage)
# --------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse without ``-h``: a graded file name such as ``x -h .md``, word-split by the round's
    shell command, would otherwise print help and exit 0, a pass. Any exit argparse asks for is a
    usage error (exit 2), never a pass."""

    def __init__(self, *args, **kwargs):
        kwargs["add_help"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse exits 2 on bad usage; keep that, with one sentence
        self.print_usage(sys.stderr)
        print(f"usage error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message, file=sys.stderr, end="")
        raise SystemExit(status or 2)


def _report(verdict: Verdict) -> int:
    print(verdict)
    return 0 if verdict.passed else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be a non-negative integer")
    return value


def cli_iso8601(argv: Sequence[str] | None = None) -> int:
    """``check_iso8601.py <json_file> <field> [<field> ...]``."""
    parser = _Parser(prog="check_iso8601.py", description=check_iso8601.__doc__)
    parser.add_argument("json_file")
    parser.add_argument("fields", nargs="+", metavar="field")
    args = parser.parse_args(argv)
    return _report(check_iso8601(args.json_file, args.fields))


def cli_filename(argv: Sequence[str] | None = None) -> int:
    """``check_filename.py <file>`` or ``check_filename.py --dir D --ext E [--min-count N]``."""
    parser = _Parser(prog="check_filename.py", description=check_filename.__doc__)
    parser.add_argument("file", nargs="?")
    parser.add_argument("--dir", dest="directory")
    parser.add_argument("--ext")
    parser.add_argument("--min-count", type=_positive, default=1)
    args = parser.parse_args(argv)
    if args.directory is not None:
        if args.file is not None or not args.ext:
            parser.error("the --dir form takes --ext E and no file argument")
        return _report(check_filename_dir(args.directory, args.ext, args.min_count))
    if args.file is None:
        parser.error("give a file, or --dir D --ext E")
    return _report(check_filename(args.file))


def cli_metadata(argv: Sequence[str] | None = None) -> int:
    """``check_metadata.py <file>``."""
    parser = _Parser(prog="check_metadata.py", description=check_metadata.__doc__)
    parser.add_argument("file")
    args = parser.parse_args(argv)
    return _report(check_metadata(args.file))


def cli_backup(argv: Sequence[str] | None = None) -> int:
    """``check_backup.py <file>``."""
    parser = _Parser(prog="check_backup.py", description=check_backup.__doc__)
    parser.add_argument("file")
    args = parser.parse_args(argv)
    return _report(check_backup(args.file))


def cli_done_log(argv: Sequence[str] | None = None) -> int:
    """``check_done_log.py done.log [--task-prefix P] [--min-entries N]``.

    ``--min-count N`` is accepted too: the small benchmark's builder appended the file-name
    checker's ``--min-count`` to the end of some chained commands, where it lands on this
    checker; it is read as a lower bound on the number of entries (like ``--min-entries``).
    """
    parser = _Parser(prog="check_done_log.py", description=check_done_log.__doc__)
    parser.add_argument("file")
    parser.add_argument("--task-prefix")
    parser.add_argument("--min-entries", type=_positive, default=1)
    parser.add_argument("--min-count", type=_positive, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return _report(check_done_log(args.file, args.task_prefix, max(args.min_entries, args.min_count)))


CLIS = {
    "check_iso8601": cli_iso8601,
    "check_filename": cli_filename,
    "check_metadata": cli_metadata,
    "check_backup": cli_backup,
    "check_done_log": cli_done_log,
}
