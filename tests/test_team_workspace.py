"""A team's workspace on PostgreSQL, as several machines use it: two proxies with their own skills
folders and home directories on one database, skills changed from a third process, kill -9 of a
proxy under load (a throwaway cluster; skipped where PostgreSQL cannot start)."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from metaclaw import cli
from metaclaw.store import Store

pytest.importorskip("psycopg")

ASK = "Round the ledger totals for the quarterly reconciliation report."
SKILL = """---
name: ledger-rounding
description: Round ledger totals to whole cents with banker's rounding in reconciliation reports.
category: finance
---

# Ledger rounding
Round every ledger total in a reconciliation report to whole cents, half to even.
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(url: str, machine) -> tuple[subprocess.Popen, str]:
    """``metaclaw serve`` as a machine of the team runs it: its own skills folder and home."""
    (machine / "home").mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "HOME": str(machine / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "metaclaw", "serve", "--db", url, "--skills",
         str(machine / "skills"), "--retrieval", "lexical", "--port", str(port)],
        cwd=machine, env=env, stdout=subprocess.DEVNULL, stderr=open(machine / "serve.log", "w"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (machine / "serve.log").read_text()
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.1)


def ask(base: str, session: str, text: str = ASK) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=30, headers={"X-Session-Id": session},
                      json={"model": "m", "messages": [{"role": "user", "content": text}]})


@pytest.fixture()
def team(pg_cluster, tmp_path):
    url = pg_cluster.new_database("team")
    procs = []

    def start(name):
        proc, base = serve(url, tmp_path / name)
        procs.append(proc)
        return proc, base

    yield url, start
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_a_skill_added_on_a_third_machine_reaches_both_proxies(team, tmp_path):
    url, start = team
    _, a = start("machine-a")
    _, b = start("machine-b")
    before = {ask(base, f"before-{i}").headers["X-MetaClaw-Injected-Skills"]
              for i, base in enumerate((a, b))}
    assert not any("ledger-rounding" in h for h in before)
    source = tmp_path / "machine-c" / "new" / "ledger-rounding"
    source.mkdir(parents=True)
    (source / "SKILL.md").write_text(SKILL)
    assert cli.main(["skills", "import", "--from", str(source.parent), "--db", url,
                     "--skills", str(tmp_path / "machine-c" / "skills")]) == 0
    started = time.monotonic()
    # each machine serves it at once (the target is 1 s, measured on an idle machine in
    # tests/test_store_postgres.py; here the bound leaves room for a loaded test machine)
    for i, base in enumerate((a, b)):
        while "ledger-rounding" not in ask(base, f"after-{i}").headers[
                "X-MetaClaw-Injected-Skills"].split(","):
            assert time.monotonic() - started < 5.0, f"machine {'ab'[i]} still serves the old"
    with Store(url) as store:
        served = store.turns("session_id LIKE 'after-%' AND injected_skills LIKE "
                             "'%ledger-rounding%'")
        assert {r["skill_generation"] for r in served} == {store.latest_generation()}
    # a new machine with an empty folder serves the workspace's generation, files and all
    _, d = start("machine-d")
    assert (tmp_path / "machine-d" / "skills" / "ledger-rounding" / "SKILL.md").exists()
    assert "ledger-rounding" in ask(d, "new-machine").headers["X-MetaClaw-Injected-Skills"]


def test_a_hand_edit_on_one_machine_is_a_generation_every_machine_serves(team, tmp_path):
    url, start = team
    _, a = start("machine-a")
    _, b = start("machine-b")
    with Store(url) as store:
        first = store.latest_generation()
    folder = tmp_path / "machine-a" / "skills" / "ledger-rounding"
    folder.mkdir()
    (folder / "SKILL.md").write_text(SKILL)  # written by hand on machine a
    deadline = time.monotonic() + 20
    while "ledger-rounding" not in ask(b, "edit").headers["X-MetaClaw-Injected-Skills"]:
        assert time.monotonic() < deadline, "machine b never served the hand edit"
        time.sleep(0.2)
    with Store(url) as store:
        assert store.latest_generation() == first + 1
        assert store.generation(first + 1)["kind"] == "disk"


def test_kill_9_of_one_proxy_under_load_loses_no_acknowledged_turn(team):
    url, start = team
    victim, a = start("machine-a")
    _, b = start("machine-b")
    acknowledged: list[str] = []
    killed = threading.Event()
    kill_once = threading.Lock()

    def one(i: int) -> None:
        session = f"load-{i}"
        try:
            if ask(a if i % 2 else b, session, f"Summarise note {i}.").status_code == 200:
                acknowledged.append(session)
        except httpx.HTTPError:
            pass  # in flight at the kill
        # one thread kills, once: a second kill could reach a pid another thread's poll reaped
        with kill_once:
            if len(acknowledged) >= 30 and not killed.is_set():
                os.kill(victim.pid, signal.SIGKILL)
                killed.set()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(80)))
    assert victim.wait(10) == -signal.SIGKILL
    with Store(url) as store:
        recorded = {r["session_id"] for r in store.query("SELECT session_id FROM turns")}
    assert len(acknowledged) >= 30 and set(acknowledged) <= recorded
    assert ask(b, "after-the-kill").status_code == 200  # the other machine serves on


