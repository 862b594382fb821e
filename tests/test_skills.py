"""Skill files, the versioned skill library (generations, diff, rollback) and its files on disk."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metaclaw.skills.library import (EXAMPLE_ASK_CHARS, LoadProblem, Skill, SkillConflict,
                                     SkillDiff, SkillFormatError, SkillLibrary, SkillNotFound,
                                     SkillOp, load_skills_dir, starter_skills_dir, validate_name)
from metaclaw.store import Store

BACKUP_MD = """---
name: backup-before-modify
description: Keep a copy of a file before changing it.
category: safety
tags: [files, safety]
version: 2
---

# Backup before modify

1. Copy the file.
2. Then edit it.
"""


def write_skill(root: Path, folder: str, text: str | bytes) -> Path:
    path = root / folder / "SKILL.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def skill(name: str, description: str = "A test skill.", body: str = "Do the thing.",
          category: str = "general") -> Skill:
    return Skill(name=name, description=description, category=category, body=body)


@pytest.fixture
def lib(tmp_path, store):
    root = tmp_path / "skills"
    write_skill(root, "backup-before-modify", BACKUP_MD)
    return SkillLibrary(root, store)


# -- SKILL.md ------------------------------------------------------------------------------------

def test_skill_md_round_trip_preserves_fields_and_extra_keys():
    s = Skill.from_markdown(BACKUP_MD, source="x/SKILL.md")
    assert (s.name, s.category) == ("backup-before-modify", "safety")
    assert s.description == "Keep a copy of a file before changing it."
    assert s.extra == {"tags": ["files", "safety"], "version": 2}
    assert s.body.startswith("# Backup before modify") and s.body.endswith("2. Then edit it.")
    text = s.to_markdown()
    assert text.startswith("---\nname: backup-before-modify\n")
    again = Skill.from_markdown(text)
    assert again == s and again.to_markdown() == text
    assert again.content_hash == s.content_hash and len(s.content_hash) == 64
    assert Skill.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_round_trip_of_unicode_multiline_and_tricky_yaml_values():
    s = Skill(name="zeit_1", description="Dates: 'ISO' — «immer» with: colons # and hashes",
              category="data", body="Line one\n\n```python\n  indented()\n```",
              extra={"created": "2026-01-01", "nested": {"a": [1, 2]}})
    again = Skill.from_markdown(s.to_markdown())
    assert again == s
    assert Skill.from_markdown("---\nname: d\ndescription: x\ncreated: 2026-01-02\n---\n").extra \
        == {"created": "2026-01-02"}  # YAML dates become ISO strings (JSON-safe snapshots)


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # SKILL.md is UTF-8


@settings(max_examples=300, deadline=None)
@given(description=_TEXT.filter(lambda t: t.strip() and t.strip() != "~"),
       extra=st.dictionaries(_TEXT.filter(lambda k: k not in ("name", "description", "category",
                                                               "body")),
                             _TEXT | st.lists(_TEXT, max_size=3), max_size=4))
def test_front_matter_text_round_trips(description, extra):
    """Whatever text a description or an extra key or value holds (YAML line breaks such as
    U+0085 included) reads back as written."""
    try:
        skill = Skill(name="any", description=description, extra=extra)
    except SkillFormatError:
        return  # refused up front, with a reason: nothing to round-trip
    assert Skill.from_markdown(skill.to_markdown()) == skill


def test_a_next_line_character_in_front_matter_reads_back():
    skill = Skill(name="nel", description="one\x85two", extra={"k\x85ey": "v\x85alue"})
    assert Skill.from_markdown(skill.to_markdown()) == skill


def test_category_defaults_to_general_and_body_may_be_empty():
    s = Skill.from_markdown("---\nname: tiny\ndescription: Short.\n---\n")
    assert (s.category, s.body) == ("general", "")
    assert Skill.from_markdown(s.to_markdown()) == s


@pytest.mark.parametrize("text, reason", [
    ("no front matter here", "front matter"),
    ("---\nname: a\ndescription: b\n", "closing"),
    ("---\nname: [unclosed\ndescription: b\n---\n", "not valid YAML"),
    ("---\n- a\n- b\n---\n", "mapping"),
    ("---\nname: a\n---\nbody", "'description'"),
    ("---\ndescription: b\n---\n", "'name'"),
    ("---\nname: Bad Name\ndescription: b\n---\n", "invalid skill name"),
    ("---\nname: 12\ndescription: b\n---\n", "must be text"),
])
def test_from_markdown_errors_name_the_source_and_reason(text, reason):
    with pytest.raises(SkillFormatError) as err:
        Skill.from_markdown(text, source="lib/a/SKILL.md")
    assert str(err.value).startswith("lib/a/SKILL.md: ")
    assert reason in str(err.value)


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "a\\b", "", ".hidden", "Upper", "-dash",
                                  "x" * 65, "a b", "a\n", "naïve", None, 3])
def test_invalid_names_are_rejected(name):
    with pytest.raises(SkillFormatError, match="invalid skill name"):
        validate_name(name)


@pytest.mark.parametrize("name", ["a", "0", "a-b_c1", "x" * 64])
def test_valid_names(name):
    assert validate_name(name) == name


def test_path_traversal_names_never_reach_the_filesystem(lib, tmp_path):
    outside = tmp_path / "x"
    with pytest.raises(SkillFormatError):
        Skill(name="../x", description="escape")
    with pytest.raises(SkillFormatError):
        Skill.from_markdown("---\nname: ../../x\ndescription: escape\n---\n")
    with pytest.raises(SkillFormatError):
        lib.remove("../skills/backup-before-modify")
    assert not outside.exists()
    assert (lib.directory / "backup-before-modify" / "SKILL.md").is_file()
    assert lib.generation == 0


# -- loading -------------------------------------------------------------------------------------

def test_broken_files_are_reported_with_path_and_reason_and_skipped(tmp_path, store):
    root = tmp_path / "skills"
    write_skill(root, "good", "---\nname: good\ndescription: Fine.\n---\nBody.")
    bad = {
        "bad-yaml": write_skill(root, "bad-yaml", "---\nname: bad-yaml\ndescription: [x\n---\n"),
        "no-desc": write_skill(root, "no-desc", "---\nname: no-desc\n---\nBody"),
        "mismatch": write_skill(root, "mismatch", "---\nname: other\ndescription: d\n---\n"),
        "Bad Folder": write_skill(root, "Bad Folder", "---\nname: Bad Folder\ndescription: d\n---\n"),
        "latin1": write_skill(root, "latin1", "---\nname: latin1\ndescription: caf\xe9\n---\n"
                              .encode("latin-1")),
        "no-front": write_skill(root, "no-front", "# just markdown\n"),
    }
    (root / "empty-folder").mkdir()
    (root / "README.md").write_text("not a skill folder")
    lib = SkillLibrary(root, store)
    assert [s.name for s in lib.skills()] == ["good"]
    by_path = {p.path: p.reason for p in lib.problems}
    assert set(by_path) == {str(p) for p in bad.values()}
    assert all(isinstance(p, LoadProblem) and p.reason for p in lib.problems)
    assert "YAML" in by_path[str(bad["bad-yaml"])]
    assert "description" in by_path[str(bad["no-desc"])]
    assert "does not match its folder" in by_path[str(bad["mismatch"])]
    assert "invalid skill name" in by_path[str(bad["Bad Folder"])]
    assert "UTF-8" in by_path[str(bad["latin1"])]
    # nothing was rewritten or deleted
    assert bad["latin1"].read_bytes().endswith(b"caf\xe9\n---\n")


def test_a_broken_file_keeps_its_stored_version(lib, store):
    path = lib.directory / "backup-before-modify" / "SKILL.md"
    path.write_text("---\nname: backup-before-modify\ndescription: [broken\n---\n")
    reopened = SkillLibrary(lib.directory, store)
    assert reopened.generation == 0  # not recorded as a removal
    assert reopened.get("backup-before-modify").category == "safety"
    assert len(reopened.problems) == 1 and "keeping its version" in reopened.problems[0].reason


def _link_loop(folder: Path) -> None:
    path = folder / "SKILL.md"
    path.unlink()
    path.symlink_to(path)


def _folder_loop(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder)
    folder.symlink_to(folder)


def _directory_named_skill_md(folder: Path) -> None:
    (folder / "SKILL.md").unlink()
    (folder / "SKILL.md").mkdir()


def _huge(folder: Path) -> None:
    path = folder / "SKILL.md"
    path.write_text(path.read_text() + "x" * 300_000)


def _renamed_folder(folder: Path) -> None:
    folder.rename(folder.with_name(folder.name + "-old"))


@pytest.mark.parametrize("break_it", [_link_loop, _folder_loop, _directory_named_skill_md, _huge,
                                      _renamed_folder])
def test_an_unreadable_skill_is_a_problem_never_a_removal(lib, store, break_it):
    """A link loop, a directory named SKILL.md, a file too large to be a skill, a folder renamed
    by hand: reported, and the stored version keeps serving."""
    lib.add(Skill(name="small-commits", description="Commit small.", body="One change each."))
    break_it(lib.directory / "backup-before-modify")
    reopened = SkillLibrary(lib.directory, store)
    assert reopened.generation == 1 and store.latest_generation() == 1
    assert reopened.get("backup-before-modify").category == "safety"
    assert len(reopened.problems) == 1 and "keeping its version" in reopened.problems[0].reason


def test_a_change_never_writes_over_a_hand_edit_not_yet_recorded(lib, store):
    """The user saved the file; before the watcher records it, a process edits or removes the
    same skill: refused as a conflict, the file untouched; once recorded, a change made from the
    recorded version goes through."""
    import dataclasses

    path = lib.directory / "backup-before-modify" / "SKILL.md"
    stored = lib.get("backup-before-modify")
    hand = path.read_text().replace(stored.body, "Edited by hand.")
    path.write_text(hand)
    evolved = dataclasses.replace(stored, body=stored.body + "\nAn evolved line.")
    with pytest.raises(SkillConflict, match="backup-before-modify: changed in"):
        lib.edit(evolved, base=stored.content_hash)
    with pytest.raises(SkillConflict):
        lib.remove("backup-before-modify")
    assert path.read_text() == hand and store.latest_generation() == 0
    assert lib.reload() == 1 and lib.get("backup-before-modify").body == "Edited by hand."
    recorded = lib.get("backup-before-modify")
    assert lib.edit(dataclasses.replace(recorded, body="Edited by hand, then evolved."),
                    base=recorded.content_hash) == 2


def test_starter_skills_are_well_formed():
    skills, problems = load_skills_dir(starter_skills_dir())
    assert problems == []
    assert 6 <= len(skills) <= 8
    for s in skills.values():
        assert s.category != "general" and len(s.description) > 30 and len(s.body) > 300
        assert Skill.from_markdown(s.to_markdown()) == s
        # they ship with the keys the evolver writes: a "use when" line, nine anticipated asks
        # and six near-miss asks, none cut
        assert s.use_when and len(s.anticipated_asks) == 9 and len(s.near_miss_asks) == 6
        assert all(len(a) < EXAMPLE_ASK_CHARS for a in s.anticipated_asks + s.near_miss_asks)


# -- generations ---------------------------------------------------------------------------------

def test_init_generation_then_reopen_is_stable(lib, store):
    assert lib.generation == 0
    assert store.generation(0)["kind"] == "init"
    assert [e["op"] for e in store.skill_events(0)] == ["add"]
    again = SkillLibrary(lib.directory, store)
    assert again.generation == 0 and store.latest_generation() == 0
    assert again.skills() == lib.skills()


def test_add_edit_remove_import_rollback_and_diff(lib, store, tmp_path):
    seen: list[int] = []
    lib.subscribe(seen.append)
    root = lib.directory

    g1 = lib.add(skill("check-units", body="Always state units.\nRound to 2 decimals."),
                 reason="users asked", evidence=[7, 9])
    assert g1 == 1 and (root / "check-units" / "SKILL.md").read_text().endswith(
        "Round to 2 decimals.\n")

    g2 = lib.edit(skill("check-units", body="Always state units.\nRound to 3 decimals."),
                  reason="precision", evidence=[11])
    assert g2 == 2 and "3 decimals" in (root / "check-units" / "SKILL.md").read_text()

    g3 = lib.remove("backup-before-modify", reason="obsolete")
    assert g3 == 3 and not (root / "backup-before-modify").exists()

    other = tmp_path / "upstream"
    write_skill(other, "new-one", "---\nname: new-one\ndescription: Imported.\n---\nHi.")
    write_skill(other, "check-units", "---\nname: check-units\ndescription: Changed.\n---\nX.")
    write_skill(other, "broken", "---\nname: broken\n---\n")
    g4 = lib.import_dir(other)
    assert g4 == 4 and store.generation(4)["kind"] == "import"
    assert {e["op"]: e["skill_name"] for e in store.skill_events(4)} == {
        "add": "new-one", "edit": "check-units"}
    assert any(p.path.endswith("broken/SKILL.md") for p in lib.problems)
    assert lib.import_dir(other) == 4  # nothing new: no new generation

    d = lib.diff(1, 2)
    assert isinstance(d, SkillDiff) and (d.added, d.removed) == ([], [])
    [edited] = d.edited
    assert edited.name == "check-units"
    assert "-Round to 2 decimals." in edited.unified_diff
    assert "+Round to 3 decimals." in edited.unified_diff
    assert [(e["op"], e["evidence"], e["reason"]) for e in d.events] == [("edit", [11], "precision")]

    d = lib.diff(0, 4)
    assert [s.name for s in d.added] == ["check-units", "new-one"]
    assert [s.name for s in d.removed] == ["backup-before-modify"]
    assert d.edited == []
    assert [e["generation"] for e in d.events] == [1, 2, 3, 4, 4]
    assert d.events[0]["evidence"] == [7, 9]
    json.dumps(d.to_dict())
    text, page = str(d), d._repr_html_()
    assert "+ new-one" in text and "- backup-before-modify" in text and "new-one" in page

    g5 = lib.rollback(1)
    assert g5 == 5 and store.generation(5)["kind"] == "rollback"
    assert store.generation(5)["parent"] == 4
    assert lib.snapshot(5) == lib.snapshot(1)
    assert sorted(p.name for p in root.iterdir()) == ["backup-before-modify", "check-units"]
    assert Skill.from_markdown((root / "check-units" / "SKILL.md").read_text()) == \
        lib.snapshot(1)["check-units"]
    assert lib.diff(1, 5).empty
    assert seen == [1, 2, 3, 4, 5]

    rows = lib.generations()
    assert [r["kind"] for r in rows] == ["init", "add", "edit", "remove", "import", "rollback"]
    assert "snapshot" not in rows[0] and rows[4]["skills"] == 2

    # a fresh process sees the same library, without a new generation
    reopened = SkillLibrary(root, Store(store.target))
    assert reopened.generation == 5 and reopened.skills() == lib.skills()


def test_apply_validates_everything_before_changing_anything(lib, store):
    before_files = {p: p.read_text() for p in lib.directory.rglob("*") if p.is_file()}
    before = lib.current()
    bad_batches = [
        [SkillOp("add", skill("fresh")), SkillOp("edit", skill("missing"))],
        [SkillOp("add", skill("fresh")), SkillOp("rename", skill("fresh"))],
        [SkillOp("add", skill("backup-before-modify"))],
        [SkillOp("remove", None, "fresh")],
        [SkillOp("add", skill("fresh")), SkillOp("add", skill("fresh"))],
        [SkillOp("add", skill("fresh"), "other-name")],
        [SkillOp("add", None, "fresh")],
        [SkillOp("add", skill("fresh"), evidence=["turn-1"])],
        [],
    ]
    for ops in bad_batches:
        with pytest.raises(SkillFormatError):
            lib.apply(ops)
    assert lib.current() == before
    assert store.latest_generation() == 0
    assert {p: p.read_text() for p in lib.directory.rglob("*") if p.is_file()} == before_files


def test_apply_several_ops_is_one_generation(lib, store):
    g = lib.apply([SkillOp("add", skill("one")), SkillOp("add", skill("two")),
                   SkillOp("edit", skill("one", body="changed")),
                   SkillOp("remove", None, "backup-before-modify", reason="r", evidence=[3])],
                  kind="evolve", reason="batch")
    assert g == 1 and [s.name for s in lib.skills()] == ["one", "two"]
    assert lib.get("one").body == "changed"
    row = store.generation(1)
    assert (row["kind"], row["reason"], row["parent"]) == ("evolve", "batch", 0)
    assert [e["op"] for e in store.skill_events(1)] == ["add", "add", "edit", "remove"]


def test_files_edited_on_disk_become_a_disk_generation(lib, store):
    path = lib.directory / "backup-before-modify" / "SKILL.md"
    path.write_text(path.read_text().replace("Then edit it.", "Then edit it carefully."))
    write_skill(lib.directory, "handmade", "---\nname: handmade\ndescription: By hand.\n---\n")
    reopened = SkillLibrary(lib.directory, store)
    assert reopened.generation == 1 and store.generation(1)["kind"] == "disk"
    assert {(e["op"], e["skill_name"]) for e in store.skill_events(1)} == {
        ("edit", "backup-before-modify"), ("add", "handmade")}
    assert "+2. Then edit it carefully." in reopened.diff(0, 1).edited[0].unified_diff


def test_refresh_picks_up_changes_made_by_another_process(lib, store):
    seen: list[int] = []
    lib.subscribe(seen.append)
    other = SkillLibrary(lib.directory, Store(store.target))  # e.g. the `metaclaw skills` command
    other.add(skill("from-elsewhere"))
    other.rollback(0)
    assert lib.generation == 0 and "from-elsewhere" not in lib
    assert lib.sync() == 2 and seen == [2]
    assert lib.snapshot(2) == lib.snapshot(0) and lib.sync() == 2 and seen == [2]
    path = lib.directory / "backup-before-modify" / "SKILL.md"
    path.write_text(path.read_text().replace("safety", "care"))
    assert lib.reload() == 3 and lib.get("backup-before-modify").category == "care"
    assert seen == [2, 3]


def test_remove_keeps_other_files_of_the_skill_folder(lib):
    extra = lib.directory / "backup-before-modify" / "helper.sh"
    extra.write_text("echo hi\n")
    lib.remove("backup-before-modify")
    assert extra.read_text() == "echo hi\n"
    assert not (lib.directory / "backup-before-modify" / "SKILL.md").exists()
    assert "backup-before-modify" not in lib


def test_a_file_instead_of_a_folder_is_a_clear_error(tmp_path, store):
    path = tmp_path / "skills.txt"
    path.write_text("x")
    with pytest.raises(SkillFormatError, match="is a file; pass a folder"):
        SkillLibrary(path, store)
    fresh = SkillLibrary(tmp_path / "new" / "skills", store)
    assert fresh.directory.is_dir() and fresh.skills() == [] and fresh.generation == 0


def test_lookups_and_frames(lib):
    with pytest.raises(KeyError) as err:
        lib.get("nope")
    assert "no skill named 'nope'" in str(err.value) and isinstance(err.value, SkillNotFound)
    with pytest.raises(KeyError, match="generation 42 does not exist"):
        lib.snapshot(42)
    frame = lib.frame()
    assert frame.columns == ["name", "category", "stage", "description", "chars", "hash"]
    assert frame["name"].to_list() == ["backup-before-modify"]
    assert "backup-before-modify" in lib._repr_html_()


def test_readers_see_consistent_generations_while_writers_change_the_library(lib):
    errors: list[str] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            generation, skills = lib.current()
            expected = sorted(lib.snapshot(generation).values(), key=lambda s: s.name)
            if skills != expected:
                errors.append(f"generation {generation} inconsistent")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(15):
            lib.add(skill(f"s{i}"))
            if i % 3 == 0:
                lib.remove(f"s{i}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert lib.generation == 20


_CRASHING_IMPORT = """
import os, sys
from pathlib import Path
import metaclaw.skills.library as skills
from metaclaw.store import Store

