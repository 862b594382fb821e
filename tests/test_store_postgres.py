"""The PostgreSQL engine: what only a server database has (targets, connection errors, locks
held across machines, restarts), on a throwaway cluster. The shared behaviour is tested by
running the other suites with ``--store-engine postgresql``."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from metaclaw.store import SCHEMA_VERSION, Store, StoreError, parse_target
from metaclaw.training_lease import TrainingLease

pytest.importorskip("psycopg")


@pytest.fixture()
def url(pg_cluster):
    return pg_cluster.new_database()


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_targets_pick_the_engine_and_unknown_schemes_are_one_sentence(tmp_path):
    assert parse_target(tmp_path / "w.db") == ("sqlite", str(tmp_path / "w.db"))
    assert parse_target(f"sqlite:///{tmp_path}/w.db") == ("sqlite", f"{tmp_path}/w.db")
    assert parse_target("postgresql://u@h/db")[0] == "postgresql"
    assert parse_target("postgres://u@h/db")[0] == "postgresql"
    # the scheme as libpq reads it (another spelling it takes for settings, and echoes)
    assert parse_target("PostgreSQL://u:pw@h/db") == ("postgresql", "postgresql://u:pw@h/db")
    assert parse_target("POSTGRESQL+psycopg://u@h/db") == ("postgresql", "postgresql://u@h/db")
    for bad in ("mysql://u@h/db", "http://example.com/x.db", "sqlite://relative.db"):
        with pytest.raises(StoreError) as err:
            Store(bad)
        assert "\n" not in str(err.value) and not (tmp_path / "mysql:").exists()
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir())


def test_a_server_workspace_keeps_its_machine_files_in_one_folder_whatever_the_working_folder(
        tmp_path, monkeypatch):
    from metaclaw.store.base import local_dir

    monkeypatch.setenv("METACLAW_DATA_DIR", str(tmp_path / "data"))
    url = "postgresql://bob:s3cret-pw@db.example:5433/team"
    monkeypatch.chdir(tmp_path)
    here = local_dir(url)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert local_dir(url) == here and here.parent == tmp_path / "data" / "workspaces"
    assert here.name.startswith("team-") and "s3cret" not in str(here)
    assert local_dir("postgresql://bob:other-pw@db.example:5433/team") == here  # not the password
    assert local_dir("postgresql://bob@db.example:5433/team2") != here
    assert local_dir("postgresql://alice@db.example:5433/team") != here
    assert local_dir("postgresql:///team?user=alice") != local_dir("postgresql:///team?user=bob")
    assert local_dir("postgresql://bob@h1:5432,h2:5433/team").name.startswith("team-")  # libpq's
    assert local_dir("postgresql:///x?dbname=other").name.startswith("other-")
    assert local_dir(tmp_path / "w.db") == tmp_path  # a SQLite workspace: beside its file


def test_a_libpq_key_value_string_is_refused_never_echoed_nor_made_a_file(tmp_path, monkeypatch,
                                                                          capsys):
    from metaclaw import cli

    monkeypatch.chdir(tmp_path)
    conninfo = "host=127.0.0.1 port=5432 user=bob password=s3cret-pw dbname=team"
    with pytest.raises(StoreError, match="named by a URL") as err:
        Store(conninfo)
    assert "s3cret-pw" not in str(err.value)
    assert cli.main(["turns", "--db", conninfo]) == 1
    assert cli.main(["turns", "--db", " USER=bob"]) == 1
    assert cli.main(["turns", "--db", "PostgreSQL://bob:s3cret-pw@127.0.0.1:1/team"]) == 1
    assert "s3cret-pw" not in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert parse_target("hosts.db") == ("sqlite", "hosts.db")  # a file name is still one


def test_turn_listings_and_imports_name_the_workspace_with_its_password_masked(
        pg_cluster, url, tmp_path, capsys):
    import json

    from metaclaw import cli

    import psycopg

    with psycopg.connect(pg_cluster.url(), autocommit=True) as conn:
        conn.execute("ALTER ROLE metaclaw PASSWORD 's3cret-pw'")
    secret = url.replace("metaclaw@", "metaclaw:s3cret-pw@")
    assert cli.main(["turns", "--db", secret, "--session", "nope"]) == 0
    said = capsys.readouterr()
    assert "no turns of session 'nope'" in said.err and "metaclaw:***@" in said.err
    transcript = tmp_path / "t.jsonl"
    transcript.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "hello"}]})
                          + "\n")
    assert cli.main(["turns", "import", str(transcript), "--db", secret]) == 0
    assert cli.main(["turns", "import", str(transcript), "--db", secret, "--json"]) == 0
    said = capsys.readouterr()
    assert "s3cret-pw" not in said.out + said.err and "metaclaw:***@" in said.out


def test_an_unreachable_database_fails_fast_with_the_password_masked(tmp_path):
    started = time.monotonic()
    target = f"postgresql://bob:s3cret-pw@/nowhere?host={tmp_path}&port=5999"
    with pytest.raises(StoreError) as err:
        Store(target)
    assert time.monotonic() - started < 8
    message = str(err.value)
    assert "s3cret-pw" not in message and "bob:***@" in message
    assert "cannot connect to the PostgreSQL workspace" in message


def test_an_unauthorised_user_is_a_clear_error(pg_cluster, url):
    import psycopg

    with psycopg.connect(pg_cluster.url(), autocommit=True) as conn:
        conn.execute("CREATE ROLE stranger LOGIN")
    Store(url).close()  # the schema exists
    stranger = url.replace("metaclaw@", "stranger:pw@")
    with pytest.raises(Exception) as err:
        with Store(stranger) as store:
            store.turns()
    assert "pw@" not in str(err.value) and "permission denied" in str(err.value)


def test_schema_migrates_once_and_a_newer_schema_is_refused(url):
    with Store(url) as store:
        assert store.engine == "postgresql" and store.schema_version == SCHEMA_VERSION
        store.record_turn(session_id="s", request_messages=[{"role": "user", "content": "hi"}],
                          status="ok")
    with Store(url) as store:  # opening again migrates nothing and keeps the rows
        assert store.counts()["turns"] == 1
        store.execute("UPDATE metaclaw_schema SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match="newer than this MetaClaw"):
        Store(url)


def test_a_schema_of_another_build_is_refused_in_a_sentence_and_left_as_it_was(url):
    with Store(url) as store:
        store.record_turn(session_id="s", request_messages=[{"role": "user", "content": "hi"}],
                          status="ok")
        store.execute("UPDATE metaclaw_schema SET version = 11")
    with pytest.raises(StoreError) as err:
        Store(url)
    message = str(err.value)
    assert "cannot be upgraded from schema version 11 to 12" in message
    assert "development build" in message and "\n" not in message
    import psycopg

    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM metaclaw_schema").fetchone()[0] == 11
        assert conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 1


def test_only_pooled_connections_commit_without_waiting_for_the_flush(url):
    """Pooled connections read and claim session ids; every other commit (turns, migrations)
    returns once the server flushed it."""
    store = Store(url)
    with store._lock:
        setting = store._conn().execute("SHOW synchronous_commit").fetchone()
    assert setting["synchronous_commit"] == "on"
    with store._pooled() as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone()["synchronous_commit"] == "off"
    store.close()


def test_concurrent_writers_on_several_processes_keep_one_linear_history(url):
    code = """
        import sys
        from metaclaw.store import Store
        with Store(sys.argv[1]) as store:
            for i in range(15):
                store.add_generation(snapshot={"k": i}, kind="edit", reason=sys.argv[2])
                store.record_turn(session_id="shared", request_messages=[], status="ok")
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), url, str(n)])
             for n in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    with Store(url) as store:
        generations = [r["generation"] for r in store.query(
            "SELECT generation FROM skill_generations ORDER BY generation")]
        assert generations == list(range(60))
        indexes = [r["turn_index"] for r in store.turns("session_id = 'shared'")]
        assert sorted(indexes) == list(range(60))


