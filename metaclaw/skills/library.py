"""The skill library: ``SKILL.md`` files on disk, every version of the library kept in the store.

A skill is one folder ``<library>/<name>/SKILL.md`` (the upstream MetaClaw layout): YAML front
matter with ``name``, ``description``, ``category`` (and any other keys, preserved) followed by a
Markdown body::

    ---
    name: backup-before-modify
    description: Keep a copy of a file before changing it.
    category: safety
    ---

    # Backup before modify
    ...

A skill may be scoped to one stage of a multi-stage task with ``metadata: {stage: <name>}`` in its
front matter (``metadata`` is the free key-value map of the Agent Skills ``SKILL.md`` format, so
such a file stays valid for other readers): it is then offered only to turns of type
``stage:<name>`` (:func:`offered_to`). A skill without a stage is general: offered to every main
and stage turn. The evolver scopes what it learns from one stage's failures to that stage.

Every change (add, edit, remove, import, rollback, or files edited by hand) creates a new
*generation*: a full snapshot stored in the ``skill_generations`` table with one
``skill_events`` row per operation (reason and evidence turn ids). Any two generations can be
diffed, any generation restored. The folder on disk mirrors the current generation; files are
written atomically (temporary file + ``os.replace``). The library never writes or deletes outside
its folder: a skill folder linked in from elsewhere is read through the link, but a change to
that skill replaces the link with a copy in the folder, and removing it removes only the link.

One workspace, many processes: the store is the single source of truth for the current
generation. A proxy, the CLI and several notebook kernels may share one workspace:

- every read of the library (:meth:`SkillLibrary.current`) first asks the store whether any
  process committed since the last look (``PRAGMA data_version``, microseconds, no directory
  scan) and adopts a newer generation from the store's snapshot;
- every change runs inside one exclusive store transaction (``BEGIN IMMEDIATE``, which also
  serialises other processes): adopt the latest generation, validate the operations against
  it, write the files, insert the generation with ``parent`` = the latest. Two processes
  evolving at once therefore produce a linear history, never a fork, and an operation that
  conflicts with the other process's change fails with a clear error;
- a folder may lag the store (the workspace changed through another folder, e.g. ``metaclaw
  evolve`` run from another directory): its files still as the generation it was last brought
  to had them are stale, brought up to date at the next change or reload, never recorded as
  a change back (:data:`FOLDER_MARKS`);
- files edited by hand become a generation of kind ``disk``: at construction, on
  :meth:`SkillLibrary.reload`, and continuously while :meth:`SkillLibrary.watch` runs (a
  file-system watcher, what the proxy and notebook runtimes use).

A broken ``SKILL.md`` (bad YAML, missing ``name`` or ``description``, a name that does not match
its folder, an invalid name, bytes that are not UTF-8) never stops a load: it is reported in
:attr:`SkillLibrary.problems` as a :class:`LoadProblem` with its path and reason, and skipped.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import html
import itertools
import json
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

import yaml

from metaclaw.fileio import atomic_folder, write_atomic
from metaclaw.jsonlib import LONE_SURROGATE as _SURROGATE
from metaclaw.store import Store, StoreBusy, StoreUnavailable
from metaclaw.turns import SHARED_SCOPE, STAGE_NAME, check_scope, scope_visible, stage_of

log = logging.getLogger(__name__)

SKILL_FILE = "SKILL.md"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
OPS = ("add", "edit", "remove")
#: The journal a change writes in the folder before its files (hidden, so never read as a
#: skill): the generation it will commit and the touched files' text before it. A process that
#: dies before committing leaves it, and the next to take the write lock puts the files back.
JOURNAL_PREFIX = ".metaclaw-change-"
JOURNAL_GLOB = f"{JOURNAL_PREFIX}*.json"
#: Folder marks: the generation each skill folder's files were last brought to, in the
#: workspace's ``skill_folders`` table, per folder (and for a database server's workspace, per
#: machine: :func:`this_machine`). A
#: workspace may be used through several folders (``metaclaw evolve`` run from another
#: directory, another machine), so the folder of one process can lag the store; its skills still
#: as that generation had them are stale, not edited by hand, and are brought up to date instead
#: of being recorded as a change back. Kept in the workspace, where every user and process of the
#: machine finds them (they were kept in files per user before: a service user with another HOME
#: found none), and out of the folder, which holds skills only (and may be under version
#: control, where a checkout would bring back old marks). The files they were kept in before
#: (``<db>-skill-folders.json``, or this user's state folder for a database server) are still
#: read for a folder the workspace has no mark of.
FOLDER_MARKS = "-skill-folders.json"
#: The name this machine's skill folders are marked under (default: :func:`this_machine`).
MACHINE_ENV = "METACLAW_MACHINE"
#: Largest SKILL.md read (bytes): every generation stores every skill again, and a skill is
#: injected into prompts whose budget is a few thousand characters.
MAX_SKILL_BYTES = 256 * 1024
#: How often the folder watcher's thread wakes (ms): watchfiles sleeps this long between checks
#: for its stop event, each check taking the interpreter lock. At its default of 50 ms an idle
#: library spent about 2.7 ms of CPU a second on it; at 250, about 0.5, and a hand edit is still
#: picked up within about half a second.
WATCH_STEP_MS = 250
_CORE_KEYS = ("name", "description", "category")
#: Retrieval keys in the front matter's ``metadata`` map (string values, as the Agent Skills
#: format asks): a one-line "use when", the example asks (asks seen in turns), the
#: anticipated asks (asks the evolver wrote, in a user's words) and the near-miss asks (asks
#: near the skill's subject that it is not for), one per line.
USE_WHEN_KEY = "use-when"
EXAMPLE_ASKS_KEY = "example-asks"
ANTICIPATED_ASKS_KEY = "anticipated-asks"
NEAR_MISS_ASKS_KEY = "near-miss-asks"
#: Who may be offered the skill, in the front matter's ``metadata`` map: ``shared`` (the
#: default: every skill without the key), ``person:<id>`` or ``agent:<id>`` (see
#: :attr:`Skill.scope`).
SCOPE_KEY = "scope"
#: At most this many example asks are kept per skill (the first ones: those the skill was
#: written from, then the asks of the first turns it served well), each cut to this many
#: characters.
MAX_EXAMPLE_ASKS = 8
EXAMPLE_ASK_CHARS = 300
#: At most this many anticipated asks are kept per skill (the evolver writes nine).
MAX_ANTICIPATED_ASKS = 12
#: At most this many near-miss asks are kept per skill (the evolver writes six).
MAX_NEAR_MISS_ASKS = 12
#: A "use when" line is cut to this many characters.
USE_WHEN_CHARS = 300


class _FrontMatterDumper(yaml.SafeDumper):
    """YAML for front matter that reads back as written: PyYAML writes a string holding U+0085
    (a YAML line break) in a plain or single-quoted style, where reading folds it into a space;
    such strings are written double-quoted, where it is escaped."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text,
                                   style='"' if "\x85" in text else None)


_FrontMatterDumper.add_representer(str, _represent_text)


