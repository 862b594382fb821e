"""The skill evolver against the offline double: validation, retry, dedupe, lineage and
verified promotion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from metaclaw import buffers
from metaclaw.fastloop.evolver import (EVOLVER_RESPONSE_FORMAT, EvolveError, Evolver,
                                       EvolveValidationError, parse_evolver_prompt,
                                       validate_operations)
from metaclaw.fastloop.judge import SECTION_REPLY, Judge, parse_judge_prompt
from metaclaw.fastloop.keys import RETRY_PREFIX
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.skills.block import inject, render_block, strip_skill_block
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.skills.retrieval import LexicalRetriever, ScoredSkill

BACKUP = Skill("backup-before-modify", "Keep a copy of a file before changing it.", "safety",
               "Before editing or deleting a file, copy it to a .bak file so the change can be "
               "undone. Check the copy exists before you modify the original.")
CITE = Skill("cite-sources", "Name where each fact comes from.", "research",
             "When you state a fact, say which document or tool result it came from.")


@pytest.fixture
def library(tmp_path, store):
    folder = tmp_path / "skills"
    for skill in (BACKUP, CITE):
        (folder / skill.name).mkdir(parents=True)
        (folder / skill.name / "SKILL.md").write_text(skill.to_markdown())
    return SkillLibrary(folder, store)


def record(store, library, text, reply, reward=None, session="s1", rationale=None, system=None):
    """Record a turn the way the proxy does (conversation so far + new user message)."""
    previous = store.turns("session_id = ?", (session,), order="turn_index")
    messages = [{"role": "system", "content": system or "You are helpful."}]
    for row in previous:
        messages += [m for m in row["request_messages"] if m["role"] != "system"]
        messages.append({"role": "assistant", "content": row["response"]})
    messages.append({"role": "user", "content": text})
    turn_id = store.record_turn(session_id=session, request_messages=messages, status="ok",
                                response=reply, skill_generation=library.generation,
                                model="agent")
    if reward is not None:
        store.update_turn(turn_id, reward=float(reward), judge_rationale=rationale,
                          judged_at=1.0)
    return turn_id


def op(op, name, description="", body="", reason="because", evidence=(), category=""):
    return {"op": op, "name": name, "description": description, "category": category,
            "body": body, "reason": reason, "evidence": list(evidence)}


def ops_reply(*ops) -> Reply:
    return Reply(content=json.dumps({"operations": list(ops)}))


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def evolver_requests(double):
    return [r["body"] for r in double.requests if r["body"] and r["body"]["model"] == "evolver"]


# -- applying with lineage ---------------------------------------------------------------------
def test_evolve_applies_with_lineage_and_moves_the_buffers(store, library):
    fail = record(store, library, "Convert 5 miles to km", "5 miles is 5 km.", reward=-1,
                  rationale="wrong conversion factor")
    record(store, library, "That's wrong, a mile is longer than a km!", "Sorry, 8.05 km.",
           reward=1)
    buffers.refresh(store)
    assert [t["id"] for t in buffers.support_set(store)] == [fail]
    new = op("add", "unit-conversion", "Convert units with the exact factor.",
             "One mile is 1.609 km. Show the factor you used.", "miles were treated as km",
             [fail, 12345], category="math")
    with DoubleServer([ops_reply(new)]) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        result = evolver.evolve()
        [body] = evolver_requests(double)
    assert result.applied and result.status == "applied"
    assert result.parent == 0 and result.generation == 1 == library.generation
    assert library.get("unit-conversion").body.startswith("One mile is 1.609 km.")
    assert (library.directory / "unit-conversion" / "SKILL.md").is_file()
    # lineage: parent generation and per-operation evidence (unknown ids dropped)
    assert store.generation(1)["parent"] == 0 and store.generation(1)["kind"] == "evolve"
    [event] = store.skill_events(1)
    assert (event["op"], event["skill_name"], event["evidence"]) == ("add", "unit-conversion",
                                                                      [fail])
    assert event["reason"] == "miles were treated as km"
    # buffers: the support turn is consumed, the old query turn purged
    assert result.consumed == [fail] and result.purged == 1
    assert buffers.support_set(store, 0, state="consumed")[0]["id"] == fail
    assert [t["buffer_state"] for t in buffers.query_set(store, 0, state=None)] == ["purged"]
    # what the evolver saw
    assert body["response_format"] == EVOLVER_RESPONSE_FORMAT
    prompt = parse_evolver_prompt(body["messages"][-1]["content"])
    [item] = prompt["support"]
    assert item["id"] == fail and item["reply"] == "5 miles is 5 km."
    assert "Convert 5 miles to km" in item["task"]
    assert item["rationale"] == "wrong conversion factor"
    assert item["feedback"] == "That's wrong, a mile is longer than a km!"
    assert prompt["generation"] == 0
    assert {s["name"] for s in prompt["library"]} == {"backup-before-modify", "cite-sources"}
    assert all(set(s) == {"name", "description", "category", "stage", "body"}
               for s in prompt["library"])
    assert item["turn_type"] == "main" and all(s["stage"] is None for s in prompt["library"])


def test_an_added_skill_keeps_the_evolvers_retrieval_keys_on_disk(store, library):
    """The "use when" line and the anticipated asks the evolver writes reach the skill's SKILL.md
    (metadata map) through a real HTTP round trip."""
    fail = record(store, library, "Convert 5 miles to km", "5 miles is 5 km.", reward=-1,
                  rationale="wrong conversion factor")
    buffers.refresh(store)
    new = {**op("add", "unit-conversion", "Convert units with the exact factor.",
                "One mile is 1.609 km.", "miles were treated as km", [fail], category="math"),
           "use_when": "converting distances, weights or temperatures",
           "anticipated_asks": ["how far is 10k in miles?", "my running app and my watch "
                                "disagree about today's distance"]}
    with DoubleServer([ops_reply(new)]) as double:
        assert Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve().applied
    skill = library.get("unit-conversion")
    assert skill.use_when == "converting distances, weights or temperatures"
    assert skill.anticipated_asks == tuple(new["anticipated_asks"])
    text = (library.directory / "unit-conversion" / "SKILL.md").read_text()
    assert "anticipated-asks:" in text and "how far is 10k in miles?" in text


def test_edit_and_remove_keep_unspecified_fields(store, library):
    fail = record(store, library, "Edit config.yaml", "Edited it in place.", reward=-1)
    buffers.refresh(store)
    reply = ops_reply(op("edit", "backup-before-modify", body="Copy the file first, always.",
                         evidence=[fail]),
                      op("remove", "cite-sources", reason="caused long replies"))
    with DoubleServer([reply]) as double:
        result = Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
    assert result.applied
    edited = library.get("backup-before-modify")
    assert edited.body == "Copy the file first, always."
    assert edited.description == BACKUP.description and edited.category == "safety"
    assert "cite-sources" not in library
    events = store.skill_events(result.generation)
    assert [(e["op"], e["evidence"]) for e in events] == [("edit", [fail]), ("remove", [fail])]


def test_dry_run_and_empty_support_change_nothing(store, library):
    with DoubleServer([]) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        result = evolver.evolve()
        assert result.status == "no_support" and double.requests == []
        fail = record(store, library, "q", "bad", reward=-1)
        double.add(ops_reply(op("add", "new-one", "d", "b", evidence=[fail])))
        dry = evolver.evolve(dry_run=True)
        double.add(ops_reply())
        nothing = evolver.evolve()
    assert dry.status == "dry_run" and [o.name for o in dry.proposal.ops] == ["new-one"]
    assert nothing.status == "no_change"
    assert library.generation == 0 and "new-one" not in library
    assert store.turn(fail)["buffer_state"] == "live"


def test_a_dry_run_proposal_can_be_applied_later_unless_the_library_moved(store, library):
    fail = record(store, library, "q", "bad", reward=-1)
    replies = [ops_reply(op("add", "reviewed", "d", "b", evidence=[fail]))] * 2
    with DoubleServer(replies) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        first = evolver.evolve(dry_run=True).proposal
        second = evolver.propose()
        result = evolver.apply(first)
        assert len(evolver_requests(double)) == 2
    assert result.applied and result.generation == library.generation == 1
    assert "reviewed" in library and store.turn(fail)["buffer_state"] == "consumed"
    with pytest.raises(EvolveError, match="library changed") as err:
        evolver.apply(second)
    assert err.value.kind == "conflict"  # not a failed call: `metaclaw evolve` records none
    assert library.generation == 1


def test_another_process_committing_between_the_check_and_the_write_is_a_conflict(
        store, library, monkeypatch):
    """Two `metaclaw evolve` at once: the loser's write found the library moved, and that was
    reported as the evolver's answer being unusable (an evolve_failed event)."""
    from metaclaw.skills.library import SkillConflict

    fail = record(store, library, "q", "bad", reward=-1)

    def moved(*args, **kwargs):
        raise SkillConflict("the library moved from generation 0 to 1 since these operations "
                            "were made from it; make them again")

    with DoubleServer([ops_reply(op("add", "raced", "d", "b", evidence=[fail]))]) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        monkeypatch.setattr(library, "apply", moved)
        with pytest.raises(EvolveError, match="library changed since") as err:
            evolver.evolve()
    assert err.value.kind == "conflict"


