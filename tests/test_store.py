import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import polars as pl
import pytest

from metaclaw.store import DB_ERRORS, SCHEMA_VERSION, TABLES, Store, StoreError


@pytest.mark.sqlite_only
def test_fresh_store_is_wal_and_versioned(tmp_path):
    store = Store(tmp_path / "ws" / "metaclaw.db")
    assert store.schema_version == SCHEMA_VERSION
    assert store.query("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
    for table in TABLES:
        assert isinstance(store.frame(table), pl.DataFrame)


@pytest.mark.sqlite_only
def test_newer_schema_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "m.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 5}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this MetaClaw"):
        Store(path)


@pytest.mark.sqlite_only
def test_a_schema_of_another_build_is_refused_in_a_sentence_and_left_as_it_was(tmp_path):
    path = tmp_path / "m.db"
    with Store(path) as store:  # tables of version 12 stamped 11, as a development build's
        store.record_turn(session_id="s", request_messages=[{"role": "user", "content": "hi"}],
                          status="ok")
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=11")
    db.commit()
    db.close()
    with pytest.raises(StoreError) as err:
        Store(path)
    message = str(err.value)
    assert "cannot be upgraded from schema version 11 to 12" in message
    assert "duplicate column" in message and "development build" in message
    assert "\n" not in message and "Nothing was changed" in message
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 11
    assert db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 1
    db.close()


@pytest.mark.sqlite_only
def test_not_a_database_is_a_store_error(tmp_path):
    path = tmp_path / "m.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot open the MetaClaw store"):
        Store(path)


def test_turns_round_trip_json_and_indexes(tmp_path):
    store = Store(tmp_path / "m.db")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"}]
    a = store.record_turn(session_id="s1", request_messages=msgs, status="ok",
                          injected_skills=["backup-before-modify"], skill_generation=2,
                          usage={"prompt_tokens": 3})
    b = store.record_turn(session_id="s1", request_messages=msgs, status="error", error="boom")
    c = store.record_turn(session_id="s2", request_messages=msgs, status="ok")
    assert [store.turn(i)["turn_index"] for i in (a, b, c)] == [0, 1, 0]
    row = store.turn(a)
    assert row["request_messages"] == msgs
    assert row["injected_skills"] == ["backup-before-modify"]
    assert row["usage"] == {"prompt_tokens": 3}
    store.update_turn(a, reward=-1.0, judge_votes=[{"score": -1}])
    assert store.turn(a)["judge_votes"] == [{"score": -1}]
    frame = store.frame("turns", "session_id = ?", ("s1",))
    assert frame.height == 2 and frame["status"].to_list() == ["ok", "error"]
    store.mark_session_done("s1")
    assert store.session("s1")["done"] == 1


def test_generations_are_numbered_and_events_atomic(tmp_path):
    store = Store(tmp_path / "m.db")
    g0 = store.add_generation(snapshot={}, kind="init")
    g1 = store.add_generation(snapshot={"a": {"name": "a"}}, kind="edit", parent=g0,
                              events=[{"op": "add", "skill_name": "a", "evidence": [1, 2]}])
    assert (g0, g1) == (0, 1) and store.latest_generation() == 1
    assert store.skill_events(1)[0]["evidence"] == [1, 2]
    with pytest.raises(DB_ERRORS):
        # an event with a missing column aborts the whole generation
        store.add_generation(snapshot={}, kind="edit", events=[{"op": None, "skill_name": "x"}])
    assert store.latest_generation() == 1


