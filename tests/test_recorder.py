"""Where the proxy's turns are committed: on the event loop when the store is free at once (a
commit without fsync is cheaper than a thread hand-off), else by the writer thread, so that the
loop never waits for the store: another connection or thread writing, fsync asked for, a slow
commit. Nothing is lost or reordered on either path, and checkpoints stay off the loop."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest

# the event loop's own SQLite connection (a database server is written from a thread)
pytestmark = pytest.mark.sqlite_only

from metaclaw.proxy.pipeline import Recorder
from metaclaw.store import Store, StoreBusy

ROW = {"request_messages": [{"role": "user", "content": "hi"}], "status": "ok"}


class SpyStore(Store):
    """Notes each transaction (fsync, wait, thread) and checkpoint (thread); shared by the
    store's loop writer, which is a copy of it."""

    def __init__(self, path, delay: float = 0.0):
        super().__init__(path)
        self.seen: list[tuple] = []
        self.checkpoints: list[str] = []
        self.delay = delay

    def transaction(self, fsync=True, wait=True):  # a turn's own nests in its group's
        self.seen.append((fsync, wait, threading.current_thread().name))
        return super().transaction(fsync, wait)

    def checkpoint(self):
        self.checkpoints.append(threading.current_thread().name)
        super().checkpoint()

    def record_turn(self, **fields):
        time.sleep(self.delay)
        return super().record_turn(**fields)


def _turns(path) -> list[tuple]:
    conn = sqlite3.connect(str(path))
    try:
        return conn.execute("SELECT id, session_id FROM turns ORDER BY id").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("fsync", [False, True])
def test_a_free_store_commits_on_the_loop_unless_fsync_is_asked(tmp_path, fsync):
    store = SpyStore(tmp_path / "m.db")
    recorder = Recorder(store, fsync=fsync)

    async def one():
        return await recorder.submit({**ROW, "session_id": "s"}, False), \
            threading.current_thread().name

    try:
        turn_id, loop_thread = asyncio.run(one())
    finally:
        recorder.stop()
    fsync_seen, wait, thread = store.seen[0]
    assert turn_id is not None and _turns(tmp_path / "m.db") == [(turn_id, "s")]
    assert fsync_seen is fsync
    if fsync:  # an fsync never runs on the loop
        assert (wait, thread) == (True, "metaclaw-record") and recorder._loop_commits == 0
    else:
        assert (wait, thread) == (False, loop_thread) and recorder._loop_commits == 1
    store.close()


def test_loop_commits_leave_the_generation_check_cheap_and_still_see_other_writers(tmp_path):
    store = Store(tmp_path / "m.db")
    writer = store.loop_writer()
    assert writer.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert writer.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    assert store.execute("PRAGMA synchronous").fetchone()[0] == 2  # the store's own: FULL
    assert store.current_generation() is None
    version = store._probe.execute("PRAGMA data_version").fetchone()[0]
    with writer.transaction(False, wait=False):
        writer.record_turn(session_id="s", **ROW)
    # the probe's own commit: not a change to re-read the tables for
    assert store._probe.execute("PRAGMA data_version").fetchone()[0] == version
    assert _turns(tmp_path / "m.db")[0][1] == "s"  # committed for every other connection
    other = Store(tmp_path / "m.db")  # another process publishes a generation
    other.add_generation(snapshot={}, kind="test")
    assert store.current_generation() == 0
    other.close()
    store.close()
    assert Store(":memory:").loop_writer() is None


def test_transaction_without_waiting_refuses_a_busy_store_and_writes_nothing(tmp_path):
    store = Store(tmp_path / "m.db")
    writer = store.loop_writer()
    other = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process is writing
    started = time.monotonic()
    with pytest.raises(StoreBusy, match="write lock"):
        with writer.transaction(False, wait=False):
            writer.record_turn(session_id="never", **ROW)
    assert time.monotonic() - started < 1.0  # not the 30 s busy timeout
    other.execute("COMMIT")
    holder = threading.Thread(target=lambda: (store._lock.acquire(), time.sleep(0.3),
                                              store._lock.release()))
    holder.start()  # another thread of this process is writing
    time.sleep(0.05)
    with pytest.raises(StoreBusy, match="another thread"):
        with store.transaction(False, wait=False):
            pass
    holder.join()
    with writer.transaction(False, wait=False):  # free again: written, and waiting resumed
        writer.record_turn(session_id="later", **ROW)
    assert [s for _, s in _turns(tmp_path / "m.db")] == ["later"]
    assert writer.execute("PRAGMA busy_timeout").fetchone()[0] == 0  # it never waits
    store.close()


