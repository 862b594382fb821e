"""The skill library against hostile files, damaged stored generations, workspaces used through
several folders, and a revert racing another process's change."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaclaw.fastloop import proposals
from metaclaw.skills.library import (FOLDER_MARKS, UNNAMED_FILE, Skill, SkillFormatError,
                                     SkillLibrary, SkillOp, _machine_of, _skills_digest,
                                     load_skills_dir, workspace_folders)
from metaclaw.store import Store


def _marks(store: Store) -> dict:
    """The folder marks ``store`` keeps for this machine (a workspace file: for that file)."""
    return store.folder_marks(_machine_of(store))


def write_skill(root: Path, folder: str, text: str) -> Path:
    path = root / folder / "SKILL.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def run_python(code: str, *args: object) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def files(folder: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*/SKILL.md"))}


# -- front matter whose values hold a '---' line -------------------------------------------------

def test_a_dash_line_inside_a_front_matter_value_is_not_its_end(tmp_path, store):
    """A block scalar holding a '---' line (indented, as YAML requires) was read as the end
    of the front matter: the value was cut and the rest of the front matter became the body
    injected into prompts, without any problem reported."""
    write_skill(tmp_path / "skills", "notes", textwrap.dedent("""\
        ---
        name: notes
        description: Keep notes.
        changelog: |
          v1: first
          ---
          v2: second
        ---

        # Notes
        Write things down.
        """))
    library = SkillLibrary(tmp_path / "skills", store)
    assert library.problems == []
    notes = library.get("notes")
    assert notes.extra == {"changelog": "v1: first\n---\nv2: second"}
    assert notes.body == "# Notes\nWrite things down."


_LINES = st.lists(st.sampled_from(["---", "...", "--- ", "  ---", "a", "b: c", "", " ", "#"]),
                  min_size=1, max_size=6).map("\n".join)


@settings(max_examples=200, deadline=None)
@given(description=_LINES.filter(lambda t: t.strip()), value=_LINES)
def test_a_skill_whose_values_hold_dash_lines_reads_back_from_its_file(description, value):
    """Whatever lines a description or a front-matter value holds, the file the library writes
    reads back as the same skill (a description with a '---' line was written, stored, and then
    refused as invalid YAML at every load of the folder)."""
    try:
        skill = Skill(name="rules", description=description, extra={"notes": value})
    except SkillFormatError:
        return
    assert Skill.from_markdown(skill.to_markdown()) == skill


def test_a_skill_added_with_a_dash_line_in_its_description_loads_again(tmp_path, store):
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(Skill(name="steps", description="Steps:\n---\nthen more", body="Body."))
    reopened = SkillLibrary(tmp_path / "skills", store)
    assert reopened.problems == [] and load_skills_dir(tmp_path / "skills")[1] == []
    assert reopened.get("steps").description == "Steps:\n---\nthen more"


# -- damaged stored generations ------------------------------------------------------------------

_GOOD = {"name": "z", "description": "Z.", "category": "general", "body": "z", "extra": {}}
_MALFORMED = {
    "a skill under another name": {"a": dict(_GOOD, name="a"), "zz": _GOOD},
    "an invalid name": {"a": dict(_GOOD, name="a"), "~evil": dict(_GOOD, name="~evil")},
    "an invalid skill": {"a": dict(_GOOD, name="a", description="")},
    "an entry that is not a skill": {"a": "text"},
    "extra that is not a map": {"a": dict(_GOOD, name="a", extra="text")},
    "a list": ["a"],
    "null": None,
    "not JSON": "{not json",
}


def _damage(db: Path, generation: int, snapshot: object) -> None:
    connection = sqlite3.connect(db)
    text = snapshot if isinstance(snapshot, str) else json.dumps(snapshot)
    connection.execute("UPDATE skill_generations SET snapshot = ? WHERE generation = ?",
                       (text, generation))
    connection.commit()
    connection.close()


def _two_generations(tmp_path: Path) -> tuple[Path, Path]:
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    library = SkillLibrary(skills, Store(db))
    library.add(Skill(name="a", description="A.", body="a"))
    library.add(Skill(name="b", description="B.", body="b"))
    return skills, db


@pytest.mark.parametrize("damage", list(_MALFORMED))
def test_a_rollback_to_a_malformed_generation_is_refused_naming_it(tmp_path, damage):
    """A rollback to a generation whose stored snapshot is damaged is refused with one sentence
    naming the generation, the library and its files unchanged (a skill stored under another
    name's key was restored into that name's folder and recorded as a new generation; a
    snapshot that is not a map failed with an AttributeError)."""
    skills, db = _two_generations(tmp_path)
    _damage(db, 2 - 1, _MALFORMED[damage])
    library = SkillLibrary(skills, Store(db))  # another process: reads the row from the store
    before = files(skills)
    with pytest.raises(SkillFormatError, match=r"skill generation 1 in the store is malformed"):
        library.rollback(1)
    assert files(skills) == before
    assert library.generation == 2 and [s.name for s in library.skills()] == ["a", "b"]
    assert SkillLibrary(skills, Store(db)).generation == 2


@pytest.mark.parametrize("damage", ["an invalid skill", "a list", "not JSON"])
def test_a_workspace_whose_latest_generation_is_malformed_still_opens(tmp_path, damage):
    """A damaged latest generation made every process fail to open the workspace (a rollback
    from the command line included); the folder is recorded over it instead."""
    skills, db = _two_generations(tmp_path)
    _damage(db, 2, _MALFORMED[damage])
    library = SkillLibrary(skills, Store(db))
    assert library.generation == 3 and [s.name for s in library.skills()] == ["a", "b"]
    assert "generation 2 in the store is malformed" in library.generations()[-1]["reason"]
    assert library.rollback(1) == 4 and [s.name for s in library.skills()] == ["a"]


# -- one workspace, several folders --------------------------------------------------------------

EVOLVE_ELSEWHERE = """
    import sys
    from metaclaw.skills.library import Skill, SkillLibrary
    from metaclaw.store import Store
    library = SkillLibrary(sys.argv[1], Store(sys.argv[2]))
    library.edit(Skill(name="units", description="Units.", body="Convert miles to km."))
    library.add(Skill(name="dates", description="Dates.", body="Use ISO dates."))
    library.remove("old")
    print(library.generation)