def test_acknowledged_turn_survives_kill_9(tmp_path):
    path = tmp_path / "m.db"
    script = textwrap.dedent(f"""
        import sys, time
        from metaclaw.store import Store
        store = Store({str(path)!r})
        for i in range(50):
            store.record_turn(session_id="k", request_messages=[{{"role": "user", "content": str(i)}}],
                              status="ok", response="r" * 1000)
            print(i, flush=True)          # acknowledged
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged == 49:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = Store(path)
    assert store.query("SELECT COUNT(*) AS n FROM turns")[0]["n"] == 50


def test_store_shows_itself(tmp_path):
    store = Store(tmp_path / "m.db")
    store.record_turn(session_id="s", request_messages=[], status="ok")
    assert store.counts()["turns"] == 1 and store.counts()["sessions"] == 1
    assert "<td>turns</td><td>1</td>" in store._repr_html_() and f"schema v{store.schema_version}" in repr(store)


def test_frames_have_the_declared_dtypes_even_when_empty(tmp_path):
    """An empty table, or a column that is null in every row, has the dtype of a full one, so
    frames taken at two moments filter and concatenate alike."""
    import polars as pl

    store = Store(tmp_path / "ws.db")
    empty = store.frame("turns")
    assert empty.height == 0 and pl.Null not in empty.schema.values()
    assert empty.schema["session_id"] == pl.Utf8 and empty.schema["reward"] == pl.Float64
    assert empty.schema["turn_index"] == pl.Int64
    assert empty.filter(pl.col("session_id").str.starts_with("nb")).height == 0
    store.record_turn(session_id="nb-1", request_messages=[{"role": "user", "content": "q"}],
                      status="ok")
    full = store.frame("turns")
    assert full.schema == empty.schema and full["reward"].to_list() == [None]
    assert pl.concat([empty, full]).height == 1
    assert pl.Null not in store.frame("events").schema.values()


OPEN_AT = """
import sys, time
from metaclaw.store import SCHEMA_VERSION, Store
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # every process opens at this moment
with Store(sys.argv[1]) as store:
    assert store.schema_version == SCHEMA_VERSION
"""


@pytest.mark.parametrize("trial", range(3))
def test_processes_opening_a_new_workspace_at_once_all_start(tmp_path, trial):
    """Two proxies, or a proxy and a notebook, starting together on a new workspace (or on one
    an upgrade migrates): each migration runs once and every process opens the store."""
    import subprocess
    import sys
    import time

    at = str(time.time() + 1.5)
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT, str(tmp_path / "ws.db"), at],
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [proc.communicate(timeout=60)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, errors


def _v6_workspace(path):
    """A workspace as MetaClaw with schema version 6 left it: a turn trained twice, a judge's
    lease."""
    from metaclaw.store.base import MIGRATIONS, _split_sql

    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    for script in MIGRATIONS[:6]:
        for statement in _split_sql(script):
            db.execute(statement)
    db.execute("PRAGMA user_version=6")
    db.execute("INSERT INTO sessions (id, created_at, updated_at) VALUES ('s', 1, 1)")
    db.execute("INSERT INTO turns (session_id, turn_index, created_at, request_messages, status, "
               "buffer_set, buffer_state, trained_steps, judge_lease_until) "
               "VALUES ('s', 0, 1, '[]', 'ok', 'query', 'live', 2, 5.0)")
    db.close()


@pytest.mark.sqlite_only
def test_a_v6_workspace_migrates_keeping_its_trained_counts(tmp_path):
    from metaclaw import buffers

    path = tmp_path / "ws.db"
    _v6_workspace(path)
    with Store(path) as store:
        assert store.schema_version == SCHEMA_VERSION >= 7
        row = store.turns()[0]
        assert row["trained_steps"] == 2 and row["judge_lease_until"] == 5.0
        assert row["train_claim_until"] is None and row["train_claim_by"] is None
        assert buffers.is_trained(row) and buffers.consumable(store, [row["id"]]) == []


@pytest.mark.sqlite_only
def test_a_migration_is_said_where_it_happens(tmp_path, caplog, capsys):
    """Opening an older workspace migrates it: the store says from which version (in the
    log, and `metaclaw db migrate` in its line), since an older MetaClaw refuses it after."""
    from metaclaw import cli

    path = tmp_path / "ws.db"
    _v6_workspace(path)
    assert cli.main(["db", "migrate", "--db", str(path)]) == 0
    assert (f"migrated from schema version 6 to {SCHEMA_VERSION} (a MetaClaw older than this "
            "one no longer opens it)") in capsys.readouterr().out
    assert "from schema version 6" in caplog.text
    caplog.clear()
    with Store(path) as store:
        assert store.migrated_from is None and "migrated" not in caplog.text
    with Store(tmp_path / "new.db") as store:  # created, not migrated: nothing said
        assert store.migrated_from is None and "migrated" not in caplog.text
        assert store.created
    with Store(tmp_path / "new.db") as store:
        assert not store.created
    assert cli.main(["db", "migrate", "--db", str(path)]) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.mark.sqlite_only
@pytest.mark.parametrize("trial", range(2))
def test_processes_opening_a_v6_workspace_at_once_all_migrate_it(tmp_path, trial):
    import time

    _v6_workspace(tmp_path / "ws.db")
    at = str(time.time() + 1.5)
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT, str(tmp_path / "ws.db"), at],
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [proc.communicate(timeout=60)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, errors
    with Store(tmp_path / "ws.db") as store:
        assert store.turns()[0]["trained_steps"] == 2


# -- a group of turns in one transaction (the proxy's recorder) ------------------------------
def _turn(session, generation, **fields):
    return {"session_id": session, "request_messages": [{"role": "user", "content": "q"}],
            "status": "ok", "buffer_set": "query", "buffer_state": "live",
            "skill_generation": generation, **fields}


def test_record_turns_writes_a_group_and_purges_turns_of_a_superseded_generation(store):
    """A turn served under generation 0 and written after generation 1 was committed enters
    the query buffer purged: the check is made by the write itself, under the write lock."""
    store.add_generation(snapshot={}, kind="initial")
    store.add_generation(snapshot={}, kind="evolve")
    odd = "b\ufdd0"  # the PostgreSQL store's escape character, in an id
    ids = store.record_turns([(_turn("a", 0), False), (_turn("a", 1), True),
                              (_turn(odd, 0, buffer_state="consumed"), True)],
                             fsync=False, wait=False, stale={"live": "purged"})
    rows = [store.turn(i) for i in ids]
    assert [r["buffer_state"] for r in rows] == ["purged", "live", "consumed"]
    assert [(r["session_id"], r["turn_index"]) for r in rows] == [("a", 0), ("a", 1), (odd, 0)]
    assert store.session("a")["done"] and store.session(odd)["done"]
    assert store.record_turns([]) == []
    (plain,) = store.record_turns([(_turn("c", 0), False)])  # no stale rule: as given
    assert store.turn(plain)["buffer_state"] == "live"


def test_record_turns_goes_on_after_refusals_once_its_statements_are_prepared(store):
    """A driver that prepares statements it runs often (psycopg, after five uses) must not be
    left believing in one the server never made when a write is refused part-way (a busy lock
    aborts the rest of PostgreSQL's pipeline): every later write failed with "prepared
    statement ... does not exist" on a team proxy under load."""
    from metaclaw.store import StoreBusy

    for i in range(12):  # the group's statements are prepared by now
        store.record_turns([(_turn(f"warm-{i % 3}", 0), i % 2 == 0)], wait=False)
    for round_ in range(3):
        with Store(store.target) as other, other.transaction():
            other.record_turn(**_turn(f"other-{round_}", 0))
            for attempt in range(3):
                with pytest.raises(StoreBusy):
                    store.record_turns([(_turn("refused", 0), True)], wait=False)
        for i in range(8):
            store.record_turns([(_turn(f"after-{round_}-{i % 2}", 0), i % 2 == 1)],
                               wait=i % 2 == 0)
    assert len(store.turns()) == 12 + 3 + 3 * 8
    assert not store.turns("session_id = 'refused'")


def test_record_turns_is_all_or_nothing_and_refuses_a_busy_store_without_waiting(store):
    from metaclaw.store import StoreBusy

    with pytest.raises(Exception):
        store.record_turns([(_turn("a", 0), False), (_turn("a", 0, no_such_column=1), False)])
    assert store.turns() == []
    with Store(store.target) as other, other.transaction():
        other.record_turn(**_turn("other", 0))
        with pytest.raises(StoreBusy):
            store.record_turns([(_turn("a", 0), False)], wait=False)
    assert [t["session_id"] for t in store.turns()] == ["other"]
    store.record_turns([(_turn("a", 0), False)], wait=False)  # free again
    assert len(store.turns()) == 2
    import threading
    import time

    held, release = threading.Event(), threading.Event()

    def hold():  # another thread of this process is writing (a slow disk, a long reload)
        with store._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        with pytest.raises(StoreBusy):
            store.record_turns([(_turn("a", 0), False)], wait=False)
        assert time.monotonic() - started < 1.0  # at once, not after the other thread
    finally:
        release.set()
        holder.join()
    assert len(store.turns()) == 2


def test_proxy_activity_is_the_newest_turn_or_a_request_in_flight(store):
    """What the scheduler's proxy signal reads: the newest turn, or a later report of a request
    still in flight (a turn is recorded only when its reply ends); a stopped proxy's row goes."""
    assert store.last_proxy_activity() is None
    store.record_turn(session_id="s", request_messages=[], status="ok")
    ended = store.query("SELECT created_at FROM turns")[0]["created_at"]
    assert store.last_proxy_activity() == pytest.approx(ended)
    store.mark_proxy_busy("host:1:a", at=ended + 100)
    store.mark_proxy_busy("host:2:b", at=ended + 50)
    store.mark_proxy_busy("host:1:a", at=ended + 200)  # one row per proxy, moved on
    assert store.last_proxy_activity() == pytest.approx(ended + 200)
    assert len(store.query("SELECT * FROM proxy_activity")) == 2
    store.forget_proxy("host:1:a")
    assert store.last_proxy_activity() == pytest.approx(ended + 50)


def test_a_copy_whose_source_changes_meanwhile_leaves_the_destination_empty(tmp_path):
    """A proxy recording into the source during `metaclaw db copy`: the verification found it
    only after the commit, and left the destination half filled (a rerun was then refused)."""
    from metaclaw.store import StoreError
    from metaclaw.store.transfer import copy_store

    source, dest = Store(tmp_path / "source.db"), Store(tmp_path / "dest.db")
    writer = Store(tmp_path / "source.db")  # another process's proxy
    for i in range(3):
        source.record_turn(session_id="s", request_messages=[], status="ok", response=str(i))
    rows, wrote = source._rows, []

    def rows_while_a_proxy_writes(sql, params):
        out = rows(sql, params)
        if "FROM turns" in sql and not wrote:
            wrote.append(writer.record_turn(session_id="s", request_messages=[], status="ok"))
        return out

    source._rows = rows_while_a_proxy_writes
    with pytest.raises(StoreError, match="the source changed while it was copied"):
        copy_store(source, dest)
    assert not any(dest.counts().values())  # nothing written: a rerun is not refused
    source._rows = rows
    copy_store(source, dest)
    assert dest.counts()["turns"] == 4
    for store in (source, dest, writer):
        store.close()


def test_an_outage_is_logged_once_a_while_not_once_a_turn(caplog):
    """A 14-second database outage logged thousands of warnings, each turn and task its own;
    those held back are said when the interval ends, not at the next outage."""
    import logging
    import time

    from metaclaw.store import OutageLog

    log = logging.getLogger("metaclaw.test-outage")
    outages = OutageLog(log, interval=0.3)
    with caplog.at_level(logging.WARNING, logger="metaclaw.test-outage"):
        for n in range(50):
            outages.warning("could not record %d turns: %s", n, "server down")
        time.sleep(0.6)  # the held ones are said once the interval is over, with no new one
        said = [r.getMessage() for r in caplog.records]
        assert said[0] == "could not record 0 turns: server down" and len(said) == 2
        assert said[1].startswith("could not record 49 turns: server down (49 like it since ")
        time.sleep(0.4)
        outages.warning("could not record %d turns: %s", 99, "down again")
    assert caplog.records[-1].getMessage() == "could not record 99 turns: down again"
