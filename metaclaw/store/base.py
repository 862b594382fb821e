"""The workspace store's SQLite engine and what both engines share (schema, migrations, the
``Store`` API; see :mod:`metaclaw.store`)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import re
import shlex
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import parse_qs, unquote, urlsplit

from metaclaw.jsonlib import dumps

log = logging.getLogger(__name__)

DEFAULT_DB = Path(".metaclaw") / "metaclaw.db"

#: Columns of ``turns`` holding JSON; decoded on read.
JSON_COLUMNS = {
    "request_messages", "request_params", "tool_calls", "usage", "injected_skills",
    "judge_votes", "prompt_tokens_ids", "completion_tokens_ids", "completion_logprobs",
    "meta", "snapshot", "evidence", "metrics", "signals", "retrieval_scores", "identified_by",
    "detail", "context_budget", "ops", "support_ids", "safety", "history",
}

MIGRATIONS: list[str] = [
    # 1: the foundation schema
    """
    CREATE TABLE sessions (
        id          TEXT PRIMARY KEY,
        created_at  REAL NOT NULL,
        updated_at  REAL NOT NULL,
        done        INTEGER NOT NULL DEFAULT 0,
        meta        TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE turns (
        id                    INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id            TEXT NOT NULL REFERENCES sessions(id),
        turn_index            INTEGER NOT NULL,
        turn_type             TEXT NOT NULL DEFAULT 'main',
        created_at            REAL NOT NULL,
        model                 TEXT,
        stream                INTEGER NOT NULL DEFAULT 0,
        request_messages      TEXT NOT NULL,
        request_params        TEXT NOT NULL DEFAULT '{}',
        response              TEXT,
        tool_calls            TEXT,
        finish_reason         TEXT,
        usage                 TEXT,
        prompt_tokens         INTEGER,
        completion_tokens     INTEGER,
        latency_ms            REAL,
        status                TEXT NOT NULL,
        http_status           INTEGER,
        error                 TEXT,
        skill_generation      INTEGER NOT NULL DEFAULT 0,
        injected_skills       TEXT NOT NULL DEFAULT '[]',
        policy_version        INTEGER NOT NULL DEFAULT 0,
        reward                REAL,
        judge_model           TEXT,
        judge_votes           TEXT,
        judge_rationale       TEXT,
        judged_at             REAL,
        buffer_set            TEXT,
        buffer_state          TEXT,
        prompt_tokens_ids     TEXT,
        completion_tokens_ids TEXT,
        completion_logprobs   TEXT
    );
    CREATE INDEX turns_session ON turns(session_id, turn_index);
    CREATE INDEX turns_generation ON turns(skill_generation);
    CREATE TABLE skill_generations (
        generation  INTEGER PRIMARY KEY,
        parent      INTEGER,
        created_at  REAL NOT NULL,
        kind        TEXT NOT NULL,
        reason      TEXT NOT NULL DEFAULT '',
        snapshot    TEXT NOT NULL
    );
    CREATE TABLE skill_events (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        generation  INTEGER NOT NULL REFERENCES skill_generations(generation),
        op          TEXT NOT NULL,
        skill_name  TEXT NOT NULL,
        reason      TEXT NOT NULL DEFAULT '',
        evidence    TEXT NOT NULL DEFAULT '[]',
        created_at  REAL NOT NULL
    );
    CREATE TABLE policy_versions (
        version           INTEGER PRIMARY KEY,
        created_at        REAL NOT NULL,
        backend           TEXT NOT NULL,
        base_model        TEXT NOT NULL,
        skill_generation  INTEGER NOT NULL DEFAULT 0,
        checkpoint        TEXT,
        meta              TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE training_steps (
        id                INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id            TEXT NOT NULL,
        step              INTEGER NOT NULL,
        created_at        REAL NOT NULL,
        backend           TEXT NOT NULL,
        policy_version    INTEGER NOT NULL,
        skill_generation  INTEGER NOT NULL,
        loss              REAL,
        reward_mean       REAL,
        reward_std        REAL,
        groups            INTEGER NOT NULL DEFAULT 0,
        skipped_groups    INTEGER NOT NULL DEFAULT 0,
        tokens            INTEGER NOT NULL DEFAULT 0,
        wall_time_s       REAL,
        metrics           TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE scheduler_transitions (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        at          REAL NOT NULL,
        from_state  TEXT NOT NULL,
        to_state    TEXT NOT NULL,
        reason      TEXT NOT NULL DEFAULT '',
        signals     TEXT NOT NULL DEFAULT '{}'
    );
    """,
    # 2: why a turn got its skills and its session, and the loops' events
    """
    ALTER TABLE turns ADD COLUMN retrieval_query TEXT;
    ALTER TABLE turns ADD COLUMN retrieval_scores TEXT;
    ALTER TABLE turns ADD COLUMN identified_by TEXT;
    CREATE TABLE events (
        id       INTEGER PRIMARY KEY AUTOINCREMENT,
        at       REAL NOT NULL,
        source   TEXT NOT NULL,
        kind     TEXT NOT NULL,
        level    TEXT NOT NULL DEFAULT 'info',
        message  TEXT NOT NULL,
        detail   TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_kind ON events(kind, at);
    """,
    # 3: the wire protocol a turn arrived in, and what the context budget decided for it
    """
    ALTER TABLE turns ADD COLUMN protocol TEXT NOT NULL DEFAULT 'openai';
    ALTER TABLE turns ADD COLUMN context_budget TEXT;
    """,
    # 4: human labels (history in ``labels``, the latest verdict denormalised on the turn so the
    # buffer rules read it) and skill proposals held back or promoted by the verification gate
    """
    ALTER TABLE turns ADD COLUMN human_label TEXT;
    CREATE TABLE labels (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        turn_id     INTEGER NOT NULL REFERENCES turns(id),
        verdict     TEXT NOT NULL CHECK (verdict IN ('pass', 'fail')),
        note        TEXT NOT NULL DEFAULT '',
        corrected   TEXT,
        author      TEXT NOT NULL,
        created_at  REAL NOT NULL
    );
    CREATE INDEX labels_turn ON labels(turn_id, id);
    CREATE TABLE proposals (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        created_at       REAL NOT NULL,
        origin           TEXT NOT NULL,
        status           TEXT NOT NULL,
        base_generation  INTEGER NOT NULL,
        ops              TEXT NOT NULL,
        support_ids      TEXT NOT NULL DEFAULT '[]',
        evidence         TEXT NOT NULL DEFAULT '{}',
        safety           TEXT NOT NULL DEFAULT '[]',
        judge_calls      INTEGER NOT NULL DEFAULT 0,
        reason           TEXT NOT NULL DEFAULT '',
        history          TEXT NOT NULL DEFAULT '[]',
        decided_by       TEXT,
        decided_at       REAL,
        generation       INTEGER
    );
    CREATE INDEX proposals_status ON proposals(status, id);
    """,
    # 5: the slow loop: how many GRPO steps trained on a turn (a trained turn keeps its buffer set)
    """
    ALTER TABLE turns ADD COLUMN trained_steps INTEGER NOT NULL DEFAULT 0;
    """,
    # 6: a judge's lease on a turn it is scoring, so that another process does not score it too
    """
    ALTER TABLE turns ADD COLUMN judge_lease_until REAL;
    """,
    # 7: a GRPO step's expiring claim on a turn it is training on (which step, until when): the
    # step is counted in ``trained_steps`` only when its record is committed, so a trainer
    # killed mid-step leaves a claim that expires instead of a count that lasts forever
    """
    ALTER TABLE turns ADD COLUMN train_claim_until REAL;
    ALTER TABLE turns ADD COLUMN train_claim_by TEXT;
    """,
    # 8: a step's claimed turns found without reading every turn (renewing, committing and
    # releasing a claim scanned the whole table under the write lock). Partial: a turn without
    # a claim (every turn the proxy records) has no entry, so recording costs nothing more
    """
    CREATE INDEX turns_train_claim ON turns(train_claim_by) WHERE train_claim_by IS NOT NULL;
    """,
    # 9: which process a scheduler transition came from: every process of a workspace (the CLI's
    # trainer, each notebook kernel) runs its own scheduler and writes here
    """
    ALTER TABLE scheduler_transitions ADD COLUMN process TEXT;
    """,
    # 10: experiments (metaclaw.fastloop.experiments): named selections of turns, experiments replaying
    # them with several variants, and one judged result per case and variant
    """
    CREATE TABLE datasets (
        name         TEXT PRIMARY KEY,
        created_at   REAL NOT NULL,
        description  TEXT NOT NULL DEFAULT '',
        selection    TEXT NOT NULL DEFAULT '{}',
        turn_ids     TEXT NOT NULL DEFAULT '[]'
    );
    CREATE TABLE experiments (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        name        TEXT NOT NULL UNIQUE,
        created_at  REAL NOT NULL,
        dataset     TEXT NOT NULL REFERENCES datasets(name),
        variants    TEXT NOT NULL DEFAULT '[]',
        config      TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE experiment_results (
        id                INTEGER PRIMARY KEY AUTOINCREMENT,
        experiment_id     INTEGER NOT NULL REFERENCES experiments(id),
        turn_id           INTEGER NOT NULL,
        variant           TEXT NOT NULL,
        created_at        REAL NOT NULL,
        score             REAL,
        verdict           TEXT,
        votes             TEXT NOT NULL DEFAULT '[]',
        reply             TEXT,
        tool_calls        TEXT,
        skills            TEXT NOT NULL DEFAULT '[]',
        error             TEXT,
        upstream_failed   INTEGER NOT NULL DEFAULT 0,
        latency_ms        REAL,
        prompt_tokens     INTEGER,
        completion_tokens INTEGER,
        label_similarity  REAL,
        UNIQUE (experiment_id, turn_id, variant)
    );
    """,
    # 11: whom a turn served: the agent and the person (X-MetaClaw-Agent / X-MetaClaw-User, else
    # the proxy's --agent / --user); private skills are offered only to their own (scopes)
    """
    ALTER TABLE turns ADD COLUMN agent TEXT;
    ALTER TABLE turns ADD COLUMN person TEXT;
    """,
    # 12: the features the proxy computed of a turn's ask (static embedding and BM25 terms,
    # metaclaw.skills.retrieval.ask_features), so that per-skill evidence reads them back
    """
    ALTER TABLE turns ADD COLUMN ask_features TEXT;
    """,
    # 13: when each proxy process last had a request in flight (a turn is recorded when its
    # reply ends), so that the scheduler's proxy signal counts a long reply as activity; and
    # the generation each skill folder of each machine was last brought to (kept in files per
    # user before: another user of the same folder found none)
    """
    CREATE TABLE proxy_activity (
        proxy    TEXT PRIMARY KEY,
        busy_at  REAL NOT NULL
    );
    CREATE TABLE skill_folders (
        machine     TEXT NOT NULL,
        folder      TEXT NOT NULL,
        generation  INTEGER NOT NULL,
        digest      TEXT NOT NULL,
        PRIMARY KEY (machine, folder)
    );
    """,
    # 14: a skill's changes by name (per-skill evidence reads each skill's latest add or edit);
    # also the version from which a workspace file's folder marks name the file (an older
    # MetaClaw, reading them under another key, would take its folders for strangers')
    """
    CREATE INDEX skill_events_skill ON skill_events(skill_name, generation);
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)


def said_migrated(location: str, before: int) -> None:
    """Log that the workspace at ``location`` was migrated from schema ``before`` (a MetaClaw
    older than this one refuses it from now on)."""
    log.warning("migrated the workspace %s from schema version %d to %d; a MetaClaw older "
                "than this one no longer opens it", location, before, SCHEMA_VERSION)


#: The tables of the workspace's records (``metaclaw db copy`` copies them; ``skill_folders``
#: and ``proxy_activity`` hold the state of the machines and proxies using it).
TABLES = ("sessions", "turns", "skill_generations", "skill_events", "policy_versions",
          "training_steps", "scheduler_transitions", "events", "labels", "proposals", "datasets",
          "experiments", "experiment_results")
EVENT_LEVELS = ("info", "warning", "error")
#: Seconds a write waits for another connection's write lock before it fails.
BUSY_TIMEOUT_S = 30.0


#: ``WHERE id IN_IDS`` with the one parameter ``id_list(ids)``: any number of ids (a JSON array
#: SQLite reads with json_each), where a placeholder each would run past SQLite's limit.
IN_IDS = "IN (SELECT value FROM json_each(?))"


def id_list(ids: Iterable[int]) -> str:
    """The parameter of :data:`IN_IDS` for ``ids``."""
    return dumps(sorted({int(i) for i in ids}))


def default_target() -> str:
    """The workspace a command opens unless told: ``METACLAW_DB`` (a path or URL), else
    :data:`DEFAULT_DB`."""
    return os.environ.get("METACLAW_DB") or str(DEFAULT_DB)


def workspace_exists(target: "str | os.PathLike[str]") -> bool:
    """Whether ``target`` names a workspace that can be opened without creating one: the file
    exists (SQLite); always for a database server (opening it says if it cannot be reached)."""
    engine, where = parse_target(target)
    return engine != "sqlite" or where == ":memory:" or Path(where).exists()


def local_dir(target: "str | os.PathLike[str]") -> Path:
    """The folder for this machine's files of a workspace (training state, checkpoints): beside
    the SQLite file; for a database server, one folder per database whatever the working folder:
    ``$METACLAW_DATA_DIR`` (else ``$XDG_DATA_HOME/metaclaw``, else ``~/.local/share/metaclaw``)
    ``/workspaces/<dbname>-<digest of user, hosts and dbname>``."""
    engine, where = parse_target(target)
    if engine == "sqlite":
        return Path(where).resolve().parent
    url = urlsplit(where)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    user = query.get("user") or unquote(url.username or "")
    dbname = query.get("dbname") or unquote(url.path.lstrip("/")) or user or "postgres"
    hosts = url.netloc.rpartition("@")[2].lower() or query.get("host", "").lower()
    who = f"{user}@{unquote(hosts)}/{dbname}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", dbname)[:40].strip(".") or "db"
    root = os.environ.get("METACLAW_DATA_DIR")
    base = Path(root).expanduser().resolve() if root else Path(
        os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "metaclaw"
    return base / "workspaces" / f"{name}-{hashlib.sha256(who.encode()).hexdigest()[:12]}"


class StoreError(RuntimeError):
    """The store cannot be opened (a bad target, an unreachable or refusing database) or is from
    a newer version of MetaClaw."""


class EngineError(Exception):
    """An error of a database engine other than SQLite, as the store raises it (the driver's own
    exception is its ``__cause__``). :data:`DB_ERRORS` catches every engine's errors."""


class StoreUnavailable(EngineError):
    """The workspace's database server cannot be reached now (down, restarting, the network):
    the call failed after the connect timeout; a later call reconnects by itself."""


class OutageLog:
    """Warnings about a workspace that cannot be reached, which every turn and task meets while
    it lasts: the first at once, then at most one per ``interval`` seconds; those held back
    meanwhile are said when the interval ends, the last of them with their count (a 14-second
    outage logged thousands of lines, each with a traceback)."""

    def __init__(self, logger: Any, interval: float = 30.0) -> None:
        self.logger, self.interval = logger, interval
        self._lock = threading.Lock()
        self._said_at = -math.inf
        self._held: list[Any] = []  # [count, since (epoch), message, args] while any is held
        self._timer: threading.Timer | None = None

    def warning(self, message: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._said_at >= self.interval and not self._held:
                self._said_at = now
            else:
                count, since = (self._held[0], self._held[1]) if self._held else (0, time.time())
                self._held = [count + 1, since, message, args]
                if self._timer is None:
                    self._timer = threading.Timer(
                        max(0.0, self._said_at + self.interval - now), self._say_held)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self.logger.warning(message, *args)

    def _say_held(self) -> None:
        with self._lock:
            held, self._held, self._timer = self._held, [], None
            self._said_at = time.monotonic()
        if held:
            count, since, message, args = held
            when = time.strftime("%H:%M:%S", time.localtime(since))
            self.logger.warning(message + f" ({count} like it since {when})", *args)


#: What a database call of either engine may raise: ``except DB_ERRORS`` where code used to
#: catch ``sqlite3.Error``.
DB_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error, EngineError)

#: Engine name -> a function giving its ``Store`` class (the package fills in the engines other
#: than SQLite, which import their driver only when used).
ENGINES: dict[str, Any] = {"sqlite": lambda: Store}

#: URL schemes of PostgreSQL targets.
POSTGRES_SCHEMES = ("postgresql", "postgres")


#: A libpq connection string of key=value settings ("host=db user=me password=..."), which is
#: not a file name.
_CONNINFO = re.compile(r"\s*(host|hostaddr|port|dbname|user|password|passfile|service|sslmode)"
                       r"\s*=", re.IGNORECASE)


def parse_target(target: "str | os.PathLike[str]") -> tuple[str, str]:
    """``(engine, where)`` for a store target: ``("sqlite", path)`` for a path, ``:memory:`` or
    ``sqlite:///path``; ``("postgresql", url)`` for a ``postgresql://`` or ``postgres://`` URL.
    Any other ``scheme://`` is a :class:`StoreError` (never taken for a file name)."""
    text = os.fspath(target)
    scheme, sep, rest = text.partition("://")
    if not sep and _CONNINFO.match(text):  # never echoed: it may hold a password
        raise StoreError("a PostgreSQL workspace is named by a URL, postgresql://user@host:port/"
                         "dbname (the password in ~/.pgpass or PGPASSWORD), not by key=value "
                         "connection settings")
    if not sep or not scheme or not all(c.isalnum() or c in "+.-" for c in scheme):
        return "sqlite", text
    scheme = scheme.lower()
    if scheme == "sqlite":
        if not rest.startswith("/") or rest == "/":
            raise StoreError(f"a SQLite URL names a file: sqlite:///relative/path or "
                             f"sqlite:////absolute/path, not {text!r}")
        return "sqlite", rest[1:]
    if scheme in POSTGRES_SCHEMES or scheme.startswith("postgresql+"):
        # the scheme as libpq reads it: any other spelling (PostgreSQL://, a SQLAlchemy-style
        # driver suffix) it takes for key=value settings, and its error quotes the password
        return "postgresql", f"{'postgresql' if '+' in scheme else scheme}://{rest}"
    raise StoreError(f"the store cannot open {scheme}:// URLs; give a file path, sqlite:///path "
                     f"or postgresql://user@host/dbname")


#: What an engine says when a migration meets tables that already have its change.
_MISMATCH = re.compile(r"duplicate column|already exists", re.IGNORECASE)


def unmigratable(where: object, version: int, error: BaseException) -> str:
    """The sentence for a workspace whose schema upgrade from ``version`` failed (its tables are
    not the ones this release's schema ``version`` has: a development build made it)."""
    reason = " ".join(str(error).split())[:200]
    return (f"{where} cannot be upgraded from schema version {version} to {version + 1} "
            f"({reason}): its tables are not those of this release's schema version {version}, "
            f"as happens with a workspace made by a development build of MetaClaw. Nothing was "
            f"changed. Open it with the build that made it, or start a new workspace.")


def this_process() -> str:
    """This process as the workspace's rows name it: ``pid N on HOST`` (read at each call: a
    forked child is another process)."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _synchronous(fsync: bool) -> str:
    return f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}"


def _busy_timeout(wait: bool) -> str:
    return f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000) if wait else 0}"


def _use_write_ahead_log(db: sqlite3.Connection) -> None:
    """Switch ``db``'s file to WAL mode. Switching a new file takes an exclusive lock, and
    SQLite answers "locked" at once (no busy wait) to a second process switching it at the
    same moment: retried until the first has finished, within the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if not lock_busy(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class StoreBusy(RuntimeError):
    """``transaction(wait=False)``: another thread or process holds the write lock right now."""


def lock_busy(exc: BaseException) -> bool:
    """Whether ``exc`` says the store's write lock stayed taken (SQLite's busy timeout, or
    PostgreSQL's lock timeout as :class:`StoreBusy`)."""
    if isinstance(exc, StoreBusy):
        return True
    return isinstance(exc, sqlite3.OperationalError) and \
        getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_BUSY


def _dumps(value: Any) -> str:
    return dumps(value)


#: A folder mark (see :meth:`Store.mark_folder`) and a proxy's report of a request in flight
#: (:meth:`Store.mark_proxy_busy`), written over the row before.
FOLDER_MARK_UPSERT = ("INSERT INTO skill_folders (machine, folder, generation, digest) "
                      "VALUES (?, ?, ?, ?) ON CONFLICT(machine, folder) DO UPDATE SET "
                      "generation = excluded.generation, digest = excluded.digest")
PROXY_BUSY_UPSERT = ("INSERT INTO proxy_activity (proxy, busy_at) VALUES (?, ?) "
                     "ON CONFLICT(proxy) DO UPDATE SET busy_at = excluded.busy_at")
#: Create a session's row (id, created_at, updated_at, meta), or touch its updated_at.
SESSION_UPSERT = ("INSERT INTO sessions (id, created_at, updated_at, meta) VALUES (?, ?, ?, ?) "
                  "ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at")
#: Create a session's row unless there is one (:meth:`Store.claim_session`).
SESSION_CLAIM = ("INSERT INTO sessions (id, created_at, updated_at, meta) VALUES (?, ?, ?, ?) "
                 "ON CONFLICT(id) DO NOTHING")
#: SESSION_CLAIM, written only when no session's id lies in [?, ?) (a family of ids).
SESSION_CLAIM_FIRST = ("INSERT INTO sessions (id, created_at, updated_at, meta) "
                       "SELECT ?, ?, ?, ? WHERE NOT EXISTS "
                       "(SELECT 1 FROM sessions WHERE id >= ? AND id < ?) "
                       "ON CONFLICT(id) DO NOTHING")


def session_claim(session_id: str, first_of: tuple[str, str] | None
                  ) -> tuple[str, tuple[Any, ...]]:
    """The statement claiming ``session_id`` (see :meth:`Store.claim_session`)."""
    now = time.time()
    if first_of is None:
        return SESSION_CLAIM, (session_id, now, now, "{}")
    return SESSION_CLAIM_FIRST, (session_id, now, now, "{}", *first_of)


def turn_insert(row: dict[str, Any], stale: dict[str, str] | None = None
                ) -> tuple[str, list[Any]]:
    """The INSERT of the turn ``row`` and its parameters. Its ``turn_index``, the next of its
    session, is computed by the statement itself (one statement, under the write lock). With
    ``stale``, a ``buffer_state`` among its keys is replaced by its value there when a newer
    generation than the turn's ``skill_generation`` is committed, as the statement runs."""
    columns, values = list(row), _encoded(row)
    marks = ["?"] * len(columns)
    if stale and row.get("buffer_state") in stale:
        at = columns.index("buffer_state")
        marks[at] = ("CASE WHEN ? < COALESCE((SELECT MAX(generation) FROM skill_generations), 0)"
                     " THEN ? ELSE ? END")
        values[at:at + 1] = [row.get("skill_generation") or 0, stale[row["buffer_state"]],
                             row["buffer_state"]]
    return (f"INSERT INTO turns ({', '.join(columns)}, turn_index) VALUES ({', '.join(marks)}, "
            "(SELECT COALESCE(MAX(turn_index), -1) + 1 FROM turns WHERE session_id = ?))",
            [*values, row["session_id"]])


def _turn_row(session_id: str, request_messages: list[dict[str, Any]], status: str,
              **fields: Any) -> dict[str, Any]:
    return {"session_id": session_id, "created_at": time.time(),
            "request_messages": request_messages, "status": status, **fields}


def _encoded(fields: dict[str, Any]) -> list[Any]:
    """The values of ``fields`` as stored: JSON columns' objects serialised."""
    return [_dumps(v) if k in JSON_COLUMNS and not isinstance(v, str) and v is not None else v
            for k, v in fields.items()]


#: What a turn's JSON columns hold when present: readers iterate them or look keys up.
JSON_SHAPES: dict[str, type] = {
    "request_messages": list, "tool_calls": list, "injected_skills": list, "judge_votes": list,
    "request_params": dict, "usage": dict,
}


def _decode(row: sqlite3.Row) -> dict[str, Any]:
    """A row as a dict, JSON columns decoded. A value that is not valid JSON, or JSON of
    another shape than the column holds (:data:`JSON_SHAPES`: a row written by another program,
    a damaged page), reads as ``None`` and its column is named in the row's
    ``malformed_columns``: one bad row must not make every query that touches it fail (the
    judge, the trainer, the trace would each stop at it for good)."""
    out = dict(row)
    for key in JSON_COLUMNS.intersection(out):
        if isinstance(out[key], str):
            try:
                out[key] = json.loads(out[key])
                shape = JSON_SHAPES.get(key)
                if shape is not None and not isinstance(out[key], (shape, type(None))):
                    raise ValueError(f"not a {shape.__name__}")
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                log.warning("column %s of row %s holds malformed JSON; it reads as NULL",
                            key, out.get("id"))
                out[key] = None
                out.setdefault("malformed_columns", []).append(key)
    return out


class Store:
    """One workspace database. Thread-safe; every write is durable when the method returns.

    ``Store(target)`` opens SQLite for a path (this class) and PostgreSQL for a
    ``postgresql://`` URL (:class:`metaclaw.store.postgres.PostgresStore`, a subclass)."""

    #: The engine's name, as ``metaclaw status`` and the views show it.
    engine = "sqlite"

    def __new__(cls, path: "str | os.PathLike[str] | None" = None, *args: Any, **kwargs: Any):
        if cls is Store:
            try:
                cls = ENGINES[parse_target(default_target() if path is None else path)[0]]()
            except StoreError:  # said by __init__; a copy (no path given) is of this class
                pass
        return super().__new__(cls)

    @property
    def location(self) -> str:
        """Where the store is, for messages: the file, or the database URL (password masked)."""
        return str(self.path)

    def db_option(self) -> str:
        """What a ``metaclaw`` command line in a message needs to open this workspace: ``""``
        for the one a command opens unless told (``$METACLAW_DB``, else the default), else
        `` --db LOCATION`` (a password masked; also where ``$METACLAW_DB`` cannot be read)."""
        try:
            engine, where = parse_target(default_target())
            if self.target == where or (engine == "sqlite" and self.target != ":memory:"
                                        and Path(where).resolve() == Path(self.target).resolve()):
                return ""
        except (StoreError, OSError, ValueError):
            pass
        return f" --db {shlex.quote(self.location)}"

    #: The schema version this process migrated the workspace from when it opened it (None:
    #: it was up to date, or new); ``created``: this process made its schema (a new workspace).
    migrated_from: int | None = None
    created = False

    def __init__(self, path: "str | os.PathLike[str] | None" = None):
        """``path``: a file, ``sqlite:///path`` or ``postgresql://`` URL; default
        ``$METACLAW_DB``, else :data:`DEFAULT_DB`."""
        engine, path = parse_target(default_target() if path is None else path)
        if engine != "sqlite":  # a subclass of the SQLite engine given another engine's URL
            raise StoreError(f"{type(self).__name__} is a SQLite store; it cannot open "
                             f"{engine} workspaces")
        if str(path) != ":memory:":  # whole: a later change of directory (a notebook's %cd)
            path = Path(path).absolute()  # must not move the workspace
        #: What ``Store(...)`` opens this workspace again with (in another process too).
        self.target = str(path)
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                       timeout=BUSY_TIMEOUT_S)
            self._db.row_factory = sqlite3.Row
            _use_write_ahead_log(self._db)
            self._db.execute(_synchronous(True))
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open the MetaClaw store at {self.path}: {exc}") from exc
        # the connection's standing settings, which a transaction changes only for itself
        self._fsync_by_default = True  # synchronous=FULL
        self._waits_by_default = True  # a busy timeout of BUSY_TIMEOUT_S
        # A second connection answers "did anything commit since I last looked?" (``PRAGMA
        # data_version`` changes only for commits made by *other* connections, this process's
        # writer included), without waiting behind the writer's lock. The proxy's event loop
        # writes its turns through it too (:meth:`loop_writer`).
        self._probe_lock = threading.RLock()
        self._probe: sqlite3.Connection | None = None
        self._probe_version: int | None = None
        self._probe_latest: int | None = None
        if str(path) != ":memory:":
            self._probe = sqlite3.connect(str(path), check_same_thread=False,
                                          isolation_level=None, timeout=BUSY_TIMEOUT_S)
            self._probe.row_factory = sqlite3.Row  # queries through loop_writer() decode too

    # -- schema ---------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._lock:
            while True:
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreError(
                        f"{self.path} has schema version {version}, newer than this MetaClaw "
                        f"understands ({SCHEMA_VERSION}); upgrade the metaclaw package.")
                if version == SCHEMA_VERSION:
                    if not self.migrated_from:  # a new workspace was created, not migrated
                        self.created = self.migrated_from == 0
                        self.migrated_from = None
                    else:
                        said_migrated(str(self.path), self.migrated_from)
                    return
                self._db.execute("BEGIN IMMEDIATE")
                try:  # read again under the write lock: another process may have migrated
                    version = self._db.execute("PRAGMA user_version").fetchone()[0]
                    if version < SCHEMA_VERSION:
                        if self.migrated_from is None:  # (0: created, and said as such)
                            self.migrated_from = version
                        for statement in _split_sql(MIGRATIONS[version]):
                            try:
                                self._db.execute(statement)
                            except sqlite3.OperationalError as exc:
                                if not _MISMATCH.search(str(exc)):
                                    raise
                                raise StoreError(unmigratable(self.path, version, exc)) from None
                        self._db.execute(f"PRAGMA user_version={version + 1}")
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
        with self._probe_lock:
            if self._probe is not None:
                self._probe.close()

    def counts(self) -> dict[str, int]:
        """Rows per table."""
        with self._lock:
            return {t: int(self._scalar(f"SELECT COUNT(*) FROM {t}")) for t in TABLES}

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, schema v{self.schema_version})"

    def _repr_html_(self) -> str:
        import html

        rows = "".join(f"<tr><td>{t}</td><td>{n}</td></tr>" for t, n in self.counts().items())
        return (f"<b>MetaClaw store</b> <code>{html.escape(str(self.path))}</code> "
                f"(schema v{self.schema_version}, WAL)<table><tr><th>table</th><th>rows</th></tr>"
                f"{rows}</table><small>store.frame(table) gives a polars DataFrame</small>")

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- low level ------------------------------------------------------------------------
    def execute(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, tuple(params))

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [_decode(r) for r in self._db.execute(sql, tuple(params)).fetchall()]

    def _scalar(self, sql: str, params: Iterable[Any] = ()) -> Any:
        """The first column of the first row ``sql`` returns (``None`` for no row)."""
        with self._lock:
            row = self._db.execute(sql, tuple(params)).fetchone()
        return None if row is None else row[0]

    # -- dialect: the few SQL forms the engines spell differently -------------------------
    def json_values(self, expr: str, alias: str, kind: str = "text") -> str:
        """A FROM item yielding the elements of the JSON array ``expr`` as ``alias.value``
        (``kind`` ``"int"`` or ``"text"``: what the caller compares them with) and their JSON
        type as ``alias.type`` (SQLite's names: ``text``, ``integer``, ``real``, ``true``,
        ``false``, ``null``, ``array``, ``object``); a row whose ``expr`` is not a JSON array
        yields none."""
        return (f"json_each(CASE WHEN json_valid({expr}) AND json_type({expr}) = 'array' "
                f"THEN {expr} ELSE '[]' END) AS {alias}")

    def json_text(self, expr: str, *path: "str | int", guarded: bool = True) -> str:
        """The value at ``path`` inside the JSON text ``expr`` (keys, or list indexes where
        ``-1`` is the last element); NULL where absent. ``guarded=False`` skips validating
        ``expr`` first (faster; SQLite then fails the query on a malformed value)."""
        steps = "".join(f"[#{p}]" if isinstance(p, int) and p < 0 else
                        f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        value = f"json_extract({expr}, '${steps}')"
        return f"(CASE WHEN json_valid({expr}) THEN {value} END)" if guarded else value

    def json_length(self, expr: str, guarded: bool = True) -> str:
        """The number of elements of the JSON array ``expr`` (0 where it is JSON but not an
        array, NULL where it is NULL or not JSON; see :meth:`json_text` for ``guarded``)."""
        if not guarded:
            return f"json_array_length({expr})"
        return (f"(CASE WHEN json_valid({expr}) THEN CASE WHEN json_type({expr}) = 'array' "
                f"THEN json_array_length({expr}) ELSE 0 END END)")

    def json_size(self, expr: str) -> str:
        """The number of keys of the JSON object (or elements of the array) ``expr``; NULL where
        ``expr`` is not valid JSON."""
        return f"(CASE WHEN json_valid({expr}) THEN (SELECT COUNT(*) FROM json_each({expr})) END)"

    @property
    def in_ids(self) -> str:
        """``WHERE id {store.in_ids}`` with the one parameter :func:`id_list` (see :data:`IN_IDS`)."""
        return IN_IDS

    def transaction(self, fsync: bool = True, wait: bool = True) -> "_Transaction":
        """``with store.transaction(): ...`` groups writes into one durable commit.

        ``fsync=False``: the commit survives ``kill -9`` of this process but not necessarily an
        OS crash or power loss (``synchronous=NORMAL`` for this commit; see the module doc).
        ``wait=False``: raise :class:`StoreBusy` at once, having written nothing, when another
        thread of this process or another connection holds the write lock (a caller on an
        event loop hands its writes to a thread instead of blocking the loop)."""
        return _Transaction(self, fsync, wait)

    def unreachable(self) -> bool:
        """Whether the workspace's database server was found unreachable moments ago (calls
        fail at once meanwhile); never for a file."""
        return False

    def loop_writer(self) -> "Store | None":
        """This store through its second connection, for the writes of an event loop (the
        proxy's turns): its transactions commit without fsync and without waiting for the write
        lock unless asked (``transaction(fsync=True, wait=True)``), and no commit on it
        checkpoints the write-ahead log (``wal_autocheckpoint=0``; the caller runs
        :meth:`checkpoint` elsewhere), so that no fsync happens on the loop. Its commits are the
        probe's own, so they do not count as changes for :meth:`current_generation`: a request
        after a turn was recorded still finds the generation check a few microseconds long,
        without re-reading the tables. Use ``transaction(wait=False)`` on it from a loop.
        ``None`` for an in-memory store (it has no second connection)."""
        if self._probe is None:
            return None
        with self._probe_lock:
            for pragma in (_synchronous(False), _busy_timeout(False),
                           "PRAGMA wal_autocheckpoint=0", "PRAGMA foreign_keys=ON"):
                self._probe.execute(pragma)
        writer = copy.copy(self)  # the same class: a test double's overrides still apply
        writer._db, writer._lock = self._probe, self._probe_lock
        writer._fsync_by_default = writer._waits_by_default = False
        return writer

    def watcher(self) -> "_Watcher":
        """A private reader that says cheaply whether anything was committed since its last
        look (:meth:`_Watcher.changed`) and reads without waiting behind this store's writer
        (what a follower polling for new rows uses). SQLite: ``PRAGMA data_version`` on its own
        connection, a few microseconds."""
        if str(self.path) == ":memory:":
            raise ValueError("watching a workspace needs a store on disk or a database server")
        return _Watcher(self.path)

    def checkpoint(self) -> None:
        """Copy committed pages from the write-ahead log into the database file now (a passive
        checkpoint: it waits for no reader). SQLite does this itself every 1,000 pages unless
        ``PRAGMA wal_autocheckpoint`` turned it off, as the proxy does to keep it off its loop."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def _insert(self, table: str, fields: dict[str, Any]) -> int:
        cols = list(fields)
        sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        return self._insert_row(table, sql, _encoded(fields))

    def _insert_row(self, table: str, sql: str, values: list[Any]) -> int:
        """Run the INSERT ``sql``; the new row's key (its rowid: the integer primary key)."""
        with self._lock:
            return int(self._db.execute(sql, values).lastrowid)

    def _update(self, table: str, key: str, key_value: Any, fields: dict[str, Any]) -> None:
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.execute(f"UPDATE {table} SET {sets} WHERE {key} = ?", [*_encoded(fields), key_value])

    # -- sessions and turns ---------------------------------------------------------------
    def ensure_session(self, session_id: str, **meta: Any) -> None:
        now = time.time()
        self.execute(SESSION_UPSERT, (session_id, now, now, _dumps(meta)))

    def claim_session(self, session_id: str, first_of: tuple[str, str] | None = None
                      ) -> bool | None:
        """Create the row of ``session_id`` unless there is one, without waiting for the write
        lock: what a proxy does when a conversation opens, before its first reply, so that
        another proxy of the workspace numbering the same opening finds the id taken. True: this
        call created it; False: it was there (taken elsewhere); None: the write lock was held
        and nothing was written. ``first_of=(low, high)``: created only when no session's id
        lies in that range either (False otherwise): the first of a family of ids claimed with
        no look-up before it."""
        try:
            with self.transaction(fsync=False, wait=False):
                created = self.execute(*session_claim(session_id, first_of)).rowcount
        except StoreBusy:
            return None
        return created == 1

    def folder_marks(self, machine: str | None) -> dict[Any, dict[str, Any]]:
        """The skill folders of ``machine`` and the generation each was last brought to:
        ``{folder: {"generation": n, "snapshot": digest}}``; ``None``: every machine's, keyed
        ``(machine, folder)``."""
        rows = self.query("SELECT machine, folder, generation, digest FROM skill_folders"
                          + ("" if machine is None else " WHERE machine = ?"),
                          () if machine is None else (machine,))
        return {(r["folder"] if machine is not None else (r["machine"], r["folder"])):
                {"generation": r["generation"], "snapshot": r["digest"]} for r in rows}

    def mark_folder(self, machine: str, folder: str, generation: int, digest: str) -> None:
        """Record that ``machine``'s skill folder ``folder`` holds ``generation`` (whose skills
        have the digest ``digest``)."""
        self.execute(FOLDER_MARK_UPSERT, (machine, folder, generation, digest))

    def forget_folder(self, machine: str, folder: str) -> None:
        """Drop the mark of ``machine``'s skill folder ``folder`` (see :meth:`mark_folder`)."""
        self.execute("DELETE FROM skill_folders WHERE machine = ? AND folder = ?",
                     (machine, folder))

    def mark_proxy_busy(self, proxy: str, at: float | None = None) -> None:
        """Record that the proxy process ``proxy`` has a request in flight at ``at`` (now)."""
        self.execute(PROXY_BUSY_UPSERT, (proxy, time.time() if at is None else at))

    def forget_proxy(self, proxy: str) -> None:
        """Drop the activity row of ``proxy`` (a proxy that stopped)."""
        self.execute("DELETE FROM proxy_activity WHERE proxy = ?", (proxy,))

    def last_proxy_activity(self) -> float | None:
        """Epoch seconds of the latest proxied request: the newest turn's, or later, the last
        time a proxy reported a request still in flight (:meth:`mark_proxy_busy`); None before
        any."""
        value = self._scalar("SELECT MAX(t) FROM (SELECT MAX(created_at) AS t FROM turns "
                             "UNION ALL SELECT MAX(busy_at) AS t FROM proxy_activity) AS latest")
        return None if value is None else float(value)

    def mark_session_done(self, session_id: str) -> None:
        with self._lock, self.transaction():
            self.ensure_session(session_id)
            self.execute("UPDATE sessions SET done = 1, updated_at = ? WHERE id = ?",
                         (time.time(), session_id))

    def session(self, session_id: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM sessions WHERE id = ?", (session_id,))
        return rows[0] if rows else None

    def record_turn(self, *, session_id: str, request_messages: list[dict[str, Any]],
                    status: str, stale: dict[str, str] | None = None, **fields: Any) -> int:
        """Insert one turn (the session row is created if needed); returns the turn id.

        ``turn_index`` is assigned as the next index within the session. Other keyword
        arguments are ``turns`` columns. ``stale`` maps a ``buffer_state`` to the one recorded
        instead when a generation newer than the turn's ``skill_generation`` is committed (read
        by the INSERT itself, under the write lock: none can land between check and write).
        """
        with self._lock, self.transaction():
            return self._insert_turn(_turn_row(session_id, request_messages, status, **fields),
                                     stale)

    def record_turns(self, turns: list[tuple[dict[str, Any], bool]], *, fsync: bool = True,
                     wait: bool = True, stale: dict[str, str] | None = None) -> list[int]:
        """Record ``turns``, ``(fields, session_done)`` pairs (``fields`` as
        :meth:`record_turn`'s keywords), in one transaction (see :meth:`transaction` for
        ``fsync`` and ``wait``); a true ``session_done`` marks the turn's session done. Returns
        the turns' ids, in order."""
        with self.transaction(fsync, wait=wait):  # it takes the store's lock (or refuses)
            ids = []
            for fields, done in turns:
                ids.append(self.record_turn(**fields, stale=stale))
                if done:
                    self.mark_session_done(fields["session_id"])
            return ids

    def _insert_turn(self, row: dict[str, Any], stale: dict[str, str] | None = None) -> int:
        """Insert the turn ``row`` and its session's row if missing (caller's transaction)."""
        self.ensure_session(row["session_id"])
        return self._insert_row("turns", *turn_insert(row, stale))

    def update_turn(self, turn_id: int, **fields: Any) -> None:
        self._update("turns", "id", turn_id, fields)

    def absent_turns(self, turn_ids: Iterable[int]) -> list[int]:
        """The ids of ``turn_ids`` no turn has, in order (none: every one is recorded)."""
        ids = sorted({int(i) for i in turn_ids})
        kept = [i for i in ids if 0 < i < 2 ** 63]  # (no id lies outside: a server's bigint)
        found = {r["id"] for r in self.query(f"SELECT id FROM turns WHERE id {IN_IDS}",
                                             (id_list(kept),))} if kept else set()
        return [i for i in ids if i not in found]

    def turn(self, turn_id: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM turns WHERE id = ?", (turn_id,))
        return rows[0] if rows else None

    def turns(self, where: str = "1=1", params: Iterable[Any] = (),
              order: str = "id") -> list[dict[str, Any]]:
        """Turns matching an SQL condition, decoded (JSON columns become Python objects)."""
        return self.query(f"SELECT * FROM turns WHERE {where} ORDER BY {order}", params)

    # -- skill generations ----------------------------------------------------------------
    def add_generation(self, *, snapshot: dict[str, Any], kind: str, reason: str = "",
                       parent: int | None = None,
                       events: Iterable[dict[str, Any]] = ()) -> int:
        """Store a new generation (number = latest + 1) with its events, atomically."""
        with self._lock, self.transaction():
            number = self._scalar(
                "SELECT COALESCE(MAX(generation), -1) + 1 FROM skill_generations")
            now = time.time()
            self._insert("skill_generations", {
                "generation": number, "parent": parent, "created_at": now, "kind": kind,
                "reason": reason, "snapshot": snapshot})
            for event in events:
                self._insert("skill_events", {"generation": number, "created_at": now, **event})
            return int(number)

    def latest_generation(self) -> int | None:
        value = self._scalar("SELECT MAX(generation) FROM skill_generations")
        return None if value is None else int(value)

    def current_generation(self) -> int | None:
        """The latest generation committed by any process, cheap enough for every request.

        The number is re-read only when some connection has committed since the last call
        (``PRAGMA data_version`` on a private connection: a few microseconds); otherwise the
        cached value is returned without touching the tables or the writer's lock.
        """
        if self._probe is None:  # an in-memory store has no other connection to hear from
            return self.latest_generation()
        with self._probe_lock:
            try:
                version = self._probe.execute("PRAGMA data_version").fetchone()[0]
                if version != self._probe_version:
                    value = self._probe.execute(
                        "SELECT MAX(generation) FROM skill_generations").fetchone()[0]
                    self._probe_version = version
                    self._probe_latest = None if value is None else int(value)
            except sqlite3.OperationalError as exc:
                # the probe waits for no lock once it writes for an event loop (loop_writer):
                # a read refused during another connection's recovery is retried next call
                if not lock_busy(exc):
                    raise
            return self._probe_latest

    def generation(self, number: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM skill_generations WHERE generation = ?", (number,))
        return rows[0] if rows else None

    def skill_events(self, generation: int | None = None) -> list[dict[str, Any]]:
        if generation is None:
            return self.query("SELECT * FROM skill_events ORDER BY id")
        return self.query("SELECT * FROM skill_events WHERE generation = ? ORDER BY id",
                          (generation,))

    # -- slow loop ------------------------------------------------------------------------
    def add_policy_version(self, *, backend: str, base_model: str, skill_generation: int = 0,
                           checkpoint: str | None = None, **meta: Any) -> int:
        with self._lock, self.transaction():
            number = self._scalar(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM policy_versions")
            self._insert("policy_versions", {
                "version": number, "created_at": time.time(), "backend": backend,
                "base_model": base_model, "skill_generation": skill_generation,
                "checkpoint": checkpoint, "meta": meta})
            return int(number)

    def record_training_step(self, **fields: Any) -> int:
        return self._insert("training_steps", {"created_at": time.time(), **fields})

    def record_transition(self, *, from_state: str, to_state: str, reason: str = "",
                          signals: dict[str, Any] | None = None, at: float | None = None,
                          process: str | None = None) -> int:
        """Record a scheduler's state change; ``process`` (default: this one,
        :func:`this_process`) says whose scheduler it was."""
        return self._insert("scheduler_transitions", {
            "at": time.time() if at is None else at, "from_state": from_state,
            "to_state": to_state, "reason": reason, "signals": signals or {},
            "process": process or this_process()})

    # -- events ---------------------------------------------------------------------------
    def record_event(self, *, source: str, kind: str, message: str, level: str = "info",
                     **detail: Any) -> int:
        """Record a notable event of a loop (``level``: info, warning or error)."""
        if level not in EVENT_LEVELS:
            raise ValueError(f"event level must be one of {', '.join(EVENT_LEVELS)}, not {level!r}")
        return self._insert("events", {"at": time.time(), "source": source, "kind": kind,
                                       "level": level, "message": message, "detail": detail})

    def events(self, *, kind: str | None = None, level: str | None = None,
               limit: int | None = None) -> list[dict[str, Any]]:
        """Events, newest first, optionally of one kind or level."""
        where, params = ["1=1"], []
        if kind is not None:
            where.append("kind = ?")
            params.append(kind)
        if level is not None:
            where.append("level = ?")
            params.append(level)
        sql = f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self.query(sql, params)

    def event_counts(self) -> dict[str, int]:
        """Warning and error events per kind (what ``status`` views show)."""
        rows = self.query("SELECT kind, COUNT(*) AS n FROM events WHERE level != 'info' "
                          "GROUP BY kind ORDER BY kind")
        return {row["kind"]: row["n"] for row in rows}

    # -- frames ---------------------------------------------------------------------------
    def frame(self, table: str, where: str = "1=1", params: Iterable[Any] = ()):
        """A table (optionally filtered) as a ``polars.DataFrame``; JSON columns stay strings."""
        import polars as pl

        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; choose one of {', '.join(TABLES)}")
        with self._lock:
            declared = self.declared_types(table)
            names, rows = self._rows(f"SELECT * FROM {table} WHERE {where}", tuple(params))
        columns = {name: [row[i] for row in rows] for i, name in enumerate(names)}
        # the declared types, so that an empty table or an all-null column has the dtype of a
        # full one (frames from two moments concatenate and filter alike)
        schema = {name: _polars_type(declared.get(name, ""), pl) for name in names}
        return pl.DataFrame(columns, schema=schema, strict=False)


    def declared_types(self, table: str) -> dict[str, str]:
        """Column name -> declared type (upper case) of ``table``."""
        with self._lock:
            return {row["name"]: row["type"].upper()
                    for row in self._db.execute(f"PRAGMA table_info({table})")}

    def raw(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of the query ``sql`` as tuples, JSON columns as stored (text): for bulk
        reads that decode only what they use (:meth:`query` builds a decoded dict per row)."""
        return self._rows(sql, tuple(params))[1]

    def _rows(self, sql: str, params: tuple[Any, ...]) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and raw rows (tuples, JSON undecoded) of ``sql``."""
        with self._lock:
            cur = self._db.execute(sql, params)
            return [d[0] for d in cur.description], [tuple(r) for r in cur.fetchall()]

    def _insert_many(self, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        """Insert raw ``rows`` (values as stored, keys included) into ``table``."""
        sql = (f"INSERT INTO {table} ({', '.join(columns)}) "
               f"VALUES ({', '.join('?' * len(columns))})")
        with self._lock:
            self._db.executemany(sql, rows)

    def _after_copy(self, table: str, key: str) -> None:
        """After rows were copied in with their keys: nothing (SQLite numbers past them)."""

    # -- the engine's transactions (used by :class:`_Transaction`) -------------------------
    def _in_transaction(self) -> bool:
        return self._db.in_transaction

    def _begin(self, fsync: bool, wait: bool) -> None:
        """Open a write transaction holding the workspace's write lock (raise
        :class:`StoreBusy` when ``wait`` is false and another connection holds it)."""
        db = self._db
        if fsync != self._fsync_by_default:
            db.execute(_synchronous(fsync))
        switch = wait != self._waits_by_default  # the connection's busy timeout
        if switch:
            db.execute(_busy_timeout(wait))
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if wait or not lock_busy(exc):
                raise
            raise StoreBusy(f"another connection holds the store's write lock ({exc})") from None
        finally:
            if switch:
                db.execute(_busy_timeout(self._waits_by_default))

    def _end(self, commit: bool) -> None:
        """Commit (or roll back) the open transaction; nothing may stay open after a failure."""
        db = self._db
        if not db.in_transaction:
            return
        try:
            db.execute("COMMIT" if commit else "ROLLBACK")
        except BaseException:
            if db.in_transaction:  # a failed COMMIT leaves it open: nothing may linger
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def _after(self, fsync: bool) -> None:
        """Put back the connection's standing settings after a transaction."""
        if fsync != self._fsync_by_default:
            self._db.execute(_synchronous(self._fsync_by_default))


def _polars_type(declared: str, pl: Any) -> Any:
    """The polars dtype of a column declared ``declared`` (the schema declares INTEGER, REAL
    and TEXT only; SQLite's affinity rules read the name)."""
    if "INT" in declared:
        return pl.Int64
    if any(word in declared for word in ("REAL", "FLOA", "DOUB")):
        return pl.Float64
    return pl.Utf8


class _Transaction:
    def __init__(self, store: Store, fsync: bool = True, wait: bool = True):
        self.store = store
        self.fsync = fsync
        self.wait = wait
        self.outer = False
        self.begun = False

    def __enter__(self) -> Store:
        if not self.store._lock.acquire(blocking=self.wait):
            raise StoreBusy("another thread of this process is writing to the store")
        try:
            self.outer = not self.store._in_transaction()
            if not self.outer and not self.wait:  # not waiting means a transaction of its own
                raise StoreBusy("the store's connection is inside another transaction")
            if self.outer:
                self.begun = True
                self.store._begin(self.fsync, self.wait)
        except BaseException:  # e.g. another process holds the write lock past the timeout
            with contextlib.suppress(Exception):  # the lock is released whatever happens
                self.__exit__(None)
            raise
        return self.store

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if self.outer:
                self.store._end(commit=not exc_type)
        finally:
            try:
                if self.begun:
                    self.store._after(self.fsync)
            finally:
                self.store._lock.release()


class _Watcher:
    """:meth:`Store.watcher` for SQLite."""

    def __init__(self, path: Path):
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                   timeout=BUSY_TIMEOUT_S)
        self._version: int | None = None

    def changed(self) -> bool:
        version = self._db.execute("PRAGMA data_version").fetchone()[0]
        seen, self._version = self._version, version
        return version != seen

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        self._db.close()


def _split_sql(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