"""


def _proxy_folder(tmp_path: Path) -> tuple[Path, Path, SkillLibrary]:
    skills, db = tmp_path / "proxy-skills", tmp_path / "ws.db"
    library = SkillLibrary(skills, Store(db))
    library.add(Skill(name="units", description="Units.", body="Use metres."))
    library.add(Skill(name="old", description="Old.", body="Outdated."))
    return skills, db, library


def _evolved(library: SkillLibrary) -> dict[str, str]:
    return {s.name: s.body for s in library.skills()}


EVOLVED = {"dates": "Use ISO dates.", "units": "Convert miles to km."}


def test_a_restart_on_a_folder_another_folder_moved_past_keeps_the_workspace(tmp_path):
    """`metaclaw evolve` run from another directory changes the workspace through another
    folder; the proxy's folder still holds the old files. Reopening it recorded them as a
    'disk' generation that silently undid the evolved skills; they are brought up instead."""
    skills, db, proxy = _proxy_folder(tmp_path)
    evolved = int(run_python(EVOLVE_ELSEWHERE, tmp_path / "cli-skills", db))
    assert proxy.current()[0] == evolved and _evolved(proxy) == EVOLVED  # adopted in memory

    restarted = SkillLibrary(skills, Store(db))
    assert restarted.generation == evolved and _evolved(restarted) == EVOLVED
    assert [g["kind"] for g in restarted.generations()][-1] != "disk"
    assert {n: Skill.from_markdown(t).body for n, t in files(skills).items()} == EVOLVED
    marks = _marks(restarted.store)  # kept in the workspace (a file: any host name)
    assert marks[str(skills.resolve())]["generation"] == evolved
    assert not db.with_name(db.name + FOLDER_MARKS).exists()
    assert sorted(p.name for p in skills.iterdir()) == ["dates", "units"]  # skills only


def test_a_hand_edit_in_a_lagging_folder_is_recorded_and_nothing_else_is_undone(tmp_path):
    skills, db, proxy = _proxy_folder(tmp_path)
    proxy.add(Skill(name="style", description="Style.", body="Be brief."))
    evolved = int(run_python(EVOLVE_ELSEWHERE, tmp_path / "cli-skills", db))
    write_skill(skills, "style", "---\nname: style\ndescription: Style.\n---\n\nBe very brief.\n")

    assert proxy.reload() == evolved + 1  # what the folder watcher calls on the edit
    assert _evolved(proxy) == {**EVOLVED, "style": "Be very brief."}
    ops = [(e["op"], e["skill_name"]) for e in proxy.store.skill_events(evolved + 1)]
    assert ops == [("edit", "style")]


STEPS = "---\nname: steps\ndescription: Steps.\n---\n\n{0}\n\n{1}\n\n{2}\n"


def _two_folders(tmp_path: Path) -> tuple[Path, SkillLibrary, Path, SkillLibrary]:
    """Two folders of one workspace (two machines' checkouts): ``steps`` has three lines."""
    db = tmp_path / "ws.db"
    here, there = tmp_path / "here", tmp_path / "there"
    write_skill(here, "steps", STEPS.format("Read the file.", "Back it up.", "Then edit."))
    mine = SkillLibrary(here, Store(db))
    theirs = SkillLibrary(there, Store(db))  # filled from the workspace
    return here, mine, there, theirs


def _body(library: SkillLibrary) -> str:
    return library.get("steps").body


def test_a_running_folder_follows_changes_made_through_another(tmp_path):
    """A proxy's folder used to keep its old files while it served a newer generation in
    memory, so a person opening a file there edited a stale one."""
    here, mine, there, theirs = _two_folders(tmp_path)
    mine.watch()
    try:
        theirs.edit(Skill.from_markdown(STEPS.format("Read the file.", "Back it up first.",
                                                     "Then edit.")))
        deadline = time.monotonic() + 10
        while "Back it up first." not in (here / "steps" / "SKILL.md").read_text():
            assert time.monotonic() < deadline, "the folder did not follow the library"
            time.sleep(0.05)
        assert mine.current()[0] == theirs.generation
    finally:
        mine.unwatch()
    assert [g["kind"] for g in mine.generations()][-1] == "edit"  # nothing recorded back


def test_an_edit_of_a_stale_file_merges_with_the_change_it_missed(tmp_path):
    here, mine, there, theirs = _two_folders(tmp_path)
    theirs.edit(Skill.from_markdown(STEPS.format("Read the whole file.", "Back it up.",
                                                 "Then edit.")))
    write_skill(here, "steps", STEPS.format("Read the file.", "Back it up.", "Then edit once."))
    mine.reload()  # what the watcher calls on the edit
    assert _body(mine) == "Read the whole file.\n\nBack it up.\n\nThen edit once."
    assert "Read the whole file." in (here / "steps" / "SKILL.md").read_text()
    assert not list(here.glob("*.conflict*"))


def test_an_edit_of_a_stale_file_that_overlaps_the_change_is_set_aside_not_recorded_over_it(
        tmp_path):
    """It was recorded as the folder's edit, silently undoing the other folder's change."""
    here, mine, there, theirs = _two_folders(tmp_path)
    theirs.edit(Skill.from_markdown(STEPS.format("Read the file.", "Back it up to .bak.",
                                                 "Then edit.")))
    edited = STEPS.format("Read the file.", "Back it up to git.", "Then edit.")
    write_skill(here, "steps", edited)
    generation = theirs.generation
    assert mine.reload() == generation  # nothing recorded: the other change stands
    assert "Back it up to .bak." in _body(mine)
    assert "Back it up to .bak." in (here / "steps" / "SKILL.md").read_text()
    assert (here / f"steps.conflict-{generation}.md").read_text() == edited  # not lost
    events = [e for e in mine.store.events() if e["kind"] == "skill_edit_conflict"]
    assert len(events) == 1 and "merge it into" in events[0]["message"]
    assert mine.reload() == generation and sorted(mine.problems) == []  # not a skill
    # a second overlapping edit of the same generation's file never writes over the first
    write_skill(here, "steps", STEPS.format("Read the file.", "Back it up to svn.", "Then edit."))
    mine.store.mark_folder(_machine_of(mine.store), str(here.resolve()), 0,  # lagging again
                           _skills_digest(mine.snapshot(0)))
    assert mine.reload() == generation
    assert (here / f"steps.conflict-{generation}.md").read_text() == edited
    assert "svn" in (here / f"steps.conflict-{generation}.2.md").read_text()


def test_a_skill_removed_from_a_stale_folder_that_another_changed_comes_back_said_so(tmp_path):
    """The removal met a change made elsewhere: the change stands and the folder gets the skill
    back, with a warning event that says so (it came back with only a log line)."""
    import shutil

    write_skill(tmp_path / "here", "tone", "---\nname: tone\ndescription: Tone.\n---\nBe kind.\n")
    here, mine, there, theirs = _two_folders(tmp_path)  # the folder keeps a skill (not emptied)
    generation = theirs.edit(Skill.from_markdown(STEPS.format("Read the file.",
                                                              "Back it up first.", "Then edit.")))
    shutil.rmtree(here / "steps")
    assert mine.reload() == generation and "first" in _body(mine)
    assert "first" in (here / "steps" / "SKILL.md").read_text()
    events = [e for e in mine.store.events() if e["kind"] == "skill_edit_conflict"]
    assert len(events) == 1 and "was removed from" in events[0]["message"]
    assert "remove it once more" in events[0]["message"]
    assert not list(here.glob("*.conflict*"))


def test_the_same_edit_made_in_both_folders_written_otherwise_is_no_conflict(tmp_path):
    here, mine, there, theirs = _two_folders(tmp_path)
    edited = STEPS.format("Read the file.", "Back it up first.", "Then edit.")
    generation = theirs.edit(Skill.from_markdown(edited))
    write_skill(here, "steps", edited.replace("name: steps\n", "name: 'steps'\n"))
    assert mine.reload() == generation and "first" in _body(mine)
    assert not list(here.glob("*.conflict*"))


def test_a_folder_that_cannot_be_written_never_records_its_stale_files_back(tmp_path,
                                                                            monkeypatch):
    """Its stale files were recorded as a generation, undoing the other folder's change."""
    import metaclaw.skills.library as module

    here, mine, there, theirs = _two_folders(tmp_path)
    changed = theirs.edit(Skill.from_markdown(STEPS.format("Read the file.", "Back it up.",
                                                           "Then edit twice.")))

    def refuse(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(module, "_write_skill_file", refuse)
    reopened = SkillLibrary(here, Store(tmp_path / "ws.db"))
    assert reopened.generation == changed and "twice" in _body(reopened)
    monkeypatch.undo()
    again = SkillLibrary(here, Store(tmp_path / "ws.db"))  # still lagging: brought up now
    assert again.generation == changed
    assert "twice" in (here / "steps" / "SKILL.md").read_text()


def test_a_change_made_through_a_lagging_folder_applies_on_the_latest_generation(tmp_path):
    """The proxy evolves after the CLI did through another folder: its files of the skills the
    CLI changed are stale, not hand edits, so the change goes through (it was refused as
    written over a hand edit, and the reload it asked for undid the CLI's skills)."""
    skills, db, proxy = _proxy_folder(tmp_path)
    evolved = int(run_python(EVOLVE_ELSEWHERE, tmp_path / "cli-skills", db))
    generation = proxy.apply([SkillOp("add", Skill(name="tone", description="Tone.",
                                                   body="Be kind."))], kind="evolve")
    assert generation == evolved + 1
    assert _evolved(SkillLibrary(skills, Store(db))) == {**EVOLVED, "tone": "Be kind."}
    assert sorted(files(skills)) == ["dates", "tone", "units"]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "edit", "remove"]),
                          st.sampled_from(["a", "b", "c"]), st.sampled_from(["x", "y"])),
                min_size=1, max_size=6))
