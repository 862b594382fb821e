"""The workspace store on PostgreSQL: one database a team points every process at, on every machine.

``Store("postgresql://user@host/dbname")`` opens it (psycopg 3; the ``postgres`` extra). The
schema and its migrations are the SQLite engine's own (:data:`metaclaw.store.MIGRATIONS`),
translated once at migration time (:func:`ddl`): ``INTEGER`` becomes ``BIGINT``, ``REAL``
becomes ``DOUBLE PRECISION``, an ``AUTOINCREMENT`` key an identity column, and the tables without
an integer key get a ``rowid`` identity column, so the same queries run on both engines. The
schema version lives in the table ``metaclaw_schema``.

How it keeps SQLite's guarantees across machines:

- **One writer at a time.** Every write transaction first takes the workspace's write lock, a
  transaction-scoped advisory lock (``pg_advisory_xact_lock``): numbering (the next skill
  generation, the next turn of a session) and read-then-write steps (judge leases, training
  claims) stay linear under concurrent writers on any machine, as SQLite's single writer keeps
  them. A single write statement outside a transaction is wrapped in one. One write goes
  without it: a proxy's claim of a new conversation's session id
  (:meth:`PostgresStore.claim_session`), kept unique by the key alone.
- **Durable acknowledgement.** A commit returns after PostgreSQL has flushed it
  (``synchronous_commit`` on); ``transaction(fsync=False)`` commits with
  ``synchronous_commit = off`` for that transaction, which survives the death of the writing
  process (the commit is in the server's hands) but not a crash of the database server itself,
  the same promise as SQLite's ``synchronous=NORMAL`` (the proxy's turns never use it on
  PostgreSQL: :class:`metaclaw.proxy.pipeline.Recorder`).
- **Every process sees the newest generation** before its next request, without a query per
  request: a trigger announces each generation as it commits (``NOTIFY``), and a thread of every
  process that serves ``LISTEN``s and re-reads the number when told (and once a second in any
  case). While that connection is down, the number it last knew (a database that went away
  must not hold up a request); before it first connected, ``MAX(generation)`` is read.
- **Readers do not queue behind the writer.** Queries outside this thread's transaction run on a
  connection pool (``psycopg_pool``; ``METACLAW_DB_POOL`` connections, default 8).
- **A database that went away** (restarted, unreachable) fails the calls made meanwhile with a
  one-sentence :class:`~metaclaw.store.EngineError` after a short connect timeout (never a hang;
  TCP keepalives and ``tcp_user_timeout`` end a connection whose peer went silent, see
  :data:`TCP_TIMEOUTS`), and the next call reconnects by itself.

Text columns cannot hold the character U+0000 in PostgreSQL: a string holding it is stored with a
reversible escape (:data:`ESCAPE`, a Unicode noncharacter, followed by ``0``; the escape
character itself doubled) and read back exactly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import threading
import time
import weakref
from typing import Any, Iterable
from urllib.parse import parse_qsl, urlencode

from metaclaw.redact import masked_url as mask

import metaclaw.store.base as base
from metaclaw.store.base import (
    BUSY_TIMEOUT_S, IN_IDS, MIGRATIONS, SCHEMA_VERSION, EngineError, Store, StoreBusy, StoreError,
    StoreUnavailable, _decode, _split_sql, said_migrated, unmigratable,
)

log = logging.getLogger(__name__)

#: The advisory lock every write transaction holds: the workspace's one writer at a time.
WRITE_LOCK = 0x6D63_7772  # "mcwr"
#: Seconds to wait for a connection before a one-sentence error.
CONNECT_TIMEOUT_S = 5
#: Connections of the read pool, unless ``METACLAW_DB_POOL`` says otherwise.
POOL_SIZE = 8
#: After the server could not be reached (a connection or the pool's wait for one timed out),
#: calls fail at once for this long instead of each waiting the timeout again: a proxy's
#: requests meanwhile get their 503 at once (the proxy's Retry-After), and the first call after
#: it tries the server again; sooner where the store's generation listener, which retries every
#: half second, has connected again since.
UNREACHABLE_HOLD_S = 5.0
#: Seconds the writer connection may sit idle before its next use first checks that the server
#: still holds it open (one round trip): a server restart closes idle connections, and a write
#: sent on one could not be told from a write the server took before it went.
IDLE_CHECK_S = 2.0
#: libpq's TCP settings every connection gets unless the URL sets them: keepalive probes after
#: 5 s idle, 2 s apart, 2 unanswered end it; data unacknowledged for 10 s ends it (Linux).
TCP_TIMEOUTS = {"keepalives": "1", "keepalives_idle": "5", "keepalives_interval": "2",
                "keepalives_count": "2", "tcp_user_timeout": "10000"}

#: Tables whose key is not called ``id`` (what an INSERT returns).
_KEYS = {"skill_generations": "generation", "policy_versions": "version"}

#: The first half of the two-integer advisory locks of :meth:`PostgresStore.session_lock`.
LEASE_SPACE = 0x6D636C73  # "mcls"

#: What the engine adds to the shared schema, created if missing at every open: the holders'
#: records of the session locks (read only while their holder's lock is held).
_ENGINE_TABLES = """
CREATE TABLE IF NOT EXISTS metaclaw_leases (
    name    TEXT PRIMARY KEY,
    record  TEXT NOT NULL
)
"""

#: The channel on which every committed skill generation is announced (``LISTEN``).
GENERATION_CHANNEL = "metaclaw_generation"

#: Functions the queries of :class:`PostgresStore` use, and the trigger that announces each new
#: skill generation on :data:`GENERATION_CHANNEL`; created (or replaced) at every open.
_FUNCTIONS = ["""
CREATE OR REPLACE FUNCTION metaclaw_json(doc TEXT) RETURNS JSONB
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN doc::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$
""", """
CREATE OR REPLACE FUNCTION metaclaw_generation_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('""" + GENERATION_CHANNEL + """', NEW.generation::text);
    RETURN NULL;
