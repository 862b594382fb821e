"""An experiment's replays and judge votes run concurrently; its memory stays bounded.

Measured side by side in one run, against the offline double answering every request after a
fixed latency (a simulated upstream and judge, not models; the double runs in its own process,
as in ``bench_judge.py``, the same one for every measurement, but on the same machine: its CPU,
about 0.6 ms a request, shares the cores with the client, as a remote judge's would not, so on a
small machine the ratio moves with the machine's load):

- single: the wall time of one case of one variant (``current``: its skills selected, one
  upstream call, then one judge call for its ``--votes`` votes: ``n`` choices, the judge's
  default, which the double honours), the slowest of ``--repeat`` after one
  that warms the process (the retrieval model loads once per process, about 0.3 s);
- experiment: ``Experiment.run`` over ``--cases`` cases x 2 variants, reading the cases and
  storing every result.

PASS when experiment / single <= 1.5 (the judge benchmark's rule) at the ``--latency`` (default 1
s). Then the peak memory (tracemalloc) of an experiment over ``--large`` cases at no latency.

    python benchmarks/bench_experiment.py [--cases 200] [--votes 3] [--latency 1.0] [--large 10000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_judge import MAX_RATIO, simulated_double, slowest  # noqa: E402


def workspace(folder: Path, cases: int):
    from metaclaw.fastloop import experiments as ex
    from metaclaw.skills.library import Skill, SkillLibrary
    from metaclaw.store import Store

    store = Store(folder / "metaclaw.db")
    library = SkillLibrary(folder / "skills", store)
    library.add(Skill(name="iso-dates", description="Write dates as ISO 8601",
                      body="Every date you write uses YYYY-MM-DD."), reason="bench")
    with store.transaction(fsync=False):
        ids = [store.record_turn(session_id=f"s{i % 20}", status="ok", response=f"answer {i}",
                                 request_messages=[{"role": "user",
                                                    "content": f"write the due date {i} into "
                                                               "tasks.json"}])
               for i in range(cases)]
    ex.dataset(store, "cases", turn_ids=ids)
    return store, library


def prepared(url: str, store, name: str, latency: float, votes: int, dataset: str = "cases",
             variants: tuple[str, ...] = ("none", "current")):
    """A new experiment ``name`` over ``dataset`` (``variants``), and the replayer that runs it
    against the double at ``latency``."""
    from metaclaw.fastloop import experiments as ex
    from metaclaw.fastloop.judge import Judge
    from metaclaw.fastloop.replay import Replayer

    model = f"judge-{latency:g}"
    replayer = Replayer(Judge(url, model, votes=votes, timeout=30 + latency), url, model,
                        timeout=30 + latency)
    return ex.Experiment.create(store, name, dataset, list(variants)), replayer


def check_scored(experiment) -> None:
    frame = experiment.frame()
    assert frame["score"].null_count() == 0, frame.filter(frame["score"].is_null())["error"][0]


def timed(url: str, store, library, name: str, latency: float, votes: int,
          dataset: str = "cases") -> float:
    """The wall time of running experiment ``name`` over ``dataset``, in seconds."""
    experiment, replayer = prepared(url, store, name, latency, votes, dataset)
    start = time.perf_counter()
    experiment.run(replayer, library)
    seconds = time.perf_counter() - start
    check_scored(experiment)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--votes", type=int, default=3)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--large", type=int, default=10_000)
    args = parser.parse_args(argv)

    from metaclaw.fastloop import experiments as ex

    with simulated_double() as url:
        with tempfile.TemporaryDirectory() as tmp:
            store, library = workspace(Path(tmp) / "a", args.cases + args.repeat)
            ids = ex.dataset_ids(store, "cases")
            runs = []  # one case of one variant each
            for i in range(args.repeat + 1):
                ex.dataset(store, f"one{i}", turn_ids=[ids[args.cases + i - 1]])
                runs.append(prepared(url, store, f"s{i}", args.latency, args.votes, f"one{i}",
                                     ("current", "none")))  # max_calls: current only
            single, _median = slowest(  # the first warms the process
                lambda i: runs[i][0].run(runs[i][1], library, concurrency=1,
                                         max_calls=1 + args.votes), args.repeat)
            for experiment, _replayer in runs:
                check_scored(experiment)
            ex.dataset(store, "batch", turn_ids=ids[:args.cases])
            batch = timed(url, store, library, "batch", args.latency, args.votes,
                          dataset="batch")
            store.close()

            store, library = workspace(Path(tmp) / "b", args.large)
            tracemalloc.start()
            large = timed(url, store, library, "large", 0.0, 1)
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            store.close()
    replays = 2 * args.cases
    ratio = batch / single
    print(f"experiment: {args.cases} cases x 2 variants x {args.votes} votes = {replays} "
          f"upstream calls + {replays} judge calls of {args.votes} choices ({replays * args.votes} "
          f"votes), simulated latency {args.latency:g} s")
    print(f"  one case, one variant (slowest of {args.repeat}): {single:.2f} s")
    print(f"  the whole experiment: {batch:.2f} s; ratio {ratio:.2f} (must be <= {MAX_RATIO}): "
          f"{'PASS' if ratio <= MAX_RATIO else 'FAIL'}")
    print(f"  {args.large:,} cases x 2 variants at no latency: {large:.1f} s, peak traced "
          f"memory {peak:.0f} MiB")
    return 0 if ratio <= MAX_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