def test_whatever_another_folder_changes_reopening_this_one_changes_nothing(changes):
    with tempfile.TemporaryDirectory() as tmp:
        here, there, db = Path(tmp, "here"), Path(tmp, "there"), Path(tmp, "ws.db")
        mine = SkillLibrary(here, Store(db))
        mine.add(Skill(name="a", description="A.", body="start"))
        other = SkillLibrary(there, Store(db))
        for op, name, body in changes:
            present = name in other
            if op == "remove" and present:
                other.remove(name)
            elif op in ("add", "edit"):
                skill = Skill(name=name, description=f"{name}.", body=f"{body} {len(changes)}")
                if present and other.get(name) != skill:
                    other.edit(skill)
                elif not present:
                    other.add(skill)
        latest = other.generation
        expected = {s.name: s for s in other.skills()}
        if not expected:
            return  # an empty library: the other folder is filled instead (tested elsewhere)
        reopened = SkillLibrary(here, Store(db))
        assert reopened.generation == latest
        assert {s.name: s for s in reopened.skills()} == expected
        assert {n: Skill.from_markdown(t) for n, t in files(here).items()} == expected


# -- revert racing another change ----------------------------------------------------------------

SLOW_EDIT = """
    import sys, time
    from pathlib import Path
    from metaclaw.skills.library import Skill, SkillLibrary, SkillOp
    from metaclaw.store import Store
    library = SkillLibrary(sys.argv[1], Store(sys.argv[2]))
    def slow(generation):  # the change's own writes (a promotion's record), in its transaction
        Path(sys.argv[3]).touch()
        time.sleep(1.5)
    edit = Skill(name="units", description="Units.", body="Edited by a person.")
    print(library.apply([SkillOp("edit", edit)], then=slow))
"""


