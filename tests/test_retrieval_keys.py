"""Skills learn their own retrieval keys: the asks they were written from and the asks they later
served well become example asks (front matter ``metadata.example-asks``), the evolver writes a
"use when" line and anticipated asks (asks in a user's words, front matter
``metadata.anticipated-asks``), retrieval matches new asks against all of them, and the keys are
shown where a person looks (``metaclaw turns --why``, the trace, the diff). No timing and no quality figures here:
``benchmarks/bench_retrieval.py`` measures those on the labelled set."""

from __future__ import annotations

import pytest

from metaclaw import buffers
from metaclaw.fastloop.evolver import validate_operations, with_origin_asks
from metaclaw.fastloop.proposals import apply_ops
from metaclaw.skills.library import (MAX_ANTICIPATED_ASKS, MAX_EXAMPLE_ASKS, MAX_NEAR_MISS_ASKS,
                                     Skill, SkillLibrary, SkillOp)
from metaclaw.skills.retrieval import (EmbeddingRetriever, HybridRetriever, LexicalRetriever,
                                       keys_text, make_retriever, select)

DATES = Skill("iso-dates", "Write every date as an ISO 8601 datetime with the user's offset.",
              "data", "Use `2026-03-16T09:30:00+08:00`, never `3/16` or `9:30am`.")
OTHERS = [
    Skill("backup-first", "Copy a file before changing it.", "safety",
          "`cp config.yaml config.yaml.bak` before any edit."),
    Skill("commit-messages", "Write commit messages with an imperative subject line.", "coding",
          "Subject under 60 characters; a body that says why."),
    Skill("csv-headers", "Give every CSV file a header row.", "data",
          "Column names in snake_case, one header line."),
]
#: An ask that shares no content word with the dates skill's text.
ASK = "put the standup slot and each action item's deadline into standup.json"


def test_example_asks_and_use_when_round_trip_through_skill_md():
    skill = DATES.with_retrieval_keys([ASK, "log when the nightly backup ran"],
                                      use_when="writing dates, times or deadlines into files")
    again = Skill.from_markdown(skill.to_markdown())
    assert again == skill
    assert again.example_asks == (ASK, "log when the nightly backup ran")
    assert again.use_when == "writing dates, times or deadlines into files"
    text = skill.to_markdown()
    assert "metadata:" in text and "example-asks:" in text and "use-when:" in text


def test_anticipated_asks_round_trip_are_replaced_not_merged_and_stay_apart_from_example_asks():
    many = [f"ask {i}" for i in range(MAX_ANTICIPATED_ASKS + 2)]
    skill = DATES.with_retrieval_keys([ASK], anticipated=["when is the call, in my time?",
                                                          " when is the call,  in my time? ",
                                                          *many])
    assert skill.example_asks == (ASK,)
    assert skill.anticipated_asks[0] == "when is the call, in my time?"
    assert len(skill.anticipated_asks) == MAX_ANTICIPATED_ASKS  # deduped, then bounded
    assert skill.retrieval_asks == (ASK, *skill.anticipated_asks)
    again = Skill.from_markdown(skill.to_markdown())
    assert again == skill and "anticipated-asks:" in skill.to_markdown()
    assert skill.with_retrieval_keys(["another seen ask"]).anticipated_asks == \
        skill.anticipated_asks  # adding example asks keeps them
    replaced = skill.with_retrieval_keys(anticipated=["the deadline field is unreadable"])
    assert replaced.anticipated_asks == ("the deadline field is unreadable",)
    assert replaced.example_asks == (ASK,)
    assert skill.with_retrieval_keys(anticipated=list(skill.anticipated_asks)) is skill
    cleared = skill.with_retrieval_keys(anticipated=[])
    assert cleared.anticipated_asks == () and "anticipated-asks" not in cleared.to_markdown()
    listed = Skill.from_markdown("---\nname: a\ndescription: A.\nmetadata:\n"
                                 "  anticipated-asks:\n    - one\n    - two\n---\n\nBody.\n")
    assert listed.anticipated_asks == ("one", "two")