class _FrontMatterLoader(yaml.SafeLoader):
    """``yaml.safe_load`` with its aliases (``*name``, ``<<: *name``) bounded: a few hundred
    bytes of nested aliases expand to gigabytes when the front matter is copied (a "billion
    laughs"), which would hang every process loading the folder. Aliases themselves stay
    allowed: a skill file may share values through anchors (a merge key of defaults), and
    refusing them makes such a skill unloadable and, kept at its stored version, uneditable.
    Refused, before anything is built: front matter that aliases expand to more values than a
    skill file could hold written out (:data:`MAX_SKILL_BYTES`), and an alias inside the very
    value it names (endless)."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        if _expanded_size(node, {}, set()) > MAX_SKILL_BYTES:
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*name) expand the front matter to more than "
                f"{MAX_SKILL_BYTES:,} values, more than a skill file may hold; write the values "
                "out", node.start_mark)
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values ``node`` holds once every alias in it is expanded (a copy of what it
    names), counted in time linear in the nodes as written (``sizes`` remembers each one)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise yaml.composer.ComposerError(
            None, None, "a YAML alias (*name) sits inside the value it names, which makes the "
            "front matter endless; write the value out", node.start_mark)
    open_nodes.add(key)
    children: list[Any] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    size = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    open_nodes.discard(key)
    sizes[key] = size
    return size


#: Characters a retrieval key never keeps: control characters, bidirectional overrides, BOMs.
_UNWRITTEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ufeff]")


def key_line(text: Any, limit: int) -> str:
    """A line of a skill's retrieval keys as it is stored (an ask, the "use when" line): its
    whitespace folded, control characters dropped, runs of dashes cut to two (``---`` ends the
    front matter for some readers), credentials and e-mail addresses masked
    (:func:`metaclaw.redact.mask_personal`: the file is read by everyone with the workspace),
    cut to ``limit`` characters."""
    from metaclaw.redact import mask_personal

    text = " ".join(_UNWRITTEN.sub("", str(text)).split())
    return mask_personal(re.sub(r"-{3,}", "--", text))[:limit].strip()


def bounded_asks(kept: Iterable[str], more: Iterable[str], limit: int) -> list[str]:
    """``kept`` followed by the asks of ``more`` (each a :func:`key_line` of at most
    :data:`EXAMPLE_ASK_CHARS`, duplicates ignored by case) up to ``limit`` asks in all."""
    out = list(kept)
    seen = {a.casefold() for a in out}
    for ask in more:
        ask = key_line(ask, EXAMPLE_ASK_CHARS)
        if ask and ask.casefold() not in seen and len(out) < limit:
            out.append(ask)
            seen.add(ask.casefold())
    return out


class SkillFormatError(ValueError):
    """A skill, a skill file or a change to the library is invalid.

    The message names the file (when there is one) and what to change.
    """

    def __init__(self, reason: str, path: str | os.PathLike[str] | None = None):
        self.reason = reason
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {reason}" if self.path else reason)


class SkillConflict(SkillFormatError):
    """An edit or remove made from a version of a skill that another process has changed."""


class SkillNotFound(KeyError):
    """A skill name or a generation number that the library does not have."""

    def __str__(self) -> str:  # KeyError would show the message with quotes around it
        return str(self.args[0]) if self.args else "not found"


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid skill slug, else raise :class:`SkillFormatError`.

    A valid name is 1-64 characters of lowercase letters, digits, ``-`` and ``_``, starting with a
    letter or digit (so it is always a safe folder name: no ``/``, ``..`` or hidden files).
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise SkillFormatError(
            f"invalid skill name {name!r}: use 1-64 lowercase letters, digits, '-' or '_', "
            "starting with a letter or digit (e.g. 'backup-before-modify')")
    return name


def _json_safe(value: Any, name: Any = None) -> Any:
    """Front-matter values as JSON-compatible data (YAML dates become ISO strings).

    NaN and infinities are refused: the store writes them as ``null``, so a skill holding one
    would never equal its stored version and every process opening the workspace would record
    it again as a new generation. Nesting deeper than Python's recursion limit is refused too.
    """
    try:
        return json.loads(json.dumps(value, ensure_ascii=False, default=str, allow_nan=False))
    except ValueError:
        raise SkillFormatError(f"skill {name!r}: a front-matter value is NaN or infinite, which "
                               "JSON cannot store; quote it or write a finite number") from None
    except RecursionError:
        raise SkillFormatError(f"skill {name!r}: a front-matter value is nested too deeply"
                               ) from None


def _no_surrogates(name: str, field_name: str, text: str) -> None:
    """Refuse text with a lone surrogate: it cannot be written to SKILL.md nor to the store, so
    it would fail every write (and every reload of the folder) with a ``UnicodeEncodeError``."""
    match = _SURROGATE.search(text)
    if match:
        raise SkillFormatError(
            f"skill {name!r}: the {field_name} holds a lone surrogate "
            f"(U+{ord(match.group()):04X} at character {match.start()}, e.g. half of an emoji), "
            "which is not valid Unicode; remove it or write the whole character")


def _clean_body(body: str) -> str:
    """Drop leading blank lines and trailing whitespace, so a body round-trips exactly."""
    lines = body.replace("\r\n", "\n").split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines).rstrip()


@dataclass(frozen=True)
class Skill:
    """One skill. ``extra`` holds any other front-matter keys (kept as JSON-compatible data)."""

    name: str
    description: str
    category: str = "general"
    body: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_name(self.name)
        if not isinstance(self.description, str) or not self.description.strip():
            raise SkillFormatError(f"skill {self.name!r} needs a non-empty text 'description'")
        if not isinstance(self.category, str) or not self.category.strip():
            raise SkillFormatError(f"skill {self.name!r}: 'category' must be a non-empty text")
        if not isinstance(self.body, str):
            raise SkillFormatError(f"skill {self.name!r}: the body must be text")
        if not isinstance(self.extra, dict):
            raise SkillFormatError(f"skill {self.name!r}: 'extra' must be a dict")
        clash = set(self.extra) & set(_CORE_KEYS + ("body",))
        if clash:
            raise SkillFormatError(
                f"skill {self.name!r}: move {sorted(clash)} out of 'extra' into the fields")
        object.__setattr__(self, "description", self.description.strip())
        object.__setattr__(self, "category", self.category.strip())
        object.__setattr__(self, "body", _clean_body(self.body))
        object.__setattr__(self, "extra", _json_safe(self.extra, self.name))
        for field_name in ("description", "category", "body"):
            _no_surrogates(self.name, field_name, getattr(self, field_name))
        _no_surrogates(self.name, "front matter",
                       json.dumps(self.extra, ensure_ascii=False))
        metadata = self.extra.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("stage"), str):
            # spelled as turn types are (``stage:Plan`` is recorded as ``stage:plan``)
            self.extra["metadata"] = {**metadata, "stage": metadata["stage"].strip().lower()}
        self.stage  # noqa: B018 - a bad 'metadata.stage' is refused here, not at retrieval
        self.scope  # noqa: B018 - and a bad 'metadata.scope' too

    def __hash__(self) -> int:
        return hash(self.content_hash)

    @functools.cached_property
    def stage(self) -> str | None:
        """The stage this skill is scoped to (front matter ``metadata.stage``), or ``None``
        for a general skill."""
        metadata = self.extra.get("metadata")
        stage = metadata.get("stage") if isinstance(metadata, dict) else None
        if stage is None:
            return None
        if not isinstance(stage, str) or not STAGE_NAME.fullmatch(stage):
            raise SkillFormatError(
                f"skill {self.name!r}: 'metadata.stage' must be a stage name of 1-64 lowercase "
                f"letters, digits, '-' or '_' (e.g. 'plan'), not {stage!r}")
        return stage

    @functools.cached_property
    def scope(self) -> str:
        """Who may be offered this skill (front matter ``metadata.scope``): ``shared`` (the
        default) with the whole workspace, ``person:<id>`` only in turns served to that person,
        ``agent:<id>`` only in turns of that agent (:func:`visible`)."""
        metadata = self.extra.get("metadata")
        scope = metadata.get(SCOPE_KEY) if isinstance(metadata, dict) else None
        if scope is None:
            return SHARED_SCOPE
        try:
            return check_scope(scope)
        except ValueError as exc:
            raise SkillFormatError(f"skill {self.name!r}: 'metadata.scope': {exc}") from None

    @property
    def private(self) -> bool:
        """Whether the skill is private to one person or agent (not ``shared``)."""
        return self.scope != SHARED_SCOPE

    @functools.cached_property
    def use_when(self) -> str:
        """When to use this skill, in one line (front matter ``metadata.use-when``; "" when
        not given). Retrieval matches asks against it."""
        metadata = self.extra.get("metadata")
        value = metadata.get(USE_WHEN_KEY) if isinstance(metadata, dict) else None
        return " ".join(value.split()) if isinstance(value, str) else ""

    @functools.cached_property
    def example_asks(self) -> tuple[str, ...]:
        """Asks this skill is for (front matter ``metadata.example-asks``, one per line): the
        retrieval queries of the failed turns it was written from and of turns it later served
        well. Retrieval matches new asks against them as well as against the skill's text."""
        return self._asks(EXAMPLE_ASKS_KEY)

    @functools.cached_property
    def anticipated_asks(self) -> tuple[str, ...]:
        """Asks the evolver expects this skill to be needed for, written in a user's words rather
        than the skill's (front matter ``metadata.anticipated-asks``, one per line). Retrieval
        matches them like :attr:`example_asks`; unlike those, no user sent them."""
        return self._asks(ANTICIPATED_ASKS_KEY)

    @functools.cached_property
    def near_miss_asks(self) -> tuple[str, ...]:
        """Asks near this skill's subject that it is not for, which the evolver wrote with its
        anticipated asks (front matter ``metadata.near-miss-asks``, one per line): ordinary work
        on the same files, tools or subject where the skill changes nothing. Retrieval holds the
        skill back from an ask about as near one of them as its own asks, or nearer. As a skill
        keeps them: each cut to :data:`EXAMPLE_ASK_CHARS`, at most :data:`MAX_NEAR_MISS_ASKS`,
        none that is one of the skill's own asks (a hand-written file is read so too)."""
        own = {a.casefold() for a in self.retrieval_asks}
        return tuple(bounded_asks((), [a for a in self._asks(NEAR_MISS_ASKS_KEY)
                                       if key_line(a, EXAMPLE_ASK_CHARS).casefold() not in own],
                                  MAX_NEAR_MISS_ASKS))

    @property
    def retrieval_asks(self) -> tuple[str, ...]:
        """Every ask retrieval matches new asks against: the example asks, then the anticipated
        ones."""
        return self.example_asks + self.anticipated_asks

    def _asks(self, key: str) -> tuple[str, ...]:
        metadata = self.extra.get("metadata")
        value = metadata.get(key) if isinstance(metadata, dict) else None
        if isinstance(value, list):  # written by hand as a YAML list: read it all the same
            value = "\n".join(v for v in value if isinstance(v, str))
        if not isinstance(value, str):
            return ()
        return tuple(line for line in (" ".join(v.split()) for v in value.split("\n")) if line)

    def with_retrieval_keys(self, asks: Iterable[str] = (), *, use_when: str | None = None,
                            anticipated: Iterable[str] | None = None,
                            near_miss: Iterable[str] | None = None) -> "Skill":
        """This skill with ``asks`` added to its example asks (whitespace folded, cut to
        :data:`EXAMPLE_ASK_CHARS`, duplicates ignored by case, at most
        :data:`MAX_EXAMPLE_ASKS` kept: the earliest) and, when given, a new ``use_when`` line,
        new ``anticipated`` asks (replacing the old ones; at most :data:`MAX_ANTICIPATED_ASKS`)
        and new ``near_miss`` asks (likewise; at most :data:`MAX_NEAR_MISS_ASKS`). Returns
        ``self`` when nothing changes (no new generation for nothing)."""
        kept = bounded_asks(self.example_asks, asks, MAX_EXAMPLE_ASKS)
        line = self.use_when if use_when is None else key_line(use_when, USE_WHEN_CHARS)
        foreseen = self.anticipated_asks if anticipated is None else \
            bounded_asks((), anticipated, MAX_ANTICIPATED_ASKS)
        near = self.near_miss_asks if near_miss is None else \
            bounded_asks((), near_miss, MAX_NEAR_MISS_ASKS)  # (read back without own asks)
        if (tuple(kept) == self.example_asks and line == self.use_when
                and tuple(foreseen) == self.anticipated_asks
                and tuple(near) == self.near_miss_asks):
            return self
        metadata = dict(self.extra.get("metadata") or {}) \
            if isinstance(self.extra.get("metadata"), dict) else {}
        for key, value in ((USE_WHEN_KEY, line), (EXAMPLE_ASKS_KEY, "\n".join(kept)),
                           (ANTICIPATED_ASKS_KEY, "\n".join(foreseen)),
                           (NEAR_MISS_ASKS_KEY, "\n".join(near))):
            metadata.pop(key, None)
            if value:
                metadata[key] = value
        extra = {k: v for k, v in self.extra.items() if k != "metadata"}
        if metadata:
            extra["metadata"] = metadata
        return Skill(self.name, self.description, self.category, self.body, extra)

    def with_stage(self, stage: str | None) -> "Skill":
        """This skill scoped to ``stage`` (``None``: general), other metadata kept."""
        metadata = dict(self.extra.get("metadata") or {}) \
            if isinstance(self.extra.get("metadata"), dict) else {}
        metadata.pop("stage", None)
        if stage is not None:
            metadata["stage"] = stage
        extra = {k: v for k, v in self.extra.items() if k != "metadata"}
        if metadata:
            extra["metadata"] = metadata
        return Skill(self.name, self.description, self.category, self.body, extra)

    def with_scope(self, scope: str) -> "Skill":
        """This skill with scope ``scope`` (``shared``, ``person:<id>`` or ``agent:<id>``),
        other metadata kept; a shared skill carries no ``scope`` key (as every skill written
        before scopes existed)."""
        try:
            scope = check_scope(scope)
        except ValueError as exc:
            raise SkillFormatError(f"skill {self.name!r}: {exc}") from None
        metadata = dict(self.extra.get("metadata") or {}) \
            if isinstance(self.extra.get("metadata"), dict) else {}
        metadata.pop(SCOPE_KEY, None)
        if scope != SHARED_SCOPE:
            metadata[SCOPE_KEY] = scope
        extra = {k: v for k, v in self.extra.items() if k != "metadata"}
        if metadata:
            extra["metadata"] = metadata
        return Skill(self.name, self.description, self.category, self.body, extra)

    # -- SKILL.md ---------------------------------------------------------------------------
    @classmethod
    def from_markdown(cls, text: str, *, source: str | None = None) -> "Skill":
        """Parse ``SKILL.md`` text (front matter + body). ``source`` names the file in errors.

        Raises :class:`SkillFormatError` naming ``source`` and the reason.
        """
        if not isinstance(text, str):
            raise SkillFormatError("SKILL.md content must be text", source)
        text = text.lstrip("\ufeff").replace("\r\n", "\n")
        lines = text.split("\n")
        if not lines or lines[0].strip() != "---":
            raise SkillFormatError(
                "missing YAML front matter: the file must start with a '---' line, then "
                "'name:' and 'description:', then a closing '---' line", source)
        try:
            # the closing line starts at the margin: an indented '---' is a line of a value (a
            # block scalar, or a multi-line quoted string as the library writes it), and
            # ending there read the rest of the front matter as the body
            end = next(i for i in range(1, len(lines)) if lines[i].rstrip() in ("---", "..."))
        except StopIteration:
            raise SkillFormatError("the YAML front matter has no closing '---' line",
                                   source) from None
        try:
            meta = yaml.load("\n".join(lines[1:end]), Loader=_FrontMatterLoader)
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise SkillFormatError(f"the front matter is not valid YAML ({detail})",
                                   source) from None
        except RecursionError:  # a few KB of '[[[[' would otherwise end the load of the folder
            raise SkillFormatError("the front matter is nested too deeply", source) from None
        if not isinstance(meta, dict):
            raise SkillFormatError("the front matter must be a mapping with 'name' and "
                                   "'description' keys", source)
        for key in ("name", "description"):
            if key not in meta or meta[key] is None or str(meta[key]).strip() == "":
                raise SkillFormatError(f"the front matter has no '{key}'", source)
        name = meta["name"]
        if not isinstance(name, str):
            raise SkillFormatError(f"'name' must be text, got {name!r}", source)
        description = meta["description"]
        if not isinstance(description, str):
            raise SkillFormatError("'description' must be text", source)
        category = meta.get("category")
        category = "general" if category is None or str(category).strip() == "" else category
        if not isinstance(category, str):
            category = str(category)
        extra = {str(k): v for k, v in meta.items() if k not in _CORE_KEYS}
        if "body" in extra:
            raise SkillFormatError("'body' is not allowed in the front matter; put the text "
                                   "after the closing '---'", source)
        try:
            return cls(name=name, description=description, category=category,
                       body="\n".join(lines[end + 1:]), extra=extra)
        except SkillFormatError as exc:
            raise SkillFormatError(exc.reason, source) from None

    def to_markdown(self) -> str:
        """The ``SKILL.md`` text: YAML front matter, a blank line, the body. Round-trips."""
        return self._markdown

    @functools.cached_property
    def _markdown(self) -> str:
        meta = {"name": self.name, "description": self.description, "category": self.category,
                **self.extra}
        front = yaml.dump(meta, Dumper=_FrontMatterDumper, sort_keys=False, allow_unicode=True,
                          default_flow_style=False, width=10_000)
        text = f"---\n{front}---\n"
        return f"{text}\n{self.body}\n" if self.body else text

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 hex digest of :meth:`to_markdown`."""
        return hashlib.sha256(self.to_markdown().encode("utf-8")).hexdigest()

    # -- dict form (what the store keeps) ----------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-compatible dict: name, description, category, body, extra."""
        return {"name": self.name, "description": self.description, "category": self.category,
                "body": self.body, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, d: dict) -> "Skill":
        """Inverse of :meth:`to_dict` (unknown keys go to ``extra``)."""
        if not isinstance(d, dict):
            raise SkillFormatError(f"a skill dict is expected, got {type(d).__name__}")
        known = {"name", "description", "category", "body", "extra"}
        extra = dict(d.get("extra") or {})
        extra.update({k: v for k, v in d.items() if k not in known})
        return cls(name=d.get("name"), description=d.get("description"),
                   category=d.get("category") or "general", body=d.get("body") or "",
                   extra=extra)

    def _repr_html_(self) -> str:
        scope = f" · stage {self.stage}" if self.stage else ""
        scope += f" · {self.scope}" if self.private else ""
        return (f"<div><b>{html.escape(self.name)}</b> "
                f"<i>({html.escape(self.category + scope)})</i>"
                f"<br>{html.escape(self.description)}"
                f"<pre style='white-space:pre-wrap'>{html.escape(self.body)}</pre></div>")