def _wait_for(predicate, timeout: float = 5.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout
        time.sleep(0.005)
    return time.monotonic() - started


def test_a_generation_committed_by_one_process_is_current_for_another_within_a_second(url):
    with Store(url) as reader:
        assert reader.current_generation() is None
        other = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from metaclaw.store import Store
            with Store(sys.argv[1]) as store:
                store.add_generation(snapshot={}, kind="init")
                print(time.time(), flush=True)
                sys.stdin.read()  # held open until the reader has seen it
        """), url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            committed = float(other.stdout.readline())
            _wait_for(lambda: reader.current_generation() == 0, timeout=5.0)
            assert time.time() - committed < 1.0  # the target
        finally:
            other.stdin.close()
            assert other.wait(60) == 0


def test_the_generation_is_announced_not_polled_and_survives_a_lost_listener(url, monkeypatch):
    """Each request's generation check reads no table while the listener is up (a trigger
    NOTIFYs every new generation); with its connection gone, every call reads the table, and the
    listener comes back by itself."""
    import psycopg

    with Store(url) as reader, Store(url) as writer:
        reader.current_generation()
        listener = reader._listener
        _wait_for(lambda: listener.latest is None)
        reads = []
        real = type(reader).latest_generation
        monkeypatch.setattr(type(reader), "latest_generation",
                            lambda self: reads.append(self) or real(self))
        writer.add_generation(snapshot={}, kind="init")
        assert _wait_for(lambda: reader.current_generation() == 0) < 1.0
        assert [r for r in reads if r is reader] == []  # told, not asked
        backend = listener._conn.info.backend_pid
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        writer.add_generation(snapshot={}, kind="evolve")
        assert _wait_for(lambda: reader.current_generation() == 1) < 1.0  # read, or told
        _wait_for(lambda: listener._conn.info.backend_pid != backend
                  and listener.latest == 1)  # a new connection, listening again
        writer.add_generation(snapshot={}, kind="evolve")
        reads.clear()
        _wait_for(lambda: reader.current_generation() == 2, timeout=1.0)
        assert [r for r in reads if r is reader] == []


def test_acknowledged_turns_survive_kill_9_of_the_writer(url):
    code = """
        import sys
        from metaclaw.store import Store
        store = Store(sys.argv[1])
        for i in range(100000):
            with store.transaction(fsync=False):
                store.record_turn(session_id="k", request_messages=[], status="ok",
                                  response=str(i))
            print(i, flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), url],
                            stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 200:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    with Store(url) as store:
        responses = {int(r["response"]) for r in store.turns("session_id = 'k'")}
    assert set(range(acknowledged + 1)) <= responses


