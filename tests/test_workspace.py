"""One workspace, many processes: every process sees the generation any other one committed,
hand edits become generations, and concurrent writers keep one linear history."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import openai
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.skills.library import Skill, SkillConflict, SkillLibrary, SkillOp
from metaclaw.store import Store
from test_cli import CLI, free_port, run_cli, wait_for_port, write_skill
from waiting import wait_until


def _in_another_process(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


ADD_ONE = """
    import sys
    from metaclaw.skills.library import Skill, SkillLibrary
    from metaclaw.store import Store
    library = SkillLibrary(sys.argv[1], Store(sys.argv[2]))
    print(library.add(Skill(name=sys.argv[3], description="Added by another process.",
                            category="ops", body="Body.")))
"""


def test_a_generation_committed_by_another_process_is_seen_on_the_next_read(tmp_path):
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "first", "The first skill.", "Body.")
    library = SkillLibrary(skills, Store(db))
    assert library.current()[0] == 0
    seen = []
    library.subscribe(seen.append)

    generation = int(_finish(_in_another_process(ADD_ONE, skills, db, "second")))

    assert generation == 1
    current, names = library.current()
    assert current == 1 and [s.name for s in names] == ["first", "second"]
    assert seen == [1]  # subscribers (buffer purge, fast loop) hear about the adoption


def test_two_processes_changing_the_library_at_once_keep_one_linear_history(tmp_path):
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "common", "Shared by both writers.", "Start.")
    SkillLibrary(skills, Store(db))
    writer = """
        import sys
        from metaclaw.skills.library import Skill, SkillConflict, SkillLibrary
        from metaclaw.store import Store
        library = SkillLibrary(sys.argv[1], Store(sys.argv[2]))
        tag = sys.argv[3]
        for i in range(12):
            library.add(Skill(name=f"{tag}-{i}", description="d", category="c", body="b"))
            while True:  # read, modify, write: a change made meanwhile elsewhere is a conflict
                common = library.get("common")
                try:
                    library.edit(Skill(name="common", description=common.description,
                                       category="c", body=common.body + f"\\n{tag}{i}"),
                                 base=common.content_hash)
                    break
                except SkillConflict:
                    pass
    """
    procs = [_in_another_process(writer, skills, db, tag) for tag in ("a", "b")]
    for proc in procs:
        _finish(proc)

    store = Store(db)
    rows = store.query("SELECT generation, parent FROM skill_generations ORDER BY generation")
    assert [r["generation"] for r in rows] == list(range(49))
    assert all(r["parent"] == r["generation"] - 1 for r in rows[1:])  # no fork
    library = SkillLibrary(skills, store)
    assert library.generation == 48  # the folder matches the latest generation: no disk change
    names = {s.name for s in library.skills()}
    assert {f"{t}-{i}" for t in "ab" for i in range(12)} <= names
    common = library.get("common").body.splitlines()
    assert sorted(common[1:]) == sorted(f"{t}{i}" for t in "ab" for i in range(12))  # no edit lost




def test_hand_edits_become_generations_and_broken_files_are_reported(tmp_path):
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "first", "The first skill.", "Body.")
    store = Store(db)
    library = SkillLibrary(skills, store).watch()
    try:
        write_skill(skills, "by-hand", "Written in an editor.", "Hand-made body.")
        wait_until(lambda: library.current()[0] == 1)
        assert store.generation(1)["kind"] == "disk" and "by-hand" in library

        (skills / "first" / "SKILL.md").write_text("---\nname: [unclosed\n---\nbody\n")
        event = wait_until(lambda: store.events(kind="skill_file_problem"))
        assert "first" in event[0]["message"] and event[0]["level"] == "warning"
        # the whole path: two processes' relative folders are told apart
        assert str(skills / "first" / "SKILL.md") in event[0]["message"]
        assert library.get("first").body == "Body."  # the stored version is kept
        assert library.current()[0] == 1  # a broken file is not a removal
    finally:
        library.unwatch()
    assert not library.watching


def test_a_hand_edit_the_store_could_not_take_is_recorded_once_it_answers(tmp_path,
                                                                          monkeypatch):
    """A reload refused by a workspace database that was down (or restarting) waited for the
    next edit of the folder: the edit never reached the team."""
    from metaclaw.store import StoreUnavailable

    skills, store = tmp_path / "skills", Store(tmp_path / "ws.db")
    write_skill(skills, "first", "The first skill.", "Body.")
    library = SkillLibrary(skills, store)
    reload, refused = library.reload, []

    def once_down():
        if (skills / "by-hand").exists() and not refused:  # the reload of the edit
            refused.append(True)
            raise StoreUnavailable("the workspace database is restarting")
        return reload()

    monkeypatch.setattr(library, "reload", once_down)
    library.watch()
    try:
        write_skill(skills, "by-hand", "Written in an editor.", "Hand-made body.")
        wait_until(lambda: library.current()[0] == 1)  # with no further edit
        assert refused and "by-hand" in library
    finally:
        library.unwatch()


@pytest.mark.sqlite_only
def test_opening_an_up_to_date_library_waits_for_no_writer(tmp_path):
    """`metaclaw skills list` (any process opening the library) waited for the write lock even
    when nothing had changed, and failed with "database is locked" behind a long write."""
    import sqlite3

    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "first", "The first skill.", "Body.")
    SkillLibrary(skills, Store(db)).store.close()  # generation 0, the folder marked
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # another process's long write
    try:
        started = time.monotonic()
        library = SkillLibrary(skills, Store(db))
        assert time.monotonic() - started < 5 and library.generation == 0 and "first" in library
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    write_skill(skills, "second", "Added by hand.", "Body.")
    assert SkillLibrary(skills, Store(db)).generation == 1  # a change still takes the lock


def test_an_idle_folder_watcher_wakes_a_few_times_a_second(tmp_path, monkeypatch):
    """Each wake-up of the watcher's thread takes the interpreter lock from the proxy's loop: at
    watchfiles' default step an idle library spent about 2.7 ms of CPU a second on them."""
    import threading

    from metaclaw.skills import library as skills_module

    checks = []

    class CountingEvent(threading.Event):
        def is_set(self):  # watchfiles checks its stop event once per wake-up
            checks.append(1)
            return super().is_set()

    monkeypatch.setattr(skills_module.threading, "Event", CountingEvent)
    write_skill(tmp_path / "skills", "first", "The first skill.", "Body.")
    library = SkillLibrary(tmp_path / "skills", Store(tmp_path / "ws.db")).watch()
    try:
        before = len(checks)
        time.sleep(2.0)
        wakeups = len(checks) - before
    finally:
        library.unwatch()
    assert 0 < wakeups < 2.0 * 20  # watchfiles' default step: about 40 checks a second


