"""A day's workspace and the file tools the agent uses in it, confined to it.

Each day starts from a fresh copy (in a temporary folder) of the shared workspace's root files
(``AGENTS.md``, ``IDENTITY.md``, ``SOUL.md``, ``TOOLS.md``, ``USER.md``), its non-day folders, and
that day's folder. The agent's tools (``read_file``, ``write_file``, ``list_dir``, ``copy_file``,
``append_file``) take paths relative to the workspace root; a path that escapes it (``..``,
absolute paths, symlinks pointing outside, after resolving) is refused with a tool error message.
:func:`execute_tool` never raises: every problem becomes the tool result text ``"Error: ..."``.

    ws = Workspace.create(day.workspace_src, "day01")
    result = execute_tool(ws, "write_file", '{"path": "day01/a.json", "content": "{}"}')
    ws.cleanup()
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

CONTEXT_FILES = ("AGENTS.md", "IDENTITY.md", "SOUL.md", "TOOLS.md", "USER.md")
DAY_DIR = re.compile(r"^day\d+$")
MAX_READ_CHARS = 100_000
MAX_WRITE_BYTES = 2 * 2**20


class ToolError(Exception):
    """A tool call the agent got wrong; the message is shown to the agent as the tool result."""


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy files and folders with fresh, writable permissions (the data may be read-only)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.is_symlink():
            continue  # never import links from the data folder
        if item.is_dir():
            _copy_tree(item, dst / item.name)
        elif item.is_file():
            shutil.copyfile(item, dst / item.name)


class Workspace:
    """A folder the agent may read and write; every tool path is checked against it."""

    def __init__(self, root: str | Path, *, owned: bool = False):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"workspace {root} is not a folder")
        self._owned = owned
        self.initial_files: list[str] = self.files()

    @classmethod
    def create(cls, workspace_src: str | Path, day_id: str, parent: str | Path | None = None) -> "Workspace":
        """A fresh temporary copy: root files and non-day folders of ``workspace_src`` + ``day_id``/."""
        src = Path(workspace_src)
        if not (src / day_id).is_dir():
            raise ValueError(f"{src} has no folder {day_id}/ for this day's input files")
        root = Path(tempfile.mkdtemp(prefix=f"metaclaw-bench-{day_id}-", dir=parent))
        for item in sorted(src.iterdir()):
            if item.is_symlink():
                continue
            if item.is_dir():
                if not DAY_DIR.match(item.name) or item.name == day_id:
                    _copy_tree(item, root / item.name)
            elif item.is_file():
                shutil.copyfile(item, root / item.name)
        return cls(root, owned=True)

    def files(self) -> list[str]:
        """Every file under the root, as sorted POSIX paths relative to it."""
        out = []
        for dirpath, _dirs, names in os.walk(self.root):
            for name in names:
                out.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(out)

    def context(self) -> dict[str, str]:
        """The context files present at the root, in :data:`CONTEXT_FILES` order: name -> text."""
        return {name: (self.root / name).read_text(encoding="utf-8")
                for name in CONTEXT_FILES if (self.root / name).is_file()}

    def resolve(self, path: Any) -> Path:
        """The absolute path of ``path`` (relative to the root), or :class:`ToolError` if it escapes."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty string relative to the workspace root")
        if "\x00" in path:
            raise ToolError("path must not contain NUL characters")
        if os.path.isabs(path) or path.startswith("~"):
            raise ToolError(f"{path} is an absolute path; use a path relative to the workspace root "
                            "(e.g. day01/notes.md)")
        target = (self.root / path).resolve()
        if target != self.root and not target.is_relative_to(self.root):
            raise ToolError(f"{path} is outside the workspace; only paths inside the workspace root "
                            "are allowed")
        return target

    def cleanup(self) -> None:
        """Delete the folder if this object created it."""
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    # ---------------------------------------------------------------- the tools
    def read_file(self, path: str) -> str:
        p = self.resolve(path)
        if p.is_dir():
            raise ToolError(f"{path} is a folder; use list_dir to see its entries")
        if not p.is_file():
            raise ToolError(f"{path} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{path} is not a UTF-8 text file") from None
        if len(text) > MAX_READ_CHARS:
            return text[:MAX_READ_CHARS] + f"\n[... truncated: {len(text)} characters in total]"
        return text

    def _check_writable(self, path: str, content: Any) -> Path:
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        if len(content.encode("utf-8")) > MAX_WRITE_BYTES:
            raise ToolError(f"content is larger than {MAX_WRITE_BYTES} bytes")
        p = self.resolve(path)
        if p == self.root or p.is_dir():
            raise ToolError(f"{path} is a folder; give a file path")
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_file(self, path: str, content: str) -> str:
        p = self._check_writable(path, content)
        p.write_text(content, encoding="utf-8")
        return f"Wrote {len(content.encode('utf-8'))} bytes to {path}"

    def append_file(self, path: str, content: str) -> str:
        p = self._check_writable(path, content)
        with p.open("a", encoding="utf-8") as fh:
            fh.write(content)
        return f"Appended {len(content.encode('utf-8'))} bytes to {path}"

    def list_dir(self, path: str = ".") -> str:
        p = self.resolve(path or ".")
        if not p.is_dir():
            raise ToolError(f"{path} is not a folder")
        entries = sorted(e.name + ("/" if e.is_dir() else "") for e in p.iterdir())
        return "\n".join(entries) if entries else "(empty folder)"

    def copy_file(self, source: str, destination: str) -> str:
        src = self.resolve(source)
        if not src.is_file():
            raise ToolError(f"{source} does not exist or is not a file")
        dst = self.resolve(destination)
        if dst == self.root or dst.is_dir():
            raise ToolError(f"{destination} is a folder; give the destination file path")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        return f"Copied {source} to {destination}"


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