def offered_to(turn_type: str | None) -> Callable[[Skill], bool]:
    """Which skills a turn of ``turn_type`` may be offered (a ``keep`` for
    :func:`metaclaw.skills.retrieval.select`): general skills, and for a ``stage:<name>`` turn also the
    skills scoped to that stage; never another stage's."""
    stage = stage_of(turn_type)
    return lambda skill: skill.stage is None or skill.stage == stage


def visible(skills: list[Skill], person: str | None = None,
            agent: str | None = None) -> list[Skill]:
    """The skills a turn serving ``person`` through ``agent`` may be offered: the shared ones
    and those private to that person or that agent, never another's. The selection paths (the
    proxy's, and the replays of the gate, the evolver and experiments) filter with this before
    ranking, so a private skill never reaches another person's prompt. ``skills`` itself
    comes back (the same list) when all of it is visible, so a retriever's index of it stays
    cached."""
    if not any(s.private for s in skills):
        return skills
    kept = [s for s in skills if scope_visible(s.scope, person, agent)]
    return skills if len(kept) == len(skills) else kept


def default_author() -> str:
    """Who acts from this process: ``$METACLAW_USER``, else the login name."""
    name = os.environ.get("METACLAW_USER")
    if name:
        return name
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # no login name in some containers
        return "unknown"


def oversize_reason(skill: Skill) -> str | None:
    """Why ``skill`` is too large to be a skill (its ``SKILL.md`` over :data:`MAX_SKILL_BYTES`:
    every request it is injected into would carry it), or ``None``."""
    size = len(skill.to_markdown().encode("utf-8", "replace"))
    if size <= MAX_SKILL_BYTES:
        return None
    return (f"the skill is {size:,} bytes as SKILL.md, more than a skill may be "
            f"({MAX_SKILL_BYTES:,})")


@dataclass
class SkillOp:
    """One operation of a change to the library. ``evidence`` holds turn ids. ``base``: the
    content hash of the skill an edit or remove was made from; when the skill has changed
    since (another process edited it), the operation fails with :class:`SkillConflict`
    instead of silently overwriting that change."""

    op: Literal["add", "edit", "remove"]
    skill: Skill | None = None
    name: str = ""
    reason: str = ""
    evidence: list[int] = field(default_factory=list)
    base: str | None = None

    def __post_init__(self) -> None:
        if not self.name and self.skill is not None:
            self.name = self.skill.name


@dataclass
class LoadProblem:
    """A skill file that could not be loaded (and was skipped)."""

    path: str
    reason: str
    #: The skill the file is for, where known: its stored version keeps serving.
    name: str | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class EditedSkill:
    """A skill present in both generations of a diff, with different content."""

    name: str
    before: Skill
    after: Skill
    unified_diff: str