def test_the_training_lease_is_one_holder_across_processes_and_freed_by_kill_9(url):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from metaclaw.store import Store
        from metaclaw.training_lease import TrainingLease
        lease = TrainingLease.for_store(Store(sys.argv[1]))
        assert lease.acquire("idle-window training")
        print("held", flush=True)
        time.sleep(600)
    """), url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with Store(url) as store:
            lease = TrainingLease.for_store(store)
            assert not lease.acquire()
            assert f"pid {holder.pid}" in lease.holder()
            assert "idle-window training" in (lease.training_elsewhere() or "")
            evolve = TrainingLease.for_store(store, "evolve")  # another lease: free
            assert evolve.acquire() and evolve.held
            evolve.release()
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(30)
            deadline = time.monotonic() + 10
            while not lease.acquire():  # the server notices the dead connection
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert lease.training_elsewhere() is None
            lease.release()
    finally:
        holder.kill()


def test_text_with_nul_is_stored_exactly(url):
    with Store(url) as store:
        turn = store.record_turn(session_id="n", request_messages=[{"role": "user",
                                                                     "content": "a\x00b"}],
                                 status="ok", response="x\x00y")
        row = store.turn(turn)
        assert row["response"] == "x\x00y"  # escaped in the column, read back exactly
        assert row["request_messages"][0]["content"] == "a\x00b"  # JSON escapes it
        tricky = "\ufdd0\x00\ufdd00\ufdd0"
        store.update_turn(turn, response=tricky)
        assert store.turn(turn)["response"] == tricky
        assert store.turns("response = ?", (tricky,))[0]["id"] == turn


def test_the_store_comes_back_after_the_server_restarts(pg_cluster, url):
    with Store(url) as store:
        store.record_turn(session_id="r", request_messages=[], status="ok")
        pg_cluster.stop()
        try:
            started = time.monotonic()
            with pytest.raises(Exception) as err:
                store.record_turn(session_id="r", request_messages=[], status="ok")
            assert time.monotonic() - started < 40
            assert "PostgreSQL" in str(err.value)
        finally:
            pg_cluster.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                store.record_turn(session_id="r", request_messages=[], status="ok")
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert len(store.turns("session_id = 'r'")) == 2
        assert store.current_generation() is None


def test_calls_go_through_once_the_listener_is_back_not_after_a_fixed_hold(
        pg_cluster, url, monkeypatch):
    """After the server could not be reached, calls fail at once for a while instead of each
    waiting for the connect timeout; proxies kept answering 503 for up to 5 s after the server
    was back. The store's generation listener, which retries every half second, ends it."""
    from metaclaw.store import StoreUnavailable, postgres

    monkeypatch.setattr(postgres, "UNREACHABLE_HOLD_S", 120.0)
    with Store(url) as store:
        store.current_generation()  # its listener runs
        pg_cluster.stop()
        try:
            with pytest.raises(StoreUnavailable):
                store.record_turn(session_id="h", request_messages=[], status="ok")
            assert store.unreachable()
        finally:
            pg_cluster.start()
        started = time.monotonic()
        while store.unreachable():
            assert time.monotonic() - started < 15, "still held after the server came back"
            time.sleep(0.1)
        store.record_turn(session_id="h", request_messages=[], status="ok")


