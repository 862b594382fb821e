"""Skill retrieval: quality and speed of BM25, all-MiniLM-L6-v2 and the default static model.

- Quality, on the hand-labelled set ``tests/fixtures/retrieval/labelled_asks.json`` (the eight
  starter skills plus 24 more, 68 asks labelled with their relevant skills, 8 off-topic asks):
  recall@3 of the ranking; recall@3 of what :func:`metaclaw.retrieval.select` injects at the
  retriever's default ``min_score``; how many off-topic asks get no skill. A hybrid (static
  cosine + 0.2 * BM25 / (BM25 + 3)) is measured beside them as the alternative that was weighed.
  Then top-1/top-3 hits on the same file's 10 paraphrases of starter-skill asks (few words in
  common with their skill; written earlier to check MiniLM, so they favour it).
- Speed per request: :func:`metaclaw.retrieval.augment` (query extraction, ranking, selection,
  rendering, injection: what the proxy adds for retrieval) on that library, each query a fresh
  text (no cache can serve it), models warm, the retrievers taking turns query by query so machine
  noise falls on all alike. Target: the default embedding model <= 3 ms p50.
- Scale: ``rank(query, skills, limit=16)`` (what ``select`` asks for at top_k=3) over
  ``--skills`` (10,000) generated skills with fresh queries, indexes built beforehand, for BM25 and
  the static model. Target: <= 2 ms p50 each. (MiniLM is left out here: embedding 20,000 skill
  texts with it takes minutes on two cores; its ranking is the same matrix-vector product.)

    python benchmarks/bench_retrieval.py [--queries 200] [--skills 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time
from pathlib import Path

import numpy as np

from metaclaw.retrieval import (
    LexicalRetriever, ScoredSkill, augment, make_retriever, recall_at_k, select,
)
from metaclaw.skills import Skill, load_skills_dir, starter_skills_dir

LABELLED = (Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "retrieval"
            / "labelled_asks.json")
P50_TARGET_MS = 3.0
TOP_K_TARGET_MS = 2.0


class Hybrid:
    """Static cosine plus a saturated BM25 bonus (measured, not shipped)."""

    kind = "hybrid"

    def __init__(self, static, lexical, weight: float = 0.2, saturation: float = 3.0):
        self.static, self.lexical = static, lexical
        self.weight, self.saturation = weight, saturation

    def rank(self, query: str, skills: list[Skill]) -> list[ScoredSkill]:
        cos = {r.skill.name: r.score for r in self.static.rank(query, skills)}
        bm25 = {r.skill.name: r.score for r in self.lexical.rank(query, skills)}
        scored = [ScoredSkill(s, cos[s.name] + self.weight * bm25[s.name]
                              / (bm25[s.name] + self.saturation)) for s in skills]
        return sorted(scored, key=lambda r: (-r.score, r.skill.name))


def labelled_set() -> tuple[list[Skill], list[tuple[str, list[str]]]]:
    data = json.loads(LABELLED.read_text())
    starters, _ = load_skills_dir(starter_skills_dir())
    skills = sorted([*starters.values(), *(Skill(**s) for s in data["skills"])],
                    key=lambda s: s.name)
    return skills, [(a["ask"], a["relevant"]) for a in data["asks"]]


def paraphrase_set() -> tuple[list[Skill], list[tuple[str, str]]]:
    starters, _ = load_skills_dir(starter_skills_dir())
    pairs = json.loads(LABELLED.read_text())["paraphrases"]
    return sorted(starters.values(), key=lambda s: s.name), [(a, e) for a, e in pairs]


def generated_skills(n: int, words: list[str], seed: int = 0) -> list[Skill]:
    """``n`` skills of Zipf-distributed words from ``words`` (realistic term frequencies)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(words))]

    def text(k: int) -> str:
        return " ".join(rng.choices(words, weights, k=k))

    return [Skill(name=f"{'-'.join(rng.choices(words, weights, k=2))}-{i}",
                  description=text(rng.randint(10, 25)), body=text(rng.randint(40, 150)),
                  category="generated") for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=200, help="timed queries per retriever")
    parser.add_argument("--skills", type=int, default=10_000, help="generated library size")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    skills, asks = labelled_set()
    started = time.perf_counter()
    retrievers = {
        "lexical (BM25)": LexicalRetriever(),
        "minilm (transformer)": make_retriever("embedding", model="minilm"),
        "static (default)": make_retriever("embedding"),
    }
    for retriever in retrievers.values():
        retriever.warm(skills)
    print(f"models loaded and {len(skills)} skills indexed in {time.perf_counter() - started:.1f} s"
          f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    labelled = [(a, r) for a, r in asks if r]
    off_topic = [a for a, r in asks if not r]
    print(f"\nQuality: {len(skills)} skills, {len(labelled)} labelled asks, {len(off_topic)} "
          f"off-topic asks ({LABELLED.relative_to(LABELLED.parents[3])})")
    print(f"  {'retriever':<34} {'recall@3':>9} {'injected@3':>11} {'off-topic quiet':>16}")
    hybrid = Hybrid(retrievers["static (default)"], retrievers["lexical (BM25)"])
    for name, retriever in [*retrievers.items(), ("hybrid static+BM25 (not shipped)", hybrid)]:
        recall = recall_at_k(retriever, asks, skills, 3)
        if retriever is hybrid:
            print(f"  {name:<34} {recall:>9.3f} {'-':>11} {'-':>16}")
            continue
        injected = recall_at_k(retriever, asks, skills, 3, min_score=retriever.default_min_score)
        quiet = sum(not select(retriever, a, skills) for a in off_topic)
        print(f"  {name:<34} {recall:>9.3f} {injected:>11.3f} {quiet:>12}/{len(off_topic)}"
              f"   (min_score {retriever.default_min_score:g})")

    starters, paraphrases = paraphrase_set()
    print(f"\nParaphrases: {len(paraphrases)} asks over the {len(starters)} starter skills with few "
          "words in common with their skill (written earlier to check MiniLM; they favour it)")
    print(f"  {'retriever':<34} {'top-1':>9} {'top-3':>11}")
    for name, retriever in retrievers.items():
        ranked = [[r.skill.name for r in retriever.rank(a, starters)[:3]] for a, _ in paraphrases]
        top1 = sum(r[0] == e for r, (_, e) in zip(ranked, paraphrases))
        top3 = sum(e in r for r, (_, e) in zip(ranked, paraphrases))
        print(f"  {name:<34} {top1:>6}/{len(paraphrases)} {top3:>8}/{len(paraphrases)}")

    # per-request cost, fresh text each time, retrievers interleaved
    times: dict[str, list[float]] = {name: [] for name in retrievers}
    for i in range(5):  # warm-up: first calls of each code path
        for retriever in retrievers.values():
            augment(retriever, [{"role": "user", "content": f"warm up {i}"}], skills)
    for i in range(args.queries):
        ask = f"{asks[i % len(asks)][0]} (request {i})"
        messages = [{"role": "system", "content": "You are a helpful agent."},
                    {"role": "user", "content": ask}]
        for name, retriever in retrievers.items():
            start = time.perf_counter()
            augment(retriever, messages, skills, top_k=3)
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"\nPer request: augment() over {len(skills)} skills, {args.queries} fresh queries each")
    print(f"  {'retriever':<34} {'p50 ms':>9} {'p99 ms':>9}")
    for name, values in times.items():
        print(f"  {name:<34} {statistics.median(values):>9.3f} {percentile(values, 99):>9.3f}")
    static_p50 = statistics.median(times["static (default)"])
    minilm_p50 = statistics.median(times["minilm (transformer)"])
    print(f"  static vs minilm: {minilm_p50 / static_p50:.0f}x faster; static p50 "
          f"{static_p50:.3f} ms vs target {P50_TARGET_MS} ms: "
          f"{'PASS' if static_p50 <= P50_TARGET_MS else 'FAIL'}")

    # scale: top-k over a large generated library
    words = sorted({w for s in skills for w in re.findall(r"[a-z]+", f"{s.description} {s.body}".lower())},
                   key=lambda w: (-sum(f"{s.description} {s.body}".lower().count(w) for s in skills), w))
    big = generated_skills(args.skills, words)
    scale = {"lexical (BM25)": LexicalRetriever(), "static (default)": make_retriever("embedding")}
    print(f"\nScale: rank(query, skills, limit=16) over {len(big):,} generated skills, "
          f"{args.queries} fresh queries each")
    for name, retriever in scale.items():
        start = time.perf_counter()
        retriever.warm(big)
        print(f"  {name:<34} index built in {time.perf_counter() - start:.1f} s")
    top_times: dict[str, list[float]] = {name: [] for name in scale}
    for i in range(args.queries):
        query = f"{asks[i % len(asks)][0]} (request {i})"
        for name, retriever in scale.items():
            start = time.perf_counter()
            retriever.rank(query, big, limit=16)
            top_times[name].append((time.perf_counter() - start) * 1e3)
    print(f"  {'retriever':<34} {'p50 ms':>9} {'p99 ms':>9}")
    for name, values in top_times.items():
        p50 = statistics.median(values)
        print(f"  {name:<34} {p50:>9.3f} {percentile(values, 99):>9.3f}   target "
              f"{TOP_K_TARGET_MS} ms: {'PASS' if p50 <= TOP_K_TARGET_MS else 'FAIL'}")


if __name__ == "__main__":
    main()