@dataclass
class SkillDiff:
    """What changed from generation ``old`` to generation ``new``."""

    old: int
    new: int
    added: list[Skill]
    removed: list[Skill]
    edited: list[EditedSkill]
    events: list[dict]

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.edited)

    def to_dict(self) -> dict:
        return {
            "old": self.old, "new": self.new,
            "added": [s.to_dict() for s in self.added],
            "removed": [s.to_dict() for s in self.removed],
            "edited": [{"name": e.name, "before": e.before.to_dict(), "after": e.after.to_dict(),
                        "unified_diff": e.unified_diff} for e in self.edited],
            "events": [dict(e) for e in self.events],
        }

    def __str__(self) -> str:
        lines = [f"skills: generation {self.old} -> {self.new}"]
        if self.empty:
            lines.append("  no changes")
        for s in self.added:
            lines.append(f"  + {s.name}: {s.description}")
        for s in self.removed:
            lines.append(f"  - {s.name}: {s.description}")
        for e in self.edited:
            lines.append(f"  ~ {e.name}")
            lines.extend("      " + line for line in e.unified_diff.rstrip("\n").split("\n"))
        if self.events:
            lines.append("events:")
            for ev in self.events:
                evidence = f" (turns {', '.join(map(str, ev.get('evidence') or []))})" \
                    if ev.get("evidence") else ""
                why = f": {ev['reason']}" if ev.get("reason") else ""
                lines.append(f"  [{ev['generation']}] {ev['op']} {ev['skill_name']}{why}{evidence}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        parts = [f"<div><b>Skills: generation {self.old} &rarr; {self.new}</b>"]
        if self.empty:
            parts.append("<p>No changes.</p>")
        if self.added:
            parts.append("<p style='color:#1a7f37'>Added: " + ", ".join(
                f"<b>{esc(s.name)}</b> &mdash; {esc(s.description)}" for s in self.added) + "</p>")
        if self.removed:
            parts.append("<p style='color:#cf222e'>Removed: " + ", ".join(
                f"<b>{esc(s.name)}</b>" for s in self.removed) + "</p>")
        for e in self.edited:
            rows = []
            for line in e.unified_diff.split("\n"):
                color = ("#1a7f37" if line.startswith("+") and not line.startswith("+++") else
                         "#cf222e" if line.startswith("-") and not line.startswith("---") else
                         "inherit")
                rows.append(f"<span style='color:{color}'>{esc(line)}</span>")
            parts.append(f"<details open><summary>Edited: <b>{esc(e.name)}</b></summary>"
                         f"<pre style='white-space:pre-wrap'>{chr(10).join(rows)}</pre></details>")
        if self.events:
            parts.append("<table><tr><th>gen</th><th>op</th><th>skill</th><th>reason</th>"
                         "<th>evidence</th></tr>")
            for ev in self.events:
                parts.append(
                    f"<tr><td>{ev['generation']}</td><td>{esc(ev['op'])}</td>"
                    f"<td>{esc(ev['skill_name'])}</td><td>{esc(ev.get('reason') or '')}</td>"
                    f"<td>{esc(', '.join(map(str, ev.get('evidence') or [])))}</td></tr>")
            parts.append("</table>")
        parts.append("</div>")
        return "".join(parts)


def apply_in_memory(skills: dict[str, Skill], ops: Iterable[SkillOp]) -> dict[str, Skill]:
    """The library ``skills`` after ``ops`` (no files, no store)."""
    out = dict(skills)
    for op in ops:
        if op.op == "remove":
            out.pop(op.name, None)
        else:
            out[op.name] = op.skill
    return out


def starter_skills_dir() -> Path:
    """The folder of starter skills shipped with the package (``metaclaw/skills/starter_skills``)."""
    return Path(__file__).resolve().parent / "starter_skills"


# -- reading and writing folders -----------------------------------------------------------------

def load_skills_dir(directory: str | os.PathLike[str]) -> tuple[dict[str, Skill], list[LoadProblem]]:
    """Read every ``<directory>/<name>/SKILL.md``. Returns (skills by name, problems).

    Folders without ``SKILL.md`` and hidden folders are ignored; broken files become problems.
    """
    root = Path(directory)
    skills: dict[str, Skill] = {}
    problems: list[LoadProblem] = []
    if not root.is_dir():
        return skills, problems
    for folder in sorted(root.iterdir(), key=lambda p: p.name):
        path = folder / SKILL_FILE
        if folder.name.startswith(".") or folder.is_file():
            continue
        problem = _unreadable(folder, path)
        if problem is not None:
            problems.append(LoadProblem(str(path), problem, folder.name))
            continue
        if not path.is_file():  # a folder without a skill file
            continue
        skill, problem = _read_skill_file(path, folder.name)
        if problem is not None:
            problems.append(problem)
        elif skill is not None:
            skills[skill.name] = skill
    return skills, problems


def _unreadable(folder: Path, path: Path) -> str | None:
    """Why a skill folder's file cannot be read (a link loop, a link to nothing, a directory
    named SKILL.md), or None: such a skill is a problem to report, never a removal."""
    try:
        if not folder.is_dir() and folder.is_symlink():
            folder.stat()  # raises why: a loop, or nothing there
        if not path.exists():
            if path.is_symlink():
                path.stat()
            return None
        if not path.is_file():
            return "is not a regular file"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None


def _read_skill_file(path: Path, folder_name: str | None) -> tuple[Skill | None, LoadProblem | None]:
    try:
        size = path.stat().st_size
        if size > MAX_SKILL_BYTES:
            return None, LoadProblem(str(path), f"is {size:,} bytes, more than a skill may be "
                                                f"({MAX_SKILL_BYTES:,}): a skill is injected into "
                                                "prompts, keep it short", folder_name)
        raw = path.read_bytes()
    except OSError as exc:
        return None, LoadProblem(str(path), f"cannot be read ({exc.strerror or exc})", folder_name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, LoadProblem(str(path), f"is not UTF-8 text (bad byte at offset {exc.start}); "
                                            "save it as UTF-8")
    try:
        skill = Skill.from_markdown(text, source=str(path))
    except SkillFormatError as exc:
        return None, LoadProblem(str(path), exc.reason)
    if folder_name is not None and skill.name != folder_name:
        return None, LoadProblem(str(path), f"name {skill.name!r} does not match its folder "
                                            f"{folder_name!r}; rename one of them", skill.name)
    _warn_misplaced_keys(path, skill)
    return skill, None


#: Spellings and places of the retrieval keys that are not read (a hand-written skill), by the
#: key they were meant to be.
_KEY_SPELLINGS = {k: (k.replace("-", "_"), k.replace("-", "")) for k in
                  (USE_WHEN_KEY, EXAMPLE_ASKS_KEY, ANTICIPATED_ASKS_KEY, NEAR_MISS_ASKS_KEY)}
_warned_keys: set[tuple[str, str]] = set()


def _warn_misplaced_keys(path: Path, skill: Skill) -> None:
    """A retrieval key written where it is not read (``use_when``, or ``use-when`` outside
    ``metadata``) is said once per file and key: otherwise the skill is silently matched on
    its text alone."""
    metadata = skill.extra.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    for key, others in _KEY_SPELLINGS.items():
        found = [f"metadata.{o}" for o in others if o in metadata]
        found += [k for k in (key, *others) if k in skill.extra]
        for where in found:
            if (str(path), where) not in _warned_keys and len(_warned_keys) < 10_000:
                _warned_keys.add((str(path), where))
                log.warning("skill file %s: %r is not read; write the key as metadata.%s",
                            path, where, key)


def _atomic_write(path: Path, text: str) -> None:
    """A skill file or a journal written whole (:func:`metaclaw.fileio.write_atomic`; one
    name for every write of the library, so a test can stop a change between two files)."""
    write_atomic(path, text, newline="\n")


def _snapshot_digest(snapshot: dict[str, Any]) -> str:
    """A generation's snapshot, as stored, in a few bytes (to tell a committed change)."""
    return hashlib.sha256(json.dumps(snapshot, sort_keys=True).encode()).hexdigest()


def _skills_digest(skills: dict[str, Skill]) -> str:
    return _snapshot_digest({n: s.to_dict() for n, s in sorted(skills.items())})


def _text_digest(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def _file_text(path: Path) -> str | None:
    """A skill file's text (``None``: there is none; undecodable bytes kept as escapes)."""
    try:
        return path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return None


def _own_folder(folder: Path) -> None:
    """Turn a skill folder that is a link (to a folder elsewhere, linked in by hand) into a real
    folder of the library holding a copy of what the link showed, before the library writes
    the skill: a change (an evolver's edit, a rollback) then stays inside the library instead
    of writing into the linked folder, which other libraries or people may be using."""
    if not folder.is_symlink():
        return
    source = os.path.realpath(folder)
    # the copy is made in a hidden folder beside the link (never read as a skill) and moved in
    # with metaclaw.fileio.atomic_folder, once the link is removed: the rename needs the name free
    with atomic_folder(folder, prefix=f".{folder.name}.copy-") as copy:
        try:  # its files, with its own mode; its links kept as links
            shutil.copytree(source, copy, symlinks=True, dirs_exist_ok=True)
        except shutil.Error as exc:
            # some entries could not be copied (a named pipe, an unreadable file); copytree
            # copied all the others, which are kept (dropping them all lost the skill's scripts
            # silently)
            log.warning("skill library: copied the linked skill folder %s into %s without %s",
                        source, folder, ", ".join(str(error[0]) for error in exc.args[0]))
        except OSError:  # a broken or looping link: nothing to keep (a plain new folder)
            shutil.rmtree(copy, ignore_errors=True)
            copy.mkdir()
        _relink_outside(copy, source)
        folder.unlink()  # the link only; what it points to is left as it is


def _relink_outside(copy: str | os.PathLike[str], source: str) -> None:
    """Make the links in ``copy`` (a copy of the folder ``source``) that point outside it by a
    relative path absolute, to where they pointed from ``source``: a link such as
    ``scripts -> ../common`` would otherwise point next to the library's copy (to nothing, or
    to another skill). Links within the folder stay relative, to the copy's own files."""
    for dirpath, dirnames, filenames in os.walk(copy):
        inner = os.path.relpath(dirpath, copy)
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                continue
            target = os.readlink(path)
            within = os.path.normpath(os.path.join(inner, target))
            if os.path.isabs(target) or (within != os.pardir
                                         and not within.startswith(os.pardir + os.sep)):
                continue
            os.unlink(path)
            os.symlink(os.path.join(os.path.normpath(os.path.join(source, inner)), target), path)


def _write_skill_file(folder: Path, text: str) -> None:
    _own_folder(folder)
    _atomic_write(folder / SKILL_FILE, text)


def _remove_skill_folder(folder: Path) -> None:
    """Remove ``SKILL.md``, and the folder when nothing else (scripts, resources) is left in it.
    A folder that is a link loses only the link: the library never deletes outside itself."""
    if folder.is_symlink():
        folder.unlink()
        return
    try:
        (folder / SKILL_FILE).unlink()
    except FileNotFoundError:
        pass
    try:
        folder.rmdir()
    except OSError:
        pass  # other files remain in the folder: keep them


def _stored_skills(generation: int, snapshot: Any) -> dict[str, Skill]:
    """A stored generation's snapshot as skills by name. A snapshot the library could not have
    written (damaged in the database, or written by a version with other rules) raises a
    :class:`SkillFormatError` naming the generation: restored as it is, a skill stored under
    another name's key was written into that name's folder and recorded again."""
    def malformed(why: str) -> SkillFormatError:
        return SkillFormatError(f"skill generation {generation} in the store is malformed "
                                f"({why}); roll back to another generation")

    if snapshot is None:  # how the store reads a snapshot that is not valid JSON
        raise malformed("its snapshot is missing or not valid JSON")
    if not isinstance(snapshot, dict):
        raise malformed(f"its snapshot is a {type(snapshot).__name__}, not skills by name")
    skills = {}
    for name, data in snapshot.items():
        try:
            skill = Skill.from_dict(data)
        except (ValueError, TypeError) as exc:  # SkillFormatError, or an 'extra' not a map
            raise malformed(f"skill {name!r}: {getattr(exc, 'reason', exc)}") from None
        if skill.name != name:
            raise malformed(f"the skill stored as {name!r} is named {skill.name!r}")
        skills[name] = skill
    return skills


def _changes(old: dict[str, Skill], new: dict[str, Skill], reason: str) -> list[SkillOp]:
    """Operations turning ``old`` into ``new`` (sorted by name)."""
    ops: list[SkillOp] = []
    for name in sorted(set(old) | set(new)):
        if name not in old:
            ops.append(SkillOp("add", new[name], name, reason))
        elif name not in new:
            ops.append(SkillOp("remove", None, name, reason))
        elif old[name] != new[name]:
            ops.append(SkillOp("edit", new[name], name, reason))
    return ops


# -- the library ---------------------------------------------------------------------------------

def _marks_path(store: Store, key: str | None = None) -> Path | None:
    """The file where the folder marks of ``store``'s workspace were kept before the workspace
    kept them (:data:`FOLDER_MARKS`), read for a folder it has no mark of; its name also places
    this user's own folder of a database server's workspace (:func:`own_folder`).

    A database server's workspace: the marks were kept in this user's state folder, one file
    per workspace, named after the workspace itself (when
    its first generation was made), not after the URL it was reached by: a password moved to
    ``~/.pgpass``, ``localhost`` for ``127.0.0.1`` or another option find the same marks.
    ``key``: another name (the URL's, as marks were named before)."""
    path = getattr(store, "path", None)
    if path is None and getattr(store, "engine", "sqlite") != "sqlite":
        state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        key = key or _workspace_key(store)
        if key is None:
            return None
        return state / "metaclaw" / f"workspace-{key}{FOLDER_MARKS}"
    if path is None or str(path) == ":memory:":
        return None  # a store of this process only: no other folder can move it
    return Path(path).with_name(Path(path).name + FOLDER_MARKS)


def _workspace_key(store: Store) -> str | None:
    """A server workspace's own name: a digest of when its generation 0 was made (None before
    it has one), read once per store."""
    key = getattr(store, "_metaclaw_workspace_key", None)
    if key is None:
        first = store.generation(0)
        if first is None:
            return None
        key = hashlib.sha256(f"{first['created_at']!r} {first['reason']}".encode()
                             ).hexdigest()[:16]
        store._metaclaw_workspace_key = key  # type: ignore[attr-defined]
    return key


def this_machine() -> str:
    """The name this machine's skill folders are marked under in a database server's workspace:
    ``$METACLAW_MACHINE``, else its host name and machine id (Linux's machine id, a Mac's
    hardware UUID, Windows' machine GUID): containers of one image share the id, not the name."""
    given = os.environ.get(MACHINE_ENV, "").strip()
    return given or _machine_id()


@functools.lru_cache(maxsize=1)
def _machine_id() -> str:
    import socket
    import sys

    found = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            found = Path(path).read_text(encoding="ascii").strip()[:64]
        except (OSError, ValueError):
            continue
        if found:
            break
    if not found and sys.platform == "darwin":
        import subprocess

        try:
            out = subprocess.run(["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"],
                                 capture_output=True, text=True, timeout=5).stdout
            match = re.search(r'"IOPlatformUUID" = "([^"]+)"', out)
            found = match.group(1) if match else ""
        except (OSError, subprocess.SubprocessError):
            found = ""
    elif not found and sys.platform == "win32":
        try:
            import winreg

            with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE,
                                r"SOFTWARE\Microsoft\Cryptography") as key:
                found = str(winreg.QueryValueEx(key, "MachineGuid")[0])
        except OSError:
            found = ""
    host = socket.gethostname()
    return f"{host}/{found}" if found else host


def _copy_resources(source: Path, dest: Path) -> None:
    """The files of the skill folder ``source`` other than ``SKILL.md`` (scripts, references)
    copied into ``dest`` where they are missing (links kept as links, nothing written over)."""
    import shutil

    if source.resolve() == dest.resolve() or not dest.is_dir():
        return
    for item in source.iterdir():
        target = dest / item.name
        if item.name == SKILL_FILE or os.path.lexists(target):
            continue
        try:
            if item.is_dir() and not item.is_symlink():
                shutil.copytree(item, target, symlinks=True)
            else:
                shutil.copy2(item, target, follow_symlinks=False)
        except OSError as exc:
            log.warning("skill library: could not copy %s into %s (%s)", item, dest, exc)


def _folder_text(path: Path) -> str:
    """The key a folder is marked under: its path, or where the path has bytes that are no
    UTF-8 (which Python keeps as escapes), ``hex:`` and its bytes (no absolute path starts so:
    two folders never share a key)."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "hex:" + os.fsencode(text).hex()
    return text


def _folder_of(key: str) -> Path:
    """The folder marked under ``key`` (:func:`_folder_text`)."""
    return Path(os.fsdecode(bytes.fromhex(key[4:]))) if key.startswith("hex:") else Path(key)


def _as_text(path: Path) -> str:
    """``path`` as text to show and record in messages: bytes of a name that are no UTF-8 as
    ``\\xNN``."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _machine_of(store: Store) -> str:
    """The machine a folder mark of ``store`` is kept under: for a workspace file, ``file:``
    and the file's resolved path (it is on this machine's disk: folder paths name its folders,
    whatever the host is called; and a copy of the file, which carries the marks, is not used
    through the original's folders), else :func:`this_machine`."""
    path = getattr(store, "path", None)
    if path is None:
        return this_machine()
    return "file:" + _folder_text(Path(path).resolve())


#: The key a workspace file's folder marks had before they named the file: read where the
#: file's own have none, and dropped once its own are written (a copy made since finds none).
UNNAMED_FILE = ""


def _names_a_file(machine: str) -> bool:
    """Whether folder marks kept under ``machine`` are those of a workspace file."""
    return machine == UNNAMED_FILE or machine.startswith("file:")


def _marks_kept(store: Store) -> bool:
    """Whether folder marks are kept for ``store``: not for a store of this process only (in
    memory), whose folder no other process can move."""
    return str(getattr(store, "path", "")) != ":memory:"


def _file_marks(store: Store) -> dict[str, Any]:
    """The marks kept in files before they were kept in the workspace."""
    for path in (_marks_path(store), _legacy_marks_path(store)):
        try:
            marks = json.loads(path.read_text(encoding="utf-8")) if path else None
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return {}
        return marks if isinstance(marks, dict) else {}
    return {}


def _folder_marks(store: Store) -> dict[str, Any]:
    """This machine's folders of ``store``'s workspace and the generation each was last brought
    to (:data:`FOLDER_MARKS`)."""
    if not _marks_kept(store):
        return {}
    machine = _machine_of(store)
    unnamed = store.folder_marks(UNNAMED_FILE) if _names_a_file(machine) else {}
    return {**_file_marks(store), **unnamed, **store.folder_marks(machine)}


def _any_marks(store: Store) -> bool:
    """Whether ``store``'s workspace has marked any folder, on any machine (none: it was made
    before folder marks were kept)."""
    return bool(store.folder_marks(None)) or bool(_file_marks(store))


def carry_folder_marks(source: Store, dest: Store) -> int:
    """Write the folder marks of ``source`` into ``dest``, a copy of it (``metaclaw db copy``:
    the copy keeps the source's generation numbers), under the machine names ``dest`` keeps them
    by, so that a folder that lagged when the copy was made is brought up there instead of its
    stale files being recorded back. This machine's marks move to this machine's name (a
    workspace file's are this machine's folders); other machines' marks go only to a database
    server's workspace. Returns how many were written."""
    if not (_marks_kept(source) and _marks_kept(dest)):
        return 0
    here, there = _machine_of(source), _machine_of(dest)
    ours = (here, UNNAMED_FILE) if _names_a_file(here) else (here,)
    found = sorted(source.folder_marks(None).items(), key=lambda item: item[0][0] == here)
    marks = {(there if machine in ours else machine, folder): mark  # its own over unnamed ones
             for (machine, folder), mark in found
             if machine in ours or not _names_a_file(there)}
    for folder, mark in _file_marks(source).items():  # kept in a file before: this machine's
        marks.setdefault((there, folder), mark)
    written = 0
    with dest.transaction():
        for (machine, folder), mark in marks.items():
            try:
                generation, digest = int(mark["generation"]), str(mark["snapshot"])
            except (KeyError, TypeError, ValueError):  # a damaged mark of a file
                continue
            dest.mark_folder(machine, folder, generation, digest)
            written += 1
    return written


def _legacy_marks_path(store: Store) -> Path | None:
    """The marks of a server workspace as they were named before (after its URL): read where
    the workspace's own have not been written yet."""
    if getattr(store, "engine", "sqlite") == "sqlite":
        return None
    return _marks_path(store, hashlib.sha256(store.location.encode()).hexdigest()[:16])


def own_folder(store: Store) -> Path | None:
    """This user's folder of a database server's workspace (None for a file workspace): where
    a command run on a machine that serves none of the workspace's folders reads and writes
    its library, instead of a new ``.metaclaw/skills`` wherever it runs. Kept beside the
    workspace's folder marks (:func:`_marks_path`), so it is found again as a folder of the
    workspace (:func:`workspace_folders`)."""
    marks = _marks_path(store)
    if marks is None or getattr(store, "path", None) is not None:
        return None
    return marks.with_name(marks.name.removesuffix(FOLDER_MARKS) + "-skills")


def workspace_folders(store: Store) -> list[Path]:
    """The skill folders on this machine that ``store``'s workspace has been used through (as
    ``metaclaw serve --skills`` gave them), those still there, the most up to date first: a
    command run from another directory reads the library there instead of writing a copy of
    it where it runs."""
    marks = _folder_marks(store)

    def generation(folder: str) -> int:
        mark = marks[folder]
        try:
            return int(mark["generation"]) if isinstance(mark, dict) else -1
        except (KeyError, TypeError, ValueError):
            return -1

    own = own_folder(store)
    own = own.resolve() if own is not None else None

    def someone_elses(folder: Path) -> bool:  # another user's own folder (own_folder)
        return folder != own and folder.parent.name == "metaclaw" \
            and folder.name.startswith("workspace-") and folder.name.endswith("-skills")

    folders = (_folder_of(key) for key in sorted(marks, key=generation, reverse=True))
    return [folder for folder in folders if not someone_elses(folder) and folder.is_dir()]


class SkillLibrary:
    """The skills in ``directory``, versioned in ``store``. Thread-safe.

    On construction the folder is read (broken files go to :attr:`problems`). When the store has
    no generation yet, generation 0 (kind ``init``) is created from the folder; when the folder
    differs from the latest stored generation, a new generation of kind ``disk`` records the
    difference. A skill whose file is broken keeps its stored version (nothing is lost).
    """

    def __init__(self, directory: str | os.PathLike[str], store: Store):
        self.directory = Path(directory).absolute()  # a later change of directory keeps it
        self.store = store
        self.problems: list[LoadProblem] = []
        self.import_problems: list[LoadProblem] = []  # the files the last import_dir skipped
        self._warned: set[str] = set()  # the problems already logged (each once while it lasts)
        self._lock = threading.RLock()
        self._skills: dict[str, Skill] = {}
        self._sorted: tuple[Skill, ...] = ()
        self._view: tuple[int, tuple[Skill, ...]] = (-1, ())  # (generation, sorted skills)
        self._catch_up_failed = False  # the folder could not be brought up: not marked
        self._pending_events: list[dict[str, Any]] = []  # recorded once a change is over
        self._generation = -1
        self._subscribers: list[Callable[[int], None]] = []
        self._snapshots: dict[int, dict[str, Skill]] = {}
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()
        self._journal: Path | None = None  # written by the change in progress, not committed
        self._folder_generation = -1  # the generation the folder was last brought to (marked)
        if self.directory.exists() and not self.directory.is_dir():
            raise SkillFormatError(f"the skills folder {self.directory} is a file; pass a folder "
                                   "(it is created when missing)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.reload()

    # -- reading ----------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The current generation number."""
        with self._lock:
            return self._generation

    def current(self) -> tuple[int, list[Skill]]:
        """(generation, skills sorted by name), read atomically; a generation committed by
        another process is adopted first (see :meth:`sync`)."""
        self.sync()
        generation, skills = self._view  # set whole by _set: no lock (a change in progress
        return generation, list(skills)  # must not hold up a request)

    def sync(self) -> int:
        """Adopt the store's latest generation if another process (or library) committed one.

        Cheap when nothing changed (one ``PRAGMA data_version``), so it runs before every
        request. Subscribers are told about an adopted generation. Returns the generation.
        """
        latest = self.store.current_generation()
        if latest is None or latest == self._generation:
            return self._generation
        with self._lock:
            adopted = self._adopt_latest()
        if adopted:
            self._notify(self._generation)
        return self._generation

    def _adopt_latest(self) -> bool:
        """Load the store's latest generation into memory (caller holds the lock)."""
        latest = self.store.latest_generation()
        if latest is None or latest == self._generation:
            return False
        previous = self._generation
        self._set(latest, self.snapshot(latest))
        log.info("skill library: adopted generation %d (was %d) from the store", latest, previous)
        return previous != -1

    def skills(self) -> list[Skill]:
        """The current skills, sorted by name."""
        return self.current()[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._skills)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._skills

    def get(self, name: str) -> Skill:
        """The current skill called ``name`` (:class:`SkillNotFound`, a ``KeyError``, if absent)."""
        self.sync()
        with self._lock:
            try:
                return self._skills[name]
            except KeyError:
                known = ", ".join(sorted(self._skills)) or "none"
                raise SkillNotFound(f"no skill named {name!r} in generation {self._generation} "
                                    f"(skills: {known})") from None

    def snapshot(self, generation: int) -> dict[str, Skill]:
        """The skills of a stored generation, by name."""
        with self._lock:
            if generation in self._snapshots:
                return dict(self._snapshots[generation])
        row = self.store.generation(int(generation))
        if row is None:
            latest = self.store.latest_generation()
            raise SkillNotFound(f"skill generation {generation} does not exist; choose one "
                                f"between 0 and {latest}")
        skills = _stored_skills(int(generation), row["snapshot"])
        with self._lock:
            self._snapshots[int(generation)] = skills
        return dict(skills)

    def generations(self) -> list[dict]:
        """Rows of ``skill_generations`` (without the snapshot), with the number of skills and events."""
        rows = self.store.query(
            "SELECT g.generation, g.parent, g.created_at, g.kind, g.reason, "
            # a damaged snapshot (not JSON) lists with no count instead of failing the listing
            f"{self.store.json_size('g.snapshot')} AS skills, "
            "(SELECT COUNT(*) FROM skill_events e WHERE e.generation = g.generation) AS events "
            "FROM skill_generations g ORDER BY g.generation")
        return rows

    def frame(self, generation: int | None = None):
        """The skills (of ``generation``; default: the current one) as a ``polars.DataFrame``:
        name, category, stage (``None``: general), description, chars, hash."""
        import polars as pl

        skills = self.skills() if generation is None else [
            skill for _, skill in sorted(self.snapshot(generation).items())]
        return pl.DataFrame(
            {"name": [s.name for s in skills], "category": [s.category for s in skills],
             "stage": [s.stage for s in skills],
             "description": [s.description for s in skills],
             "chars": [len(s.to_markdown()) for s in skills],
             "hash": [s.content_hash[:12] for s in skills]},
            schema={"name": pl.Utf8, "category": pl.Utf8, "stage": pl.Utf8,
                    "description": pl.Utf8, "chars": pl.Int64, "hash": pl.Utf8})

    def diff(self, g1: int, g2: int) -> SkillDiff:
        """What changed from generation ``g1`` to ``g2`` (either order), with the events between."""
        old, new = self.snapshot(g1), self.snapshot(g2)
        added = [new[n] for n in sorted(set(new) - set(old))]
        removed = [old[n] for n in sorted(set(old) - set(new))]
        edited = []
        for name in sorted(set(old) & set(new)):
            if old[name] != new[name]:
                text = "".join(difflib.unified_diff(
                    old[name].to_markdown().splitlines(keepends=True),
                    new[name].to_markdown().splitlines(keepends=True),
                    fromfile=f"{name}/SKILL.md (generation {g1})",
                    tofile=f"{name}/SKILL.md (generation {g2})"))
                edited.append(EditedSkill(name, old[name], new[name], text))
        lo, hi = sorted((int(g1), int(g2)))
        events = self.store.query(
            "SELECT generation, op, skill_name, reason, evidence, created_at FROM skill_events "
            "WHERE generation > ? AND generation <= ? ORDER BY id", (lo, hi))
        return SkillDiff(int(g1), int(g2), added, removed, edited, events)

    # -- changing ---------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(generation)`` after every change (errors in it are logged, not raised)."""
        with self._lock:
            self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[int], None]) -> None:
        """Stop calling ``callback`` (one added by :meth:`subscribe`; absent: nothing to do)."""
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def add(self, skill: Skill, *, reason: str = "", evidence: Iterable[int] = ()) -> int:
        """Add a new skill; returns the new generation."""
        return self.apply([SkillOp("add", skill, getattr(skill, "name", ""), reason,
                                   list(evidence))], kind="add", reason=reason)

    def edit(self, skill: Skill, *, reason: str = "", evidence: Iterable[int] = (),
             base: str | None = None) -> int:
        """Replace the skill of the same name; returns the new generation. ``base``: the
        content hash of the version the edit was made from (see :class:`SkillOp`)."""
        return self.apply([SkillOp("edit", skill, getattr(skill, "name", ""), reason,
                                   list(evidence), base)], kind="edit", reason=reason)

    def remove(self, name: str, *, reason: str = "", evidence: Iterable[int] = (),
               base: str | None = None) -> int:
        """Remove a skill; returns the new generation (``base`` as in :meth:`edit`)."""
        return self.apply([SkillOp("remove", None, name, reason, list(evidence), base)],
                          kind="remove", reason=reason)

    def apply(self, ops: list[SkillOp], *, kind: str = "edit", reason: str = "",
              base_generation: int | None = None,
              then: Callable[[int], None] | None = None) -> int:
        """Apply several operations as one new generation; returns its number.

        All operations are checked first: an unknown op, an ``add`` of an existing name, an
        ``edit`` or ``remove`` of a missing one raise :class:`SkillFormatError` and leave the
        library (and its files) unchanged. ``base_generation``: the generation the operations
        were made from (an evolver's proposal); a :class:`SkillConflict` if any process has
        committed another since. ``then(generation)``: writes to :attr:`store` that belong to
        the change (the buffers it moves, the record of who made it): they run in the
        generation's transaction, so they commit with it or not at all, and an exception from
        ``then`` undoes the change and propagates.
        """
        ops = list(ops)
        if not ops:
            raise SkillFormatError("no operations given; pass at least one SkillOp")
        with self._exclusive():
            if base_generation is not None and self._generation != base_generation:
                raise SkillConflict(f"the library moved from generation {base_generation} to "
                                    f"{self._generation} since these operations were made "
                                    "from it; make them again")
            new = self._validate(ops)
            generation = self._commit(new, ops, kind=kind, reason=reason, then=then)
        self._notify(generation)
        return generation

    def share(self, name: str, *, by: str | None = None, reason: str = "") -> int:
        """Promote the private skill ``name`` to ``shared`` (offered to every person and agent of
        the workspace): an explicit, recorded step. Returns the new generation, whose single
        event is an ``edit`` setting the scope to ``shared``, its reason saying who (``by``,
        default :func:`default_author`), from which scope and why (``reason``). A skill already
        shared is refused (:class:`SkillFormatError`), as is an unknown name
        (:class:`SkillNotFound`)."""
        skill = self.get(name)
        if not skill.private:
            raise SkillFormatError(f"skill {name!r} is already shared with the workspace")
        who = " ".join(str(by).split()) if by is not None and str(by).strip() \
            else default_author()
        why = " ".join(str(reason or "").split())
        text = f"shared with the workspace by {who} (was {skill.scope})" + (
            f": {why}" if why else "")
        return self.apply([SkillOp("edit", skill.with_scope(SHARED_SCOPE), name, text, [],
                                   skill.content_hash)], kind="share", reason=text)

    def import_dir(self, path: str | os.PathLike[str]) -> int:
        """Add or update skills from another upstream-style folder (``<path>/<name>/SKILL.md``,
        or a single skill folder holding ``SKILL.md``). A skill's other files (``scripts/``,
        references its text points at) are copied beside its ``SKILL.md`` in this library's
        folder, where they are not there yet (the workspace records ``SKILL.md`` alone: another
        folder of the workspace gets the text, not these files). Broken files are skipped, added
        to :attr:`problems` and kept in :attr:`import_problems`. Returns the new generation
        (the current one when nothing changed).
        """
        source = Path(path)
        if not source.is_dir():
            raise SkillFormatError(f"cannot import skills: {source} is not a folder")
        if (source / SKILL_FILE).is_file():
            skill, problem = _read_skill_file(source / SKILL_FILE, None)
            incoming, problems = ({skill.name: skill} if skill else {}), [problem] if problem else []
            folders = {skill.name: source} if skill else {}
        else:
            incoming, problems = load_skills_dir(source)
            folders = {name: source / name for name in incoming}
        self.import_problems = problems
        why = f"imported from {source}"
        with self._exclusive():
            self.problems.extend(problems)
            merged = {**self._skills, **incoming}
            ops = _changes(self._skills, merged, why)
            if ops:
                generation = self._commit(merged, ops, kind="import", reason=why)
        for name, folder in folders.items():
            _copy_resources(folder, self.directory / name)
        if not ops:
            return self._generation
        self._notify(generation)
        return generation

    def rollback(self, generation: int) -> int:
        """Restore an earlier generation as a new generation (kind ``rollback``); returns it."""
        target = self.snapshot(generation)
        why = f"rollback to generation {generation}"
        with self._exclusive():
            ops = _changes(self._skills, target, why)
            new_generation = self._commit(target, ops, kind="rollback", reason=why)
        self._notify(new_generation)
        return new_generation

    def _up_to_date(self) -> bool:
        """Whether the folder holds the store's latest generation as it is, with nothing to
        record, finish or bring up (no journal of a change, no broken file, the folder marked
        as at that generation): then that generation is taken without the store's write lock,
        so that opening a library to read it never waits behind another process's write."""
        if any(self.directory.glob(JOURNAL_GLOB)):
            return False
        latest = self.store.latest_generation()
        if latest is None:
            return False
        try:
            stored = self.snapshot(latest)
        except SkillFormatError:
            return False
        disk, problems = load_skills_dir(self.directory)
        if problems or not disk or _changes(stored, disk, ""):
            return False
        if _marks_kept(self.store):  # marked in the workspace as a change would mark it
            stored_mark = self.store.folder_marks(_machine_of(self.store)).get(self._folder_key())
            if stored_mark != {"generation": latest, "snapshot": _skills_digest(stored)}:
                return False
        with self._lock:  # a writer of this process holds it through its change: none is midway
            if self._generation > latest or self.store.latest_generation() != latest:
                return False  # committed meanwhile: the full reload reads it
            self.problems = []
            self._set(latest, stored)
            self._folder_generation = latest
        return True

    def reload(self) -> int:
        """Re-read the folder; records a ``disk`` generation if files changed. Returns the generation.

        A folder without a single readable skill, for a workspace whose latest generation has
        some, is filled from that generation instead (a new checkout, or a wrong folder, must
        not empty the library for every process; remove skills through the library or a
        rollback)."""
        previous = self._generation
        if not self._up_to_date():
            with self._exclusive(adopt=False):
                disk, problems = load_skills_dir(self.directory)
                self.problems = problems
                latest = self.store.latest_generation()
                if latest is None:
                    ops = _changes({}, disk, f"initial library from {_as_text(self.directory)}")
                    number = self.store.add_generation(
                        snapshot={n: disk[n].to_dict() for n in sorted(disk)}, kind="init",
                        reason=f"initial library from {_as_text(self.directory)}", parent=None,
                        events=[self._event(op) for op in ops])
                    self._set(number, disk)
                else:
                    why, damaged = "files changed on disk", False
                    try:
                        stored = self.snapshot(latest)
                    except SkillFormatError as exc:
                        # the folder is what is left of the current library: recorded over the
                        # damaged generation, so that every process can open the workspace again
                        log.error("skill library: %s; recording the folder %s as a new "
                                  "generation", exc, self.directory)
                        stored, damaged = {}, True
                        why = f"{exc.reason.split(';')[0]}; recorded the folder"
                    if stored and not disk:
                        # not a single readable skill in the folder of a workspace that has some (a
                        # new checkout, a wrong --skills): filled from the store, never read as
                        # "every skill removed" (a broken file in it is left as it is, below)
                        self._fill(latest)
                        disk, problems = load_skills_dir(self.directory)
                        self.problems = problems
                    elif stored and not damaged and _marks_kept(self.store) \
                            and self._folder_mark() is None \
                            and (_any_marks(self.store) or self._lags(stored, disk)):
                        # skills in a folder this workspace has never marked (another member's,
                        # one used with another workspace): it joins the library, never read as it
                        # (a workspace that marked no folder ever predates the marks: its folder
                        # is read as it always was, what differs a hand edit, unless it lags:
                        # it lacks skills, or holds an earlier version of one; it joins then)
                        why = self._join(latest, stored, disk)
                        disk, problems = load_skills_dir(self.directory)
                        self.problems = problems
                        for name, skill in stored.items():  # never a removal (a stray file of its
                            disk.setdefault(name, skill)    # name, a folder that cannot be written)
                    if not damaged:  # stale files are not hand edits: never recorded as such
                        for name, skill in self._catch_up(latest, stored, problems).items():
                            if skill is None:
                                disk.pop(name, None)
                            else:
                                disk[name] = skill
                    # a broken file keeps the stored version of its folder's skill, and of the skill
                    # it names (a folder renamed by hand), instead of counting as their removal
                    for problem in problems:
                        kept = [name for name in dict.fromkeys((Path(problem.path).parent.name,
                                                                problem.name))
                                if name in stored and name not in disk]
                        for name in kept:
                            disk[name] = stored[name]
                        if kept:
                            problem.reason += f" (keeping its version from generation {latest})"
                    ops = _changes(stored, disk, why)
                    if ops or damaged:
                        number = self.store.add_generation(
                            snapshot={n: disk[n].to_dict() for n in sorted(disk)}, kind="disk",
                            reason=why, parent=latest,
                            events=[self._event(op) for op in ops])
                        self._set(number, disk)
                        log.info("skill library: generation %d: %s in %s (%s)", number,
                                 ", ".join(f"{op.op} {op.name}" for op in ops) or "recorded",
                                 _as_text(self.directory), why)
                    else:
                        self._set(latest, stored)
        generation = self._generation
        changed = previous != -1 and generation != previous
        said = {str(problem) for problem in self.problems}
        for problem in self.problems:
            if str(problem) not in self._warned:
                log.warning("skipped skill file %s", problem)
        self._warned = said
        if changed:
            self._notify(generation)
        return generation

    def watch(self, *, debounce_ms: int = 300) -> "SkillLibrary":
        """Turn hand edits of the folder into generations while the process runs.

        A daemon thread waits on file-system events (``watchfiles``: inotify / FSEvents /
        ReadDirectoryChanges, polling where none exists) and calls :meth:`reload` when a
        ``SKILL.md`` changes; broken files are reported (``problems``, the log and a
        ``skill_file_problem`` event in the store) and keep their stored version. Idempotent;
        :meth:`unwatch` stops it.
        """
        with self._lock:
            if self._watcher is not None and self._watcher.is_alive():
                return self
            self._stop_watching = threading.Event()
            ready = threading.Event()
            self._watcher = threading.Thread(target=self._watch_loop, args=(debounce_ms, ready),
                                             name="metaclaw-skills-watch", daemon=True)
            self._watcher.start()
        ready.wait(5.0)  # from here on no edit is missed
        return self

    def unwatch(self, timeout: float = 5.0) -> None:
        """Stop the watcher started by :meth:`watch` (no-op when none runs)."""
        with self._lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            self._stop_watching.set()
            watcher.join(timeout)

    @property
    def watching(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def _watch_loop(self, debounce_ms: int, ready: threading.Event) -> None:
        import watchfiles

        def relevant(change: Any, path: str) -> bool:
            name = os.path.basename(path)
            return name == SKILL_FILE or (not name.startswith(".") and "." not in name)

        pending = False  # a reload that failed (the store was down): tried again between edits
        try:
            # the first (empty) yield on timeout means the watch is in place: one reload then
            # catches edits made before it was; later empty yields are skipped
            for changes in watchfiles.watch(self.directory, watch_filter=relevant,
                                            debounce=debounce_ms, step=WATCH_STEP_MS,
                                            stop_event=self._stop_watching,
                                            rust_timeout=WATCH_STEP_MS, yield_on_timeout=True,
                                            raise_interrupt=False):
                if not changes and ready.is_set() and not pending:
                    try:  # between edits: the folder follows the library
                        self._bring_folder_up()
                    except Exception:  # the store is down: tried again at the next step
                        log.debug("could not bring %s up to date", self.directory, exc_info=True)
                    continue
                retry, pending = pending and not changes, False
                try:
                    known = {(p.path, p.reason) for p in self.problems}
                    self.reload()
                    for problem in self.problems:
                        if (problem.path, problem.reason) not in known:
                            # the whole path, and the machine where a server's workspace has
                            # several: two processes' "./skills" are told apart
                            where = _as_text(Path(problem.path).absolute())
                            machine = _machine_of(self.store)
                            self.store.record_event(
                                source="skills", kind="skill_file_problem", level="warning",
                                message=f"{where}: {problem.reason}"
                                + ("" if _names_a_file(machine) else f" (on {machine})"),
                                path=where)
                except StoreUnavailable as exc:  # the edit waits for the store, not the next one
                    pending = True
                    if not retry:
                        log.warning("could not reload the skills folder %s (%s); tried again "
                                    "until the workspace answers", self.directory, exc)
                except Exception:  # keep watching: the next edit may fix it
                    log.exception("could not reload the skills folder %s", self.directory)
                ready.set()
        except Exception:
            log.exception("the skills folder watcher stopped; hand edits of %s are picked up "
                          "on the next reload", self.directory)
        finally:
            ready.set()

    # -- internals --------------------------------------------------------------------------
    def _bring_folder_up(self) -> None:
        """Adopt a generation another process committed and, where the folder lags behind it,
        bring the folder to it (:meth:`_catch_up`), so the files a person opens next are the
        library's; a busy store is tried again at the next call (the watcher calls this every
        :data:`WATCH_STEP_MS` between edits)."""
        before = self.sync()
        if self._folder_generation >= self._generation or not _marks_kept(self.store):
            return
        try:
            with self._exclusive(wait=False):
                pass
        except StoreBusy:
            return
        if self._generation != before:  # adopted a newer one on the way: its listeners hear
            self._notify(self._generation)

    @contextlib.contextmanager
    def _exclusive(self, adopt: bool = True, wait: bool = True):
        """Hold the library lock and the store's write lock (every process), having finished
        what a process that died mid-change left (:meth:`_recover`), adopted the latest
        stored generation and brought the folder's stale files to it (:meth:`_catch_up`), so a
        change is validated against the true latest; on success the folder is marked as
        holding the new current generation, in the same transaction."""
        with self._lock:
            self._journal = journal = None
            self._catch_up_failed = False
            try:
                with self.store.transaction(wait=wait):
                    self._recover()
                    if adopt:
                        self._adopt_latest()
                        self._catch_up(self._generation, self._skills, self.problems)
                    yield
                    journal, self._journal = self._journal, None
                    if not self._catch_up_failed:  # else the folder still lags: said so
                        self._mark_folder()
            finally:  # said whether the change went through or not (the files changed)
                events, self._pending_events = self._pending_events, []
                for event in events:
                    with contextlib.suppress(Exception):  # the log holds it as well
                        self.store.record_event(**event)
            if journal is not None:  # committed: the files it guarded hold the generation now
                journal.unlink(missing_ok=True)

    def _folder_marks(self) -> dict[str, Any]:
        return _folder_marks(self.store)

    def _folder_key(self) -> str:
        return _folder_text(self.directory.resolve())

    def _folder_mark(self) -> dict[str, Any] | None:
        mark = self._folder_marks().get(self._folder_key())
        return mark if isinstance(mark, dict) else None

    def _mark_folder(self) -> None:
        """Record that the folder's files hold the current generation (where not edited by
        hand), in the transaction of the change the caller holds: the mark and the generation
        commit together."""
        mark = {"generation": self._generation, "snapshot": _skills_digest(self._skills)}
        if not _marks_kept(self.store) or self._generation < 0:
            return
        self._folder_generation = self._generation
        machine = _machine_of(self.store)
        if self.store.folder_marks(machine).get(self._folder_key()) == mark:
            return  # (a mark of the files of before is written here all the same)
        self.store.mark_folder(machine, self._folder_key(), mark["generation"], mark["snapshot"])
        if _names_a_file(machine):
            self.store.forget_folder(UNNAMED_FILE, self._folder_key())

    def _catch_up(self, number: int, latest: dict[str, Skill],
                  problems: list[LoadProblem]) -> dict[str, Skill | None]:
        """Bring the folder to generation ``number`` (the store's latest, holding ``latest``)
        where it lags: a skill whose file is still as the generation the folder was last
        brought to had it (another folder of the workspace changed it since) gets its latest
        version; a skill edited by hand since, or whose file is broken, is left as it is.
        Returns the skills brought up (``None``: removed), written or, where the folder cannot
        be written, to be read as written.

        Without a mark from this workspace nothing is known to be stale, so nothing is done."""
        mark = self._folder_mark()
        try:
            generation = int(mark["generation"])  # type: ignore[index]
            if generation >= number:
                return {}
            base = self.snapshot(generation)
        except (TypeError, KeyError, ValueError, SkillNotFound):  # no mark, or not readable
            return {}
        if _skills_digest(base) != mark.get("snapshot"):
            return {}  # a mark from before the database was replaced: not this generation
        broken = {Path(p.path).parent.name for p in problems} | {p.name for p in problems}
        changed = [name for name in sorted(set(base) | set(latest))
                   if base.get(name) != latest.get(name)]
        stale = [name for name in changed
                 if name not in broken and not self._edited_by_hand(name, base.get(name))]
        # edited here on the folder's old version while another folder changed it: both kept
        # where the two changes touch different lines, else the other's and the edit set aside
        edited = [name for name in changed if name not in stale and name not in broken]
        if not stale and not edited:
            return {}
        # read as brought up even where the folder cannot be written: its stale files must
        # never be recorded as changes back (an edit there stays in its file)
        brought: dict[str, Skill | None] = {name: latest.get(name) for name in stale + edited}
        try:
            if stale:
                log.info("skill library: brought %s in %s from generation %d to %d (changed "
                         "through another folder of the workspace)", ", ".join(stale),
                         self.directory, generation, number)
                self._write(stale, latest)
            for name in edited:
                brought[name] = self._merge(name, base.get(name), latest.get(name), number,
                                            generation)
        except OSError as exc:
            self._catch_up_failed = True
            log.warning("skill library: cannot write the folder %s (%s); it still holds "
                        "generation %d's files", self.directory, exc, generation)
        return brought

    def _merge(self, name: str, base: Skill | None, latest: Skill | None, number: int,
               since: int) -> Skill | None:
        """The skill ``name`` of a lagging folder (last brought to generation ``since``), edited
        here on the version ``base`` while generation ``number`` made it ``latest``: the two
        changes merged line by line (three-way, as version control merges) where they touch
        different lines and the result is a valid skill, written into the folder and read as
        this folder's edit; otherwise ``latest`` is
        written and the edit is kept beside the skill folders as ``<name>.conflict-<number>.md``
        (never read as a skill, never written over), with a warning and a
        ``skill_edit_conflict`` event (recorded once the change is over, whatever its outcome). Nothing is lost
        and nothing edited elsewhere is silently undone."""
        import merge3

        folder = self.directory / validate_name(name)
        path = folder / SKILL_FILE
        mine = _file_text(path)
        theirs = latest.to_markdown() if latest is not None else None
        if mine == theirs or (mine is not None and latest is not None
                              and _read_skill_file(path, name)[0] == latest):
            return latest  # the same skill, written alike or otherwise: nothing to merge
        if base is not None and mine is not None and theirs is not None:
            merge = merge3.Merge3(base.to_markdown().splitlines(True), mine.splitlines(True),
                                  theirs.splitlines(True))
            if not any(region[0] == "conflict" for region in merge.merge_regions()):
                text = "".join(merge.merge_lines())
                try:
                    merged = Skill.from_markdown(text, source=str(path))
                except SkillFormatError:
                    merged = None
                if merged is not None and merged.name == name and not oversize_reason(merged):
                    _write_skill_file(folder, text)
                    log.info("skill library: merged the edit of %s in %s with generation %d's "
                             "change of it", name, self.directory, number)
                    return merged
        aside = self._set_aside(name, number, mine) if mine is not None else None
        self._write([name], {name: latest} if latest is not None else {})
        if mine is None:  # removed here, changed there: the change stands, not the removal
            said = (f"{name} was removed from {_as_text(self.directory)} on its version of "
                    f"generation {since} while generation {number} changed it through another "
                    f"folder: the folder holds generation {number}'s version again; remove it once "
                    "more to remove it from the workspace")
        elif latest is None:  # edited here, removed there: the removal stands
            said = (f"{name} was edited in {_as_text(self.directory)} on its version of "
                    f"generation {since} while generation {number} removed it through another "
                    f"folder: the removal stands and the edit is kept in {_as_text(aside)}; to "
                    f"keep the skill, write it back as {_as_text(path)}")
        else:
            said = (f"{name} was edited in {_as_text(self.directory)} on its version of "
                    f"generation {since} while generation {number} changed it through another "
                    f"folder, and the two changes overlap: the folder holds generation "
                    f"{number}'s version; the edit is kept in {_as_text(aside)}: merge it into "
                    f"{_as_text(path)} and save")
        log.warning("skill library: %s", said)
        self._pending_events.append({"source": "skills", "kind": "skill_edit_conflict",
                                     "level": "warning", "message": said,
                                     "path": str(aside if aside is not None else path)})
        return latest

    def _set_aside(self, name: str, number: int, text: str) -> Path:
        """``text``, a version of skill ``name`` the folder no longer holds, kept beside the
        skill folders as ``<name>.conflict-<number>.md`` (never read as a skill, never written
        over: a second one gets ``.2``, ...)."""
        aside = self.directory / f"{name}.conflict-{number}.md"
        for k in itertools.count(2):  # never over an earlier one (it may hold another edit)
            if not os.path.lexists(aside):
                break
            aside = self.directory / f"{name}.conflict-{number}.{k}.md"
        _atomic_write(aside, text)
        return aside

    def _lags(self, stored: dict[str, Skill], disk: dict[str, Skill]) -> bool:
        """Whether a folder no mark speaks for is behind the library (``stored``, its latest
        generation's skills): it lacks some of them, or holds a version of one that an earlier
        generation had (a stale copy, not a hand edit)."""
        if not set(stored) <= set(disk):
            return True
        for name in (n for n in stored if stored[n] != disk[n]):
            rows = self.store.query("SELECT DISTINCT generation FROM skill_events WHERE "
                                    "skill_name = ? AND op IN ('add', 'edit') "
                                    "ORDER BY generation DESC", (name,))
            for row in rows:
                try:
                    if self.snapshot(int(row["generation"])).get(name) == disk[name]:
                        return True
                except SkillNotFound:
                    continue
        return False

    def _join(self, number: int, stored: dict[str, Skill], disk: dict[str, Skill]) -> str:
        """A folder holding skills that the workspace has never marked (another member's, one
        used with another workspace, or moved) joins the library at generation ``number``
        (holding ``stored``): it gets the skills it lacks, and the workspace's version of those
        it holds otherwise (its own kept beside, as an overlapping edit is:
        :meth:`_set_aside`); its other skills are added to the workspace, but for skills the
        workspace removed (a stale copy must not bring them back: kept beside and taken out of
        the folder). Its missing skills are never read as removals (which every folder of the
        workspace would follow). Returns the reason of the generation that adds its skills."""
        differ = [name for name in sorted(set(stored) & set(disk)) if stored[name] != disk[name]]
        extra = sorted(set(disk) - set(stored))
        removed = [name for name in extra if self.store.query(
            "SELECT 1 AS found FROM skill_events WHERE skill_name = ? LIMIT 1", (name,))]
        kept: dict[str, Path] = {}
        written = 0
        try:
            for name in differ + removed:
                text = _file_text(self.directory / name / SKILL_FILE)
                if text is not None:
                    kept[name] = self._set_aside(name, number, text)
            self._write(differ + removed, stored)  # the workspace's version, or none
            written = self._write_missing(stored)
        except OSError as exc:  # a folder that cannot be written: read as the workspace's
            self._catch_up_failed = True
            log.warning("skill library: cannot write the folder %s (%s); it is read as "
                        "generation %d's skills", self.directory, exc, number)
        extra = [name for name in extra if name not in removed]
        where = _as_text(self.directory)
        # the workspace's skills as they are: the folder moved or was copied with its
        # workspace; nothing joined, nothing to warn about
        quiet = not (differ or removed or extra or written)
        if quiet:
            said = (f"the skills folder {where} holds generation {number}'s skills as they are "
                    "(moved or copied with its workspace): marked as this workspace's")
        else:
            said = (f"the skills folder {where} has no mark of this workspace (new to it, or "
                    f"moved; generation {number}, {len(stored)} skills): it joined the library "
                    f"instead of replacing it; wrote {written} "
                    f"skill{'' if written == 1 else 's'} it lacked")
        if kept:
            said += (f"; its own version of {', '.join(kept)} is kept in "
                     f"{', '.join(_as_text(p) for p in kept.values())}")
        if removed:
            said += f" ({', '.join(removed)}: removed from the workspace before)"
        if extra:
            said += f"; its own skills {', '.join(extra)} are added to the workspace"
        level = "info" if quiet else "warning"
        log.log(logging.INFO if quiet else logging.WARNING, "skill library: %s", said)
        self._pending_events.append({"source": "skills", "kind": "skill_folder_joined",
                                     "level": level, "message": said, "path": where})
        return f"skills of {where}, a folder new to the workspace"

    def _recover(self) -> None:
        """Finish what a process that died mid-change left in the folder (caller holds the
        store's write lock, so no live process is between writing and committing):

        - a change whose generation is not in the store: its files are put back, except those
          edited since (kept, and logged); a committed change's files were all written before
          its commit, so its journal is only removed;
        - an interrupted fill from the store (:meth:`_fill`): completed."""
        for path in sorted(self.directory.glob(JOURNAL_GLOB)):
            try:
                journal = json.loads(path.read_text(encoding="utf-8"))
                if "fill" in journal:
                    self._write_missing(self.snapshot(int(journal["fill"])))
                else:
                    row = self.store.generation(int(journal["generation"]))
                    if row is None or _snapshot_digest(row["snapshot"]) != journal["snapshot"]:
                        self._put_back(journal)
                path.unlink()
            except (OSError, ValueError, KeyError, TypeError):
                log.exception("skill library: cannot finish the journal %s; remove it once the "
                              "folder is as it should be", path)

    def _put_back(self, journal: dict[str, Any]) -> None:
        """The files of an uncommitted change as they were before it, where they still hold
        what it wrote (or it had not written them yet)."""
        kept = []
        for name, text in journal["old"].items():
            folder = self.directory / validate_name(name)
            current = _file_text(folder / SKILL_FILE)
            if current == text:
                continue  # not written yet
            if _text_digest(current) != journal["new"][name]:
                kept.append(name)  # edited since the change died: the user's, not the change's
            elif text is None:
                _remove_skill_folder(folder)
            else:
                _write_skill_file(folder, text)
        log.warning("skill library: put back the skill files in %s that a change left "
                    "unfinished (its process stopped before committing generation %s)%s",
                    self.directory, journal["generation"],
                    f"; kept {', '.join(kept)}, edited since" if kept else "")

    def _fill(self, generation: int) -> None:
        """Write the stored generation's skills that the folder lacks, under a journal, so that a
        fill cut short is completed rather than read as skills removed."""
        journal = self.directory / f"{JOURNAL_PREFIX}fill-{generation}.json"
        _atomic_write(journal, json.dumps({"fill": generation}))
        written = self._write_missing(self.snapshot(generation))
        journal.unlink()
        log.info("skill library: wrote generation %d's %d skills into the folder %s, which had "
                 "none", generation, written, self.directory)

    def _write_missing(self, skills: dict[str, Skill]) -> int:
        """Write the skills that have neither a folder nor a file (links, even broken, count)."""
        missing = [name for name in sorted(skills)
                   if not os.path.lexists(folder := self.directory / name)
                   or folder.is_dir() and not os.path.lexists(folder / SKILL_FILE)]
        self._write(missing, skills)
        return len(missing)

    def _validate(self, ops: list[SkillOp]) -> dict[str, Skill]:
        new = dict(self._skills)
        for i, op in enumerate(ops):
            where = f"operation {i + 1} ({getattr(op, 'op', '?')} {getattr(op, 'name', '')!r})"
            if not isinstance(op, SkillOp):
                raise SkillFormatError(f"operation {i + 1} is a {type(op).__name__}; "
                                       "pass SkillOp objects")
            if op.op not in OPS:
                raise SkillFormatError(f"{where}: unknown op {op.op!r}; use add, edit or remove")
            if op.op in ("add", "edit"):
                if not isinstance(op.skill, Skill):
                    raise SkillFormatError(f"{where}: {op.op} needs a Skill in 'skill'")
                if op.name != op.skill.name:
                    raise SkillFormatError(f"{where}: name {op.name!r} differs from the "
                                           f"skill's name {op.skill.name!r}")
                too_big = oversize_reason(op.skill)
                if too_big:
                    raise SkillFormatError(f"{where}: {too_big}")
            validate_name(op.name)
            if not all(isinstance(e, int) and not isinstance(e, bool) for e in op.evidence):
                raise SkillFormatError(f"{where}: evidence must be a list of turn ids (ints)")
            if op.op == "add" and op.name in new:
                raise SkillFormatError(f"{where}: a skill named {op.name!r} already exists; "
                                       "use edit to change it")
            if op.op in ("edit", "remove") and op.name not in new:
                raise SkillFormatError(f"{where}: there is no skill named {op.name!r}; "
                                       "use add to create it")
            if op.base is not None and op.name in new and new[op.name].content_hash != op.base:
                raise SkillConflict(f"{where}: the skill changed since this operation was "
                                    f"made from it (now generation {self._generation}); read "
                                    "it again and redo the change")
            if op.op == "remove":
                del new[op.name]
            else:
                new[op.name] = op.skill
        return new

    @staticmethod
    def _event(op: SkillOp) -> dict:
        return {"op": op.op, "skill_name": op.name, "reason": op.reason or "",
                "evidence": list(op.evidence)}

    def _commit(self, new: dict[str, Skill], ops: list[SkillOp], *, kind: str,
                reason: str, then: Callable[[int], None] | None = None) -> int:
        """Write the files, then store the generation (and ``then``'s writes, in the same
        transaction); on failure restore the files."""
        old = dict(self._skills)
        touched = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
        edited = [name for name in touched if self._edited_by_hand(name, old.get(name))]
        if edited:  # writing over them would lose a hand edit no generation holds yet
            broken = {Path(p.path).parent.name: p.reason for p in self.problems}
            if any(name in broken for name in edited):  # never recorded while it stays broken
                raise SkillConflict("; ".join(
                    f"{name}: its file in {_as_text(self.directory)} is broken ({broken[name]})"
                    for name in edited if name in broken) + ": fix it or remove its folder "
                    "first (the change would write over it)")
            raise SkillConflict(f"{', '.join(edited)}: changed in {self.directory} since "
                                f"generation {self._generation} (an edit not yet recorded, "
                                "which the folder watcher or a reload records); retry then")
        snapshot = {n: s.to_dict() for n, s in sorted(new.items())}
        latest = self.store.latest_generation()
        number = 0 if latest is None else latest + 1  # what add_generation gives, under the lock
        journal = self.directory / f"{JOURNAL_PREFIX}{number}.json"
        _atomic_write(journal, json.dumps({
            "generation": number, "snapshot": _snapshot_digest(snapshot),
            "old": {n: old[n].to_markdown() if n in old else None for n in touched},
            "new": {n: _text_digest(new[n].to_markdown() if n in new else None)
                    for n in touched}}))
        try:
            self._write(touched, new)
            number = self.store.add_generation(
                snapshot=snapshot, kind=kind, reason=reason, parent=self._generation,
                events=[self._event(op) for op in ops])
            if then is not None:
                then(number)
        except BaseException:
            try:
                self._write(touched, old)
                journal.unlink()
            except OSError:  # the journal stays: the next change or reload puts them back
                log.exception("could not restore skill files in %s", self.directory)
            raise
        self._journal = journal  # removed once the transaction commits (see _exclusive)
        self._set(number, new)
        return number

    def _edited_by_hand(self, name: str, stored: Skill | None) -> bool:
        """Whether the skill's file in the folder differs from its stored version (``None``: no
        file), so that a change would write over an edit no generation holds."""
        path = self.directory / validate_name(name) / SKILL_FILE
        try:
            current = _file_text(path)
        except OSError:  # a link loop, a directory: not what the library wrote
            return True
        if current is None or stored is None:
            return (current is None) != (stored is None)
        if current == stored.to_markdown():
            return False
        return _read_skill_file(path, name)[0] != stored  # the same skill, written otherwise

    def _write(self, names: list[str], skills: dict[str, Skill]) -> None:
        for name in names:
            folder = self.directory / validate_name(name)
            if name in skills:
                _write_skill_file(folder, skills[name].to_markdown())
            else:
                _remove_skill_folder(folder)

    def _set(self, generation: int, skills: dict[str, Skill]) -> None:
        self._skills = dict(skills)
        self._sorted = tuple(skills[n] for n in sorted(skills))
        self._view = (int(generation), self._sorted)
        self._generation = int(generation)
        self._snapshots[int(generation)] = dict(skills)

    def _notify(self, generation: int) -> None:
        with self._lock:
            callbacks = list(self._subscribers)
        for callback in callbacks:
            try:
                callback(generation)
            except Exception:  # a broken listener must not break a change to the library
                log.exception("skill library listener %r failed", callback)

    def __repr__(self) -> str:
        return (f"SkillLibrary({str(self.directory)!r}, generation={self.generation}, "
                f"skills={len(self)}, problems={len(self.problems)})")

    def _repr_html_(self) -> str:
        generation, skills = self.current()
        esc = html.escape
        rows = "".join(
            f"<tr><td><b>{esc(s.name)}</b></td><td>{esc(s.category)}</td>"
            f"<td>{esc(s.description)}</td><td>{len(s.to_markdown())}</td></tr>" for s in skills)
        problems = "".join(f"<li>{esc(str(p))}</li>" for p in self.problems)
        return (f"<div><b>Skill library</b> {esc(str(self.directory))} &middot; generation "
                f"{generation} &middot; {len(skills)} skills"
                "<table><tr><th>name</th><th>category</th><th>description</th><th>chars</th></tr>"
                f"{rows}</table>"
                + (f"<p>Skipped files:</p><ul>{problems}</ul>" if problems else "") + "</div>")