def test_the_first_write_and_read_after_a_restart_need_no_retry(pg_cluster, url, monkeypatch):
    """A restart closes every idle connection, and none knows it until used: the first turn
    after one got a 503 though the server was back, and reads failed where the pool held more
    dead connections than the one retry."""
    import contextlib

    from metaclaw.store import postgres

    monkeypatch.setattr(postgres, "IDLE_CHECK_S", 0.0)
    with Store(url) as store:
        store.record_turn(session_id="f", request_messages=[], status="ok")
        with contextlib.ExitStack() as stack:  # three pooled connections, idle again after
            for _ in range(3):
                stack.enter_context(store._pool.connection())
        pg_cluster.stop()
        pg_cluster.start()
        store.record_turn(session_id="f", request_messages=[], status="ok")
        assert len(store.turns("session_id = 'f'")) == 2
        with store.transaction():
            store.execute("UPDATE sessions SET updated_at = updated_at WHERE id = 'f'")


def test_a_url_without_a_host_part_opens_the_socket_named_in_its_query(pg_cluster, url):
    name = url.split("/")[3].split("?")[0]
    bare = f"postgresql:///{name}?host={pg_cluster.socket_dir}&user=metaclaw"
    with Store(bare) as store:
        assert store.location == bare and store.counts()["turns"] == 0


def test_urls_are_shown_with_their_passwords_masked_and_nothing_else_lost():
    from metaclaw.redact import masked_url

    assert masked_url("postgresql://bob:pw@h:5432/db") == "postgresql://bob:***@h:5432/db"
    assert masked_url("postgresql://bob@/db?host=/tmp/s") == "postgresql://bob@/db?host=/tmp/s"
    assert masked_url("postgresql:///db?password=zz&sslmode=require") == \
        "postgresql:///db?password=***&sslmode=require"