def test_db_migrate_and_copy_through_the_cli(pg_cluster, tmp_path, capsys):
    personal = tmp_path / "personal.db"
    with Store(personal) as store:
        for i in range(5):
            store.record_turn(session_id=f"s{i % 2}", request_messages=[{"role": "user",
                              "content": f"hi {i}"}], status="ok", reward=0.5 * i)
        store.add_generation(snapshot={}, kind="init")
        store.record_event(source="test", kind="note", message="moved")
    team_url = pg_cluster.new_database("team")
    capsys.readouterr()
    assert cli.main(["db", "migrate", "--db", team_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["created"] is True  # an empty database given
    assert cli.main(["db", "migrate", "--db", team_url]) == 0  # idempotent
    assert "up to date" in capsys.readouterr().out
    assert cli.main(["db", "copy", "--from", f"sqlite:///{personal}", "--to", team_url]) == 0
    out = capsys.readouterr().out
    assert "row count and checksum match" in out and "turns" in out
    with Store(team_url) as team:
        assert team.counts()["turns"] == 5 and team.latest_generation() == 0
        new = team.record_turn(session_id="s9", request_messages=[], status="ok")
        assert new == 6  # numbering goes on past the copied keys
    # a destination with records is refused, and nothing is written to it
    assert cli.main(["db", "copy", "--from", str(personal), "--to", team_url]) == 1
    assert "already holds records" in capsys.readouterr().err
    # a URL scheme the store does not serve is one sentence, and creates no folder
    assert cli.main(["turns", "--db", "mysql://u@h/db"]) == 1
    err = capsys.readouterr().err
    assert "cannot open mysql:// URLs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "mysql:").exists()


def test_a_database_restart_under_load_is_a_clear_error_then_serving_resumes(team, pg_cluster):
    url, start = team
    _, a = start("machine-a")
    assert ask(a, "before").status_code == 200
    pg_cluster.stop()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            started = time.monotonic()
            chats = [pool.submit(ask, a, f"during-{i}") for i in range(6)]
            messages = httpx.post(a + "/v1/messages", timeout=30, json={
                "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
            for _ in range(3):  # the event loop never waits for the database meanwhile
                for path in ("/healthz", "/v1/models"):
                    asked = time.monotonic()
                    assert httpx.get(a + path, timeout=30).status_code == 200
                    assert time.monotonic() - asked < 1.0, path
            chats = [c.result() for c in chats]
        assert time.monotonic() - started < 15  # no hang
        for chat in chats:
            assert chat.status_code == 503 and chat.json()["error"]["code"] == "store_unavailable"
            assert chat.headers["Retry-After"] == "5"
        assert messages.status_code == 503 and messages.json()["type"] == "error"
        assert "unreachable" in messages.json()["error"]["message"]
        # no session header: the conversation is looked up in the workspace; once a look-up has
        # found the server unreachable, the next requests get their 503 at once instead of each
        # waiting for a connection (6-12 s each)
        anonymous = []
        for i in range(3):
            asked = time.monotonic()
            reply = httpx.post(a + "/v1/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": f"anonymous {i}"}]})
            anonymous.append((reply.status_code, time.monotonic() - asked))
        assert {status for status, _ in anonymous} == {503}
        assert all(took < 2.0 for _, took in anonymous[1:]), anonymous
        assert httpx.get(a + "/healthz", timeout=30).json()["store"] == "unreachable"
    finally:
        pg_cluster.start()
    deadline = time.monotonic() + 30
    while ask(a, "after").status_code != 200:  # reconnects by itself
        assert time.monotonic() < deadline, "serving did not resume"
        time.sleep(0.5)
    assert httpx.get(a + "/healthz", timeout=30).json()["store"] == "ok"
    with Store(url) as store:
        sessions = {r["session_id"] for r in store.query("SELECT session_id FROM turns")}
    assert {"before", "after"} <= sessions


def test_a_copy_keeps_the_folders_marks_so_a_lagging_folder_is_brought_up(pg_cluster, tmp_path,
                                                                           capsys):
    """Moving a personal workspace to the team's database: a folder that lagged behind the
    other folder's change when the copy was made is brought up on the copy. Without its mark
    there, its stale file was recorded back into the copy, undoing the change."""
    from metaclaw.skills.library import Skill, SkillLibrary

    personal = tmp_path / "personal.db"
    here = SkillLibrary(tmp_path / "here", Store(personal))
    here.add(Skill(name="steps", description="Steps.", body="v1"))
    SkillLibrary(tmp_path / "there", Store(personal)).edit(
        Skill(name="steps", description="Steps.", body="v2"))  # "here" lags at v1
    team_url = pg_cluster.new_database("team")
    assert cli.main(["db", "copy", "--from", str(personal), "--to", team_url]) == 0
    assert "the marks of 2 skill folder(s)" in capsys.readouterr().out
    opened = SkillLibrary(tmp_path / "here", Store(team_url))
    assert opened.get("steps").body == "v2"
    assert "v2" in (tmp_path / "here" / "steps" / "SKILL.md").read_text()
    assert [g["kind"] for g in opened.generations()][-1] != "disk"