def test_turns_that_find_the_store_busy_go_to_the_writer_thread_in_order(tmp_path):
    store = SpyStore(tmp_path / "m.db")
    recorder = Recorder(store)
    other = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")

    async def scenario():
        first = recorder.submit({**ROW, "session_id": "a"}, False)
        started = time.monotonic()
        await asyncio.sleep(0.2)  # the loop runs on while another connection holds the lock
        loop_free = time.monotonic() - started < 1.0
        assert not first.done()
        second = recorder.submit({**ROW, "session_id": "b"}, False)
        await asyncio.sleep(0.05)
        other.execute("COMMIT")
        return loop_free, await first, await second

    try:
        loop_free, first, second = asyncio.run(scenario())
    finally:
        recorder.stop()
    assert loop_free and first < second
    assert _turns(tmp_path / "m.db") == [(first, "a"), (second, "b")]
    assert recorder._thread_commits >= 1
    store.close()


def test_a_slow_commit_sends_the_next_groups_to_the_writer_thread(tmp_path):
    store = SpyStore(tmp_path / "m.db", delay=Recorder.SLOW_COMMIT_S * 1.5)
    recorder = Recorder(store)

    async def scenario():
        ids = [await recorder.submit({**ROW, "session_id": f"s{i}"}, False) for i in range(3)]
        return ids, threading.current_thread().name

    try:
        ids, loop_thread = asyncio.run(scenario())
    finally:
        recorder.stop()
    threads = [thread for fsync, _, thread in store.seen if not fsync]  # the groups' own
    assert threads[0] == loop_thread and set(threads[1:3]) == {"metaclaw-record"}
    assert [i for i, _ in _turns(tmp_path / "m.db")] == ids == sorted(ids)
    store.close()


def test_a_row_the_store_refuses_on_the_loop_loses_nothing_of_its_group(tmp_path):
    store = Store(tmp_path / "m.db")
    recorder = Recorder(store)
    bad = {**ROW, "session_id": "bad", "response": "lone \ud800 surrogate"}

    async def scenario():
        futures = [recorder.submit({**ROW, "session_id": "ok1"}, False),
                   recorder.submit(bad, False),
                   recorder.submit({**ROW, "session_id": "ok2"}, True)]
        return await asyncio.gather(*futures)

    try:
        ids = asyncio.run(scenario())
    finally:
        recorder.stop()
    assert None not in ids
    assert [s for _, s in _turns(tmp_path / "m.db")] == ["ok1", "bad", "ok2"]
    assert store.turn(ids[1])["response"] == "lone \ufffd surrogate"
    assert store.session("ok2")["done"] == 1
    store.close()