def test_example_asks_are_folded_deduped_bounded_and_unchanged_skills_stay_the_same_object():
    skill = DATES.with_retrieval_keys(["  Put the   slot\ninto standup.json ", "put the slot into "
                                       "STANDUP.JSON", "x" * 1000])
    assert skill.example_asks[0] == "Put the slot into standup.json"
    assert len(skill.example_asks) == 2 and len(skill.example_asks[1]) == 300
    assert skill.with_retrieval_keys(["put the slot into standup.json"]) is skill
    full = DATES.with_retrieval_keys(f"ask number {i}" for i in range(50))
    assert len(full.example_asks) == MAX_EXAMPLE_ASKS
    assert full.example_asks[0] == "ask number 0"  # the first ones are kept


def test_upstream_skill_files_with_a_list_or_other_metadata_still_import():
    text = ("---\nname: iso-dates\ndescription: ISO dates.\nmetadata:\n  author: someone\n"
            "  example-asks:\n    - first ask\n    - second ask\n---\n\nBody.\n")
    skill = Skill.from_markdown(text)
    assert skill.example_asks == ("first ask", "second ask") and skill.use_when == ""
    assert skill.extra["metadata"]["author"] == "someone"
    keyed = skill.with_retrieval_keys(["third ask"])
    assert keyed.extra["metadata"]["author"] == "someone"
    assert keyed.example_asks == ("first ask", "second ask", "third ask")


@pytest.mark.parametrize("kind", ["lexical", "embedding", "hybrid"])
def test_retrieval_matches_an_ask_against_the_example_asks(kind):
    retriever = make_retriever(kind)
    plain = [DATES, *OTHERS]
    keyed = [DATES.with_retrieval_keys(["write the standup slot and action item deadlines "
                                        "into standup.json"]), *OTHERS]
    before = {r.skill.name: r.score for r in retriever.rank(ASK, plain)}
    after = {r.skill.name: r.score for r in retriever.rank(ASK, keyed)}
    assert after["iso-dates"] > before["iso-dates"]
    assert retriever.rank(ASK, keyed)[0].skill.name == "iso-dates"
    assert "standup.json" in keys_text(keyed[0])


@pytest.mark.parametrize("kind", ["lexical", "embedding", "hybrid"])
def test_retrieval_matches_an_ask_against_the_anticipated_asks(kind):
    retriever = make_retriever(kind)
    anticipated = [DATES.with_retrieval_keys(anticipated=[
        "write the standup slot and action item deadlines into standup.json"]), *OTHERS]
    before = {r.skill.name: r.score for r in retriever.rank(ASK, [DATES, *OTHERS])}
    after = {r.skill.name: r.score for r in retriever.rank(ASK, anticipated)}
    assert after["iso-dates"] > before["iso-dates"]
    assert retriever.rank(ASK, anticipated)[0].skill.name == "iso-dates"
    assert "standup.json" in keys_text(anticipated[0])


def test_the_hybrid_is_the_default_and_its_threshold_is_relative_to_the_best_skill():
    retriever = make_retriever("auto")
    assert isinstance(retriever, HybridRetriever) and retriever.dense.static
    ranked = retriever.rank("a commit message for this change", OTHERS)
    best, runner_up = ranked[0].score, ranked[1].score
    chosen = select(retriever, "a commit message for this change", OTHERS,
                    min_score=-1.0, margin=best - runner_up - 1e-6)
    assert [c.skill.name for c in chosen] == ["commit-messages"]
    both = select(retriever, "a commit message for this change", OTHERS, min_score=-1.0,
                  margin=best - runner_up + 1e-6)
    assert len(both) == 2
    assert isinstance(retriever.dense, EmbeddingRetriever)
    assert isinstance(retriever.lexical, LexicalRetriever)