def test_a_revert_never_writes_over_a_change_committed_while_it_waits(tmp_path):
    """A revert checks that no later generation changed the skills it restores, then waits for
    the write lock another process holds for its edit of one of them: it was applied over that
    edit (lost); it is refused, saying so."""
    skills, db = tmp_path / "skills", tmp_path / "ws.db"
    library = SkillLibrary(skills, Store(db))
    library.add(Skill(name="units", description="Units.", body="Use metres."))
    automatic = library.edit(Skill(name="units", description="Units.", body="Use miles."))
    go = tmp_path / "go"
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SLOW_EDIT), str(skills),
                              str(db), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 60
    while not go.exists():
        assert other.poll() is None and time.monotonic() < deadline, other.communicate()
        time.sleep(0.01)
    with pytest.raises(proposals.ProposalError, match="changed again while reverting"):
        proposals.revert(library, automatic, by="alice")
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0, err
    assert library.get("units").body == "Edited by a person."
    assert [g["generation"] for g in library.generations()] == [0, 1, 2, 3]


def test_a_folder_marked_in_the_file_of_before_is_still_brought_up(tmp_path):
    """Marks were kept in a file beside the database before the workspace kept them: a folder
    marked there only (a workspace from before) is still known to lag, and brought up."""
    here, mine, there, theirs = _two_folders(tmp_path)
    db = tmp_path / "ws.db"
    mine.store.execute("DELETE FROM skill_folders")  # as a workspace from before had none
    (tmp_path / ("ws.db" + FOLDER_MARKS)).write_text(json.dumps(
        {str(here.resolve()): {"generation": 0, "snapshot": _skills_digest(mine.snapshot(0))}}))
    generation = theirs.edit(Skill.from_markdown(STEPS.format("Read the file.",
                                                              "Back it up first.", "Then edit.")))
    reopened = SkillLibrary(here, Store(db))
    assert reopened.generation == generation and "first" in _body(reopened)
    assert "first" in (here / "steps" / "SKILL.md").read_text()
    # marked in the workspace from now on
    assert _marks(reopened.store)[str(here.resolve())]["generation"] == generation