def test_embedding_index_re_embeds_only_the_changed_skill(tmp_path):
    from metaclaw.skills import retrieval

    if not retrieval.embeddings_available():
        pytest.skip("the embeddings extra is not installed")

    class Counting(retrieval.EmbeddingRetriever):
        encoded: list[str] = []

        def _encode(self, texts):
            self.encoded.extend(texts)
            return super()._encode(texts)

    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    for i in range(5):
        write_skill(skills, f"skill-{i}", f"Skill number {i}.", "Body.")
    library = SkillLibrary(skills, Store(db))
    retriever = Counting()
    retriever.rank("query", library.skills())
    before = len(retriever.encoded)
    _finish(_in_another_process(ADD_ONE, skills, db, "new-one"))
    retriever.rank("query", library.current()[1])
    assert len(retriever.encoded) - before == 2  # the new skill's two texts; the query is cached


def _judge_and_evolver(body):
    """A scripted double for the judge and evolver endpoints (not a model): the evolver gets
    one operation adding a backup skill; the judge scores by the prompt's length parity, so
    the first turns fail and GRPO groups have variance."""
    if (body.get("response_format") or {}).get("json_schema", {}).get("name") == "skill_operations":
        return Reply(json.dumps({"operations": [{
            "op": "add", "name": "backup-before-editing",
            "description": "Before editing a config file, copy it to a .bak file.",
            "category": "safety", "body": "Copy the config file to <name>.bak before you edit it.",
            "reason": "the user lost a config file", "evidence": []}]}))
    prompt = json.dumps(body["messages"])
    return Reply(json.dumps({"score": 1 if len(prompt) % 2 else -1, "rationale": "scripted"}))