# -- invalid output ---------------------------------------------------------------------------
def test_invalid_output_is_retried_once_with_the_error(store, library):
    fail = record(store, library, "q", "bad", reward=-1)
    replies = [Reply(content="Sure! I think we should add a skill about units."),
               ops_reply(op("add", "units", "Unit rules.", "Use exact factors.", evidence=[fail]))]
    with DoubleServer(replies) as double:
        result = Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
        second = evolver_requests(double)[1]["messages"]
    assert result.applied and result.proposal.attempts == 2
    assert second[-2] == {"role": "assistant",
                          "content": "Sure! I think we should add a skill about units."}
    assert second[-1]["content"].startswith(RETRY_PREFIX)
    assert '"operations"' in second[-1]["content"]


def test_invalid_output_twice_leaves_library_and_files_unchanged(store, library):
    fail = record(store, library, "q", "bad", reward=-1)
    before_files = files(library.directory)
    before_generations = library.generations()
    replies = [ops_reply(op("add", "Bad Name!", "d", "b")),
               ops_reply(op("edit", "no-such-skill", "d", "b"),
                         op("add", "backup-before-modify", "d", "b"))]
    with DoubleServer(replies) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        with pytest.raises(EvolveError) as info:
            evolver.evolve()
        assert len(evolver_requests(double)) == 2
        second = evolver_requests(double)[1]["messages"][-1]["content"]
    assert "invalid skill name 'Bad Name!'" in second
    error = info.value
    assert error.attempts == 2 and len(error.replies) == 2
    assert "invalid twice" in error.reason
    assert "no skill named 'no-such-skill'" in error.reason
    assert "'backup-before-modify' already exists" in error.reason
    assert files(library.directory) == before_files
    assert library.generations() == before_generations and library.generation == 0
    assert store.turn(fail)["buffer_state"] == "live"