def test_a_workspace_files_folder_marks_hold_whatever_the_host_is_called(tmp_path, monkeypatch):
    """A workspace file is on this machine's disk: its folders are known by their paths. Keyed
    by the host's name, the marks were lost when it changed (a recreated container, a laptop on
    another network), and the lagging folder's stale files were recorded back as edits."""
    here, mine, there, theirs = _two_folders(tmp_path)
    monkeypatch.setenv("METACLAW_MACHINE", "renamed-host")
    generation = theirs.edit(Skill.from_markdown(STEPS.format("Read the file.",
                                                              "Back it up first.", "Then edit.")))
    monkeypatch.setenv("METACLAW_MACHINE", "renamed-again")
    reopened = SkillLibrary(here, Store(tmp_path / "ws.db"))
    assert reopened.generation == generation and "first" in _body(reopened)
    assert [g["kind"] for g in reopened.generations()][-1] != "disk"


def test_a_folder_whose_path_is_not_utf8_is_marked(tmp_path):
    """A folder name with bytes that are no UTF-8 (kept by Python as escapes) is marked like
    any other: writing its path as text failed, and with it the change."""
    import os

    folder = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9"))
    library = SkillLibrary(folder, Store(tmp_path / "ws.db"))
    generation = library.add(Skill(name="steps", description="Steps.", body="Back it up."))
    (key,) = _marks(library.store)
    assert key.startswith("hex:") and library.generation == generation
    assert SkillLibrary(folder, Store(tmp_path / "ws.db")).generation == generation
    # a folder named with those characters written out is another folder, with its own mark
    SkillLibrary(tmp_path / "caf\\xe9", Store(tmp_path / "ws.db"))
    assert len(_marks(library.store)) == 2
    assert sorted(map(str, workspace_folders(library.store))) == sorted(
        [str(folder), str(tmp_path / "caf\\xe9")])