def test_serve_then_cli_evolve_then_the_next_turn_trains(tmp_path):
    """`metaclaw serve` in one process, `metaclaw score/evolve/train` in others: the next turn
    gets the new skill, is tagged with the new generation, is in the live query set, and
    `train --now` trains on it."""
    from metaclaw.offline.tinymodel import write_tiny_model

    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "weather-small-talk", "Chat about the weather politely.", "Forecast.")
    port = free_port()
    with DoubleServer([Reply("I edited the config directly.")]) as agent, \
            DoubleServer(_judge_and_evolver) as judge:
        proc = subprocess.Popen([str(a) for a in [
            *CLI, "serve", "--upstream", agent.url, "--model", "m", "--port", port,
            "--skills", skills, "--db", db, "--retrieval", "lexical"]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port(proc, port)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            ask = [{"role": "user", "content": "Edit the config file deploy/config.yaml to "
                                               "raise the timeout."}]
            client.chat.completions.create(model="m", messages=ask,
                                           extra_headers={"X-Session-Id": "s1"})
            client.chat.completions.create(
                model="m", extra_headers={"X-Session-Id": "s1"},
                messages=[*ask, {"role": "assistant", "content": "I edited the config directly."},
                          {"role": "user", "content": "You broke it and there is no backup."}])
            store = Store(db)
            wait_until(lambda: len(store.turns()) == 2)
            judge_args = ["--judge-url", judge.url, "--judge-model", "judge", "--votes", 1]
            run_cli("score", "--db", db, *judge_args)
            out = run_cli("evolve", "--db", db, "--skills", skills, "--evolver-url", judge.url,
                          "--evolver-model", "evolver", "--json")
            assert json.loads(out.stdout)["generation"] == 1

            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "Please edit the config file "
                                                                 "app/settings.yaml"}],
                extra_headers={"X-Session-Id": "s2"})
            assert raw.headers["x-metaclaw-skill-generation"] == "1"
            assert "backup-before-editing" in raw.headers["x-metaclaw-injected-skills"]
            assert "backup-before-editing" in json.dumps(agent.requests[-1]["body"]["messages"])
            turn = wait_until(lambda: store.turns("session_id = 's2'"))[0]
            assert turn["skill_generation"] == 1
            rows = [json.loads(line) for line in
                    run_cli("buffers", "--db", db, "--json").stdout.splitlines()]
            assert {"id": turn["id"], "set": "query", "state": "live"}.items() <= next(
                r for r in rows if r["id"] == turn["id"]).items()
        finally:
            proc.terminate()
            proc.wait(timeout=20)

        model = write_tiny_model(tmp_path / "tiny")
        out = run_cli("train", "--db", db, "--base-model", model, "--now", "--steps", 1,
                      "--group-size", 4, "--groups-per-step", 1, "--max-tokens", 8,
                      "--state-dir", tmp_path / "train", *judge_args)
    steps = Store(db).query("SELECT * FROM training_steps")
    assert len(steps) == 1 and steps[0]["skill_generation"] == 1, out.stdout
    assert steps[0]["groups"] == 1 and steps[0]["tokens"] > 0, out.stdout