END $$
""", """
CREATE OR REPLACE FUNCTION metaclaw_write_lock(lock_key BIGINT, wait BOOLEAN) RETURNS VOID
LANGUAGE plpgsql AS $$
BEGIN
    IF wait THEN
        PERFORM pg_advisory_xact_lock(lock_key);
    ELSIF NOT pg_try_advisory_xact_lock(lock_key) THEN
        RAISE EXCEPTION 'another connection holds the workspace''s write lock'
            USING ERRCODE = 'lock_not_available';
    END IF;
END $$
""", """
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'metaclaw_generation_notify'
                   AND tgrelid = 'skill_generations'::regclass) THEN
        CREATE TRIGGER metaclaw_generation_notify AFTER INSERT ON skill_generations
        FOR EACH ROW EXECUTE FUNCTION metaclaw_generation_notify();
    END IF;
END $$
"""]

#: How every write transaction starts: READ COMMITTED whatever the server's default, so that
#: each statement after the write lock sees what was committed before the lock was granted.
BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"

#: Not read yet (or no longer known): the value of an unknown latest generation.
_UNKNOWN = object()


def _opening(fsync: bool, wait: bool) -> list[str]:
    """The statements that open a write transaction (no parameters): BEGIN, its settings, and
    the workspace's write lock (waited for, or refused at once with ``lock_not_available``)."""
    steps = [BEGIN]
    if not fsync:
        steps.append("SET LOCAL synchronous_commit = off")
    else:  # a server, database or role set weaker must not weaken an acknowledgement
        steps.append("SELECT set_config('synchronous_commit', 'on', true) "
                     "WHERE current_setting('synchronous_commit') IN ('off', 'local')")
    if wait:
        steps.append(f"SET LOCAL lock_timeout = '{int(BUSY_TIMEOUT_S * 1000)}ms'")
    steps.append(f"SELECT metaclaw_write_lock({WRITE_LOCK}, {'true' if wait else 'false'})")
    return steps


def ddl(statement: str) -> str:
    """A statement of :data:`~metaclaw.store.MIGRATIONS` in PostgreSQL's dialect."""
    out = re.sub(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b",
                 "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", statement)
    out = re.sub(r"\bINTEGER\b", "BIGINT", out)
    out = re.sub(r"\bREAL\b", "DOUBLE PRECISION", out)
    # a table without an integer key gets the rowid SQLite gives every table
    match = re.match(r"\s*CREATE TABLE (\w+) \(", out)
    if match and "GENERATED BY DEFAULT AS IDENTITY" not in out and \
            not re.search(r"\n\s*\w+\s+BIGINT PRIMARY KEY", out):
        out = out[:match.end()] + "\n        rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE," + \
            out[match.end():]
    return out


@functools.lru_cache(maxsize=2048)
def translate(sql: str) -> str:
    """A query written for SQLite (``?`` placeholders) in psycopg's form (``%s``, ``%`` doubled),
    :data:`~metaclaw.store.IN_IDS` in PostgreSQL's words."""
    sql = sql.replace(IN_IDS, "IN (SELECT value::bigint FROM json_array_elements_text(?::json) "
                              "AS ids(value))")
    out, quoted = [], False
    for char in sql:
        if char == "'":
            quoted = not quoted
        if char == "%":
            out.append("%%")
        elif char == "?" and not quoted:
            out.append("%s")
        else:
            out.append(char)
    return "".join(out)


#: The escape of U+0000 in text (see the module doc): a noncharacter no text is meant to hold.
ESCAPE = "\ufdd0"


def _param(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)  # the schema's flags are integers, as in SQLite
    if isinstance(value, str) and ("\x00" in value or ESCAPE in value):
        return value.replace(ESCAPE, ESCAPE * 2).replace("\x00", ESCAPE + "0")
    return value


def _unescaped(value: str) -> str:
    out, i = [], 0
    while True:
        j = value.find(ESCAPE, i)
        if j < 0 or j + 1 >= len(value):
            out.append(value[i:])
            return "".join(out)
        out.append(value[i:j] + ("\x00" if value[j + 1] == "0" else ESCAPE))
        i = j + 2


