"""Stage turns (``X-Turn-Type: stage:<name>``) end to end: skills scoped to a stage in their
SKILL.md, retrieval that offers a stage only its own and general skills, the proxy serving and
refusing stage turn types over real HTTP, and the evolver scoping what it learns from one
stage's failures to that stage."""

from __future__ import annotations

import json

import httpx
import pytest

from metaclaw import buffers
from metaclaw.fastloop.evolver import Evolver, parse_evolver_prompt, scope_to_stages
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import Skill, SkillFormatError, SkillLibrary, SkillOp, offered_to
from metaclaw.skills.retrieval import LexicalRetriever, ScoredSkill, select
from metaclaw.turns import check_turn_type

GENERAL = Skill("cite-sources", "Cite the sources of every claim in a research report.",
                "research", "Name the paper and year for each claim.")
PLAN = Skill("plan-conventions", "What a research plan must state: hypothesis and metric.",
             "pipeline", "Include a line starting with `Metric:`.").with_stage("plan")
SEARCH = Skill("search-conventions", "What a research literature search must list: sources.",
               "pipeline", "Include a line starting with `Sources:`.").with_stage("search")
ASK = "Write the research plan for the topic and cite sources; the search comes later."


@pytest.fixture()
def library(tmp_path, store):
    lib = SkillLibrary(tmp_path / "skills", store)
    lib.apply([SkillOp("add", s) for s in (GENERAL, PLAN, SEARCH)])
    return lib


# -- skills ---------------------------------------------------------------------------------
def test_a_skill_is_scoped_in_its_front_matter_metadata(tmp_path, store):
    text = PLAN.to_markdown()
    assert "metadata:\n  stage: plan\n" in text  # the Agent Skills format's free metadata map
    assert Skill.from_markdown(text) == PLAN and Skill.from_markdown(text).stage == "plan"
    assert GENERAL.stage is None and "metadata" not in GENERAL.to_markdown()
    other = Skill("x", "d", extra={"metadata": {"author": "me"}}).with_stage("write")
    assert other.extra["metadata"] == {"author": "me", "stage": "write"}
    assert other.with_stage(None).extra == {"metadata": {"author": "me"}}
    with pytest.raises(SkillFormatError, match="'metadata.stage' must be a stage name"):
        Skill("bad", "d", extra={"metadata": {"stage": "Plan Stage"}})
    # a hand-written file with a bad stage is reported and skipped, never loaded unscoped
    folder = tmp_path / "lib" / "bad"
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text("---\nname: bad\ndescription: d\nmetadata:\n  stage: a/b\n"
                                     "---\nbody\n")
    lib = SkillLibrary(tmp_path / "lib", store)
    assert lib.skills() == [] and "metadata.stage" in str(lib.problems[0])
    assert lib.frame().columns[:3] == ["name", "category", "stage"]


def test_retrieval_offers_a_stage_its_own_and_general_skills_only():
    retriever, skills = LexicalRetriever(), [GENERAL, PLAN, SEARCH]
    everything = [s.skill.name for s in select(retriever, ASK, skills, top_k=3)]
    assert set(everything) == {"cite-sources", "plan-conventions", "search-conventions"}

    def names(turn_type):
        return [s.skill.name for s in select(retriever, ASK, skills, top_k=3,
                                             keep=offered_to(turn_type))]

    assert set(names("stage:plan")) == {"cite-sources", "plan-conventions"}
    assert set(names("stage:search")) == {"cite-sources", "search-conventions"}
    assert names("main") == ["cite-sources"] and names("stage:write") == ["cite-sources"]
    # the filter runs on the ranking: the index of the whole library is built once
    index = retriever._cache.index
    names("stage:plan"), names("main")
    assert retriever._cache.index is index


# -- the proxy --------------------------------------------------------------------------------
@pytest.fixture()
def served(library, store):
    with DoubleServer(models=("m",)) as double:
        proxy = Proxy(ProxyConfig(upstream_url=double.url, retrieval="lexical", max_retries=0),
                      store, library).start()
        try:
            yield proxy, double
        finally:
            proxy.stop()