def test_evolver_falls_back_to_plain_json_when_the_schema_is_refused(store, library):
    fail = record(store, library, "q", "bad", reward=-1)

    def reply(body):
        if "response_format" in body:
            return Reply(status=400, content="response_format is not supported by this model")
        return Reply(content="Here you go:\n```json\n" + json.dumps({"operations": [
            op("add", "plain-json", "d", "b", evidence=[fail])]}) + "\n```")
    with DoubleServer(reply) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        result = evolver.evolve()
    assert result.applied and "plain-json" in library and evolver.structured is False


def test_evolver_failure_is_retried_then_reported(store, library, monkeypatch):
    from metaclaw.fastloop import llm

    monkeypatch.setattr(llm, "MAX_RETRY_WAIT_S", 0.05)  # the backoff, not its length
    record(store, library, "q", "bad", reward=-1)
    with DoubleServer([Reply(status=500, content="boom")] * 3) as double:
        with pytest.raises(EvolveError, match="HTTP 500.*tried 3 times"):
            Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
    assert library.generation == 0
    good = ops_reply(op("add", "check-units", "Check the units.", "Convert first."))
    with DoubleServer([Reply(status=429, content="slow down"), good]) as double:
        result = Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
    assert result.applied and library.generation == 1
    record(store, library, "another q", "bad again", reward=-1)
    with DoubleServer([Reply(status=401, content="bad key")] * 3) as double:
        with pytest.raises(EvolveError, match="HTTP 401"):
            Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
        assert len(double.requests) == 1  # a client error is not retried


@pytest.mark.parametrize("answer, message", [
    ([], "must be a JSON object"),
    ({"operations": [op("rename", "x")]}, "'op' must be one of"),
    ({"operations": [op("add", "../etc", "d", "b")]}, "invalid skill name"),
    ({"operations": [op("add", "fresh", "", "b")]}, "non-empty description and body"),
    ({"operations": [op("remove", "ghost")]}, "no skill named 'ghost'"),
    ({"operations": [op("edit", "cite-sources")]}, "changes nothing"),
    ({"operations": [op("add", "x1", "d", "b"), op("remove", "x1")]}, "more than one operation"),
    ({"operations": [{"op": "add", "name": "x2", "description": 3, "body": "b"}]},
     "must be a string"),
])
def test_validation_errors(answer, message):
    with pytest.raises(EvolveValidationError, match=message):
        validate_operations(answer, {"cite-sources": CITE}, [1])


