"""Per-skill evidence on a large workspace: time and peak memory of ``evidence.skill_stats``.

    python benchmarks/bench_evidence.py                 # 100,000 turns, 300 skills
    python benchmarks/bench_evidence.py --turns 10000 --skills 50

The workspace is generated: skills mixing the words of the packaged starter skills, and task
turns whose asks mix the same words; each ask is repeated by a few turns (an agent's tool loop
sends one ask several times), a third of the turns carry one to three injected skills, half are
judged. Each turn records its ask's features as the proxy does when it serves the turn (its
static embedding and BM25 terms, :func:`metaclaw.skills.retrieval.ask_features`); the comparable
turns are timed with them and again with none recorded (turns from before they were recorded, or
imported ones: every ask tokenized and embedded again). Target: under 2 s for 100,000 turns and
300 skills, in bounded memory.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from metaclaw.fastloop import evidence
from metaclaw.skills.library import Skill, SkillLibrary, SkillOp, starter_skills_dir
from metaclaw.skills.retrieval import ask_features, make_retriever
from metaclaw.store import Store


def build(folder: Path, n_turns: int, n_skills: int, seed: int = 0) -> tuple[Store, SkillLibrary]:
    rng = random.Random(seed)
    starters = [Skill.from_markdown(p.read_text()) for p in starter_skills_dir().glob("*/SKILL.md")]
    words = [w for s in starters for w in f"{s.description} {s.body}".split()]
    store = Store(folder / "metaclaw.db")
    library = SkillLibrary(folder / "skills", store)
    skills = [Skill(name=f"skill-{i:04d}", description=" ".join(rng.choices(words, k=12)),
                    body=" ".join(rng.choices(words, k=60))) for i in range(n_skills)]
    library.apply([SkillOp("add", skill=s) for s in skills], kind="import", reason="bench")
    names = [s.name for s in skills]
    asks = [" ".join(rng.choices(words, k=rng.randint(6, 30))) for _ in range(n_turns // 4)]
    retriever = make_retriever("auto")  # the proxy's default: it records what it computed
    features = [ask_features(retriever, ask) for ask in asks]
    with store.transaction(fsync=False):
        for i in range(n_turns):
            injected = rng.sample(names, rng.randint(1, 3)) if i % 3 == 0 else []
            turn = store.record_turn(session_id=f"s{i // 50}", status="ok",
                                     request_messages=[{"role": "user", "content": "x"}],
                                     response="ok", injected_skills=injected,
                                     retrieval_query=asks[i // 4],
                                     ask_features=features[i // 4])
            if i % 2:
                store.update_turn(turn, reward=rng.choice([-1.0, 1.0]))
    return store, library


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--skills", type=int, default=300)
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store, library = build(Path(tmp), args.turns, args.skills)
        print(f"built {args.turns:,} turns and {args.skills} skills in "
              f"{time.perf_counter() - t0:.1f} s")
        evidence.skill_stats(store, library, compare=False)  # warm: the page cache, imports
        for compare, what in ((False, "with / without only"),
                              (True, "with comparable turns, features recorded"),
                              (True, "with comparable turns, no features recorded")):
            if what.endswith("no features recorded"):
                store.execute("UPDATE turns SET ask_features = NULL")
            times = []
            for _ in range(3):  # the median of three, timed without tracemalloc (it slows
                t0 = time.perf_counter()  # every allocation)
                stats = evidence.skill_stats(store, library, compare=compare)
                times.append(time.perf_counter() - t0)
            seconds = sorted(times)[1]
            tracemalloc.start()  # the memory in a run of its own
            evidence.skill_stats(store, library, compare=compare)
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            print(f"skill_stats ({what}): {seconds:.2f} s (median of 3), peak {peak:.0f} MiB traced (in a "
                  f"second run), {len(stats)} rows (target < 2 s: "
                  f"{'PASS' if seconds < 2 else 'FAIL'})")
            failed = failed or seconds >= 2
        store.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