def test_the_evolver_keeps_the_use_when_line_and_the_asks_of_the_failures_it_learned_from():
    answer = {"operations": [{
        "op": "add", "name": "iso-dates", "description": DATES.description, "category": "data",
        "body": DATES.body, "use_when": "  writing dates or deadlines\ninto files ",
        "reason": "dates were ambiguous", "evidence": [7]}]}
    ops = validate_operations(answer, {}, [7, 8])
    assert ops[0].skill.use_when == "writing dates or deadlines into files"
    ops = with_origin_asks(ops, {7: ASK, 8: "unrelated failure"})
    assert ops[0].skill.example_asks == (ASK,)  # its evidence only
    with pytest.raises(Exception, match="'use_when' must be a string"):
        validate_operations({"operations": [{**answer["operations"][0], "use_when": 3}]}, {}, [7])
    no_line = {"operations": [{k: v for k, v in answer["operations"][0].items()
                               if k != "use_when"}]}
    assert validate_operations(no_line, {}, [7])[0].skill.use_when == ""


def test_the_evolver_writes_anticipated_asks_and_an_edit_without_them_keeps_the_old_ones():
    from metaclaw.fastloop.evolver import EVOLVER_OP_SCHEMA, EVOLVER_SYSTEM_PROMPT
    from metaclaw.fastloop.keys import ANTICIPATED_RULE

    assert "anticipated_asks" in EVOLVER_OP_SCHEMA["required"]  # strict structured outputs
    assert '"anticipated_asks"' in EVOLVER_SYSTEM_PROMPT
    assert ANTICIPATED_RULE in EVOLVER_SYSTEM_PROMPT and '"anticipated_asks" are nine' in \
        ANTICIPATED_RULE and EVOLVER_SYSTEM_PROMPT.count('"<ask>"') == 9 + 6
    assert 9 <= MAX_ANTICIPATED_ASKS and 6 <= MAX_NEAR_MISS_ASKS
    op = {"op": "add", "name": "iso-dates", "description": DATES.description,
          "category": "data", "body": DATES.body, "use_when": "dates in files",
          "anticipated_asks": ["what date format goes in the feed?", "  ", "deadline looks odd"],
          "reason": "dates were ambiguous", "evidence": [7]}
    skill = validate_operations({"operations": [op]}, {}, [7])[0].skill
    assert skill.anticipated_asks == ("what date format goes in the feed?", "deadline looks odd")
    library = {"iso-dates": skill}
    edit = {**op, "op": "edit", "body": DATES.body + "\nAlso dates in CSV.", "anticipated_asks": []}
    edited = validate_operations({"operations": [edit]}, library, [9])[0].skill
    assert edited.anticipated_asks == skill.anticipated_asks  # []: not given, kept
    renewed = validate_operations({"operations": [{**edit, "anticipated_asks": ["csv dates?"]}]},
                                  library, [9])[0].skill
    assert renewed.anticipated_asks == ("csv dates?",)
    for bad in ("one ask", [1, 2], {"a": 1}):
        with pytest.raises(Exception, match="'anticipated_asks' must be a list of strings"):
            validate_operations({"operations": [{**op, "anticipated_asks": bad}]}, {}, [7])


def test_asks_a_skill_served_well_become_its_example_asks_with_the_next_generation(store,
                                                                                  tmp_path):
    library = SkillLibrary(tmp_path / "skills", store)
    library.apply([SkillOp("add", DATES), SkillOp("add", OTHERS[0])], kind="import")
    generation = library.generation
    served = store.record_turn(session_id="s", status="ok", request_messages=[], reward=1.0,
                               skill_generation=generation, injected_skills=["iso-dates"],
                               retrieval_query=ASK)
    store.record_turn(session_id="s", status="ok", request_messages=[], reward=-1.0,
                      skill_generation=generation, injected_skills=["iso-dates"],
                      retrieval_query="a failed ask is no example")
    store.record_turn(session_id="s", status="ok", request_messages=[], reward=1.0,
                      human_label="fail", skill_generation=generation,
                      injected_skills=["iso-dates"], retrieval_query="a person said it failed")
    assert buffers.served_asks(store, generation) == {"iso-dates": [(served, ASK)]}
    new = Skill("csv-headers", "Give every CSV file a header row.", "data", "One header line.")
    new_generation, _ = apply_ops(library, [SkillOp("add", new)], [], reason="evolved")
    skills = dict((s.name, s) for s in library.snapshot(new_generation).values())
    assert skills["iso-dates"].example_asks == (ASK,)
    assert skills["backup-first"].example_asks == ()
    assert "csv-headers" in skills
    diff = library.diff(generation, new_generation)
    assert [e.name for e in diff.edited] == ["iso-dates"]
    assert "standup.json" in diff.edited[0].unified_diff


