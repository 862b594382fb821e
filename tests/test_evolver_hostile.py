"""The evolver and the gate fed what real model servers send: an error body with status 200, a
reply cut at max_tokens, JSON nested thousands deep, huge or broken names, half an emoji; and
arbitrary answers (hypothesis): every one ends in a precise error, the library unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metaclaw.fastloop.evolver import (EvolveError, Evolver, EvolveValidationError,
                                       parse_operations_reply, validate_operations)
from metaclaw.fastloop.gate import Gate
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.llm import answer_error
from metaclaw.proxy.server import BackgroundServer, ServedApp
from metaclaw.skills.library import Skill, SkillFormatError, SkillLibrary, SkillOp
from metaclaw.skills.retrieval import LexicalRetriever

BACKUP = Skill("backup-before-modify", "Keep a copy of a file before changing it.", "safety",
               "Copy the file to a .bak file before you change it.")


class RawUpstream(ServedApp):
    """An OpenAI-compatible server (real sockets) answering each request with whatever
    ``answer(body) -> (status, json)`` returns, well-formed or not."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[dict] = []
        self._server = BackgroundServer(self._make_app, "127.0.0.1", 0, "raw-upstream")

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _chat(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.requests.append(body)
        status, payload = self.answer(body)
        return web.json_response(payload, status=status)


def completion(content: str, finish: str = "stop") -> dict:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content}}]}


def add_op(name: str, turn: int, body: str = "Convert with the exact factor.",
           description: str = "Unit conversions.") -> dict:
    return {"op": "add", "name": name, "description": description, "category": "",
            "body": body, "reason": "r", "evidence": [turn]}


@pytest.fixture
def library(tmp_path, store):
    folder = tmp_path / "skills"
    (folder / BACKUP.name).mkdir(parents=True)
    (folder / BACKUP.name / "SKILL.md").write_text(BACKUP.to_markdown())
    return SkillLibrary(folder, store)


@pytest.fixture
def failure(store, library):
    """A judged failure: the support set the evolver learns from."""
    turn = store.record_turn(session_id="s1", status="ok", response="5 miles is 5 km.",
                             request_messages=[{"role": "user",
                                                "content": "convert 5 miles to km units"}],
                             skill_generation=library.generation, model="agent")
    store.update_turn(turn, reward=-1.0, judge_rationale="wrong factor", judged_at=1.0)
    return turn


def evolve(url, library, store, **options):
    return Evolver(url, "evolver", library, store, dedupe_threshold=None, **options).evolve()


def test_a_200_answer_with_an_error_body_is_reported_with_the_servers_reason(
        store, library, failure, monkeypatch):
    from metaclaw.fastloop import llm

    monkeypatch.setattr(llm, "MAX_RETRY_WAIT_S", 0.01)
    body = {"error": {"message": "maximum context length is 8192 tokens", "code": 400}}
    with RawUpstream(lambda _: (200, body)) as upstream:
        with pytest.raises(EvolveError) as info:
            evolve(upstream.url, library, store)
    assert "maximum context length is 8192 tokens" in info.value.reason  # not "reply was empty"
    assert library.generation == 0


def test_a_reply_cut_at_max_tokens_is_named_as_the_cause(store, library, failure):
    whole = json.dumps({"operations": [add_op("units", failure, body="Use km. " * 200)]})
    with RawUpstream(lambda _: (200, completion(whole[:200], "length"))) as upstream:
        with pytest.raises(EvolveError, match=r"cut at the token limit \(max_tokens=300\)"):
            evolve(upstream.url, library, store, max_tokens=300)
        retry = upstream.requests[1]["messages"][-1]["content"]
    assert "cut at the token limit" in retry  # the model is told too: answer shorter
    assert library.generation == 0


def test_json_nested_too_deeply_is_invalid_output_not_a_crash(store, library, failure):
    deep = '{"operations": ' + "[" * 50_000 + "]" * 50_000 + "}"
    with RawUpstream(lambda _: (200, completion(deep))) as upstream:
        with pytest.raises(EvolveError, match='no JSON object with an "operations" list'):
            evolve(upstream.url, library, store)
    assert library.generation == 0