def test_checkpoints_run_in_the_writer_thread_not_on_the_loop(tmp_path):
    store = SpyStore(tmp_path / "m.db")
    recorder = Recorder(store)
    recorder.CHECKPOINT_EVERY = 3

    async def scenario():
        for i in range(7):
            await recorder.submit({**ROW, "session_id": f"s{i}"}, False)

    try:
        asyncio.run(scenario())
        deadline = time.monotonic() + 5
        while not store.checkpoints and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        recorder.stop()
    assert recorder._loop_commits == 7
    # on the way (two requests the thread found queued together make one), and one at stop
    assert len(store.checkpoints) >= 2
    assert set(store.checkpoints) == {"metaclaw-record"}
    busy, log_pages, copied = sqlite3.connect(str(tmp_path / "m.db")).execute(
        "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and log_pages == copied  # nothing was left behind uncopied
    store.close()


def test_the_loop_writer_still_waits_and_fsyncs_when_asked_then_goes_back(tmp_path):
    store = Store(tmp_path / "m.db")
    writer = store.loop_writer()
    other = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None,
                            check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    started = time.monotonic()  # before the timer: this thread may be paused after starting it
    release.start()
    with writer.transaction(True, wait=True):  # waits for the lock, then commits with fsync
        assert writer.execute("PRAGMA synchronous").fetchone()[0] == 2
        writer.record_turn(session_id="waited", **ROW)
    assert time.monotonic() - started >= 0.25
    release.join()
    assert writer.execute("PRAGMA synchronous").fetchone()[0] == 1
    assert writer.execute("PRAGMA busy_timeout").fetchone()[0] == 0
    assert [s for _, s in _turns(tmp_path / "m.db")] == ["waited"]
    store.close()


def _submit_on_a_loop_that_stops(recorder: Recorder, session: str) -> None:
    """Submit a turn on a loop that ends before the round that would write its group."""
    loop = asyncio.new_event_loop()

    def submit_then_stop():
        recorder.submit({**ROW, "session_id": session}, False)
        loop.stop()

    loop.call_soon(submit_then_stop)
    loop.run_forever()
    loop.close()


def test_turns_submitted_on_a_loop_that_stopped_are_written_at_stop(tmp_path):
    store = Store(tmp_path / "m.db")
    recorder = Recorder(store)
    _submit_on_a_loop_that_stops(recorder, "late")
    assert recorder._loop_commits == 0 and not _turns(tmp_path / "m.db")
    recorder.stop()
    assert [s for _, s in _turns(tmp_path / "m.db")] == ["late"]
    store.close()


def test_a_closed_store_answers_the_turn_instead_of_leaving_it_waiting(tmp_path):
    store = Store(tmp_path / "m.db")
    recorder = Recorder(store)
    store.close()

    async def one():
        return await asyncio.wait_for(recorder.submit({**ROW, "session_id": "s"}, False), 5)

    try:
        assert asyncio.run(one()) is None  # not written, and said so: the proxy answers 500
    finally:
        recorder.stop()


def test_a_failed_loop_transaction_releases_the_probe_lock(tmp_path):
    store = Store(tmp_path / "m.db")
    recorder = Recorder(store)

    async def one(session):
        return await recorder.submit({**ROW, "session_id": session}, False)

    asyncio.run(one("a"))  # the loop writer exists now
    store.close()
    assert asyncio.run(one("b")) is None
    recorder.stop()
    outcome: list = []

    def generation():
        try:
            store.current_generation()
        except Exception as exc:  # the closed store says so rather than blocking
            outcome.append(type(exc).__name__)

    other = threading.Thread(target=generation, daemon=True)
    other.start()
    other.join(5)
    assert not other.is_alive() and outcome == ["ProgrammingError"]


def test_a_recorder_started_again_after_a_leftover_group_commits_on_the_loop(tmp_path):
    store = Store(tmp_path / "m.db")
    recorder = Recorder(store)
    _submit_on_a_loop_that_stops(recorder, "late")
    recorder.stop()  # writes the leftover group
    recorder.start()  # the same proxy started again

    async def one():
        return await recorder.submit({**ROW, "session_id": "next"}, False)

    try:
        assert asyncio.run(one()) is not None and recorder._loop_commits == 1
    finally:
        recorder.stop()
        store.close()


class _CommitFailsOnce:
    """A connection whose first COMMIT fails (a disk I/O error, a full disk)."""

    def __init__(self, db):
        self.db, self.failures = db, 1

    def __getattr__(self, name):
        return getattr(self.db, name)

    def execute(self, sql, *args):
        if sql == "COMMIT" and self.failures:
            self.failures -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, *args)


@pytest.mark.sqlite_only  # looks into SQLite's own connection
def test_a_failed_commit_on_the_loop_leaves_nothing_open_and_loses_nothing(tmp_path):
    store = Store(tmp_path / "m.db")
    store._db.execute("PRAGMA busy_timeout=2000")  # a writer thread blocked by a leak gives up
    recorder = Recorder(store)
    writer = store.loop_writer()
    writer._db = _CommitFailsOnce(writer._db)
    recorder._loop_store = writer

    async def one(session):
        return await asyncio.wait_for(recorder.submit({**ROW, "session_id": session}, False), 10)

    try:
        first = asyncio.run(one("first"))  # the loop's COMMIT fails: written by the thread
        second = asyncio.run(one("second"))
        assert first is not None and second is not None
        assert [s for _, s in _turns(tmp_path / "m.db")] == ["first", "second"]
        assert not store._probe.in_transaction
    finally:
        recorder.stop()
        store.close()


def test_without_waiting_a_connection_inside_a_transaction_is_busy(tmp_path):
    store = Store(tmp_path / "m.db")
    with store.transaction():
        with pytest.raises(StoreBusy, match="inside another transaction"):
            with store.transaction(False, wait=False):
                pass
        store.record_turn(session_id="kept", **ROW)  # the outer transaction is untouched
    assert [s for _, s in _turns(tmp_path / "m.db")] == ["kept"]
    store.close()


class UnreachableStore(Store):
    """A workspace whose database server went away: every write fails as unreachable."""

    def __init__(self, path):
        super().__init__(path)
        self.attempts = 0

    def record_turns(self, turns, **kwargs):
        from metaclaw.store import StoreUnavailable

        self.attempts += 1
        raise StoreUnavailable("PostgreSQL workspace postgresql://u:***@h/db: connection refused")