def _row(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back: escaped text (see :func:`_param`) as it was written."""
    for key, value in row.items():
        if isinstance(value, str) and ESCAPE in value:
            row[key] = _unescaped(value)
    return row


def _params(params: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(_param(v) for v in params)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _driver():
    try:
        import psycopg
        import psycopg_pool
    except ImportError as exc:  # pragma: no cover - depends on the extras installed
        raise StoreError("a postgresql:// workspace needs psycopg: pip install -e '.[postgres]' "
                         "in the MetaClaw checkout") from exc
    return psycopg, psycopg_pool


class PostgresStore(Store):
    """The workspace store on a PostgreSQL database (see the module doc)."""

    engine = "postgresql"

    def __init__(self, url: str | None = None):
        psycopg, pool_mod = _driver()
        self._psycopg = psycopg
        url = base.default_target() if url is None else url
        self.url = self.target = url = base.parse_target(url)[1]
        self.path = None  # type: ignore[assignment]  # no file: see location
        self._lock = threading.RLock()
        self._fsync_by_default = True
        self._waits_by_default = True
        self._txn_thread: int | None = None
        self._down_until, self._down_reason = 0.0, ""  # see UNREACHABLE_HOLD_S
        self._down_since = 0.0
        self._hold_lock = threading.Lock()
        self._probe = None
        self._listener: _GenerationListener | None = None
        self._listener_lock = threading.Lock()  # not _lock: a writer may hold that for long
        self._txn_generation: int | None = None  # the newest generation this transaction added
        self._txn_latest: Any = _UNKNOWN  # MAX(generation) as the write lock was taken
        self._conninfo = self._conninfo_of(url)
        self._db = self._connect()
        self._db_used = time.monotonic()
        try:
            self._migrate()
        except Exception:
            self._db.close()
            raise
        given = os.environ.get("METACLAW_DB_POOL", "").strip()
        try:
            size = int(given) if given else POOL_SIZE
        except ValueError:
            self._db.close()
            raise StoreError(f"$METACLAW_DB_POOL is {given!r}: give the number of connections "
                             f"each process may open (default {POOL_SIZE})") from None
        self._pool = pool_mod.ConnectionPool(
            self._conninfo, min_size=1, max_size=max(1, size), open=True,
            kwargs={"autocommit": True}, configure=self._configure_pooled,
            timeout=CONNECT_TIMEOUT_S + 1,
            name="metaclaw-store")

    # -- connections ----------------------------------------------------------------------
    @staticmethod
    def _conninfo_of(url: str) -> str:
        base_url, _, query_text = url.partition("?")
        query = dict(parse_qsl(query_text, keep_blank_values=True))
        query.setdefault("connect_timeout", str(CONNECT_TIMEOUT_S))
        query.setdefault("application_name", "metaclaw")
        # a peer that went away (a lost machine, a cut network) is noticed within seconds, not
        # the kernel's minutes to hours: the calls made meanwhile fail instead of hanging
        for key, value in TCP_TIMEOUTS.items():
            query.setdefault(key, value)
        return f"{base_url}?{urlencode(query, safe='/')}"

    @property
    def location(self) -> str:
        return mask(self.url)

    def _configure(self, conn: Any) -> None:
        from psycopg.rows import dict_row
        from psycopg.types.numeric import FloatLoader

        conn.row_factory = dict_row
        conn.adapters.register_loader("numeric", FloatLoader)

    def _configure_pooled(self, conn: Any) -> None:
        """A pooled connection: it reads, and claims session ids (:meth:`claim_session`),
        whose commits need not wait for the flush (a turn's commit on the main connection,
        flushed, flushes the claims before it too)."""
        self._configure(conn)
        conn.execute("SET synchronous_commit = off")

    def _connect(self) -> Any:
        try:
            conn = self._psycopg.connect(self._conninfo, autocommit=True)
        except self._psycopg.Error as exc:
            raise StoreError(f"cannot connect to the PostgreSQL workspace at {self.location}: "
                             f"{_one_line(exc)}") from None
        self._configure(conn)
        return conn

    def _conn(self) -> Any:
        """The writer connection, opened again if the server dropped it (a restart; checked
        after :data:`IDLE_CHECK_S` idle seconds)."""
        now = time.monotonic()
        if self._txn_thread is None and now - self._db_used > IDLE_CHECK_S \
                and not (self._db.closed or self._db.broken):
            try:
                self._db.execute("SELECT 1")
            except self._psycopg.Error:  # closed by the server: a new one below
                self._db.close()
        self._db_used = now
        if self._db.closed or self._db.broken:
            if self._txn_thread is not None:
                raise StoreUnavailable("the connection to the PostgreSQL workspace was lost "
                                       "inside a transaction")
            self._check_reachable()
            try:
                self._db = self._connect()
            except StoreError as exc:
                self._mark_unreachable(str(exc))
                raise StoreUnavailable(str(exc)) from None
        return self._db

    def _check_reachable(self) -> None:
        """:class:`StoreUnavailable` at once while the server was found unreachable moments ago
        (:data:`UNREACHABLE_HOLD_S`)."""
        if self.unreachable():
            raise StoreUnavailable(f"{self._down_reason} (moments ago: tried again within "
                                   f"{UNREACHABLE_HOLD_S:.0f} s)")

    def _server_answers(self) -> bool:
        """Whether a new connection opens now: a pool that gave none within its timeout may
        only have had every connection busy (slow queries, a lock wait), which is no outage."""
        try:
            self._psycopg.connect(self._conninfo, autocommit=True).close()
        except self._psycopg.Error:
            return False
        return True

    def unreachable(self) -> bool:
        if time.monotonic() >= self._down_until:
            return False
        listener = self._listener
        with self._hold_lock:  # (not a hold another thread has just set)
            if listener is not None and listener.connected_at > self._down_since:
                self._down_until = 0.0  # its listener connected again since: the server is back
                return False
        return True

    def _mark_unreachable(self, reason: str) -> None:
        with self._hold_lock:
            self._down_since = time.monotonic()
            self._down_until, self._down_reason = self._down_since + UNREACHABLE_HOLD_S, reason

    def _failed(self, exc: BaseException) -> EngineError:
        """The store's error for a driver's ``exc``: :class:`StoreUnavailable` when the server
        cannot be reached or went away."""
        state = getattr(exc, "sqlstate", None) or ""
        lost = exc.__class__.__name__ in ("PoolTimeout", "PoolClosed") or (
            isinstance(exc, self._psycopg.OperationalError)
            and (not state or state.startswith(("08", "57P"))))
        kind = StoreUnavailable if lost else EngineError
        return kind(f"PostgreSQL workspace {self.location}: {_one_line(exc)}")

    def _run(self, conn: Any, sql: str, params: Iterable[Any]) -> Any:
        try:
            return conn.execute(translate(sql), _params(params))
        except self._psycopg.errors.LockNotAvailable as exc:
            raise StoreBusy(_one_line(exc)) from None
        except self._psycopg.Error as exc:
            raise self._failed(exc) from exc

    def _mine(self) -> bool:
        """Whether this thread is inside this store's transaction (reads must see its writes)."""
        return self._txn_thread == threading.get_ident()

    def _read(self, sql: str, params: Iterable[Any]) -> list[dict[str, Any]]:
        if self._mine():
            with self._lock:
                return [_row(r) for r in self._run(self._conn(), sql, params).fetchall()]
        for attempt in (1, 2):
            try:
                with self._pooled() as conn:
                    return [_row(r) for r in self._run(conn, sql, params).fetchall()]
            except StoreUnavailable:
                # a pooled connection the server dropped (a restart): the pool's others may
                # be as dead; one more try once they are checked (reads only: nothing was
                # written), unless no connection could be had at all
                if attempt == 2 or self.unreachable():
                    raise
                self._drop_dead_connections()
        raise AssertionError("unreachable")

    def _drop_dead_connections(self) -> None:
        """Check the pool's idle connections and replace those the server closed (a restart
        closes them all, and none knows it until used)."""
        try:
            self._pool.check()
        except Exception:  # noqa: BLE001 - the retry that follows says what is wrong
            log.debug("checking the PostgreSQL pool failed", exc_info=True)

    @contextlib.contextmanager
    def _pooled(self) -> Any:
        """A pooled connection; :class:`StoreUnavailable` when none comes within the pool's
        timeout, and at once while the server was found unreachable moments ago."""
        self._check_reachable()
        with contextlib.ExitStack() as stack:
            try:
                conn = stack.enter_context(self._pool.connection())
            except self._psycopg_pool_errors() as exc:  # no connection within the timeout
                failed = self._failed(exc)
                if isinstance(failed, StoreUnavailable) and not self._server_answers():
                    self._mark_unreachable(str(failed))  # down, not only every connection busy
                raise failed from exc
            yield conn

    def _psycopg_pool_errors(self) -> tuple[type[BaseException], ...]:
        import psycopg_pool

        return (psycopg_pool.PoolTimeout, psycopg_pool.PoolClosed)

    # -- schema ---------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._lock:
            db = self._db
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
                db.execute("CREATE TABLE IF NOT EXISTS metaclaw_schema (version BIGINT NOT NULL)")
                row = db.execute("SELECT version FROM metaclaw_schema").fetchone()
                version = 0 if row is None else int(row["version"])
                if row is None:
                    db.execute("INSERT INTO metaclaw_schema (version) VALUES (0)")
                if version > SCHEMA_VERSION:
                    raise StoreError(
                        f"{self.location} has schema version {version}, newer than this MetaClaw "
                        f"understands ({SCHEMA_VERSION}); upgrade the metaclaw package.")
                for number in range(version, SCHEMA_VERSION):
                    for statement in _split_sql(MIGRATIONS[number]):
                        try:
                            db.execute(ddl(statement))
                        except (self._psycopg.errors.DuplicateColumn,
                                self._psycopg.errors.DuplicateTable,
                                self._psycopg.errors.DuplicateObject) as exc:
                            raise StoreError(unmigratable(self.location, number, exc)) from None
                    db.execute("UPDATE metaclaw_schema SET version = %s", (number + 1,))
                db.execute(_ENGINE_TABLES)
                for statement in _FUNCTIONS:
                    db.execute(statement)
            if 0 < version < SCHEMA_VERSION:
                self.migrated_from = version
                said_migrated(self.location, version)
            self.created = version == 0  # (an empty database given: its schema made here)

    @property
    def schema_version(self) -> int:
        return int(self._scalar("SELECT version FROM metaclaw_schema"))

    def close(self) -> None:
        with self._listener_lock:
            if self._listener is not None:
                self._listener.stop()
        with self._lock:
            self._pool.close()
            self._db.close()

    def __repr__(self) -> str:
        return f"Store({self.location!r}, schema v{self.schema_version})"

    # -- low level ------------------------------------------------------------------------
    def execute(self, sql: str, params: Iterable[Any] = ()) -> Any:
        head = sql.lstrip()[:6].upper()
        if head.startswith(("SELECT", "WITH")) and not self._mine():
            rows = self._read(sql, params)
            return _Rows(rows)
        with self.transaction() if not self._mine() and head in ("INSERT", "UPDATE", "DELETE")\
                else _nothing(), self._lock:
            return self._run(self._conn(), sql, params)

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return [_decode(r) for r in self._read(sql, params)]

    def _scalar(self, sql: str, params: Iterable[Any] = ()) -> Any:
        rows = self._read(sql, params)
        return next(iter(rows[0].values())) if rows else None

    def _rows(self, sql: str, params: tuple[Any, ...]) -> tuple[list[str], list[tuple[Any, ...]]]:
        if self._mine():
            with self._lock:
                cur = self._run(self._conn(), sql, params)
                rows = cur.fetchall()
                names = [d.name for d in cur.description]
        else:
            with self._pooled() as conn:
                cur = self._run(conn, sql, params)
                rows = cur.fetchall()
                names = [d.name for d in cur.description]
        return names, [tuple(_row(r).values()) for r in rows]

    def _insert_row(self, table: str, sql: str, values: list[Any]) -> int:
        key = _KEYS.get(table, "id")
        cur = self.execute(f"{sql} RETURNING {key}", values)
        return int(cur.fetchone()[key])

    def _insert_turn(self, row: dict[str, Any], stale: dict[str, str] | None = None) -> int:
        return self._insert_row("turns", *self._turn_statement(row, stale))

    @staticmethod
    def _turn_statement(row: dict[str, Any], stale: dict[str, str] | None
                        ) -> tuple[str, list[Any]]:
        """The session's row and the turn in one statement: one round trip, not two."""
        sql, values = base.turn_insert(row, stale)
        now = row["created_at"]
        return f"WITH s AS ({base.SESSION_UPSERT}) {sql}", [row["session_id"], now, now, "{}",
                                                            *values]

    def claim_session(self, session_id: str, first_of: tuple[str, str] | None = None
                      ) -> bool | None:
        """:meth:`Store.claim_session`, outside the workspace's write lock: one INSERT on a
        pooled connection, which the session's key alone keeps unique (nothing is numbered
        from it), committed without waiting for the flush. So a claim does not fail while
        another proxy records a turn, as two proxies opening alike at once do."""
        with self._pooled() as conn:  # autocommit: one round trip
            cursor = self._run(conn, *base.session_claim(session_id, first_of))
        return cursor.rowcount == 1

    def record_turns(self, turns: list[tuple[dict[str, Any], bool]], *, fsync: bool = True,
                     wait: bool = True, stale: dict[str, str] | None = None) -> list[int]:
        """One round trip for the whole transaction (psycopg's pipeline mode): the write lock,
        the turns, their sessions and the commit are sent together, and the server runs them
        in order, stopping at the first error (nothing is then written)."""
        if not turns:
            return []
        if not self._lock.acquire(blocking=wait):
            raise StoreBusy("another thread of this process is writing to the store")
        try:
            if self._mine():  # inside this thread's transaction: statements of that one
                return super().record_turns(turns, fsync=fsync, wait=wait, stale=stale)
            return self._record_pipelined(turns, fsync, wait, stale)
        finally:
            self._lock.release()

    def _record_pipelined(self, turns: list[tuple[dict[str, Any], bool]], fsync: bool,
                          wait: bool, stale: dict[str, str] | None) -> list[int]:
        db = self._conn()
        self._txn_thread = threading.get_ident()
        written = False
        try:
            with db.pipeline():
                for statement in _opening(fsync, wait):
                    db.execute(statement)
                cursors = []
                for fields, done in turns:
                    row = base._turn_row(**fields)
                    sql, values = self._turn_statement(row, stale)
                    cursors.append(db.execute(translate(f"{sql} RETURNING id"), _params(values)))
                    if done:
                        db.execute(translate("UPDATE sessions SET done = 1, updated_at = ? "
                                             "WHERE id = ?"),
                                   _params((time.time(), row["session_id"])))
                db.execute("COMMIT")
            ids = [int(cur.fetchone()["id"]) for cur in cursors]
            written = True
            return ids
        except self._psycopg.errors.LockNotAvailable as exc:
            raise self._busy(wait, exc) from None
        except self._psycopg.Error as exc:
            raise self._failed(exc) from exc
        finally:
            try:
                self._end(commit=False)  # after an error: the transaction is rolled back
            finally:
                if not written:
                    _forget_prepared(db)

    @staticmethod
    def _busy(wait: bool, exc: BaseException) -> StoreBusy:
        if not wait:
            return StoreBusy("another connection holds the workspace's write lock")
        return StoreBusy(f"the workspace's write lock was not free within "
                         f"{BUSY_TIMEOUT_S:.0f} s ({_one_line(exc)})")

    def _insert_many(self, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        sql = translate(f"INSERT INTO {table} ({', '.join(columns)}) "
                        f"VALUES ({', '.join('?' * len(columns))})")
        with self._lock:
            if table == "skill_generations":
                self._txn_latest = _UNKNOWN
            try:
                with self._conn().cursor() as cur:
                    cur.executemany(sql, [_params(row) for row in rows])
            except self._psycopg.Error as exc:
                raise EngineError(f"PostgreSQL workspace {self.location}: "
                                  f"{_one_line(exc)}") from exc

    def _after_copy(self, table: str, key: str) -> None:
        """Move the identity column's sequence past the copied keys."""
        if self.declared_types(table).get(key) != "BIGINT":
            return
        sequence = self._scalar("SELECT pg_get_serial_sequence(?, ?)", (table, key))
        if sequence is not None:
            self.execute(f"SELECT setval('{sequence}', COALESCE((SELECT MAX({key}) FROM "
                         f"{table}), 0) + 1, false)")

    def loop_writer(self) -> None:
        """None: an event loop never waits on the network (the proxy records from a thread)."""
        return None

    def checkpoint(self) -> None:
        """Nothing to do: PostgreSQL checkpoints by itself."""

    def declared_types(self, table: str) -> dict[str, str]:
        rows = self.query("SELECT column_name AS name, data_type AS type FROM "
                          "information_schema.columns WHERE table_schema = current_schema() "
                          "AND table_name = ?", (table,))
        return {row["name"]: row["type"].upper() for row in rows if row["name"] != "rowid"}

    def frame(self, table: str, where: str = "1=1", params: Iterable[Any] = ()):
        frame = super().frame(table, where, params)
        return frame.drop("rowid") if "rowid" in frame.columns else frame

    def current_generation(self) -> int | None:
        """The latest generation committed on any machine, without a query: a thread of this
        process ``LISTEN``s on :data:`GENERATION_CHANNEL` (a trigger announces every new
        generation as it commits) and re-reads the number when told, and once a second in any
        case. While that connection is down (the database restarting or unreachable), the
        number it last knew, without waiting for the network: the proxy calls this before every
        request on its event loop, which must not hang on a database that went away (turns
        cannot be recorded meanwhile anyway; the listener reads the number again as soon as it
        is back). Before the listener ever connected, the table is read."""
        listener = self._listener
        if listener is None or listener.pid != os.getpid():  # none yet, or a forked child's
            with self._listener_lock:
                if self._listener is listener:  # not made by another thread meanwhile
                    self._listener = _GenerationListener(self)
                listener = self._listener
        value = listener.latest
        if value is _UNKNOWN:
            value = listener.last
        return self.latest_generation() if value is _UNKNOWN else value

    def add_generation(self, **fields: Any) -> int:
        number = super().add_generation(**fields)
        if self._mine():  # announced to this process's listeners when the transaction commits
            self._txn_generation = self._txn_latest = number  # numbers only grow
        return number

    def latest_generation(self) -> int | None:
        # inside this thread's write transaction: the number read as its write lock was taken,
        # or the one it added since (every generation is added under that lock)
        if self._mine() and self._txn_latest is not _UNKNOWN:
            return self._txn_latest
        return super().latest_generation()

    def watcher(self) -> "_Watcher":
        return _Watcher(self)

    def session_lock(self, name: str) -> "SessionLock":
        """The workspace-wide lock ``name`` (``training``, ``evolve``): held by one process of
        any machine at a time, freed by the server when its holder's connection ends (``kill
        -9`` or a lost machine included). See :mod:`metaclaw.training_lease`."""
        return SessionLock(self, name)

    # -- dialect --------------------------------------------------------------------------
    def json_values(self, expr: str, alias: str, kind: str = "text") -> str:
        doc = f"metaclaw_json({expr})"
        value = ("CASE WHEN jsonb_typeof(e.v) = 'number' THEN (e.v #>> '{}')::numeric::bigint END"
                 if kind == "int" else "e.v #>> '{}'")
        kind_of = ("CASE jsonb_typeof(e.v) WHEN 'string' THEN 'text' WHEN 'number' THEN CASE "
                   "WHEN (e.v #>> '{}') ~ '^-?[0-9]+$' THEN 'integer' ELSE 'real' END WHEN "
                   "'boolean' THEN e.v #>> '{}' ELSE jsonb_typeof(e.v) END")
        return (f"LATERAL (SELECT {value} AS value, {kind_of} AS type FROM jsonb_array_elements(CASE WHEN "
                f"jsonb_typeof({doc}) = 'array' THEN {doc} ELSE '[]'::jsonb END) AS e(v)) "
                f"AS {alias}")

    def json_text(self, expr: str, *path: "str | int", guarded: bool = True) -> str:
        keys = ",".join(str(p) for p in path)
        return f"(metaclaw_json({expr}) #>> '{{{keys}}}')"

    def json_size(self, expr: str) -> str:
        doc = f"metaclaw_json({expr})"
        return (f"(CASE jsonb_typeof({doc}) WHEN 'object' THEN (SELECT COUNT(*) FROM "
                f"jsonb_object_keys({doc})) WHEN 'array' THEN jsonb_array_length({doc}) "
                f"WHEN 'null' THEN NULL ELSE 1 END)")

    def json_length(self, expr: str, guarded: bool = True) -> str:
        doc = f"metaclaw_json({expr})"
        return (f"(CASE WHEN {doc} IS NULL THEN NULL WHEN jsonb_typeof({doc}) = 'array' "
                f"THEN jsonb_array_length({doc}) ELSE 0 END)")

    # -- transactions ---------------------------------------------------------------------
    def _in_transaction(self) -> bool:
        return self._mine()

    def _begin(self, fsync: bool, wait: bool) -> None:
        try:
            self._open_transaction(fsync, wait)
        except StoreUnavailable:
            if not (self._db.closed or self._db.broken) or self.unreachable():
                raise  # (a server found down is not waited for twice)
            # the server closed the writer connection while it was idle (a restart), which is
            # found only now: nothing was written, so once more on a new connection
            self._open_transaction(fsync, wait)

    def _open_transaction(self, fsync: bool, wait: bool) -> None:
        db = self._conn()
        # one round trip: the statements go as one simple query (no parameters)
        # the latest generation in a statement of its own: its snapshot is taken once the lock
        # is held
        steps = [*_opening(fsync, wait), "SELECT MAX(generation) AS latest FROM skill_generations"]
        try:
            self._txn_thread = threading.get_ident()
            cur = db.execute("; ".join(steps))
            while cur.nextset():
                pass
            latest = cur.fetchone()["latest"]
            self._txn_latest = None if latest is None else int(latest)
        except self._psycopg.errors.LockNotAvailable as exc:
            self._end(commit=False)
            raise self._busy(wait, exc) from None
        except self._psycopg.Error as exc:
            self._end(commit=False)
            raise self._failed(exc) from exc
        except BaseException:
            self._end(commit=False)
            raise

    def _end(self, commit: bool) -> None:
        db, self._txn_thread, self._txn_latest = self._db, None, _UNKNOWN
        added, self._txn_generation = self._txn_generation, None
        if db.closed or db.info.transaction_status == self._psycopg.pq.TransactionStatus.IDLE:
            return
        try:
            db.execute("COMMIT" if commit else "ROLLBACK")
            if commit and added is not None:  # this process need not wait for the NOTIFY
                for listener in list(_LISTENERS):
                    if listener.conninfo == self._conninfo:
                        listener.heard(added)
        except self._psycopg.Error as exc:
            if not db.closed and not db.broken and \
                    db.info.transaction_status != self._psycopg.pq.TransactionStatus.IDLE:
                try:
                    db.execute("ROLLBACK")
                except self._psycopg.Error:
                    pass
            raise self._failed(exc) from exc

    def _after(self, fsync: bool) -> None:
        """Nothing: a transaction's settings were ``SET LOCAL``."""


def _forget_prepared(db: Any) -> None:
    """After an aborted pipeline: the driver may believe in a prepared statement the server
    never made (its PREPARE was skipped with the rest of the pipeline), and every later use
    fails ("prepared statement ... does not exist"). Its cache is emptied, so the next
    statement deallocates all on the server first (psycopg's own maintenance); a driver without
    that cache gets a fresh connection instead."""
    prepared = getattr(db, "_prepared", None)
    if prepared is not None and callable(getattr(prepared, "clear", None)):
        prepared.clear()
    else:  # pragma: no cover - another psycopg layout
        with contextlib.suppress(Exception):
            db.close()


class SessionLock:
    """A session-level advisory lock on a connection of its own (``pg_try_advisory_lock``),
    with its holder's record (who, doing what, since when) in ``metaclaw_leases``."""

    def __init__(self, store: PostgresStore, name: str):
        import zlib

        self.store, self.name = store, name
        self.key = zlib.crc32(name.encode()) & 0x7FFFFFFF
        self._conn: Any = None

    def try_acquire(self, record: str) -> bool:
        """Take the lock without waiting; ``record`` (JSON text) names the holder."""
        psycopg = self.store._psycopg
        try:
            conn = psycopg.connect(self.store._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the PostgreSQL workspace at "
                             f"{self.store.location}: {_one_line(exc)}") from None
        try:
            got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                               (LEASE_SPACE, self.key)).fetchone()[0]
            if got:
                conn.execute("INSERT INTO metaclaw_leases (name, record) VALUES (%s, %s) "
                             "ON CONFLICT (name) DO UPDATE SET record = excluded.record",
                             (self.name, record))
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            return False
        self._conn = conn
        return True

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # unlocked before it returns: the server ends a closed session (and frees its
            # locks) a moment after the client has gone, so another process trying at once
            # could still find the lock held
            with contextlib.suppress(Exception):
                conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LEASE_SPACE, self.key))
            conn.close()  # ending the session frees the lock in any case

    def forget(self) -> None:
        """In a forked child: drop the parent's connection without closing it (closing would
        end the parent's session, and with it the parent's lock)."""
        self._conn = None

    def record(self) -> str | None:
        """The holder's record while someone holds the lock, else None."""
        rows = self.store.query(
            "SELECT r.record FROM metaclaw_leases r WHERE r.name = ? AND EXISTS (SELECT 1 FROM "
            "pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.classid = ? AND "
            "l.objid = ? AND l.objsubid = 2 AND l.database = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()))", (self.name, LEASE_SPACE, self.key))
        return rows[0]["record"] if rows else None