def test_validation_evidence_and_defaults():
    ops = validate_operations({"operations": [
        op("add", "fresh", "d", "b", evidence=[2, "3", 99, True]),
        op("edit", "cite-sources", description="Always cite.", evidence=[])]},
        {"cite-sources": CITE}, [2, 3])
    assert ops[0].evidence == [2, 3] and ops[0].skill.category == "general"
    assert ops[1].evidence == [2, 3]  # no valid evidence: the whole support set
    assert ops[1].skill.body == CITE.body and ops[1].skill.description == "Always cite."


# -- embedding dedupe -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedder():
    from metaclaw.skills.retrieval import make_retriever

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    retriever = make_retriever("embedding", model="minilm")
    retriever.warm([BACKUP])
    return retriever


def test_dedupe_compares_with_minilm_even_when_requests_use_the_static_model(store, library):
    from metaclaw.skills.retrieval import make_retriever

    static = make_retriever("embedding")
    assert static.static
    evolver = Evolver("http://127.0.0.1:9/v1", "evolver", library, store, retriever=static)
    assert evolver.dedupe_retriever().model_id == "minilm"


def test_embedding_dedupe_turns_a_near_duplicate_add_into_an_edit(store, library, embedder):
    fail = record(store, library, "Fix the typo in notes.md", "Rewrote notes.md (lost a line).",
                  reward=-1)
    paraphrase = op("add", "copy-file-before-editing",
                    "Make a backup copy of a file before modifying it.",
                    "Before you edit or delete any file, first copy it to a .bak backup so the "
                    "change can be reverted. Keep the backup until the user confirms the edit.",
                    evidence=[fail])
    duplicate = op("add", "save-backup-first", "Keep a copy of a file before changing it.",
                   "Before editing or deleting a file, copy it to a .bak file so the change "
                   "can be undone.", evidence=[fail])
    different = op("add", "check-timezones", "Convert meeting times to the user's time zone.",
                   "State the zone explicitly.", evidence=[fail])
    with DoubleServer([ops_reply(paraphrase, different, duplicate)]) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=0.85,
                          dedupe_retriever=embedder)
        result = evolver.evolve()
    assert result.applied
    ops = {(o.op, o.name) for o in result.proposal.ops}
    assert ops == {("edit", "backup-before-modify"), ("add", "check-timezones")}
    [merged] = result.proposal.merged
    assert merged["add"] == "copy-file-before-editing" and merged["into"] == "backup-before-modify"
    assert merged["similarity"] >= 0.85
    [dropped] = result.proposal.dropped
    assert dropped["name"] == "save-backup-first"
    assert "copy-file-before-editing" not in library and "save-backup-first" not in library
    body = library.get("backup-before-modify").body
    assert body.startswith(BACKUP.body) and body.endswith("until the user confirms the edit.")
    assert library.get("backup-before-modify").description == BACKUP.description
    # with a threshold above the similarity the add is kept as a new skill
    assert merged["similarity"] < 0.999
    store2_fail = record(store, library, "again", "bad", reward=-1)
    with DoubleServer([ops_reply(op("add", "copy-file-before-editing",
                                    "Make a backup copy of a file before modifying it.",
                                    "Keep it.", evidence=[store2_fail]))]) as double:
        strict = Evolver(double.url, "evolver", library, store, dedupe_threshold=0.999,
                         dedupe_retriever=embedder).evolve()
    assert [(o.op, o.name) for o in strict.proposal.ops] == [("add", "copy-file-before-editing")]


# -- verified promotion -----------------------------------------------------------------------
def roles(evolver_reply: Reply, marker: str):
    """One double for three roles: the evolver, the agent's upstream and the judge.

    The upstream answers badly when ``marker`` is in its system prompt; the judge scores -1 for
    a reply containing "BAD" and +1 otherwise.
    """
    def reply(body):
        if body["model"] == "evolver":
            return evolver_reply
        if body["model"] == "judge":
            text = parse_judge_prompt(body["messages"][-1]["content"])[SECTION_REPLY]
            score = -1 if "BAD" in text else 1
            return Reply(content=json.dumps({"score": score, "rationale": text}))
        system = body["messages"][0]["content"] if body["messages"][0]["role"] == "system" else ""
        return Reply(content="BAD answer" if marker in system else "good answer")
    return reply


def failing_support(store, library, n=3):
    ids = [record(store, library, f"convert {i} miles to kilometers", "BAD", reward=-1,
                  session=f"v{i}", system="You are helpful.\n\n" + render_block(
                      [ScoredSkill(CITE, 1.0)])) for i in range(n)]
    buffers.refresh(store)
    return ids