def test_a_failing_judge_is_logged_recorded_counted_and_shown(tmp_path, caplog):
    """--auto-evolve with a judge endpoint that refuses the model name: the failure names the
    endpoint, the model and the upstream's message in the log, the store's events, the
    runtime's status and `metaclaw events`."""
    from metaclaw.runtime import Runtime

    refuse = DoubleServer(lambda body: Reply("The model 'no-such-judge' does not exist",
                                             status=404))
    with DoubleServer([Reply("done")]) as agent, refuse as judge:
        runtime = Runtime.start(upstream_url=agent.url, model="m", db_path=str(tmp_path / "ws.db"),
                                skills_dir=str(tmp_path / "skills"), judge_url=judge.url,
                                judge_model="no-such-judge", evolver_url=judge.url,
                                evolver_model="no-such-evolver", auto_evolve=True)
        try:
            runtime.client().chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello"}],
                extra_headers={"X-Session-Id": "s", "X-Session-Done": "true"})
            runtime.proxy.flush()
            runtime.fast_loop.wait_idle()
            status = runtime.status()
        finally:
            runtime.stop()
    events = runtime.store.events(kind="judge_failed")
    assert len(events) == 1 and events[0]["level"] == "error"
    for text in (events[0]["message"], status["last_failure"],
                 next(r.getMessage() for r in caplog.records if "judge call failed" in r.getMessage())):
        assert "no-such-judge" in text and judge.url in text and "does not exist" in text
    assert events[0]["detail"]["endpoint"] == judge.url and "judge_failed: 1" in status["failures"]
    out = run_cli("events", "--db", tmp_path / "ws.db").stdout
    assert "judge_failed" in out and "does not exist" in out and "judge_failed: 1" in out


def test_an_edit_made_from_a_stale_version_is_a_conflict_not_an_overwrite(tmp_path):
    from metaclaw.skills.library import SkillConflict

    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "shared", "Shared.", "v1")
    mine = SkillLibrary(skills, Store(db))
    read = mine.get("shared")
    other = SkillLibrary(skills, Store(db))
    other.edit(Skill(name="shared", description="Shared.", category="ops", body="v2 (other)"),
               base=other.get("shared").content_hash)
    with pytest.raises(SkillConflict, match="changed since"):
        mine.edit(Skill(name="shared", description="Shared.", category="ops", body="v2 (mine)"),
                  base=read.content_hash)
    assert mine.get("shared").body == "v2 (other)" and mine.current()[0] == 1


def test_an_empty_skills_folder_never_empties_the_workspace(tmp_path):
    """A second folder for an existing workspace (a new checkout, a wrong --skills) holds no
    skill: it is filled from the workspace's latest generation, never recorded as every skill
    removed (which every proxy on the workspace would adopt on its next request)."""
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "alpha", "The alpha skill.", "Alpha body.")
    write_skill(skills, "beta", "The beta skill.", "Beta body.")
    assert SkillLibrary(skills, Store(db)).current()[0] == 0

    elsewhere = tmp_path / "elsewhere" / "skills"
    listed = run_cli("skills", "list", "--skills", elsewhere, "--db", db, "--json")
    assert [json.loads(line)["name"] for line in listed.stdout.splitlines()] == ["alpha", "beta"]
    store = Store(db)
    assert store.latest_generation() == 0  # no generation recorded
    assert "Beta body." in (elsewhere / "beta" / "SKILL.md").read_text()

    (elsewhere / "beta" / "SKILL.md").unlink()  # a hand edit in the filled folder still counts
    (elsewhere / "beta").rmdir()
    library = SkillLibrary(elsewhere, store)
    assert library.current()[0] == 1 and "beta" not in library