def _post(proxy, headers=None, **body):
    return httpx.post(proxy.url + "/chat/completions", timeout=10, headers=headers or {},
                      json={"model": "m", "messages": [{"role": "user", "content": ASK}], **body})


def test_the_proxy_serves_stage_turns_with_their_stage_skills(served, store):
    proxy, double = served
    for turn_type, headers, body in [
            ("stage:plan", {"X-Turn-Type": "stage:plan"}, {}),
            ("stage:search", {}, {"turn_type": "Stage:Search"}),
            ("main", {}, {}),
            ("side", {"X-Turn-Type": "side"}, {})]:
        response = _post(proxy, {"X-Session-Id": "run-1", **headers}, **body)
        assert response.status_code == 200, response.text
        injected = sorted(filter(None, response.headers["X-MetaClaw-Injected-Skills"].split(",")))
        assert injected == {"stage:plan": ["cite-sources", "plan-conventions"],
                            "stage:search": ["cite-sources", "search-conventions"],
                            "main": ["cite-sources"], "side": []}[turn_type]
        assert "turn_type" not in double.requests[-1]["body"]  # a proxy field, not forwarded
    proxy.flush()
    turns = store.turns("session_id = 'run-1'", order="id")
    assert [t["turn_type"] for t in turns] == ["stage:plan", "stage:search", "main", "side"]
    assert sorted(turns[0]["injected_skills"]) == ["cite-sources", "plan-conventions"]
    assert turns[1]["identified_by"]["turn_type"] == "body:turn_type"
    # stage turns are buffered like main turns; the side call is not
    buffers.refresh(store)
    assert [t["buffer_set"] for t in store.turns("session_id = 'run-1'", order="id")] == \
        ["query", "query", "query", None]


