"""Retrieval on a small hand-labelled set (tests/fixtures/retrieval/labelled_asks.json), as a
regression guard: the default (BM25 fused with the static table) ranks at least as well as each
of its parts alone, and stays quiet on the off-topic asks. The figures that matter are measured
on a larger set split into dev and test by benchmarks/bench_retrieval.py; no timing here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metaclaw.skills.library import Skill, load_skills_dir, starter_skills_dir
from metaclaw.skills.retrieval import (HybridRetriever, LexicalRetriever, make_retriever,
                                       recall_at_k, select)

LABELLED = Path(__file__).parent / "fixtures" / "retrieval" / "labelled_asks.json"
#: Two asks of the 68 (recall moves in steps of about 1/68 per ask).
TOLERANCE = 0.03

@pytest.fixture(scope="module")
def labelled():
    data = json.loads(LABELLED.read_text())
    starters, problems = load_skills_dir(starter_skills_dir())
    assert problems == []
    skills = sorted([*starters.values(), *(Skill(**s) for s in data["skills"])],
                    key=lambda s: s.name)
    asks = [(a["ask"], a["relevant"]) for a in data["asks"]]
    names = {s.name for s in skills}
    assert all(set(relevant) <= names for _, relevant in asks)
    return skills, asks


@pytest.fixture(scope="module")
def retrievers():
    return {"lexical": LexicalRetriever(), "static": make_retriever("embedding"),
            "default": make_retriever("auto")}


def test_the_default_ranks_the_labelled_asks_as_well_as_its_parts(labelled, retrievers):
    skills, asks = labelled
    assert isinstance(retrievers["default"], HybridRetriever)
    recall = {name: recall_at_k(r, asks, skills, 3) for name, r in retrievers.items()}
    assert recall["default"] >= max(recall["static"], recall["lexical"]) - TOLERANCE, recall
    assert recall["default"] >= 0.7, recall


def test_the_default_injects_a_relevant_skill_and_stays_quiet_off_topic(labelled, retrievers):
    skills, asks = labelled
    default = retrievers["default"]
    off_topic = [ask for ask, relevant in asks if not relevant]
    assert len(off_topic) >= 5
    for ask in off_topic:
        assert select(default, ask, skills) == [], ask
    hits = [bool({s.skill.name for s in select(default, ask, skills)} & set(relevant))
            for ask, relevant in asks if relevant]
    # 22 of 68: the fixture's own skills carry no retrieval keys (only the starter skills do),
    # and without keys the default injects mostly where the ask also shares words with the
    # skill (docs/explanation/retrieval.md); the constants hold the off-topic target in every
    # state of the skills on the dev split, which costs hits here
    assert sum(hits) / len(hits) >= 21 / 68 - TOLERANCE, sum(hits)
