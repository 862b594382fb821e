"""Answer-key agent doubles for testing and timing the benchmark runner (not models).

:func:`oracle_replies` returns a reply function for :class:`metaclaw.offline.double.DoubleServer` that
*reads the benchmark's answer key*: for a file-check round it emits the tool calls that satisfy
the round's check command (files with the right names, metadata, timestamps, backups and done-log
lines), then a short answer; for a multiple-choice round it answers ``\\bbox{<correct letters>}``.
It exists to check the runner end to end (an oracle must score 100%) and to time it; it says
nothing about any model. :func:`idle_replies` is the opposite double: it never uses a tool and
never gives a boxed answer.

The reply functions are stateless: they find the round from the last user message of the request.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable

from metaclaw.bench.data import Day, Round

TS = "2026-03-16T09:30:00+08:00"
AUTHOR = "metaclaw_agent"

_ARG = r"(\$\(python -c \"(?:[^\"\\]|\\.)*\"\)|[^\s&|;]+)"

# Files checked by inline ``python -c`` code of the small benchmark (not by a packaged checker).
INLINE_FILES: dict[str, dict] = {
    "day01/sprint_tasks.json": {"tasks": [{"id": "T-405", "title": "Release notes", "due_date": TS,
                                           "created_at": TS}]},
    "day01/api_spec_v2.3.json": {"paths": {"/projects": {
        "get": {"parameters": [{"name": "updated_since", "example": TS}]},
        "post": {"requestBody": {"content": {"application/json": {
            "example": {"start_date": TS, "deadline": TS}}}}}}}},
    "day02/perf_metrics.json": {"sampled_at": [TS, TS], "collection_start": TS, "collection_end": TS},
}


def _set_path(obj: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node: Any = obj
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part.endswith("[]"):
            name = part[:-2]
            items = node.setdefault(name, [{}])
            if last:
                node[name] = [value]
                return
            node = items[0]
        elif last:
            node[part] = value
        else:
            node = node.setdefault(part, {})


def file_content(path: str, iso_fields: Iterable[str] = ()) -> str:
    """Content for ``path`` carrying metadata (by extension) and ISO timestamps at ``iso_fields``."""
    ext = path.rsplit(".", 1)[-1].lower()
    if path in INLINE_FILES:
        data = json.loads(json.dumps(INLINE_FILES[path]))
    else:
        data = {}
    if ext == "json":
        data.setdefault("meta", {"created_at": TS, "author": AUTHOR, "status": "done"})
        for field in iso_fields:
            _set_path(data, field, TS)
        return json.dumps(data, indent=2)
    if ext in ("md", "markdown"):
        return f"---\ncreated_at: {TS}\nauthor: {AUTHOR}\nstatus: done\n---\n\n# Report\n\nDone.\n"
    if ext == "py":
        return (f'"""Utility module.\n\nMeta:\n  created_at: {TS}\n  author: {AUTHOR}\n  status: done\n"""\n\n'
                "def main():\n    return 0\n")
    return f"# meta: created_at={TS} author={AUTHOR} status=done\ncolumn_a,column_b\n1,2\n"


def _target_for(arg: str) -> str:
    """The file a checker argument names: a literal path, or the file a ``$(python -c ...)`` picks."""
    if not arg.startswith("$("):
        return arg
    pattern = re.search(r"glob\.glob\('([^']+)'\)", arg).group(1)
    words = re.findall(r"'(\w+)' in f", arg)
    stem = f"{words[0]}_oracle" if words else "oracle_output"
    return pattern.replace("*", stem, 1)


def plan_file_check(command: str) -> list[dict]:
    """Tool calls (``{"name", "arguments"}``) that make ``command`` exit 0 in a fresh workspace."""
    files: dict[str, set[str]] = {}
    calls: list[dict] = []
    for path in INLINE_FILES:
        if f"'{path}'" in command:
            files.setdefault(path, set())
    for m in re.finditer(r"check_iso8601\.py\s+" + _ARG + r"((?:\s+[\w.\[\]]+)+)", command):
        files.setdefault(_target_for(m.group(1)), set()).update(m.group(2).split())
    for m in re.finditer(r"check_metadata\.py\s+" + _ARG, command):
        files.setdefault(_target_for(m.group(1)), set())
    for m in re.finditer(r"glob\.glob\('([^']+)'\)\); sys\.exit\(0 if (?:len\(files\)>=(\d+)|files)", command):
        pattern, need = m.group(1), int(m.group(2) or 1)
        have = [p for p in files if re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), p)]
        for i in range(len(have), need):
            files.setdefault(pattern.replace("*", f"oracle_extra_{i}", 1), set())
    for m in re.finditer(r"check_filename\.py\s+--dir\s+(\S+)\s+--ext\s+(\w+)(?:\s+--min-count\s+(\d+))?",
                         command):
        folder, ext, count = m.group(1).rstrip("/"), m.group(2), int(m.group(3) or 1)
        for i in range(1, count + 1):
            files.setdefault(f"{folder}/20260101_oracle_{ext}_{i}.{ext}", set())
    for m in re.finditer(r"check_filename\.py\s+(?!--)(\S+)", command):
        files.setdefault(m.group(1), set())
    for m in re.finditer(r"check_backup\.py\s+(\S+)", command):
        path = m.group(1)
        calls.append({"name": "copy_file", "arguments": {"source": path, "destination": f"{path}.bak"}})
        calls.append({"name": "append_file", "arguments": {"path": path, "content": "\n\nUpdated.\n"}})
    for path, fields in files.items():
        calls.append({"name": "write_file", "arguments": {"path": path,
                                                          "content": file_content(path, sorted(fields))}})
    for m in re.finditer(r"check_done_log\.py\s+(\S+)([^&]*)", command):
        opts = m.group(2)
        prefix = re.search(r"--task-prefix\s+(\S+)", opts)
        counts = [int(x) for x in re.findall(r"--min-(?:entries|count)\s+(\d+)", opts)]
        n = max(counts + [1])
        task = prefix.group(1) if prefix else "task"
        lines = "".join(f"[DONE] {TS} | {task}_{i} | Finished step {i}\n" for i in range(1, n + 1))
        calls.append({"name": "write_file", "arguments": {"path": m.group(1), "content": lines}})
    return calls


def _round_index(days: Iterable[Day]) -> list[tuple[str, Round]]:
    return sorted(((r.question, r) for d in days for r in d.rounds if r.question),
                  key=lambda item: -len(item[0]))


def _find_round(body: dict, index: list[tuple[str, Round]]) -> tuple[Round | None, bool]:
    """The round the request is about, and whether tool results already follow its question."""
    messages = body.get("messages") or []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return None, False
    text = messages[last_user].get("content")
    text = text if isinstance(text, str) else ""
    acted = any(m.get("role") == "tool" for m in messages[last_user + 1:])
    for question, round_ in index:
        if text.endswith(question):
            return round_, acted
    return None, acted


def oracle_replies(days: Iterable[Day], *, delay: float = 0.0) -> Callable[[dict], Any]:
    """A ``DoubleServer`` reply function that solves every round of ``days`` from the answer key."""
    from metaclaw.offline.double import Reply

    index = _round_index(days)

    def reply(body: dict) -> Reply:
        round_, acted = _find_round(body, index)
        if round_ is None or not body.get("tools"):
            return Reply(content="Noted, thank you.", delay=delay)
        if round_.type == "multi_choice":
            return Reply(content=f"My answer: \\bbox{{{','.join(round_.answer)}}}", delay=delay)
        if acted:
            return Reply(content="Done: the files are written.", delay=delay)
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                 for i, c in enumerate(plan_file_check(round_.eval["command"]))]
        return Reply(content=None, tool_calls=calls, delay=delay)

    return reply


def idle_replies(*, delay: float = 0.0) -> Callable[[dict], Any]:
    """A ``DoubleServer`` reply function that never acts and never gives a boxed answer."""
    from metaclaw.offline.double import Reply

    def reply(body: dict) -> Reply:
        return Reply(content="I have read the request and will get to it later.", delay=delay)

    return reply
