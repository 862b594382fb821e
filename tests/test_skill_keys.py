"""Retrieval keys for skills that have none (``metaclaw skills keys``, ``Evolver.write_keys``): the
evolver model writes a skill's "use when" line and anticipated asks from the skill alone, over
real HTTP (the offline double answers per skill), and the skills change as one generation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from metaclaw.fastloop.evolver import Evolver
from metaclaw.fastloop.keys import (KEYS_RESPONSE_FORMAT, KEYS_SYSTEM_PROMPT, RETRY_PREFIX,
                                    KeysValidationError, validate_keys)
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.skills.library import (MAX_ANTICIPATED_ASKS, Skill, SkillLibrary, SkillNotFound,
                                     SkillOp)
from metaclaw.store import Store

DATES = Skill("iso-dates", "Write every date as an ISO 8601 datetime with the user's offset.",
              "data", "Use `2026-03-16T09:30:00+08:00`, never `3/16` or `9:30am`.")
BACKUP = Skill("backup-first", "Copy a file before changing it.", "safety",
               "`cp config.yaml config.yaml.bak` before any edit.")
KEYED = Skill("commit-messages", "Write commit messages with an imperative subject.", "coding",
              "Subject under 60 characters.").with_retrieval_keys(
                  use_when="writing commit messages", anticipated=["what do I call this commit?"])


def keys_for(name: str) -> dict:
    return {"use_when": f"requests about {name}",
            "anticipated_asks": [f"short ask about {name}", f"a longer ask about {name}, with a "
                                 "situation", f"a symptom of {name}"],
            "near_miss_asks": [f"nearby work that {name} does not change"]}


def answer(body: dict) -> Reply:
    """The double as an evolver model: keys for the skill in the request; for ``backup-first``,
    an unusable first answer (it is asked again)."""
    text = body["messages"][-1]["content"]
    retried = text.startswith(RETRY_PREFIX)
    skill = json.loads(re.search(r"=== Skill ===\n(.*)\n=== End ===",
                                 body["messages"][1]["content"], re.S).group(1))
    if skill["name"] == "backup-first" and not retried:
        return Reply("I think this skill is about backups.")
    return Reply(json.dumps(keys_for(skill["name"])))


@pytest.fixture()
def library(tmp_path, store):
    lib = SkillLibrary(tmp_path / "skills", store)
    lib.apply([SkillOp("add", s) for s in (DATES, BACKUP, KEYED)], kind="import")
    return lib


def test_keys_are_written_for_the_skills_without_them_as_one_generation(library, store):
    before = library.generation
    with DoubleServer(answer) as double:
        result = Evolver(double.url, "evolver", library, store,
                         dedupe_threshold=None).write_keys()
        bodies = [r["body"] for r in double.requests]
    assert sorted(result.written) == ["backup-first", "iso-dates"]
    assert result.skipped == ["commit-messages"] and result.failed == {}
    assert result.generation == before + 1 == library.generation
    assert store.generation(result.generation)["kind"] == "keys"
    for name in ("backup-first", "iso-dates"):
        skill = library.get(name)
        assert skill.use_when == f"requests about {name}"
        assert skill.anticipated_asks[0] == f"short ask about {name}"
        assert skill.near_miss_asks == (f"nearby work that {name} does not change",)
        text = (library.directory / name / "SKILL.md").read_text()
        assert "anticipated-asks:" in text and "use-when:" in text and "near-miss-asks:" in text
    assert library.get("commit-messages") == KEYED  # it had keys
    # one request per skill, with the schema; the unusable answer was asked again once
    assert len(bodies) == 3
    assert all(b["response_format"] == KEYS_RESPONSE_FORMAT for b in bodies)
    assert sum(b["messages"][-1]["content"].startswith(RETRY_PREFIX) for b in bodies) == 1
    assert '"anticipated_asks" are nine requests' in bodies[0]["messages"][0]["content"]
    assert '"near_miss_asks" are six requests' in bodies[0]["messages"][0]["content"]
    assert KEYS_RESPONSE_FORMAT["json_schema"]["schema"]["required"] == [
        "use_when", "anticipated_asks", "near_miss_asks"]
    events = {e["skill_name"]: e for e in store.skill_events(result.generation)}
    assert set(events) == {"backup-first", "iso-dates"}
    assert "retrieval keys written by the evolver model evolver" in events["iso-dates"]["reason"]


def test_a_hand_written_half_of_the_keys_is_kept(library, store):
    """A person wrote the "use when" line (or the anticipated asks) and not the other: only the
    missing half is written; it was replaced whole."""
    half = Skill("half-keyed", "Convert Markdown tables to HTML.", "docs", "Use pandoc.")
    library.apply([SkillOp("add", half.with_retrieval_keys(use_when="for the wiki's tables")),
                   SkillOp("edit", BACKUP.with_retrieval_keys(anticipated=["back it up?"]),
                           base=BACKUP.content_hash)], kind="import")
    with DoubleServer(answer) as double:
        written = Evolver(double.url, "evolver", library, store,
                          dedupe_threshold=None).write_keys(["half-keyed", "backup-first"])
    assert sorted(written.written) == ["backup-first", "half-keyed"]
    kept = library.get("half-keyed")
    assert kept.use_when == "for the wiki's tables"  # the person's
    assert kept.anticipated_asks[0] == "short ask about half-keyed"  # the missing half
    other = library.get("backup-first")
    assert other.anticipated_asks == ("back it up?",) and other.use_when == \
        "requests about backup-first"


def test_named_skills_rewrite_and_failures_are_reported_without_losing_the_others(library,
                                                                                  store):
    def flaky(body: dict) -> Reply:
        if "iso-dates" in body["messages"][1]["content"]:
            return Reply("the model is overloaded", status=400)
        return answer(body)

    with DoubleServer(flaky) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None,
                          retries=0)
        result = evolver.write_keys(["iso-dates", "commit-messages"], rewrite=True)
        with pytest.raises(SkillNotFound, match="no skill named 'ghost'"):
            evolver.write_keys(["ghost"])
    assert result.written == ["commit-messages"]
    assert "iso-dates" in result.failed and "400" in result.failed["iso-dates"]
    assert library.get("commit-messages").use_when == "requests about commit-messages"
    assert library.get("iso-dates") == DATES and library.get("backup-first") == BACKUP
    assert "iso-dates: " in str(result)


@pytest.mark.parametrize("reply, problem", [
    ("no json here", "no JSON object"),
    ('{"use_when": "", "anticipated_asks": ["a"]}', "'use_when' must be a non-empty"),
    ('{"use_when": "x", "anticipated_asks": "a"}', "must be a list of strings"),
    ('{"use_when": "x", "anticipated_asks": [" ", ""]}', "at least one ask"),
    ('{"use_when": "x", "anticipated_asks": ["<ask>", "<ask>"]}', "at least one ask"),
    (KEYS_SYSTEM_PROMPT.rsplit("\n", 1)[-1], "repeats the template's placeholders"),
])
def test_unusable_replies_say_what_is_wrong(reply, problem):
    with pytest.raises(KeysValidationError, match=problem):
        validate_keys(reply)
    # a copy of the template before the real answer is passed over; placeholders are dropped
    template = KEYS_SYSTEM_PROMPT.rsplit("\n", 1)[-1]
    assert validate_keys(template + ' {"use_when": "dates in files", "anticipated_asks": '
                         '["<ask>", "csv dates?"], "near_miss_asks": ["<ask>", "sort the csv"]}'
                         ) == ("dates in files", ["csv dates?"], ["sort the csv"])
    asks = [f" ask {i} " for i in range(MAX_ANTICIPATED_ASKS + 1)]
    # near-miss asks may be left out (an older model's reply): the skill gets none
    assert validate_keys('Sure: {"use_when": " dates\\n in files ", "anticipated_asks": '
                         + json.dumps(asks) + "}") == \
        ("dates in files", [a.strip() for a in asks[:MAX_ANTICIPATED_ASKS]], [])
    with pytest.raises(KeysValidationError, match="'near_miss_asks' must be a list of strings"):
        validate_keys('{"use_when": "x", "anticipated_asks": ["a"], "near_miss_asks": "b"}')


def test_the_cli_writes_keys_and_asks_for_the_evolver(library, store, tmp_path):
    db, skills = str(store.path), str(library.directory)
    store.close()
    cli = [sys.executable, "-m", "metaclaw", "skills", "keys", "--db", db, "--skills", skills]
    missing = subprocess.run(cli, capture_output=True, text=True)
    assert missing.returncode == 2 and "--evolver-url URL --evolver-model M" in missing.stderr
    with DoubleServer(answer) as double:
        out = subprocess.run([*cli, "--evolver-url", double.url, "--evolver-model", "e",
                              "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert sorted(result["written"]) == ["backup-first", "iso-dates"]
    assert result["skipped"] == ["commit-messages"]


REAL = {"upstream_url": "http://127.0.0.1:9/v1", "model": "m", "judge_url": "http://127.0.0.1:9/v1",
        "judge_model": "j", "evolver_url": "http://127.0.0.1:9/v1", "evolver_model": "e"}


@pytest.mark.parametrize("options, expected", [
    ({"simulated": True}, False),  # the rule-based evolver writes no keys
    (REAL, True),
    ({**REAL, "auto_keys": False}, False),
])
def test_the_fast_loop_writes_missing_keys_only_with_a_language_model_as_evolver(
        tmp_path, options, expected):
    from metaclaw.runtime import Runtime

    runtime = Runtime.start(db_path=str(tmp_path / "ws.db"), skills_dir=str(tmp_path / "skills"),
                            retrieval="lexical", **options)
    try:
        assert runtime.fast_loop.auto_keys is expected
    finally:
        runtime.stop()


def test_serve_with_the_fast_loop_writes_the_missing_keys_and_says_so(library, store, tmp_path):
    """`metaclaw serve --auto-evolve` in a process of its own: the note names the fast loop, the
    evolver model (here the upstream, as by default) is asked for the skills without keys, and
    the new generation reaches the skill folders and every process."""
    db, skills = str(store.path), str(library.directory)
    store.close()
    with DoubleServer(answer) as double:
        proc = subprocess.Popen(
            [sys.executable, "-m", "metaclaw", "serve", "--upstream", double.url, "--model", "m",
             "--db", db, "--skills", skills, "--port", "0", "--auto-evolve"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines, deadline = [], time.monotonic() + 120
            while not any("retrieval keys written for" in line for line in lines):
                assert time.monotonic() < deadline, f"no keys written in 120 s: {lines}"
                line = proc.stdout.readline()
                assert line, f"serve exited: {lines} {proc.stderr.read()}"
                lines.append(line)
        finally:
            proc.terminate()
            _, errors = proc.communicate(timeout=30)
    assert "2 of 3 skills lack retrieval keys" in errors and "fast loop has the evolver" in errors
    assert "backup-first" in lines[-1] and "iso-dates" in lines[-1]
    with Store(db) as other:  # what any other process of the workspace sees
        fresh = SkillLibrary(skills, other)
        assert fresh.get("iso-dates").anticipated_asks == tuple(
            keys_for("iso-dates")["anticipated_asks"])
        assert other.generation(fresh.generation)["kind"] == "keys"
    assert "anticipated-asks" in (tmp_path / "skills" / "backup-first" / "SKILL.md").read_text()