def test_a_copy_of_a_workspace_file_is_not_used_through_the_originals_folder(
        tmp_path, monkeypatch, capsys):
    """A workspace copied whole (``cp -r A B``) carries the marks of A's folder: a command on
    B's file without ``--skills`` wrote into A's folder, and A recorded the change as a hand
    edit. Marks name their workspace file: B's has none of its own. Marks from before they
    named it are read, and dropped once the file's own are written."""
    import shutil

    from metaclaw import cli

    a, b = tmp_path / "A", tmp_path / "B"
    library = SkillLibrary(a / "skills", Store(a / "ws.db"))
    generation = library.add(Skill(name="steps", description="Steps.", body="Back it up."))
    library.store.close()
    shutil.copytree(a, b)
    assert workspace_folders(Store(b / "ws.db")) == []
    assert workspace_folders(Store(a / "ws.db")) == [(a / "skills").resolve()]
    monkeypatch.chdir(b)
    assert cli.main(["skills", "--db", "ws.db", "remove", "steps"]) == 0
    capsys.readouterr()
    assert (a / "skills" / "steps" / "SKILL.md").exists()
    assert SkillLibrary(a / "skills", Store(a / "ws.db")).generation == generation
    # a workspace from before: its marks under no file's name are read, then replaced
    store = Store(a / "ws.db")
    store.execute("UPDATE skill_folders SET machine = ?", (UNNAMED_FILE,))
    assert workspace_folders(store) == [(a / "skills").resolve()]
    SkillLibrary(a / "skills", store).add(Skill(name="dates", description="D.", body="ISO."))
    assert set(store.folder_marks(None)) == {(_machine_of(store), str((a / "skills").resolve()))}


def test_a_copied_workspace_file_brings_a_lagging_folder_up(tmp_path, capsys):
    """`metaclaw db copy` to another file keeps the folders' marks: a folder that lagged is
    brought up on the copy, not recorded back into it."""
    from metaclaw import cli

    here, mine, there, theirs = _two_folders(tmp_path)
    generation = theirs.edit(Skill.from_markdown(STEPS.format("Read the file.",
                                                              "Back it up first.", "Then edit.")))
    assert cli.main(["db", "copy", "--from", str(tmp_path / "ws.db"),
                     "--to", str(tmp_path / "copy.db")]) == 0
    capsys.readouterr()
    opened = SkillLibrary(here, Store(tmp_path / "copy.db"))
    assert opened.generation == generation and "first" in _body(opened)