def test_half_an_emoji_in_an_answer_is_invalid_output_and_the_library_is_unchanged(
        store, library, failure):
    files = sorted(p.name for p in library.directory.iterdir())
    # "\ud83d" is valid JSON (an escape) but half of a character: no file or store can hold it
    raw = json.dumps({"operations": [add_op("units", failure)]}).replace(
        "Unit conversions.", "Unit conversions \\ud83d.")
    with RawUpstream(lambda _: (200, completion(raw))) as upstream:
        with pytest.raises(EvolveError, match="lone surrogate"):
            evolve(upstream.url, library, store)
    assert library.generation == 0
    assert sorted(p.name for p in library.directory.iterdir()) == files


def test_a_huge_invalid_name_is_shown_cut_in_the_error():
    with pytest.raises(EvolveValidationError) as info:
        validate_operations({"operations": [{"op": "add", "name": "a" * 2_000_000,
                                             "description": "d", "body": "b"}]}, {}, [1])
    assert len(str(info.value)) < 1000 and "2,000,002 characters" in str(info.value)


def test_a_mixed_list_of_valid_and_invalid_operations_is_refused_whole():
    answer = {"operations": [{"op": "add", "name": "good", "description": "d", "body": "b"},
                             {"op": "add", "name": "../../etc", "description": "d", "body": "b"}]}
    with pytest.raises(EvolveValidationError, match=r"operation 2 \(add '\.\./\.\./etc'\)"):
        validate_operations(answer, {}, [1])


#: Any text, with the characters that break writers and readers often enough to be found:
#: lone surrogates (a JSON answer can escape one, "\\ud83d": half an emoji), YAML and
#: Unicode line breaks, NUL.
_CHAR = st.characters(exclude_categories=()) | st.sampled_from(
    ["\ud83d", "\udc80", "\x85", "\u2028", "\x00", "\n", "-", ":"])
_TEXT = st.text(_CHAR, max_size=30)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8)
_FIELD = _TEXT | _TEXT | _TEXT | _VALUES
_KEYS = ("op", "name", "description", "category", "body", "reason", "evidence")
#: An operation as a model might write it: mostly well-shaped, any field possibly wrong ...
_OP = st.fixed_dictionaries(
    {"op": st.sampled_from(["add", "add", "add", "edit", "remove", "rename"]),
     "name": st.sampled_from(["units", "units", "units", BACKUP.name, "../etc", "Units",
                              "ünits", ""]),
     "description": _FIELD, "body": _FIELD},
    optional={"category": _FIELD, "reason": _FIELD,
              "evidence": st.lists(st.integers(0, 3), max_size=3) | _VALUES})
#: ... or anything at all.
_WILD = st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=7) | _VALUES


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP | _WILD, min_size=1, max_size=2))
def test_any_answer_is_refused_with_a_reason_never_a_crash(ops):
    try:
        valid = validate_operations({"operations": ops}, {BACKUP.name: BACKUP}, [1, 2])
    except EvolveValidationError:
        return
    assert all(op.op in ("add", "edit", "remove") for op in valid)


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(["add", "edit"]), description=_TEXT, category=_TEXT, body=_TEXT)
@example(op="add", description="half an emoji \ud83d", category="", body="b")
@example(op="edit", description="", category="", body="half an emoji \udc80")
def test_an_accepted_skill_can_be_written_to_its_file_and_the_store(op, description, category,
                                                                     body):
    """Whatever text an add or an edit carries, validation refuses it with a reason or accepts
    a skill that SKILL.md (UTF-8) and the store can hold and that reads back as it was."""
    name = "units" if op == "add" else BACKUP.name
    answer = {"operations": [{"op": op, "name": name, "description": description,
                              "category": category, "body": body, "reason": "", "evidence": []}]}
    try:
        [valid] = validate_operations(answer, {BACKUP.name: BACKUP}, [1])
    except EvolveValidationError:
        return
    text = valid.skill.to_markdown()
    text.encode("utf-8")
    json.dumps(valid.skill.to_dict(), ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert Skill.from_markdown(text) == valid.skill


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200) | st.builds(lambda n, t: "[" * n + t, st.integers(0, 5000),
                                              st.text(max_size=20)))