_PATH = {"type": "string", "description": "Path relative to the workspace root, e.g. day01/notes.md"}

#: OpenAI tool schemas of the workspace tools.
TOOL_SCHEMAS: list[dict] = [
    _fn("read_file", "Read a UTF-8 text file in the workspace.", {"path": _PATH}, ["path"]),
    _fn("write_file", "Create or overwrite a text file in the workspace (parent folders are created).",
        {"path": _PATH, "content": {"type": "string", "description": "The full file content"}},
        ["path", "content"]),
    _fn("list_dir", "List a folder of the workspace (folders end with /).",
        {"path": {**_PATH, "description": "Folder relative to the workspace root; '.' for the root"}}, []),
    _fn("copy_file", "Copy a file inside the workspace (e.g. make a backup before editing).",
        {"source": _PATH, "destination": _PATH}, ["source", "destination"]),
    _fn("append_file", "Append text to the end of a file in the workspace (created if missing).",
        {"path": _PATH, "content": {"type": "string", "description": "Text to append"}},
        ["path", "content"]),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOL_SCHEMAS)


def execute_tool(workspace: Workspace, name: str, arguments: str | dict | None) -> str:
    """Run one tool call; returns the result text, or ``"Error: <reason>"`` (never raises)."""
    if name not in TOOL_NAMES:
        return f"Error: unknown tool {name!r}; available tools: {', '.join(TOOL_NAMES)}"
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"Error: the arguments of {name} are not valid JSON ({exc.msg})"
    else:
        args = dict(arguments or {})
    if not isinstance(args, dict):
        return f"Error: the arguments of {name} must be a JSON object"
    schema = next(t["function"]["parameters"] for t in TOOL_SCHEMAS if t["function"]["name"] == name)
    missing = [k for k in schema["required"] if k not in args]
    unknown = [k for k in args if k not in schema["properties"]]
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(unknown)}"] if unknown else [])
        return f"Error: {name} arguments: {'; '.join(parts)}"
    try:
        return getattr(workspace, name)(**args)
    except ToolError as exc:
        return f"Error: {exc}"
    except OSError as exc:
        return f"Error: {name} failed: {exc.strerror or exc}"


def tool_step(workspace: Workspace | None, message: Any) -> tuple[list[dict], list[dict]]:
    """One step of an agent's tool loop, from a chat completion's ``message`` (the openai SDK's,
    or a dict of its shape): the messages it adds to the conversation (the assistant's, with its
    tool calls, then one ``tool`` message per call with the call's result) and the calls made,
    in the chat API's shape (``{"id", "type", "function": {"name", "arguments"}}``) with their
    ``"result"``. Without a ``workspace`` the calls are recorded but not run (no ``tool``
    messages, no results). The loop ends when a step makes no call."""
    def field(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    def arguments(call: Any) -> str:  # the chat API's shape: a JSON text
        given = field(field(call, "function"), "arguments")
        return given if isinstance(given, str) and given.strip() else \
            json.dumps(given or {}, ensure_ascii=False, default=str)

    made = [{"id": field(c, "id"), "type": "function",
             "function": {"name": field(field(c, "function"), "name") or "",
                          "arguments": arguments(c)}}
            for c in field(message, "tool_calls") or []]
    entry: dict[str, Any] = {"role": "assistant", "content": field(message, "content") or ""}
    if made:
        entry["tool_calls"] = [dict(c) for c in made]
    added = [entry]
    if workspace is not None:
        for call in made:
            call["result"] = execute_tool(workspace, call["function"]["name"],
                                          call["function"]["arguments"])
            added.append({"role": "tool", "tool_call_id": call["id"], "content": call["result"]})
    return added, made