# -- no first-run stall, and the keys shown where a person looks ------------------------------

def test_the_default_retriever_needs_no_torch_no_distillation_and_no_cache(tmp_path):
    """The static table ships in the package: a fresh machine (empty cache) loads it without
    torch, sentence-transformers or a model folder, and writes nothing to the cache."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from metaclaw.skills.retrieval import make_retriever, describe\n"
            "from metaclaw.skills.library import Skill\n"
            "r = make_retriever('auto')\n"
            "r.rank('keep a copy of the config', [Skill('a', 'Copy files first.')])\n"
            "heavy = [m for m in ('torch', 'sentence_transformers', 'transformers') "
            "if m in sys.modules]\n"
            "print(describe(r), heavy)\n")
    cache = tmp_path / "cache"
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("METACLAW_EMBEDDING_MODEL",)}
    env.update(METACLAW_CACHE_DIR=str(cache), XDG_CACHE_HOME=str(cache), HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "retrieval: hybrid (BM25 + static MiniLM table, packaged: no download, no torch) []"
    assert not cache.exists() or not any(cache.rglob("*.npy"))


def test_a_transformer_model_is_only_checked_at_start_and_loads_in_warm(monkeypatch):
    """``--embedding-model minilm`` does not hold the server's start: the model is found, not
    loaded, until :meth:`warm` (which the proxy runs after it listens)."""
    from metaclaw.skills import retrieval

    if not retrieval.embeddings_available():
        pytest.skip("needs the embeddings extra")
    loaded = []
    monkeypatch.setattr(retrieval, "_MODELS", {})  # as in a fresh process
    monkeypatch.setattr(retrieval, "load_model", lambda model=None: loaded.append(model))
    retriever = retrieval.make_retriever("hybrid", model="minilm")
    assert loaded == [] and retriever.model_id == "minilm"
    assert "loading in the background" in retrieval.describe(retriever)
    retriever.dense.warm()
    assert loaded == ["minilm"]


def test_serve_says_how_it_retrieves_and_why_shows_the_keys(tmp_path):
    import json
    import subprocess
    import sys
    import time

    import httpx

    from metaclaw.offline.double import DoubleServer, Reply

    skills = tmp_path / "skills"
    keyed = DATES.with_retrieval_keys(["write the standup slot and action item deadlines into "
                                       "standup.json"], use_when="dates or deadlines in files",
                                      anticipated=["what format for the due dates?"],
                                      near_miss=["rename the due key to dueDate in standup.json"])
    for skill in (keyed, *OTHERS):
        (skills / skill.name).mkdir(parents=True)
        (skills / skill.name / "SKILL.md").write_text(skill.to_markdown())
    db = tmp_path / "ws.db"
    with DoubleServer([Reply("done")] * 3) as upstream:
        proc = subprocess.Popen([sys.executable, "-m", "metaclaw", "serve", "--upstream",
                                 upstream.url, "--db", str(db), "--skills", str(skills),
                                 "--port", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**__import__("os").environ,
                                     "METACLAW_UPSTREAM_API_KEY": "k"})
        try:
            banner = proc.stdout.readline()
            assert "retrieval: hybrid (BM25 + static MiniLM table, packaged: no download, no torch)" in banner, banner
            url = banner.split(" on ", 1)[1].split(" ", 1)[0]
            reply = httpx.post(f"{url}/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": ASK}]})
            assert reply.status_code == 200, reply.text
            assert "iso-dates" in upstream.requests[-1]["body"]["messages"][0]["content"]
            # ordinary work near the skill's subject: held back by its near-miss ask
            reply = httpx.post(f"{url}/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "please rename the due "
                                            "key to dueDate in standup.json"}]})
            assert reply.status_code == 200, reply.text
            assert "iso-dates" not in json.dumps(upstream.requests[-1]["body"]["messages"])
            # an ask far from the skill: a penalty that changed nothing is not recorded
            reply = httpx.post(f"{url}/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "what time is it?"}]})
            assert reply.status_code == 200, reply.text
        finally:
            proc.terminate()
            _, errors = proc.communicate(timeout=30)
    # the three skills without keys are named in a note, with the command that writes them
    assert "note: 3 of 4 skills lack retrieval keys" in errors, errors
    assert "metaclaw skills keys" in errors
    deadline = time.time() + 10
    while time.time() < deadline:
        rows = [json.loads(line) for line in subprocess.run(
            [sys.executable, "-m", "metaclaw", "turns", "--db", str(db), "--json"],
            capture_output=True, text=True).stdout.splitlines()]
        if len(rows) == 3:
            break
        time.sleep(0.2)
    rows.sort(key=lambda r: r["id"])
    [held] = [e for e in rows[1]["retrieval_scores"] if e["name"] == "iso-dates"]
    assert held["injected"] is False and held["below"] == 0.825
    assert held["held_back"]["ask"] == "rename the due key to dueDate in standup.json"
    assert held["held_back"]["near"] > held["held_back"]["own"]
    assert held["score"] >= 0.825 and held["held_back"]["lost"] is None  # that near miss
    assert not any("held_back" in e for e in rows[2]["retrieval_scores"])
    scores = rows[0]["retrieval_scores"]
    assert scores[0]["name"] == "iso-dates"
    assert scores[0]["use_when"] == "dates or deadlines in files"
    assert scores[0]["example_asks"] == 1 and scores[0]["anticipated_asks"] == 1
    why = subprocess.run([sys.executable, "-m", "metaclaw", "turns", "--db", str(db), "--why"],
                         capture_output=True, text=True).stdout
    assert ("iso-dates: use when dates or deadlines in files; 1 example asks, 1 anticipated"
            in why)
    # and the key the ask was nearest to, with its cosine
    assert 'nearest key: iso-dates: "write the standup slot and action item deadlines into ' \
        'standup.json" (0.9' in why, why
    assert 'held back: iso-dates by its near-miss ask "rename the due key to dueDate in ' \
        'standup.json" (the ask is that near miss in other words: kept out whatever else it ' \
        'matched; cosine 1.00 with it, 0.' in why, why
    from metaclaw.skills.retrieval import explain_frame
    from metaclaw.store import Store

    with Store(db) as store:
        frame = explain_frame(store)
        assert frame["keys"][0].startswith('iso-dates: "write the standup')
        assert frame["held_back"][1].startswith("held back: iso-dates by its near-miss ask")
        assert frame["held_back"][2] == ""


def test_a_stored_key_holds_no_credential_control_character_or_front_matter_end():
    from metaclaw.skills.library import key_line

    assert key_line("deploy with key sk-proj-AbC123xyz789SECRETkey000, mail bob@example.com",
                    300) == "deploy with key ***, mail <email>"
    assert key_line("red \x1b[31mtext\x00 and a\u202eb", 300) == "red [31mtext and ab"
    assert key_line("diff shows --- a/config.yaml\n---\nname: evil", 300) == \
        "diff shows -- a/config.yaml -- name: evil"
    skill = DATES.with_retrieval_keys(["fix the ---- frontmatter"], use_when="before --- dates")
    assert skill.example_asks == ("fix the -- frontmatter",) and skill.use_when == "before -- dates"
    assert Skill.from_markdown(skill.to_markdown()).example_asks == skill.example_asks


def test_a_persons_ask_is_learnt_only_by_their_own_private_skill(store, tmp_path):
    """alice's ask, served well by a shared skill, was written into it for everyone to read."""
    library = SkillLibrary(tmp_path / "skills", store)
    shared = Skill("backup-first", "Copy a file before changing it.", "safety", "Copy it.")
    mine = Skill("alice-dates", DATES.description, DATES.category,
                 DATES.body).with_scope("person:alice")
    library.apply([SkillOp("add", shared), SkillOp("add", mine)], kind="import")
    generation = library.generation
    for person, skills, ask in ((None, ["backup-first"], "edit notes.md"),
                                ("alice", ["backup-first", "alice-dates"], "my ONCOLOGY visit")):
        turn = store.record_turn(session_id=f"s-{person}", request_messages=[
            {"role": "user", "content": ask}], status="ok", response="done", person=person,
            skill_generation=generation, injected_skills=skills, retrieval_query=ask)
        store.update_turn(turn, reward=1.0, judged_at=1.0)
    scopes = {s.name: s.scope for s in library.current()[1]}
    served = buffers.served_asks(store, generation, scopes=scopes)
    assert [ask for _, ask in served["backup-first"]] == ["edit notes.md"]
    assert [ask for _, ask in served["alice-dates"]] == ["my ONCOLOGY visit"]