@pytest.mark.parametrize("marker, accepted", [("SHOUT", False), ("no-such-marker", True)])
def test_verified_promotion(store, library, marker, accepted):
    ids = failing_support(store, library)
    new_skill = op("add", "miles-to-kilometers", "Convert miles to kilometers.",
                   "SHOUT the result: multiply miles by 1.609 to get kilometers.", evidence=ids)
    with DoubleServer(roles(ops_reply(new_skill), marker)) as double:
        judge = Judge(double.url, "judge", votes=1)
        evolver = Evolver(double.url, "evolver", library, store, judge=judge,
                          dedupe_threshold=None, verify=True, verify_url=double.url,
                          verify_model="agent", verify_samples=2,
                          retriever=LexicalRetriever())
        result = evolver.evolve()
        upstream = [r["body"] for r in double.requests if r["body"]["model"] == "agent"]
    assert len(upstream) == 4  # 2 samples x (old, new)
    with_new = [b for b in upstream if "miles-to-kilometers" in b["messages"][0]["content"]]
    assert len(with_new) == 2
    # the recorded turn's old skill block was replaced, not stacked
    assert all(b["messages"][0]["content"].count("## Skills") <= 1 for b in upstream)
    verification = result.verification
    assert verification is not None and verification.accepted is accepted
    assert len(verification.samples) == 2
    if accepted:
        assert result.applied and library.generation == 1
        assert verification.old_mean == verification.new_mean == 1.0
    else:
        assert result.status == "rejected" and not result.applied
        assert verification.old_mean == 1.0 and verification.new_mean == -1.0
        assert "dropped" in result.reason
        assert library.generation == 0 and "miles-to-kilometers" not in library
        assert [t["buffer_state"] for t in buffers.support_set(store)] == ["live"] * 3


def test_verify_needs_a_judge_and_an_upstream(store, library):
    with pytest.raises(ValueError, match="needs a judge"):
        Evolver("http://127.0.0.1:9/v1", "e", library, store, verify=True)
    with pytest.raises(ValueError, match="needs verify_url"):
        Evolver("http://127.0.0.1:9/v1", "e", library, store, verify=True,
                judge=Judge("http://127.0.0.1:9/v1", "j"))


def test_strip_skill_block():
    block = render_block([ScoredSkill(CITE, 1.0)])
    base = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert strip_skill_block(inject(base, block)) == base
    assert strip_skill_block(inject(base[1:], block)) == base[1:]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    assert strip_skill_block(inject(parts, block)) == parts


def test_the_result_reports_only_the_support_turns_it_consumed(store, library):
    """A support turn a GRPO step claimed before the evolution landed stays a query turn: the
    result says which turns were consumed, as the store does."""
    ids = [record(store, library, f"question {i}", "a wrong answer", reward=-1) for i in range(2)]
    buffers.refresh(store, ids)
    assert buffers.claim_for_training(store, [ids[0]]) == {ids[0]}
    answer = {"operations": [{"op": "add", "name": "check-answers", "description": "Check.",
                              "category": "general", "body": "Check the answer first.",
                              "reason": "wrong answers", "evidence": ids}]}
    with DoubleServer([Reply(content=json.dumps(answer))]) as double:
        result = Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
    assert result.applied and result.consumed == [ids[1]]
    assert [t["id"] for t in store.turns("buffer_state = 'consumed'")] == [ids[1]]


def test_a_support_turns_long_tool_calls_keep_their_names():
    """A turn that read a long file and then wrote one: the evolver's tools section (1,500
    characters) still names the write. Cut as one text, the middle went, with the write's name,
    and the evolved skill said the turn "wrote nothing"."""
    from metaclaw.fastloop.evolver import SUPPORT_BUDGETS, support_item

    def call(ident: str, name: str, **args: str) -> dict:
        return {"id": ident, "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)}}

    turn = {"id": 2, "response": "", "request_messages": [
        {"role": "user", "content": "Please organize the standup notes"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("c1", "read_file", path="day01/raw.txt")]},
        {"role": "tool", "tool_call_id": "c1", "content": "note " * 800}],
        "tool_calls": [call("c2", "write_file", path="day01/out.json", content="y" * 3000)]}
    tools = support_item(turn)["tools"]
    assert len(tools) <= SUPPORT_BUDGETS["tools"] + 100
    assert 'call read_file({"path": "day01/raw.txt"})' in tools
    assert 'call in this reply: write_file({"path": "day01/out.json"' in tools