folder, db, source, crash = sys.argv[1:5]
if crash in ("mid-write", "mid-fill"):  # the process dies (kill -9 alike) after two files
    write, written = skills._atomic_write, []
    def dying(path, text):
        if path.name == "SKILL.md":
            written.append(path)
            if len(written) > 2:
                os._exit(9)
        write(path, text)
    skills._atomic_write = dying
else:  # the process dies right after the commit, its journal still in the folder
    unlink = Path.unlink
    def dying(self, *args, **kwargs):
        if self.name.startswith(skills.JOURNAL_PREFIX):
            os._exit(9)
        unlink(self, *args, **kwargs)
    Path.unlink = dying
library = skills.SkillLibrary(folder, Store(db))  # a new, empty folder fills from the store
library.import_dir(source)
"""


@pytest.mark.parametrize("crash", ["mid-write", "mid-write, then a hand edit", "after-commit"])
def test_a_change_whose_process_dies_leaves_no_half_written_skills(lib, store, tmp_path, crash):
    """A process killed while writing a change's files (before it commits): the next library to
    take the write lock puts the files back (except one edited since: the user's), so no
    half-done change is ever read from the folder as a generation. Killed after committing: the
    files are the generation's, kept."""
    import subprocess
    import sys

    source = tmp_path / "incoming"
    for n in range(5):
        write_skill(source, f"imported-{n}", f"---\nname: imported-{n}\ndescription: Skill {n}."
                                             f"\n---\n\nBody {n}.\n")
    before = sorted(p.parent.name for p in lib.directory.glob("*/SKILL.md"))
    proc = subprocess.run([sys.executable, "-c", _CRASHING_IMPORT, str(lib.directory),
                           str(store.target), str(source), crash.split(",")[0]],
                          capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    if crash.endswith("a hand edit"):  # the user edits a file the dead change had written
        write_skill(lib.directory, "imported-0", "---\nname: imported-0\ndescription: Skill 0."
                                                 "\n---\n\nWritten by hand after the crash.\n")
    assert list(lib.directory.glob(".metaclaw-change-*"))  # the journal was left behind
    reopened = SkillLibrary(lib.directory, store)
    assert not list(lib.directory.glob(".metaclaw-change-*"))
    on_disk = sorted(p.parent.name for p in lib.directory.glob("*/SKILL.md"))
    if crash == "mid-write":
        assert store.latest_generation() == 0 and reopened.generation == 0
        assert on_disk == before and [s.name for s in reopened.skills()] == before
    elif crash == "mid-write, then a hand edit":
        assert store.latest_generation() == 1 and reopened.generation == 1  # the edit, recorded
        assert on_disk == sorted(before + ["imported-0"])
        assert reopened.get("imported-0").body == "Written by hand after the crash."
    else:
        assert store.latest_generation() == 1 and reopened.generation == 1
        assert on_disk == sorted(before + [f"imported-{n}" for n in range(5)])


def test_a_fill_from_the_store_cut_short_is_completed(lib, store, tmp_path):
    """A new, empty folder for the workspace is being filled when its process is killed: the
    next library completes the fill; the folder is never read as skills removed."""
    import subprocess
    import sys

    for n in range(4):
        lib.add(Skill(name=f"extra-{n}", description=f"Extra {n}.", body=f"Body {n}."))
    checkout = tmp_path / "checkout"
    proc = subprocess.run([sys.executable, "-c", _CRASHING_IMPORT, str(checkout),
                           str(store.target), str(tmp_path / "none"), "mid-fill"],
                          capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert 1 <= len(list(checkout.glob("*/SKILL.md"))) < 5  # cut short
    reopened = SkillLibrary(checkout, store)
    assert reopened.generation == store.latest_generation() == 4
    assert len(list(checkout.glob("*/SKILL.md"))) == 5 and not list(checkout.glob(".metaclaw-*"))


def test_a_skill_too_large_to_load_is_refused_when_added(lib):
    """The loader refuses a SKILL.md over MAX_SKILL_BYTES, so the library refuses to write one:
    a skill it could not read back could never be changed again."""
    from metaclaw.skills.library import MAX_SKILL_BYTES

    big = Skill(name="big", description="Too big.", body="x" * (MAX_SKILL_BYTES + 1))
    with pytest.raises(SkillFormatError, match="more than a skill may be"):
        lib.add(big)
    assert "big" not in lib and not (lib.directory / "big").exists()


def test_operations_made_from_an_older_generation_are_refused(lib, store):
    """Two processes evolve from generation 0; the second's proposal is refused, not applied on
    top of the first's without having seen it."""
    other = SkillLibrary(lib.directory, store)  # another process, still at generation 0
    lib.add(Skill(name="first-evolve", description="From process one.", body="One."))
    op = SkillOp("add", Skill(name="second-evolve", description="Two.", body="Two."),
                 "second-evolve")
    with pytest.raises(SkillConflict, match="moved from generation 0 to 1"):
        other.apply([op], kind="evolve", base_generation=0)
    assert store.latest_generation() == 1 and "second-evolve" not in other
    assert other.apply([op], kind="evolve", base_generation=1) == 2


# -- hostile files: what a hand edit, an imported folder or a model can put in a skill ------------
_ANY_TEXT = st.text(st.characters(exclude_categories=()) | st.sampled_from(
    ["\ud83d", "\udc80", "\x85", "\u2028", "\x00"]), max_size=40)


@settings(max_examples=300, deadline=None)
@given(description=_ANY_TEXT, category=_ANY_TEXT, body=_ANY_TEXT,
       extra=st.dictionaries(st.sampled_from(["tags", "note", "metadata"]),
                             _ANY_TEXT | st.floats() | st.lists(_ANY_TEXT, max_size=2),
                             max_size=2))
@example(description="d", category="", body="half an emoji \ud83d", extra={})
@example(description="d", category="", body="", extra={"weight": float("nan")})
def test_a_skill_is_refused_with_a_reason_or_writable_to_its_file_and_the_store(
        description, category, body, extra):
    """Any text, lone surrogates (half an emoji) and NaN included: a Skill either refuses it
    with a SkillFormatError or can be written to SKILL.md and to the store (UTF-8 JSON, where a
    NaN would become null) and reads back equal from both."""
    try:
        s = Skill("any", description, category or "general", body, extra)
    except SkillFormatError:
        return
    text = s.to_markdown()
    text.encode("utf-8")
    stored = json.dumps(s.to_dict(), ensure_ascii=False, allow_nan=False)
    stored.encode("utf-8")
    assert Skill.from_markdown(text) == s and Skill.from_dict(json.loads(stored)) == s


@pytest.mark.parametrize("front, reason", [
    ('description: "half an emoji \\uD83D"', "lone surrogate"),
    ("description: d\nweight: .nan", "NaN or infinite"),
    ("description: d\nx: " + "[" * 3000 + "]" * 3000, "nested too deeply"),
    ("description: d\na: &a [x, *a]", "inside the value it names"),
])
def test_a_hostile_front_matter_is_a_problem_and_other_hand_edits_still_go_through(
        lib, store, front, reason):
    """Each of these files used to raise out of the load (UnicodeEncodeError, RecursionError)
    or be recorded again by every process opening the workspace (NaN, which the store writes as
    null): the proxy could not start and no later hand edit was recorded."""
    write_skill(lib.directory, "hostile", f"---\nname: hostile\n{front}\n---\nBody.\n")
    path = lib.directory / "backup-before-modify" / "SKILL.md"
    path.write_text(path.read_text().replace("Then edit it.", "Then edit it, carefully."))
    assert lib.reload() == 1
    assert lib.get("backup-before-modify").body.endswith("carefully.")
    [problem] = lib.problems
    assert problem.path.endswith("hostile/SKILL.md") and reason in problem.reason
    assert SkillLibrary(lib.directory, store).generation == 1  # another process: no new one


def test_yaml_aliases_cannot_make_a_small_file_expand_to_gigabytes(tmp_path):
    """Levels of ten aliases each: each level multiplies by ten what the front matter expands
    to when it is copied (six levels, 370 bytes: a second; nine: minutes and gigabytes, while the
    library holds its write lock). Six levels here, so that a regression fails, not hangs."""
    lines = ["---", "name: laughs", "description: d", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 6)]
    write_skill(tmp_path, "laughs", "\n".join([*lines, "---", "Body."]))
    skills, [problem] = load_skills_dir(tmp_path)
    assert skills == {} and "aliases (*name) expand the front matter" in problem.reason


ANCHORED = """---
name: deploy-checklist
description: Steps before a release.
category: ops
metadata: &shared
  owner: platform-team
  review: weekly
x-defaults:
  <<: *shared
  review: daily
---
Check the config, run the tests, tag the release.
"""


def test_a_front_matter_sharing_values_through_anchors_still_loads_and_stays_editable(
        tmp_path, store):
    """Anchors and aliases (a merge key of shared defaults) are legitimate YAML that skill
    files written before aliases were bounded may hold: refusing them left such a skill out of
    every new workspace, and in an existing one kept it at its stored version with every
    change to it refused as a hand edit not yet recorded ("retry then", forever)."""
    write_skill(tmp_path / "skills", "deploy-checklist", ANCHORED)
    lib = SkillLibrary(tmp_path / "skills", store)
    assert lib.problems == []
    loaded = lib.get("deploy-checklist")
    assert loaded.extra["x-defaults"] == {"owner": "platform-team", "review": "daily"}
    lib.edit(Skill(loaded.name, loaded.description, loaded.category,
                   loaded.body + "\nAnnounce it.", loaded.extra), reason="evolver")
    assert lib.get("deploy-checklist").body.endswith("Announce it.")


def test_a_skill_folder_linked_from_elsewhere_is_never_written_or_deleted_through(
        lib, tmp_path):
    """A folder linked in by hand (a team's shared skill) is read through the link; an edit by
    the library (the evolver, a rollback) makes a copy in the library and a removal removes only
    the link: the shared file is never changed or deleted."""
    shared = tmp_path / "team" / "shared-skill"
    original = skill("shared-skill", body="The team's text.").to_markdown()
    write_skill(shared.parent, "shared-skill", original)
    (shared / "helper.sh").write_text("echo resource\n")
    (lib.directory / "shared-skill").symlink_to(shared)
    assert lib.reload() == 1 and lib.get("shared-skill").body == "The team's text."

    lib.edit(skill("shared-skill", body="Evolved text."))
    assert (shared / "SKILL.md").read_text() == original
    copy = lib.directory / "shared-skill"
    assert not copy.is_symlink() and (copy / "helper.sh").read_text() == "echo resource\n"
    assert lib.get("shared-skill").body == "Evolved text."

    (lib.directory / "shared-skill" / "helper.sh").unlink()
    import shutil

    shutil.rmtree(copy)
    copy.symlink_to(shared)
    lib.reload()
    lib.remove("shared-skill")
    assert (shared / "SKILL.md").read_text() == original and not os.path.lexists(copy)


def test_a_linked_skill_folder_is_copied_with_its_files_and_its_links_pointing_where_they_did(
        lib, tmp_path):
    """The copy made before the library writes a linked skill: an entry that cannot be copied
    (here a named pipe) used to make the copy an empty folder, silently losing the skill's
    scripts; a relative link out of the folder (``common -> ../common-scripts``) pointed next
    to the library's copy, at nothing. Now the other files are kept and such a link points
    where it did; a link within the folder stays relative, to the copy's own files."""
    team = tmp_path / "team"
    (team / "common-scripts").mkdir(parents=True)
    (team / "common-scripts" / "lint.sh").write_text("echo lint\n")
    shared = team / "shared-skill"
    write_skill(team, "shared-skill", skill("shared-skill", body="The team's text.").to_markdown())
    (shared / "scripts").mkdir()
    (shared / "scripts" / "run.sh").write_text("echo run\n")
    (shared / "common").symlink_to(os.path.join("..", "common-scripts"))
    (shared / "run").symlink_to(os.path.join("scripts", "run.sh"))
    os.mkfifo(shared / "events.pipe")
    (lib.directory / "shared-skill").symlink_to(shared)
    lib.reload()

    lib.edit(skill("shared-skill", body="Evolved text."))
    copy = lib.directory / "shared-skill"
    assert not copy.is_symlink() and lib.get("shared-skill").body == "Evolved text."
    assert (copy / "scripts" / "run.sh").read_text() == "echo run\n"
    assert (copy / "common" / "lint.sh").read_text() == "echo lint\n"
    assert os.readlink(copy / "run") == os.path.join("scripts", "run.sh")
    assert "The team's text." in (shared / "SKILL.md").read_text()


def test_a_retrieval_key_written_where_it_is_not_read_is_said_once(tmp_path, caplog):
    """`use_when` (the keys writer's JSON spelling) or `use-when` outside `metadata` was ignored
    in silence: the skill matched on its text alone."""
    import logging

    from metaclaw.skills import library as skills

    folder = tmp_path / "skills" / "x"
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text("---\nname: x\ndescription: d\nuse-when: top level\n"
                                     "metadata:\n  example_asks: [a]\n---\nbody\n")
    with caplog.at_level(logging.WARNING, logger="metaclaw.skills.library"):
        skills.load_skills_dir(tmp_path / "skills")
        skills.load_skills_dir(tmp_path / "skills")  # said once per file and key
    said = [r.getMessage() for r in caplog.records if "is not read" in r.getMessage()]
    assert len(said) == 2
    assert any("'use-when' is not read; write the key as metadata.use-when" in m for m in said)
    assert any("'metadata.example_asks'" in m for m in said)