def test_the_trace_and_the_diff_show_the_keys(store, tmp_path):
    from metaclaw.notebook.widgets import _trace_turn_html, diff_payload

    library = SkillLibrary(tmp_path / "skills", store)
    first = library.generation
    keyed = DATES.with_retrieval_keys([ASK], use_when="dates or deadlines in files",
                                      anticipated=["what format for the due dates?"],
                                      near_miss=["sort tasks.json by priority"])
    library.apply([SkillOp("add", keyed)], kind="import")
    payload = diff_payload(library.diff(first, library.generation), store)
    assert payload["added"][0]["near_miss_asks"] == ["sort tasks.json by priority"]
    assert payload["added"][0]["use_when"] == "dates or deadlines in files"
    assert payload["added"][0]["example_asks"] == [ASK]
    assert payload["added"][0]["anticipated_asks"] == ["what format for the due dates?"]
    html = _trace_turn_html({"id": 1, "retrieval": {"query": ASK, "scores": [
        {"name": "iso-dates", "score": 0.8, "use_when": "dates or deadlines in files",
         "example_asks": 1, "anticipated_asks": 3}]}, "messages": []})
    assert "use when: dates or deadlines in files" in html and "1 example asks" in html
    assert "3 anticipated asks" in html


def test_near_miss_asks_round_trip_and_hold_a_skill_back_from_nearby_work(tmp_path, store):
    """The evolver's near-miss asks (front matter ``metadata.near-miss-asks``) lower a skill's
    score for an ask nearer one of them than the skill's own asks, and say so in ``--why``."""
    near = ["add a tags array to the order JSON response",
            "the JSON config fails to load, there is a trailing comma"]
    keyed = DATES.with_retrieval_keys(["what date format goes in the export?"],
                                      use_when="writing dates into files",
                                      anticipated=["the deadline in the report looks ambiguous"],
                                      near_miss=near + ["  ", near[0]])
    assert keyed.near_miss_asks == tuple(near)  # blank and repeated ones dropped
    # an ask of the skill's own is never one of its near misses
    assert keyed.with_retrieval_keys(near_miss=["What date format goes in the export?", near[1]]
                                     ).near_miss_asks == (near[1],)
    assert keyed.with_retrieval_keys(near_miss=[f"n{i}" for i in range(20)]).near_miss_asks == \
        tuple(f"n{i}" for i in range(MAX_NEAR_MISS_ASKS))
    library = SkillLibrary(tmp_path / "skills", store)
    library.apply([SkillOp("add", keyed)], kind="import")
    text = (library.directory / "iso-dates" / "SKILL.md").read_text()
    assert "near-miss-asks:" in text and near[1] in text
    assert SkillLibrary(tmp_path / "skills", store).get("iso-dates") == keyed
    plain = keyed.with_retrieval_keys(near_miss=[])
    assert plain.near_miss_asks == () and "near-miss-asks" not in plain.to_markdown()

    ask = "add a tags array to the order JSON response, please"
    held, free = HybridRetriever(hold_back=(1.0, 0.1)), HybridRetriever(hold_back=(0.0, 0.0))
    assert held.scores(ask, [keyed])[0] < free.scores(ask, [keyed])[0]
    assert held.scores(ask, [plain])[0] == pytest.approx(free.scores(ask, [plain])[0])
    own = "what date format goes in the export?"  # the skill's own ask is not held back
    assert held.scores(own, [keyed])[0] == pytest.approx(free.scores(own, [keyed])[0])
    # an ask that is one of its near misses in other words is kept out whatever else it matches
    from metaclaw.skills.retrieval import NEAR_MISS_OUT

    strong = keyed.with_retrieval_keys(near_miss=["rename the due key in the export file"])
    assert held.held("rename the due key in the export file", strong)[3] == NEAR_MISS_OUT
    assert HybridRetriever().held("rename the due key in the export file!", strong)[3] \
        == NEAR_MISS_OUT
    # not a near miss that is as near one of the skill's own asks (a paraphrase of it)
    twin = keyed.with_retrieval_keys(near_miss=["what date format goes in the export, please?"])
    assert held.held("what date format goes in the export?", twin)[3] < NEAR_MISS_OUT
    # a hand-written file: its own ask listed as a near miss is not one, a long ask is cut
    metadata = dict(keyed.extra["metadata"])
    metadata["near-miss-asks"] = "What date format goes in the export?\n" + "x" * 5000
    by_hand = Skill(keyed.name, keyed.description, keyed.category, keyed.body,
                    {**keyed.extra, "metadata": metadata})
    assert [len(a) for a in by_hand.near_miss_asks] == [300]
    found = held.dense.contrast(ask, keyed)
    assert found[0] == near[0] and found[1] > found[2]
    held.scores(ask, [keyed, OTHERS[0]])
    assert list(held.last_held(ask)) == ["iso-dates"] and held.last_held("another ask") == {}
    said = held.held(ask, keyed)
    assert said[0] == near[0] and said[3] > 0 and held.held(own, keyed) is None
    assert held.held(ask, plain) is None and free.held(ask, keyed) is None
    assert held.held("  ", keyed) is None and held.hold_back("", [keyed], [1.0]) == {}
    # only the best few are checked: the rest of a large library costs nothing
    many = [keyed] + [Skill(f"other-{i}", f"Unrelated advice number {i}.", "misc", "Body.")
                      for i in range(30)]
    assert len(held.hold_back(ask, many, held.scores(ask, many))) <= 1
    # skills of another stage that outrank it (passed over for this turn) do not crowd it out
    decoys = [Skill(f"plan-{i}", f"Add a tags array to the order JSON response, step {i}.",
                    "plan", "Plan it.").with_stage("plan") for i in range(8)]
    import numpy as np

    assert 0 in held.hold_back(ask, [keyed, *decoys], np.array([0.5] + [1.0] * 8))