def test_any_reply_text_is_parsed_or_refused_with_a_reason(text):
    try:
        parse_operations_reply('{"operations": ' + text + "}" if text.startswith("[") else text)
    except EvolveValidationError:
        pass


@pytest.mark.parametrize("response, reason", [
    ({"error": {"message": "overloaded"}}, "overloaded"),
    ({"error": "rate limited"}, "rate limited"),
    ({"choices": []}, "no choices"),
    ({"choices": [{"index": 0}]}, "no choices"),
    ([], "not a JSON object"),
])
def test_answers_without_a_reply_are_told_apart(response, reason):
    assert reason in answer_error(response)
    assert answer_error(completion("")) is None  # an empty reply is still a reply


def test_a_replay_answered_200_with_an_error_body_is_unscored_never_judged(
        store, library, failure):
    """The replay with the current library fails with an error body (status 200); judged as an
    empty reply it scored -1 and the candidate, whose replay worked, "fixed" it and was
    promoted on evidence that never existed."""
    def answer(body):
        if body["model"] == "judge":
            score = 1 if "8.05" in json.dumps(body["messages"]) else -1
            return 200, completion(json.dumps({"score": score, "rationale": "r"}))
        if "km-rule" not in json.dumps(body["messages"]):  # the current library's replay
            return 200, {"error": {"message": "upstream overloaded", "code": 503}}
        return 200, completion("5 miles is 8.05 km")

    candidate = [SkillOp("add", Skill("km-rule", "convert miles to km units", "general",
                                      "Multiply miles by 1.609 to get km units."),
                         "km-rule", "r", [failure])]

    async def review():
        judge = Judge(upstream.url, "judge", votes=1)
        gate = Gate(judge, upstream.url, "agent", retriever=LexicalRetriever(), successes=0)
        try:
            return await gate.areview(candidate, library, store, [failure])
        finally:
            await gate.aclose()
            await judge.aclose()

    with RawUpstream(answer) as upstream:
        report = asyncio.run(review())
    assert report.decision == "hold", report
    [case] = report.cases
    assert case["outcome"] == "unscored" and case["before"] is None
    assert "upstream overloaded" in case["error"]


def test_a_lone_surrogate_is_refused_by_the_library_with_its_field():
    with pytest.raises(SkillFormatError, match="the body holds a lone surrogate"):
        Skill("units", "Unit rules.", "general", "Use km \udc80.")


def test_verified_promotion_never_judges_an_error_body_as_a_reply(store, library, failure):
    """The same fault on the evolver's own verified promotion: a replay with the old library
    answered 200 with an error body must not count as a -1 the new library then beats."""
    def answer(body):
        if body["model"] == "evolver":
            return 200, completion(json.dumps({"operations": [add_op(
                "km-rule", failure, "Multiply miles by 1.609 to get km units.",
                "convert miles to km units")]}))
        if body["model"] == "judge":
            score = 1 if "8.05" in json.dumps(body["messages"]) else -1
            return 200, completion(json.dumps({"score": score, "rationale": "r"}))
        if "km-rule" not in json.dumps(body["messages"]):
            return 200, {"error": {"message": "upstream overloaded"}}
        return 200, completion("5 miles is 8.05 km")

    with RawUpstream(answer) as upstream:
        judge = Judge(upstream.url, "judge", votes=1)
        result = evolve(upstream.url, library, store, judge=judge, verify=True,
                        verify_url=upstream.url, verify_model="agent",
                        retriever=LexicalRetriever())
    assert result.status == "rejected" and library.generation == 0
    [sample] = result.verification.samples
    assert sample["old_score"] is None and "upstream overloaded" in sample["error"]