def test_metaclaw_db_is_the_workspace_when_none_is_given(url, monkeypatch, capsys):
    from metaclaw import cli

    monkeypatch.setenv("METACLAW_DB", url)
    with Store() as store:
        assert store.engine == "postgresql"
        store.record_turn(session_id="from-env", request_messages=[], status="ok")
    assert cli.main(["turns", "--json"]) == 0
    assert "from-env" in capsys.readouterr().out


def test_a_store_dropped_without_close_stops_its_listener(url):
    import gc

    store = Store(url)
    store.current_generation()
    thread = store._listener._thread
    del store
    deadline = time.monotonic() + 10
    while thread.is_alive():  # once collected (the read pool's tasks may hold it a moment)
        assert time.monotonic() < deadline, "the listener outlived its store"
        gc.collect()
        thread.join(timeout=0.2)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_turn_waiting_for_the_write_lock_sees_the_generation_committed_meanwhile(url, isolation):
    """Whatever the database's default isolation, a live turn whose write waited behind an
    evolution that committed a newer generation is recorded purged (its write checks the
    generation after the lock is granted)."""
    import threading

    import psycopg

    from metaclaw.store.postgres import WRITE_LOCK

    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {admin.info.dbname} "
                      f"SET default_transaction_isolation = '{isolation}'")
    with Store(url) as store, psycopg.connect(url, autocommit=True) as evolver:
        store.add_generation(snapshot={}, kind="initial")
        evolver.execute("BEGIN")
        evolver.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
        evolver.execute("INSERT INTO skill_generations (generation, created_at, kind, reason, "
                        "snapshot) VALUES (1, 0, 'evolve', '', '{}')")
        turn = {"session_id": "a", "request_messages": [], "status": "ok",
                "buffer_set": "query", "buffer_state": "live", "skill_generation": 0}
        done = {}
        writer = threading.Thread(target=lambda: done.update(ids=store.record_turns(
            [(turn, False)], stale={"live": "purged"})))
        writer.start()
        time.sleep(0.5)  # the write waits for the lock
        evolver.execute("COMMIT")
        writer.join(30)
        with store.transaction():  # _begin's cached number is read after the lock, too
            assert store.latest_generation() == 1
        assert store.turn(done["ids"][0])["buffer_state"] == "purged"


def test_first_generation_checks_from_many_threads_share_one_listener(url):
    import threading

    with Store(url) as store:
        store.add_generation(snapshot={}, kind="initial")
        start, seen, errors = threading.Barrier(8), [], []

        def check():
            start.wait()
            try:
                seen.append(store.current_generation())
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=check) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == [] and seen == [0] * 8
        listeners = [t for t in threading.enumerate() if t.name == "metaclaw-generation-listener"
                     and t is store._listener._thread]
        assert len(listeners) == 1


def test_the_proxy_records_on_postgresql_from_its_thread_with_the_servers_flush(url):
    import asyncio

    from metaclaw.proxy.pipeline import Recorder

    seen = []

    from metaclaw.store.postgres import PostgresStore

    class Spy(PostgresStore):
        def record_turns(self, turns, *, fsync=True, wait=True, stale=None):
            seen.append((fsync, __import__("threading").current_thread().name))
            return super().record_turns(turns, fsync=fsync, wait=wait, stale=stale)

    store = Spy(url)
    recorder = Recorder(store)  # no fsync asked: a server database flushes all the same

    async def one():
        return await recorder.submit({"session_id": "s", "status": "ok",
                                      "request_messages": []}, False)

    try:
        assert isinstance(asyncio.run(one()), int)
    finally:
        recorder.stop()
        store.close()
    assert seen and all(fsync and name == "metaclaw-record" for fsync, name in seen)


def test_the_generation_a_proxy_serves_needs_no_database_once_known(pg_cluster, url):
    with Store(url) as store:
        store.add_generation(snapshot={}, kind="init", reason="", parent=None, events=[])
        deadline = time.monotonic() + 10
        while store._listener is None or store._listener.latest != 0:
            store.current_generation()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pg_cluster.stop()
        try:
            started = time.monotonic()
            for _ in range(20):
                assert store.current_generation() == 0  # the last known: no wait
            assert time.monotonic() - started < 0.5
        finally:
            pg_cluster.start()


