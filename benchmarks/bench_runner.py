"""Time the benchmark runner on the small MetaClaw-Bench against an answer-key upstream double.

The upstream is a local OpenAI-compatible double (metaclaw.offline.double.DoubleServer) answering from the
answer key (metaclaw.bench.oracle), so the time measured is the runner's: agent loop, tool calls,
workspaces and graders. Runs the whole benchmark against an instant upstream, then against one
with a small fixed latency per request with ``--parallel 1`` and ``--parallel N`` side by side,
and prints the times and the ratio.

    python benchmarks/bench_runner.py [--data DIR] [--latency 0.05] [--parallel 4]

Targets: with an instant upstream the whole benchmark runs in <= 30 s (even with --parallel 1),
and with the fixed latency --parallel N is at least 2x faster than --parallel 1. Exit code 0 when
both hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from metaclaw.bench.data import load_benchmark, small_bench_dir
from metaclaw.bench.oracle import oracle_replies
from metaclaw.bench.runner import run_bench
from metaclaw.offline.double import DoubleServer

DEFAULT_DATA = small_bench_dir()


def timed_run(data: Path, url: str, parallel: int, out: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    summary = run_bench(data, "all", "baseline", base_url=url, model="double-model",
                        out_dir=out, parallel=parallel)
    return time.perf_counter() - started, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path,
                        default=Path(os.environ.get("METACLAW_BENCH_DATA", DEFAULT_DATA)))
    parser.add_argument("--latency", type=float, default=0.05, help="seconds per upstream request")
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args(argv)

    bench = load_benchmark(args.data)
    with tempfile.TemporaryDirectory() as tmp:
        with DoubleServer(oracle_replies(bench.days)) as instant:
            instant_n, _ = timed_run(args.data, instant.url, args.parallel, Path(tmp) / "i-n")
            instant_1, s0 = timed_run(args.data, instant.url, 1, Path(tmp) / "i-1")
        with DoubleServer(oracle_replies(bench.days, delay=args.latency)) as slow:
            serial, s1 = timed_run(args.data, slow.url, 1, Path(tmp) / "p1")
            parallel, sn = timed_run(args.data, slow.url, args.parallel, Path(tmp) / "pn")
            requests = len(slow.requests) // 2

    ratio = serial / parallel
    print(f"small benchmark: {s1['rounds']} rounds, {len(bench.days)} days, "
          f"{requests} model requests per run")
    print(f"instant upstream, parallel {args.parallel} : {instant_n:6.2f} s")
    print(f"instant upstream, parallel 1 : {instant_1:6.2f} s   (target <= 30 s)")
    print(f"{args.latency * 1000:.0f} ms upstream, parallel 1   : {serial:6.2f} s")
    print(f"{args.latency * 1000:.0f} ms upstream, parallel {args.parallel}   : {parallel:6.2f} s")
    print(f"speed-up parallel {args.parallel} vs 1 : {ratio:.2f}x (target >= 2x)")
    accurate = s0["accuracy"] == s1["accuracy"] == sn["accuracy"] == 1.0
    print(f"answer-key accuracy 100% in every run: {accurate}")
    ok = ratio >= 2.0 and max(instant_n, instant_1) <= 30.0 and accurate
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