def test_the_evolver_writes_near_miss_asks():
    from metaclaw.fastloop.evolver import EVOLVER_OP_SCHEMA
    from metaclaw.skills.retrieval import explain_held

    assert "near_miss_asks" in EVOLVER_OP_SCHEMA["required"]
    op = {"op": "add", "name": "iso-dates", "description": DATES.description,
          "category": "data", "body": DATES.body, "use_when": "dates in files",
          "anticipated_asks": ["what date format goes in the feed?"],
          "near_miss_asks": ["pretty-print this JSON file", " "],
          "reason": "dates were ambiguous", "evidence": [7]}
    skill = validate_operations({"operations": [op]}, {}, [7])[0].skill
    assert skill.near_miss_asks == ("pretty-print this JSON file",)
    edit = {**op, "op": "edit", "body": "Use ISO 8601.", "near_miss_asks": []}  # none given:
    assert validate_operations({"operations": [edit]}, {"iso-dates": skill}, [7])[0] \
        .skill.near_miss_asks == skill.near_miss_asks  # the old ones are kept
    assert explain_held({"retrieval_scores": [{"name": "x", "injected": False}]}) == []
    for odd in ({"near": None, "own": 1}, {"near": "x", "own": 1}, {}, "text"):
        assert explain_held({"retrieval_scores": [
            {"name": "x", "injected": False, "score": 0.5, "held_back": odd}]}) == []