def test_a_folder_lagging_behind_is_known_by_its_workspace_not_by_the_url_spelling(
        url, tmp_path, monkeypatch):
    """The folder marks were named after the URL: the same database reached with the password
    moved to ~/.pgpass, or another option, found none, and the lagging folder's old files were
    recorded as changes, undoing the other machine's."""
    from metaclaw.skills.library import Skill, SkillLibrary

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    skill = Skill(name="steps", description="Steps.", body="Back it up.")
    mine = SkillLibrary(tmp_path / "mine", Store(url))
    mine.add(skill)
    theirs = SkillLibrary(tmp_path / "theirs", Store(url + "&application_name=elsewhere"))
    edited = theirs.edit(Skill(name="steps", description="Steps.", body="Back it up first."))
    reopened = SkillLibrary(tmp_path / "mine", Store(url + "&connect_timeout=3"))
    assert reopened.generation == edited
    assert reopened.get("steps").body == "Back it up first."
    assert "Back it up first." in (tmp_path / "mine" / "steps" / "SKILL.md").read_text()
    assert [g["kind"] for g in reopened.generations()][-1] != "disk"


def test_a_lagging_folder_is_known_to_every_user_of_the_machine(url, tmp_path, monkeypatch):
    """The folder marks were kept in each user's state folder: the proxy's service user marked
    its folder, a person (another HOME) opening the same folder after another machine changed a
    skill found no mark, and the folder's old files were recorded as changes back, undoing the
    other machine's. The workspace keeps the marks now, per machine and folder."""
    from metaclaw.skills.library import Skill, SkillLibrary

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "service-user"))
    served = SkillLibrary(tmp_path / "served", Store(url))
    served.add(Skill(name="steps", description="Steps.", body="Back it up."))
    monkeypatch.setenv("METACLAW_MACHINE", "another-machine")
    edited = SkillLibrary(tmp_path / "elsewhere", Store(url)).edit(
        Skill(name="steps", description="Steps.", body="Back it up first."))
    monkeypatch.setenv("METACLAW_MACHINE", "")  # back on this machine, as another user
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "person"))
    opened = SkillLibrary(tmp_path / "served", Store(url))
    assert opened.generation == edited and opened.get("steps").body == "Back it up first."
    assert "Back it up first." in (tmp_path / "served" / "steps" / "SKILL.md").read_text()
    assert [g["kind"] for g in opened.generations()][-1] != "disk"


def test_a_folder_marked_before_the_workspace_kept_marks_is_marked_there_when_opened(
        url, tmp_path, monkeypatch):
    """A proxy upgraded from when marks were kept in its user's state folder: opening its folder
    (nothing changed) writes the mark into the workspace, where another user finds it. It was
    written only on the next change, so a person opening the folder meanwhile, after another
    machine's edit, recorded the stale files back."""
    import json

    from metaclaw.skills.library import (FOLDER_MARKS, Skill, SkillLibrary, _skills_digest,
                                         this_machine)

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "service-user"))
    served = SkillLibrary(tmp_path / "served", Store(url))
    served.add(Skill(name="steps", description="Steps.", body="Back it up."))
    store = Store(url)
    store.execute("DELETE FROM skill_folders")  # as before the upgrade: in a file of the user's
    marks = tmp_path / "service-user" / "metaclaw"
    marks.mkdir(parents=True)
    key = __import__("metaclaw.skills.library", fromlist=["_workspace_key"])._workspace_key(store)
    (marks / f"workspace-{key}{FOLDER_MARKS}").write_text(json.dumps({
        str((tmp_path / "served").resolve()): {"generation": served.generation,
                                               "snapshot": _skills_digest(served.snapshot(
                                                   served.generation))}}))
    SkillLibrary(tmp_path / "served", Store(url))  # the upgraded proxy opens its folder
    assert str((tmp_path / "served").resolve()) in store.folder_marks(this_machine())
    monkeypatch.setenv("METACLAW_MACHINE", "another-machine")
    edited = SkillLibrary(tmp_path / "elsewhere", Store(url)).edit(
        Skill(name="steps", description="Steps.", body="Back it up first."))
    monkeypatch.delenv("METACLAW_MACHINE")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "person"))
    opened = SkillLibrary(tmp_path / "served", Store(url))
    assert opened.generation == edited and opened.get("steps").body == "Back it up first."


