"""Judging many turns runs every vote concurrently.

Measured side by side in one run, against the offline double answering every judge request after
a fixed latency (a simulated judge, not a model; the double runs in its own process so its event
loop does not share the interpreter with the judge):

- single: the wall time of judging one turn (its ``--votes`` votes: one request of that many
  choices, the judge's default, which the double honours), the slowest of ``--repeat`` runs;
- batch:  the wall time of ``Judge.judge_turns`` on ``--turns`` turns (``turns`` requests of
  ``votes`` choices), including reading the turns and storing the verdicts; once with a cold connection
  pool (connections opened during the batch) and once warm (as in a long-running fast loop).

PASS when batch (warm) / single <= 1.5 at the ``--latency`` of the run (default 1 s, a typical
judge-model latency) and every turn was judged. ``--also`` adds shorter latencies to the table:
there the ratio is bound by the per-request CPU cost of the HTTP client and of the double on the
machine (300 requests cost a few hundred milliseconds of CPU on a 2-core box), not by waiting.

    python benchmarks/bench_judge.py [--turns 100] [--votes 3] [--latency 1.0] [--also 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

#: PASS when the batch takes at most this many times one turn (or one case) alone.
MAX_RATIO = 1.5


def serve_double(port_queue: "mp.Queue[int]", stop: "mp.Event") -> None:
    """Child process: a double answering every request with a +1 verdict after a delay given by
    the request's model name (``judge-<seconds>``)."""
    from metaclaw.offline.double import DoubleServer, Reply

    verdict = json.dumps({"score": 1, "rationale": "fine"})

    def reply(body: dict) -> Reply:
        return Reply(content=verdict, delay=float(str(body.get("model", "judge-0")).split("-")[1]))

    double = DoubleServer(reply).start()
    port_queue.put(double.port)
    stop.wait()
    double.stop()


@contextlib.contextmanager
def simulated_double() -> Iterator[str]:
    """:func:`serve_double` in a process of its own (its event loop does not share the
    interpreter with what is measured); yields its base URL, stops it at the end."""
    ctx = mp.get_context("spawn")
    ports: "mp.Queue[int]" = ctx.Queue()
    stop = ctx.Event()
    child = ctx.Process(target=serve_double, args=(ports, stop), daemon=True)
    child.start()
    try:
        yield f"http://127.0.0.1:{ports.get(timeout=60)}/v1"
    finally:
        stop.set()
        child.join(10)


def slowest(run: Callable[[int], object], repeat: int) -> tuple[float, float]:
    """The slowest and the median wall time of ``run(1)`` .. ``run(repeat)``, after ``run(0)``
    (which warms the connection pools and is not counted)."""
    seconds = []
    for i in range(repeat + 1):
        start = time.perf_counter()
        run(i)
        if i:
            seconds.append(time.perf_counter() - start)
    return max(seconds), sorted(seconds)[len(seconds) // 2]


def measure(url: str, store, ids: list[int], latency: float, votes: int, turns: int,
            repeat: int) -> dict:
    """Single-turn and batch timings at one latency (one event loop, one connection pool)."""
    from metaclaw.fastloop.judge import Judge

    judge = Judge(url, f"judge-{latency:g}", votes=votes, timeout=30 + latency)
    batches_ids = [ids[repeat + 1:repeat + 1 + turns], ids[repeat + 1 + turns:]]
    loop = asyncio.new_event_loop()
    try:
        def single(i: int) -> None:  # ids[0] warms the pool
            [result] = loop.run_until_complete(judge.ajudge_turns(store, [ids[i]]))
            assert result.score == 1, result

        single_max, single_median = slowest(single, repeat)
        batches = []
        for batch_ids in batches_ids:
            start = time.perf_counter()
            results = loop.run_until_complete(
                judge.ajudge_turns(store, batch_ids, concurrency=turns * votes))
            batches.append((time.perf_counter() - start, sum(r.score == 1 for r in results)))
        loop.run_until_complete(judge.aclose())
    finally:
        loop.close()
    return {"latency": latency, "single": single_max, "median": single_median,
            "cold": batches[0], "warm": batches[1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--votes", type=int, default=3)
    parser.add_argument("--latency", type=float, default=1.0,
                        help="seconds per judge request for the PASS check (default 1.0)")
    parser.add_argument("--also", type=float, nargs="*", default=[0.2],
                        help="more latencies to report (default 0.2)")
    parser.add_argument("--repeat", type=int, default=5, help="single-turn repetitions")
    args = parser.parse_args(argv)

    from metaclaw.store import Store

    rows = []
    with simulated_double() as url:
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(Path(tmp) / "bench.db")
            for latency in [args.latency, *args.also]:
                with store.transaction():
                    ids = [store.record_turn(
                        session_id=f"s{i % 10}", status="ok", response=f"answer {i}",
                        request_messages=[{"role": "user", "content": f"question {i}"}])
                        for i in range(2 * args.turns + args.repeat + 1)]
                rows.append(measure(url, store, ids, latency, args.votes, args.turns,
                                    args.repeat))
            store.close()

    print(f"judge_turns: {args.turns} turns x {args.votes} votes ({args.turns} requests of "
          f"{args.votes} choices) against a simulated judge with fixed latency")
    print(f"{'latency':>8} {'single (slowest)':>17} {'batch cold':>11} {'batch warm':>11} "
          f"{'ratio cold':>11} {'ratio warm':>11} {'sequential':>11}")
    ok = True
    for row in rows:
        single = row["single"]
        (cold, judged_cold), (warm, judged_warm) = row["cold"], row["warm"]
        print(f"{row['latency']:>7.2f}s {single * 1000:>15.0f}ms {cold * 1000:>9.0f}ms "
              f"{warm * 1000:>9.0f}ms {cold / single:>11.2f} {warm / single:>11.2f} "
              f"{single * args.turns * 1000:>9.0f}ms")
        ok = ok and judged_cold == judged_warm == args.turns
    ratio = rows[0]["warm"][0] / rows[0]["single"]
    print(f"ratio batch / single at {args.latency:g} s: {ratio:.2f} (must be <= {MAX_RATIO})")
    ok = ok and ratio <= MAX_RATIO
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