@pytest.mark.sqlite_only  # copies the workspace's database file
def test_a_workspace_moved_with_its_skills_folder_is_marked_without_a_warning(tmp_path,
                                                                              caplog):
    """A workspace copied or moved whole (its database and skills folder): the folder holds the
    workspace's skills as they are. It said the folder "joined the library instead of replacing
    it" at every such move; now it is marked as the workspace's, said at INFO."""
    import logging
    import shutil

    skills, db = tmp_path / "a" / "skills", tmp_path / "a" / "ws.db"
    write_skill(skills, "alpha", "The alpha skill.", "Alpha body.")
    store = Store(db)
    SkillLibrary(skills, store).current()
    store.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with caplog.at_level(logging.INFO, logger="metaclaw.skills.library"):
        moved = SkillLibrary(tmp_path / "b" / "skills", Store(tmp_path / "b" / "ws.db"))
        assert moved.current()[0] == 0 and [s.name for s in moved.current()[1]] == ["alpha"]
    said = [r for r in caplog.records if "moved or copied with its workspace" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    [event] = moved.store.events(kind="skill_folder_joined")
    assert event["level"] == "info" and not list((tmp_path / "b" / "skills").glob("*.conflict*"))


def test_a_workspace_from_before_folder_marks_reads_its_folders_edits_as_edits(tmp_path):
    """A workspace made before folder marks were kept has none: its folder, edited by hand
    while nothing ran, is read as before (the edit recorded as a generation), not joined as a
    stranger's (the workspace's version written over the edit, the edit set aside)."""
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "alpha", "The alpha skill.", "Alpha body.")
    SkillLibrary(skills, Store(db))
    with Store(db) as store:  # as such a workspace is: no mark anywhere
        store.execute("DELETE FROM skill_folders")
    path = skills / "alpha" / "SKILL.md"
    path.write_text(path.read_text().replace("Alpha body.", "Alpha body, edited offline."))
    store = Store(db)
    library = SkillLibrary(skills, store)
    assert library.generation == 1 and library.get("alpha").body == "Alpha body, edited offline."
    assert not list(skills.glob("*.conflict-*")) and store.events(kind="skill_folder_joined") == []
    assert store.folder_marks(None)  # marked from now on
    # a stranger's folder opened first on such a workspace (a stale checkout, lacking skills)
    # joins it: what it lacks is never read as removed
    store.execute("DELETE FROM skill_folders")
    write_skill(skills, "beta", "The beta skill.", "Beta body.")
    SkillLibrary(skills, Store(db))
    store.execute("DELETE FROM skill_folders")
    stranger = tmp_path / "stranger"
    write_skill(stranger, "gamma", "The gamma skill.", "Gamma body.")
    joined = SkillLibrary(stranger, Store(db))
    assert sorted(s.name for s in joined.current()[1]) == ["alpha", "beta", "gamma"]


def test_a_stale_copy_of_a_workspace_from_before_folder_marks_never_overwrites_it(tmp_path):
    """A teammate's copy of the folder, taken before a skill's last edit, opened first on a
    workspace that never marked a folder: its older text is an earlier generation's, not a
    hand edit; it joins (the library keeps the newer text, the older one set aside)."""
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "alpha", "The alpha skill.", "Alpha v1.")
    SkillLibrary(skills, Store(db))
    stale = tmp_path / "stale"
    shutil.copytree(skills, stale)
    path = skills / "alpha" / "SKILL.md"
    path.write_text(path.read_text().replace("v1", "v2"))
    assert SkillLibrary(skills, Store(db)).get("alpha").body == "Alpha v2."
    with Store(db) as store:
        store.execute("DELETE FROM skill_folders")  # as a workspace of before the marks
    behind = SkillLibrary(stale, Store(db))
    assert behind.get("alpha").body == "Alpha v2." and behind.generation == 1
    assert "v1" in next(stale.glob("alpha.conflict-*")).read_text()