@pytest.mark.parametrize("headers, body, where", [
    ({"X-Turn-Type": "stage:Plan!"}, {}, "header X-Turn-Type"),
    ({"X-Turn-Type": "stage:" + "x" * 65}, {}, "header X-Turn-Type"),
    ({}, {"turn_type": "stage:"}, "body 'turn_type'"),
    ({}, {"turn_type": "stage:a/b"}, "body 'turn_type'"),
])
def test_a_malformed_stage_turn_type_is_a_400_in_each_protocols_shape(served, store, headers,
                                                                      body, where):
    proxy, double = served
    before = len(double.requests)
    response = _post(proxy, headers, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "turn_type"
    assert where in error["message"] and "'stage:<name>'" in error["message"]
    anthropic = httpx.post(proxy.base_url + "/v1/messages", timeout=10, headers=headers,
                           json={"model": "m", "max_tokens": 10, **body,
                                 "messages": [{"role": "user", "content": ASK}]})
    assert anthropic.status_code == 400
    shaped = anthropic.json()
    assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
    assert "'stage:<name>'" in shaped["error"]["message"]
    assert len(double.requests) == before  # nothing was forwarded


# -- the evolver ------------------------------------------------------------------------------
def _turn(store, session, turn_type, users, reward=-1.0, rationale="missing `Metric:`",
          generation=1):
    messages = [{"role": "system", "content": "You are a research assistant."}]
    for i, text in enumerate(users):
        if i:
            messages.append({"role": "assistant", "content": "draft"})
        messages.append({"role": "user", "content": text})
    turn_id = store.record_turn(session_id=session, turn_type=turn_type, status="ok",
                                request_messages=messages, response="draft",
                                skill_generation=generation)
    store.update_turn(turn_id, reward=reward, judge_rationale=rationale)
    return turn_id


def _op(op, name, evidence, body="Include a line starting with `Metric:`."):
    return {"op": op, "name": name, "description": f"{name} rules", "category": "pipeline",
            "body": body, "reason": "checks failed", "evidence": evidence}


def test_the_evolver_scopes_what_a_stage_teaches_to_that_stage(library, store):
    plan = _turn(store, "run-1", "stage:plan", ["Stage: plan"])
    search = _turn(store, "run-1", "stage:search", ["Stage: search"])
    plan_retry = _turn(store, "run-1", "stage:plan", ["Stage: plan", "The check failed: add "
                                                      "`Metric:`. Fix it."], reward=1.0)
    main = _turn(store, "run-1", "main", ["Summarise the run"])
    buffers.refresh(store)
    reply = json.dumps({"operations": [
        _op("add", "plan-metric-line", [plan]),
        _op("add", "report-everything", [search, main]),
        _op("add", "search-years-line", [search]),
        _op("edit", "search-conventions", [plan], body="Include `Sources:` and `Years:`.")]})
    with DoubleServer([Reply(reply)], models=("evolver",)) as double:
        result = Evolver(double.url, "evolver", library, store, dedupe_threshold=None).evolve()
        prompt = parse_evolver_prompt(double.requests[-1]["body"]["messages"][-1]["content"])
    assert result.applied
    scopes = {s.name: s.stage for s in library.skills()}
    assert scopes["plan-metric-line"] == "plan"     # every cited failure is a plan turn
    assert scopes["search-years-line"] == "search"
    assert scopes["report-everything"] is None      # mixed evidence: a general skill
    assert scopes["search-conventions"] == "search"  # an edit keeps the skill's scope
    # what the evolver model saw: each failure's turn type and each skill's scope
    items = {i["id"]: i for i in prompt["support"]}
    assert items[plan]["turn_type"] == "stage:plan" and items[main]["turn_type"] == "main"
    assert {s["name"]: s["stage"] for s in prompt["library"]}["plan-conventions"] == "plan"
    # the feedback on a stage turn is its own stage's next message, not the next stage's
    assert items[plan]["feedback"].startswith("The check failed: add `Metric:`")
    assert plan_retry not in items


def test_scope_to_stages_leaves_general_and_unknown_evidence_general():
    add = SkillOp("add", Skill("x", "d", body="b"), evidence=[1, 2])
    [same] = scope_to_stages([add], {1: "stage:plan", 2: "stage:plan"})
    [mixed] = scope_to_stages([add], {1: "stage:plan", 2: "main"})
    [unknown] = scope_to_stages([add], {})
    assert (same.skill.stage, mixed.skill.stage, unknown.skill.stage) == ("plan", None, None)


class SameWords:
    """A similarity double for dedupe: 1.0 for a skill with the same description and body."""

    kind, default_min_score = "embedding", 0.0

    def rank(self, query, skills):
        return sorted((ScoredSkill(s, 1.0 if query.endswith(f"{s.description}\n{s.body}")
                                   else 0.0) for s in skills), key=lambda x: -x.score)


def test_dedupe_never_merges_a_skill_into_another_stages(library, store):
    plan = _turn(store, "run-2", "stage:plan", ["Stage: plan"])
    search = _turn(store, "run-2", "stage:search", ["Stage: search"])
    buffers.refresh(store)
    copy = {"description": SEARCH.description, "category": "pipeline", "body": SEARCH.body,
            "reason": "r"}
    reply = json.dumps({"operations": [{"op": "add", "name": "copy-at-plan", **copy,
                                        "evidence": [plan]},
                                       {"op": "add", "name": "copy-at-search", **copy,
                                        "evidence": [search]}]})
    with DoubleServer([Reply(reply)], models=("evolver",)) as double:
        proposal = Evolver(double.url, "evolver", library, store, dedupe_threshold=0.9,
                           dedupe_retriever=SameWords()).propose()
    assert [(op.op, op.name, op.skill.stage) for op in proposal.ops] == [
        ("add", "copy-at-plan", "plan")]  # the same words, but for another stage: kept
    assert proposal.dropped[0]["name"] == "copy-at-search"
    assert "search-conventions" in proposal.dropped[0]["reason"]


def test_a_skills_stage_is_spelled_as_turn_types_are(tmp_path, store):
    """``X-Turn-Type: stage:Plan`` is recorded as ``stage:plan``; a SKILL.md scoped to ``Plan``
    is the same stage, not a skipped file."""
    folder = tmp_path / "lib" / "plan-notes"
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text("---\nname: plan-notes\ndescription: d\nmetadata:\n"
                                     "  stage: ' Plan '\n---\nbody\n")
    lib = SkillLibrary(tmp_path / "lib", store)
    assert lib.problems == [] and [s.stage for s in lib.skills()] == ["plan"]
    assert offered_to(check_turn_type("stage:Plan"))(lib.skills()[0])