def _three_turns_refused(recorder):
    """Three turns submitted together, then the first one's acknowledgement: (results, error)."""
    from types import SimpleNamespace

    from metaclaw.protocols import ProxyError
    from metaclaw.proxy.pipeline import TurnPipeline

    pipeline = SimpleNamespace(config=SimpleNamespace(durable_acks=True),
                               parts=SimpleNamespace(stopping=False))

    async def three():
        futures = [recorder.submit(dict(ROW, session_id=f"s{i}"), False) for i in range(3)]
        results = await asyncio.gather(*futures)
        with pytest.raises(ProxyError) as err:
            await TurnPipeline.acknowledge(pipeline, futures[0])
        return results, err.value

    try:
        return asyncio.run(three())
    finally:
        recorder.stop()


def test_turns_an_unreachable_store_cannot_take_get_a_503_to_retry_not_a_500(tmp_path):
    from metaclaw.proxy.pipeline import UNREACHABLE

    store = UnreachableStore(tmp_path / "m.db")
    results, error = _three_turns_refused(Recorder(store))
    assert results == [UNREACHABLE] * 3
    assert store.attempts <= 2  # the group, not each turn again, once the store is unreachable
    assert error.status == 503 and error.code == "store_unavailable"
    assert error.headers == {"Retry-After": "5"}


def test_a_commit_the_store_never_confirms_withholds_the_reply_with_a_503(monkeypatch):
    from types import SimpleNamespace

    from metaclaw.protocols import ProxyError
    from metaclaw.proxy import pipeline as module

    monkeypatch.setattr(module, "ACK_TIMEOUT_S", 0.2)
    pipeline = SimpleNamespace(config=SimpleNamespace(durable_acks=True),
                               parts=SimpleNamespace(stopping=False))

    async def never_confirmed():
        started = time.monotonic()
        with pytest.raises(ProxyError) as err:
            await module.TurnPipeline.acknowledge(pipeline,
                                                  asyncio.get_running_loop().create_future())
        return time.monotonic() - started, err.value

    waited, error = asyncio.run(never_confirmed())
    assert 0.2 <= waited < 2 and error.status == 503 and error.code == "store_unavailable"
    assert "did not confirm" in error.message


class LockedStore(Store):
    """Another process holds the write lock past the busy timeout: every write says so."""

    def record_turns(self, turns, **kwargs):
        error = sqlite3.OperationalError("database is locked")
        error.sqlite_errorcode = sqlite3.SQLITE_BUSY  # as SQLite sets it
        raise error


def test_a_write_lock_that_stays_taken_answers_the_group_at_once_not_turn_by_turn(tmp_path):
    """Each turn was tried again alone, each waiting the busy timeout (30 s) once more."""
    from metaclaw.proxy.pipeline import BUSY

    results, err = _three_turns_refused(Recorder(LockedStore(tmp_path / "m.db"), fsync=True))
    assert results == [BUSY] * 3
    assert err.status == 503 and err.code == "store_busy" and err.headers == {"Retry-After": "5"}


def test_a_session_look_up_the_store_never_answers_is_a_503_not_a_hang(tmp_path, monkeypatch):
    """A conversation without a session id is told apart from alike-opening ones by reading
    the recorded sessions; on a database that stopped answering (frozen, still connected) that
    read hung the request for as long as the freeze."""
    import httpx

    from metaclaw.offline.double import DoubleServer
    from metaclaw.proxy import pipeline as module
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.proxy.sessions import ReplyThreads
    from metaclaw.skills.library import SkillLibrary

    monkeypatch.setattr(module, "ACK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(ReplyThreads, "reads_network", property(lambda self: True))
    resolve = ReplyThreads.resolve

    def frozen(self, fingerprint, messages):
        time.sleep(1.5)
        return resolve(self, fingerprint, messages)

    monkeypatch.setattr(ReplyThreads, "resolve", frozen)
    store = Store(tmp_path / "m.db")
    with DoubleServer() as upstream:
        proxy = Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical"), store,
                      SkillLibrary(tmp_path / "skills", store)).start()
        try:
            started = time.monotonic()
            answer = httpx.post(proxy.url + "/chat/completions", timeout=10, json={
                "model": "m", "messages": [{"role": "user", "content": "hello there"}]})
            assert time.monotonic() - started < 1.4
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "store_unavailable"
        finally:
            proxy.stop()
            store.close()