def test_a_skills_folder_new_to_the_workspace_joins_it_and_removes_nothing(tmp_path):
    """Another member's folder, or one used with another workspace, holds other skills than
    the workspace: it joins the library (gets the skills it lacks, the workspace's version of
    one it holds otherwise, its own version kept beside; its own skills are added), never read
    as every missing skill removed, which every proxy of the team would follow."""
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "alpha", "The alpha skill.", "Alpha body.")
    write_skill(skills, "beta", "The beta skill.", "Beta body.")
    assert SkillLibrary(skills, Store(db)).current()[0] == 0

    mine = tmp_path / "mine" / "skills"
    write_skill(mine, "personal", "My own skill.", "Personal body.")
    write_skill(mine, "beta", "The beta skill.", "My older beta.")
    store = Store(db)
    library = SkillLibrary(mine, store)
    assert sorted(s.name for s in library.current()[1]) == ["alpha", "beta", "personal"]
    assert library.get("beta").body == "Beta body."  # the workspace's version stands
    assert "Beta body." in (mine / "beta" / "SKILL.md").read_text()
    assert "Alpha body." in (mine / "alpha" / "SKILL.md").read_text()
    assert "My older beta." in (mine / "beta.conflict-0.md").read_text()  # nothing lost
    [joined] = store.events(kind="skill_folder_joined")
    assert "personal are added" in joined["message"] and "beta.conflict-0.md" in joined["message"]
    ops = store.query("SELECT op, skill_name FROM skill_events WHERE generation = 1")
    assert [(r["op"], r["skill_name"]) for r in ops] == [("add", "personal")]
    # the first folder follows: nothing of it removed
    first = SkillLibrary(skills, Store(db))
    assert sorted(s.name for s in first.current()[1]) == ["alpha", "beta", "personal"]
    # once joined, the folder is the workspace's: a skill removed by hand there is removed
    import shutil

    shutil.rmtree(mine / "alpha")
    assert "alpha" not in SkillLibrary(mine, Store(db))
    # a stale copy of a folder: a skill the workspace removed is not brought back (kept
    # beside), and a stray file named like a skill is no removal
    stale = tmp_path / "stale" / "skills"
    write_skill(stale, "alpha", "The alpha skill.", "Alpha body.")
    stale.joinpath("beta").write_text("not a skill folder")
    joined = SkillLibrary(stale, Store(db))
    names = sorted(s.name for s in joined.current()[1])
    assert names == ["beta", "personal"]
    assert not (stale / "alpha" / "SKILL.md").exists()
    assert "Alpha body." in next(stale.glob("alpha.conflict-*.md")).read_text()


def test_a_runtime_that_cannot_listen_leaves_nothing_running(tmp_path):
    """A busy port (``%metaclaw start --port N``, ``metaclaw serve``) fails the start with the
    operating system's error, and the half-started runtime is taken down: no offline double,
    no skills-folder watcher, no open workspace connection left behind."""
    import socket
    import threading

    from metaclaw.runtime import Runtime

    def ours() -> set[str]:
        return {t.name for t in threading.enumerate() if t.is_alive()
                and t.name.startswith("metaclaw")}

    before = ours()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(OSError):
            Runtime.start(port=taken.getsockname()[1], db_path=str(tmp_path / "ws.db"),
                          skills_dir=str(tmp_path / "skills"), retrieval="lexical")
    finally:
        taken.close()
    for _ in range(100):  # threads end within moments of their stop
        if ours() <= before:
            break
        time.sleep(0.05)
    assert ours() <= before
    assert not any(target.startswith(str(tmp_path / "ws.db")) for target in _open_files())