def test_another_users_own_folder_is_not_offered(url, tmp_path, monkeypatch, capsys):
    """Marks are kept per machine, but a user's own folder of the workspace (in their state
    folder) is theirs: another user's command does not read or write it."""
    from metaclaw import cli
    from metaclaw.skills.library import Skill, SkillLibrary, own_folder, workspace_folders

    monkeypatch.setenv("METACLAW_MACHINE", "the-serving-machine")
    SkillLibrary(tmp_path / "served", Store(url)).add(
        Skill(name="steps", description="Steps.", body="Back it up."))
    monkeypatch.setenv("METACLAW_MACHINE", "this-machine")
    monkeypatch.chdir(tmp_path)
    for user in ("alice", "bob"):
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / user))
        assert cli.main(["skills", "--db", url]) == 0
        capsys.readouterr()
        assert workspace_folders(Store(url)) == [own_folder(Store(url))]
        assert str(tmp_path / user) in str(own_folder(Store(url)))


def test_skill_commands_on_a_machine_serving_no_folder_keep_one_of_their_own(
        url, tmp_path, monkeypatch, capsys):
    """On a machine that only has the workspace's URL, `metaclaw skills` wrote a new
    .metaclaw/skills wherever it was run; now this user's folder of the workspace is used,
    said once, and found again from any directory."""
    from metaclaw import cli
    from metaclaw.skills.library import Skill, SkillLibrary

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("METACLAW_MACHINE", "the-serving-machine")
    SkillLibrary(tmp_path / "served", Store(url)).add(
        Skill(name="steps", description="Steps.", body="Back it up."))
    monkeypatch.setenv("METACLAW_MACHINE", "this-machine")
    for here in ("a", "b"):
        (tmp_path / here).mkdir()
        monkeypatch.chdir(tmp_path / here)
        assert cli.main(["skills", "--db", url]) == 0
        out, err = capsys.readouterr()
        assert "steps" in out and not (tmp_path / here / ".metaclaw").exists()
        assert ("no folder of this workspace on this machine" in err) == (here == "a")
    folder, = (tmp_path / "state" / "metaclaw").glob("workspace-*-skills")
    assert (folder / "steps" / "SKILL.md").is_file()


def test_skill_commands_on_a_new_server_workspace_keep_no_folder_where_they_run(
        url, tmp_path, monkeypatch, capsys):
    """A workspace with no generation yet had no key to name this user's folder of it by, so
    `metaclaw skills` made .metaclaw/skills wherever it was run."""
    from metaclaw import cli

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["skills", "--db", url]) == 0
    assert not (tmp_path / ".metaclaw").exists()
    assert list((tmp_path / "state" / "metaclaw").glob("workspace-*-skills"))
    assert Store(url).latest_generation() == 0


def test_a_busy_pool_is_no_outage(url, monkeypatch):
    """No pooled connection within the pool's timeout while the server answers (every
    connection busy: slow queries, a lock wait) is no outage: the reads after it are not failed
    at once as if the server were down (and /healthz does not say so)."""
    import psycopg_pool

    from metaclaw.store import StoreUnavailable

    store = Store(url)
    real = store._pool.connection
    calls = []

    def busy(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:  # a read tries twice
            raise psycopg_pool.PoolTimeout("couldn't get a connection after 6.00 sec")
        return real(*args, **kwargs)

    monkeypatch.setattr(store._pool, "connection", busy)
    with pytest.raises(StoreUnavailable):
        store.query("SELECT 1 AS x")
    assert not store.unreachable()
    assert store.query("SELECT 1 AS x") == [{"x": 1}]
    store.close()
