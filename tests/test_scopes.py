"""Scopes and privacy: each turn records the person and the agent it served, a skill is shared
or private to one person or agent, a private skill is never offered to another's turns (the
proxy and every replay filter before ranking), the evolver keeps one person's lesson in that
person's scope unless the policy says shared, and promotion to shared is a recorded step.

The proxy tests run a real proxy in front of the offline double, as tests/test_proxy.py does."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from metaclaw import buffers, cli
from metaclaw.fastloop.evolver import Evolver, parse_evolver_prompt, scope_to_people
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.replay import Replayer
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.runtime import RuntimeConfig
from metaclaw.skills.library import (Skill, SkillFormatError, SkillLibrary, SkillOp,
                                     visible)
from metaclaw.skills.retrieval import make_retriever
from metaclaw.store import Store

QUESTION = "How should I word the git commit message for this fix?"
SHARED = Skill("git-commit-messages", "How to write clear git commit messages for a change.",
               "coding", "# Commit messages\n\nWrite the subject in the imperative mood.")
ALICE = Skill("alice-commit-style", "Alice's git commit message style for a fix.", "coding",
              "ALICE-ONLY: prefix the commit message with the ticket number.",
              {"metadata": {"scope": "person:alice"}})
BOB = Skill("bob-commit-style", "Bob's git commit message wording for a fix.", "coding",
            "BOB-ONLY: sign every commit message with your initials.",
            {"metadata": {"scope": "person:bob"}})
BOT = Skill("bot-commit-format", "The release bot's git commit message format for a fix.",
            "coding", "BOT-ONLY: end the commit message with [release].",
            {"metadata": {"scope": "agent:release-bot"}})


def _library(root, store, *skills: Skill) -> SkillLibrary:
    folder = root / "skills"
    for skill in skills:
        (folder / skill.name).mkdir(parents=True)
        (folder / skill.name / "SKILL.md").write_text(skill.to_markdown())
    return SkillLibrary(folder, store)


@pytest.fixture(scope="module")
def double():
    with DoubleServer(models=("double-model",)) as server:
        yield server


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("scopes")
    store = Store(root / "metaclaw.db")
    yield store, _library(root, store, SHARED, ALICE, BOB, BOT)
    store.close()


@pytest.fixture(scope="module")
def proxy(double, workspace):
    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, retrieval="lexical", top_k=5,
                         user="carol", agent="helper")
    p = Proxy(config, store, library, make_retriever("lexical")).start()
    yield p
    p.stop()


def _ask(proxy, double, headers=None) -> tuple[list[str], str, dict]:
    """One chat turn through the proxy: the injected skills, the system prompt the upstream got,
    and the recorded turn."""
    double.replies.clear()
    double.requests.clear()
    client = openai.OpenAI(base_url=proxy.url, api_key="none", max_retries=0, timeout=10)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "system", "content": "You help."},
                             {"role": "user", "content": QUESTION}],
        extra_headers=headers or {})
    injected = [n for n in raw.headers["X-MetaClaw-Injected-Skills"].split(",") if n]
    system = double.requests[-1]["body"]["messages"][0]["content"]
    proxy.flush()
    return injected, system, proxy.store.turns(order="id DESC")[0]


# -- whom a turn served ---------------------------------------------------------------------------
def test_a_turn_records_person_and_agent_from_the_headers_else_the_config(proxy, double):
    _, _, row = _ask(proxy, double, {"X-MetaClaw-User": "alice@example.com",
                                     "X-MetaClaw-Agent": "codex-1"})
    assert (row["person"], row["agent"]) == ("alice@example.com", "codex-1")
    assert row["identified_by"]["person"] == "header:X-MetaClaw-User"
    assert row["identified_by"]["agent"] == "header:X-MetaClaw-Agent"
    _, _, row = _ask(proxy, double, {"X-MetaClaw-User": "alice"})
    assert (row["person"], row["agent"]) == ("alice", "helper")
    assert row["identified_by"]["agent"] == "config:agent"
    _, _, row = _ask(proxy, double)
    assert (row["person"], row["agent"]) == ("carol", "helper")
    assert row["identified_by"]["person"] == "config:user"


def test_without_headers_or_config_nothing_is_recorded(double, tmp_path):
    with Store(tmp_path / "w.db") as store:
        library = _library(tmp_path, store, SHARED)
        p = Proxy(ProxyConfig(upstream_url=double.url, retrieval="lexical"), store, library,
                  make_retriever("lexical")).start()
        try:
            injected, _, row = _ask(p, double)
        finally:
            p.stop()
    assert injected == ["git-commit-messages"]
    assert row["person"] is None and row["agent"] is None
    assert set(row["identified_by"]) == {"session", "turn_type"}


@pytest.mark.parametrize("header, value", [("X-MetaClaw-User", "alice smith"),
                                           ("X-MetaClaw-User", "-alice"),
                                           ("X-MetaClaw-Agent", "a" * 65),
                                           ("X-MetaClaw-Agent", "bot:1")])
def test_a_bad_header_is_a_400_in_openai_and_anthropic_shapes(proxy, header, value):
    param = "user" if header == "X-MetaClaw-User" else "agent"
    before = proxy.store.query("SELECT COUNT(*) AS n FROM turns")[0]["n"]
    chat = httpx.post(f"{proxy.url}/chat/completions", headers={header: value}, json={
        "model": "m", "messages": [{"role": "user", "content": QUESTION}]})
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert header in error["message"] and "1-64 letters" in error["message"]
    base = proxy.url.removesuffix("/v1")
    messages = httpx.post(f"{base}/v1/messages", headers={header: value}, json={
        "model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": QUESTION}]})
    assert messages.status_code == 400
    body = messages.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert header in body["error"]["message"]
    proxy.flush()
    assert proxy.store.query("SELECT COUNT(*) AS n FROM turns")[0]["n"] == before


def test_a_bad_configured_person_or_agent_is_refused():
    with pytest.raises(ValueError, match="ProxyConfig.user"):
        ProxyConfig(user="alice smith")
    with pytest.raises(ValueError, match="ProxyConfig.agent"):
        ProxyConfig(agent="bot/1")
    assert ProxyConfig(user="", agent=" bot-1 ").user is None
    assert ProxyConfig(agent=" bot-1 ").agent == "bot-1"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--user", "alice smith"])
    config = RuntimeConfig.from_args(cli.build_parser().parse_args(
        ["serve", "--user", "alice", "--agent", "bot-1", "--skill-scope", "shared"]))
    assert (config.user, config.agent, config.skill_scope) == ("alice", "bot-1", "shared")
    assert RuntimeConfig().skill_scope == "private"


# -- a private skill reaches only its own person or agent ----------------------------------------
def test_a_private_skill_is_injected_for_its_person_and_never_for_another(proxy, double):
    injected, system, _ = _ask(proxy, double, {"X-MetaClaw-User": "alice"})
    assert "alice-commit-style" in injected and "git-commit-messages" in injected
    assert "ALICE-ONLY" in system and "BOB-ONLY" not in system
    injected, system, row = _ask(proxy, double, {"X-MetaClaw-User": "bob"})
    assert "bob-commit-style" in injected and "alice-commit-style" not in injected
    assert "ALICE-ONLY" not in system and "BOB-ONLY" in system
    assert {s["name"] for s in row["retrieval_scores"]} == set(injected)
    # the configured person (carol) has no private skill: only shared ones, nothing of others
    injected, system, _ = _ask(proxy, double)
    assert injected == ["git-commit-messages"]
    assert not any(tag in system for tag in ("ALICE-ONLY", "BOB-ONLY", "BOT-ONLY"))
    # an agent's private skill: offered to that agent's turns, whoever the person
    injected, system, _ = _ask(proxy, double, {"X-MetaClaw-Agent": "release-bot"})
    assert "bot-commit-format" in injected and "BOT-ONLY" in system
    assert "alice-commit-style" not in injected


def test_two_peoples_private_skills_never_cross(proxy, double, workspace):
    store, library = workspace
    for round_ in range(3):  # alternating, as two people's agents do on one proxy
        for person, own, other in (("alice", "alice-commit-style", "bob-commit-style"),
                                   ("bob", "bob-commit-style", "alice-commit-style")):
            injected, system, row = _ask(proxy, double, {"X-MetaClaw-User": person})
            assert own in injected and other not in injected, (round_, person, injected)
            assert other.split("-")[0].upper() + "-ONLY" not in system
            assert row["person"] == person
    # replays (the gate's, the evolver's, experiments') stay inside each turn's scope too
    replayer = Replayer(Judge("http://127.0.0.1:9/v1", "judge"), "http://127.0.0.1:9/v1",
                        retriever=make_retriever("lexical"), top_k=5)
    skills = library.skills()
    for person, own, other in (("alice", "alice-commit-style", "bob-commit-style"),
                               ("bob", "bob-commit-style", "alice-commit-style")):
        [turn] = store.turns("person = ?", (person,), order="id DESC LIMIT 1")
        messages, names = replayer.select(turn, skills)
        assert own in names and other not in names
        assert other.split("-")[0].upper() + "-ONLY" not in json.dumps(messages)
    nobody = {"request_messages": [{"role": "user", "content": QUESTION}], "turn_type": "main"}
    assert replayer.select(nobody, skills)[1] == ["git-commit-messages"]


def test_visible_filters_before_ranking_and_keeps_the_list_when_all_is_shared():
    everything = [SHARED, ALICE, BOB, BOT]
    assert visible(everything, "alice", None) == [SHARED, ALICE]
    assert visible(everything, "bob", "release-bot") == [SHARED, BOB, BOT]
    assert visible(everything) == [SHARED]
    shared_only = [SHARED]
    assert visible(shared_only, "alice") is shared_only


def test_the_scope_lives_in_the_front_matter_metadata():
    assert SHARED.scope == "shared" and not SHARED.private
    text = ALICE.to_markdown()
    assert "scope: person:alice" in text
    assert Skill.from_markdown(text).scope == "person:alice"
    assert ALICE.with_scope("shared").extra == {}
    assert SHARED.with_scope("agent:bot").extra == {"metadata": {"scope": "agent:bot"}}
    for bad in ("everyone", "person:", "team:x", "person:al ice", 3):
        with pytest.raises(SkillFormatError, match="scope"):
            Skill("x", "d", extra={"metadata": {"scope": bad}})


# -- the evolver keeps one person's lesson in that person's scope --------------------------------
def _failed(store, library, text, person=None, session="s1"):
    turn_id = store.record_turn(
        session_id=session, status="ok", model="agent", response="Edited it in place.",
        request_messages=[{"role": "system", "content": "You help."},
                          {"role": "user", "content": text}],
        skill_generation=library.generation, person=person)
    store.update_turn(turn_id, reward=-1.0, judge_rationale="no backup", judged_at=1.0)
    return turn_id


def _add(name, evidence):
    return {"op": "add", "name": name, "description": "Back up a file before editing it.",
            "category": "safety", "body": "Copy the file to .bak first.", "reason": "no backup",
            "evidence": evidence}


def _evolve(store, library, answer, **kw):
    buffers.refresh(store)
    with DoubleServer([Reply(content=json.dumps({"operations": answer}))]) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None, **kw)
        result = evolver.evolve()
        prompt = parse_evolver_prompt(double.requests[-1]["body"]["messages"][-1]["content"])
    return result, prompt


def test_the_evolver_writes_a_persons_failure_into_that_persons_scope(tmp_path, store):
    library = _library(tmp_path, store, SHARED, BOB)
    fail = _failed(store, library, "Edit config.yaml", person="alice")
    result, prompt = _evolve(store, library, [_add("backup-first", [fail])])
    assert result.applied
    assert library.get("backup-first").scope == "person:alice"
    assert "scope: person:alice" in (library.directory / "backup-first" / "SKILL.md").read_text()
    # bob's private skill never reached the model working on alice's failure
    assert {s["name"] for s in prompt["library"]} == {"git-commit-messages"}


def test_under_the_shared_policy_the_skill_is_shared(tmp_path, store):
    library = _library(tmp_path, store, SHARED)
    fail = _failed(store, library, "Edit config.yaml", person="alice")
    result, _ = _evolve(store, library, [_add("backup-first", [fail])], skill_scope="shared")
    assert result.applied and library.get("backup-first").scope == "shared"


def test_turns_without_a_person_keep_todays_shared_skills(tmp_path, store):
    library = _library(tmp_path, store, SHARED)
    fail = _failed(store, library, "Edit config.yaml")
    result, _ = _evolve(store, library, [_add("backup-first", [fail])])
    assert result.applied and library.get("backup-first").scope == "shared"
    assert "scope" not in (library.directory / "backup-first" / "SKILL.md").read_text()


def test_one_persons_edit_of_a_shared_skill_becomes_a_private_copy(tmp_path, store):
    library = _library(tmp_path, store, SHARED)
    fail = _failed(store, library, "Word my commit", person="alice")
    edit = {"op": "edit", "name": "git-commit-messages", "description": "", "category": "",
            "body": "Start with the ticket number.", "reason": "alice wants tickets",
            "evidence": [fail]}
    result, _ = _evolve(store, library, [edit])
    assert result.applied
    assert library.get("git-commit-messages") == SHARED  # everyone else's is unchanged
    copy = library.get("git-commit-messages-alice")
    assert copy.scope == "person:alice" and copy.body == "Start with the ticket number."


def test_two_peoples_failures_go_to_the_evolver_apart_under_the_private_policy(tmp_path,
                                                                               store):
    """One call shown alice's and bob's failures wrote alice's words into a shared skill (an
    operation whose evidence spans two people is shared); a private add whose name another
    scope holds took no skill at all."""
    library = _library(tmp_path, store, SHARED, ALICE)
    alice = _failed(store, library, "Edit config.yaml for my ONCOLOGY appointment",
                    person="alice", session="a")
    bob = _failed(store, library, "Edit deploy.yaml", person="bob", session="b")
    buffers.refresh(store)
    answers = [Reply(content=json.dumps({"operations": [_add("backup-first", [alice])]})),
               Reply(content=json.dumps({"operations": [_add(ALICE.name, [bob])]}))]
    with DoubleServer(answers) as double:
        evolver = Evolver(double.url, "evolver", library, store, dedupe_threshold=None)
        proposal = evolver.propose()
        shown = [parse_evolver_prompt(r["body"]["messages"][-1]["content"])
                 for r in double.requests]
    assert len(shown) == 2  # one call per person, each shown that person's failure only
    assert ["ONCOLOGY" in json.dumps(p) for p in shown] == [True, False]
    scopes = {op.name: op.skill.scope for op in proposal.ops}
    # bob's add of a name alice's private skill holds takes bob's own name, unseen by him
    assert scopes == {"backup-first": "person:alice", f"{ALICE.name}-bob": "person:bob"}
    assert proposal.support_ids == [alice, bob] and proposal.attempts == 2


def test_one_persons_failed_call_leaves_the_others_changes(tmp_path, store):
    library = _library(tmp_path, store, SHARED)
    alice = _failed(store, library, "Edit config.yaml", person="alice", session="a")
    bob = _failed(store, library, "Edit deploy.yaml", person="bob", session="b")
    buffers.refresh(store)
    answers = [Reply(content=json.dumps({"operations": [_add("backup-first", [alice])]})),
               Reply(content="not JSON"), Reply(content="still not JSON")]
    with DoubleServer(answers) as double:
        proposal = Evolver(double.url, "evolver", library, store,
                           dedupe_threshold=None).propose()
    assert [op.name for op in proposal.ops] == ["backup-first"]
    assert proposal.support_ids == [alice]  # bob's failure waits for the next attempt
    assert proposal.attempts == 3 and "one person" in proposal.notes[0]


def test_under_the_shared_policy_a_persons_ask_is_not_an_example_ask_of_a_shared_skill(
        tmp_path, store):
    library = _library(tmp_path, store, SHARED)
    fail = _failed(store, library, "Edit config.yaml for my ONCOLOGY visit", person="alice")
    result, _ = _evolve(store, library, [_add("backup-first", [fail])], skill_scope="shared")
    assert result.applied and library.get("backup-first").example_asks == ()


def test_scope_to_people_per_operation():
    shared = SHARED
    own = ALICE
    library = {s.name: s for s in (shared, own)}
    people = {1: "alice", 2: "bob", 3: None}
    ops = [SkillOp("add", Skill("a1", "d", body="b"), evidence=[1]),
           SkillOp("add", Skill("mixed", "d", body="b"), evidence=[1, 2]),
           SkillOp("add", Skill("nobody", "d", body="b"), evidence=[3]),
           SkillOp("remove", None, shared.name, evidence=[1]),
           SkillOp("remove", None, own.name, evidence=[1])]
    out, dropped = scope_to_people(ops, people, "private", library)
    scopes = {op.name: (op.op, op.skill.scope if op.skill else None) for op in out}
    assert scopes == {"a1": ("add", "person:alice"), "mixed": ("add", "shared"),
                      "nobody": ("add", "shared"), own.name: ("remove", None)}
    assert [d["name"] for d in dropped] == [shared.name]
    assert scope_to_people(ops, people, "shared", library) == (ops, [])


def test_the_gate_replays_a_private_candidate_only_for_its_person(tmp_path, store):
    library = _library(tmp_path, store, SHARED)
    candidate = [SHARED, ALICE]
    replayer = Replayer(Judge("http://127.0.0.1:9/v1", "judge"), "http://127.0.0.1:9/v1",
                        retriever=make_retriever("lexical"), top_k=5)
    ids = {p: store.record_turn(session_id=f"s-{p}", status="ok", person=p, request_messages=[
        {"role": "user", "content": QUESTION}]) for p in ("alice", "bob")}
    assert "alice-commit-style" in replayer.select(store.turn(ids["alice"]), candidate)[1]
    assert "alice-commit-style" not in replayer.select(store.turn(ids["bob"]), candidate)[1]
    assert library.generation == 0


# -- promotion to shared is explicit and recorded -------------------------------------------------
def test_skills_share_records_the_promotion(tmp_path, capsys):
    db = tmp_path / "w.db"
    with Store(db) as store:
        library = _library(tmp_path, store, SHARED, ALICE)
        before = library.generation
    folder = str(tmp_path / "skills")
    assert cli.main(["skills", "share", "alice-commit-style", "--by", "alice", "--reason",
                     "the whole lab uses tickets", "--skills", folder, "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "alice-commit-style is shared" in out and "was person:alice" in out
    with Store(db) as store:
        library = SkillLibrary(folder, store)
        assert library.get("alice-commit-style").scope == "shared"
        assert library.generation == before + 1
        generation = store.generation(library.generation)
        assert generation["kind"] == "share"
        [event] = store.skill_events(library.generation)
        assert (event["op"], event["skill_name"]) == ("edit", "alice-commit-style")
        assert "by alice" in event["reason"] and "person:alice" in event["reason"]
        assert "the whole lab uses tickets" in event["reason"]
        diff = library.diff(before, library.generation)
        assert [e.name for e in diff.edited] == ["alice-commit-style"]
    assert "scope" not in (tmp_path / "skills" / "alice-commit-style" / "SKILL.md").read_text()
    # a second share is refused: it is shared already
    assert cli.main(["skills", "share", "alice-commit-style", "--skills", folder,
                     "--db", str(db)]) == 2
    assert "already shared" in capsys.readouterr().err
    assert cli.main(["skills", "share", "no-such-skill", "--skills", folder,
                     "--db", str(db)]) == 2


def test_share_from_python_defaults_who_to_the_user(tmp_path, store, monkeypatch):
    monkeypatch.setenv("METACLAW_USER", "dana")
    library = _library(tmp_path, store, BOB)
    generation = library.share("bob-commit-style")
    [event] = store.skill_events(generation)
    assert "by dana" in event["reason"] and library.get("bob-commit-style").scope == "shared"


def test_turns_why_shows_person_and_agent(proxy, double, workspace, capsys):
    _ask(proxy, double, {"X-MetaClaw-User": "alice", "X-MetaClaw-Agent": "codex-1"})
    _, library = workspace  # the database beside the skills folder (mapped on PostgreSQL)
    db = library.directory.parent / "metaclaw.db"
    assert cli.main(["turns", "--why", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "served: person alice (by header:X-MetaClaw-User), agent codex-1" in out