@pytest.mark.sqlite_only  # holds SQLite's write lock from a raw connection
def test_a_local_model_runtime_whose_first_policy_check_fails_closes_its_follower(
        tmp_path, monkeypatch):
    """``--local-model``: the build checks the workspace's published policies at once. When that
    check fails (here another process holds the write lock past the busy timeout as the check
    records that a version cannot be served), the follower's own connection to the workspace is
    closed with the store, and the check's error is the one raised."""
    import sqlite3
    import threading

    pytest.importorskip("torch")
    from metaclaw.store import base as store_module
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.runtime import Runtime

    model = str(write_tiny_model(tmp_path / "tiny", seed=0))
    db = tmp_path / "ws.db"
    with Store(db) as store:  # a version this model cannot serve: the check reports it
        store.add_policy_version(backend="tinker", base_model="Qwen/Qwen3-4B",
                                 checkpoint="tinker://run/weights/1")
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)

    def lock_once_the_library_is_built() -> None:
        deadline = time.monotonic() + 60
        while other.execute("SELECT COUNT(*) FROM skill_generations").fetchone()[0] == 0 \
                and time.monotonic() < deadline:
            time.sleep(0.001)
        other.execute("BEGIN IMMEDIATE")

    locker = threading.Thread(target=lock_once_the_library_is_built)
    locker.start()
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.5)
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked") as failure:
            Runtime.build(local_model=model, db_path=str(db), skills_dir=str(tmp_path / "skills"),
                          retrieval="lexical")
        assert any(frame.name == "check" for frame in failure.traceback)
    finally:
        locker.join()
        other.execute("ROLLBACK")
        other.close()
    # the traceback is still held (as a notebook holds the last one), and yet:
    assert not any(target.startswith(str(db)) for target in _open_files())

def _open_files() -> list[str]:
    """What this process holds open (Linux /proc; empty elsewhere)."""
    targets = []
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return targets


REVIEW = """
    import os, sys, time
    from metaclaw.fastloop import proposals
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store
    store = Store(sys.argv[2])
    library = SkillLibrary(sys.argv[1], store)
    print("ready", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.001)
    try:
        print("promoted", proposals.promote(store, library, int(sys.argv[4]), by=sys.argv[5]))
    except proposals.ProposalError as exc:
        print("refused", exc)
"""


def test_a_proposal_promoted_from_two_processes_at_once_is_promoted_once_and_the_other_told_so(
        tmp_path):
    """Both reviewers see the proposal held and press promote: one generation is made, and the
    other reviewer is told who promoted it (not that the proposal "no longer applies, edit or
    discard it", which it said when its add of the skill, just added, failed validation)."""
    from metaclaw.fastloop import proposals
    from metaclaw.skills.library import SkillOp

    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "first", "The first skill.", "Body.")
    store = Store(db)
    library = SkillLibrary(skills, store)
    held = proposals.record(store, [SkillOp("add", Skill("units", "Unit rules.", "general",
                                                         "Use km."), "units", "r", [])],
                            origin="auto", status="held", base_generation=library.generation)
    go = tmp_path / "go"
    procs = [_in_another_process(REVIEW, skills, db, go, held, who) for who in ("ann", "bob")]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    go.touch()
    outs = sorted(_finish(proc).strip() for proc in procs)

    winner = proposals.get(store, held).decided_by
    assert outs == ["promoted 1", f"refused proposal #{held} is already promoted (by {winner}); "
                                  "only held proposals can be changed"]
    assert [g["generation"] for g in SkillLibrary(skills, store).generations()] == [0, 1]


def test_a_change_over_a_broken_file_says_to_fix_the_file(tmp_path):
    """A skill whose file is broken by hand is never recorded, so "retry then" never worked: the
    refusal names the broken file and what to do."""
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    write_skill(skills, "typo-keys", "The typo skill.", "Body.")
    library = SkillLibrary(skills, Store(db))
    (skills / "typo-keys" / "SKILL.md").write_text("---\nname: typo-keys\ndescription: [oops\n"
                                                    "---\nBody.\n")
    library.reload()
    with pytest.raises(SkillConflict, match="its file in .* is broken .*fix it or remove"):
        library.apply([SkillOp("remove", name="typo-keys", reason="not needed")])
    assert "description: [oops" in (skills / "typo-keys" / "SKILL.md").read_text()  # kept