class _Rows:
    """What :meth:`PostgresStore.execute` returns for a read: a cursor's reading methods."""

    def __init__(self, rows: list[dict[str, Any]]):
        self._rows, self.rowcount = rows, len(rows)

    def fetchone(self) -> dict[str, Any] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[dict[str, Any]]:
        rows, self._rows = self._rows, []
        return rows


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Watcher:
    """:meth:`Store.watcher` for PostgreSQL: every look reads (a primary-key range is cheap)."""

    def __init__(self, store: PostgresStore):
        self.store = store

    def changed(self) -> bool:
        return True

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        return self.store._rows(sql, tuple(params))[1]

    def close(self) -> None:
        pass


class _GenerationListener:
    """A daemon thread with a connection of its own that ``LISTEN``s on
    :data:`GENERATION_CHANNEL` and keeps :attr:`latest`, the newest committed generation
    (:data:`_UNKNOWN` while it has no live connection). It re-reads the number when notified,
    and every :data:`CHECK_S` seconds in any case (which also finds a dead connection)."""

    CHECK_S = 1.0
    RETRY_S = 0.5
    WAKE_S = 0.1  # how soon a stop is heeded

    def __init__(self, store: PostgresStore):
        # no reference to the store: a store dropped without close() is collected, and its
        # listener stops with it
        self.conninfo, self.pid, self._psycopg = store._conninfo, os.getpid(), store._psycopg
        self.latest: Any = _UNKNOWN
        self.last: Any = _UNKNOWN  # the newest number known, kept while the connection is down
        self._latest_lock = threading.Lock()
        self._conn: Any = None
        self.connected_at = -math.inf  # when its connection last opened (monotonic)
        self._stopped = threading.Event()
        _LISTENERS.add(self)
        self._thread = threading.Thread(target=self._serve, name="metaclaw-generation-listener",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(store, self._stopped.set)

    def _serve(self) -> None:
        psycopg = self._psycopg
        conninfo = self.conninfo  # with TCP_TIMEOUTS: a dead peer is noticed within seconds
        while not self._stopped.is_set():
            try:
                self._conn = conn = psycopg.connect(conninfo, autocommit=True)
                with conn:
                    conn.execute(f"LISTEN {GENERATION_CHANNEL}")
                    self.connected_at = time.monotonic()  # the server answers (again)
                    read_at = 0.0
                    while not self._stopped.is_set():
                        if time.monotonic() - read_at >= self.CHECK_S:
                            value = conn.execute("SELECT MAX(generation) FROM skill_generations"
                                                 ).fetchone()[0]
                            self._raise_to(None if value is None else int(value), known=False)
                            read_at = time.monotonic()
                        for _ in conn.notifies(timeout=self.WAKE_S, stop_after=1):
                            read_at = 0.0  # told: read now
            except psycopg.Error as exc:
                if not self._stopped.is_set():
                    log.debug("generation listener: %s; reconnecting", _one_line(exc))
                    self._forget_latest()
                    self._stopped.wait(self.RETRY_S)
            finally:
                self._forget_latest()

    def _forget_latest(self) -> None:
        with self._latest_lock:
            self.latest = _UNKNOWN

    def _raise_to(self, number: int | None, known: bool) -> None:
        """Generations only ever grow: a read that began before a newer number was heard must
        not lower it. ``known``: only while the number is known (a listener without a live
        connection stays unknown, so that callers read the table)."""
        with self._latest_lock:
            latest = self.latest
            if latest is _UNKNOWN:
                if not known:
                    self.latest = number
            elif number is not None and (latest is None or latest < number):
                self.latest = number
            last = self.last
            if last is _UNKNOWN or last is None or number is not None and last < number:
                self.last = number

    def heard(self, number: int) -> None:
        """``number`` was committed by this process (its NOTIFY is on its way)."""
        self._raise_to(number, known=True)

    def stop(self) -> None:
        self._stopped.set()
        if self.pid == os.getpid():
            self._thread.join(timeout=self.CHECK_S + 1)

    def forget(self) -> None:
        """In a forked child: keep the parent's connection unclosed (closing it would end the
        parent's session) and never use it."""
        _INHERITED.append(self._conn)
        self._conn = None


#: Every live listener of this process (for :func:`_forget_in_child`).
_LISTENERS: "weakref.WeakSet[_GenerationListener]" = weakref.WeakSet()
#: Connections a forked child inherited: held, never closed, never used.
_INHERITED: list[Any] = []


def _forget_in_child() -> None:
    for listener in list(_LISTENERS):
        listener.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
