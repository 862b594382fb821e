"""Where the running proxy's CPU goes beyond the floor's, step by step, measured in place.

``benchmarks/bench_proxy.py`` prints the proxy's CPU per request against the floor's (a bare
aiohttp pass-through). This script splits the difference. It runs the same processes (the
offline upstream double, the floor, ``metaclaw serve`` with lexical retrieval over the same 20
skills) and sends them the same requests one at a time, alternating between the two so drift
falls on both, first non-streaming, then streaming. The proxy runs with a thread-CPU clock
around each of its own steps (:data:`STEPS`: what the floor does not do), and reports their
totals on ``SIGUSR1``. Printed, in microseconds of CPU per request: each whole process, the
difference, each step as it ran in place (caches as cold as the client and the upstream left
them), their sum, and the rest (relaying more bytes, parsing and assembling stream events, the
acknowledgement). The clocks cost a little themselves (two reads per step, included in the
proxy's figures), so the proxy here runs slightly slower than in ``bench_proxy.py``.

    python benchmarks/bench_proxy_steps.py [--requests 500] [--warmup 50]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from bench_proxy import (CHECKED, FLOOR, ProxyProcess, call_plain, call_stream, cpu_seconds,
                         start_double, start_passthrough, start_proxy, stop_proxy)

#: The proxy's own steps, timed in place: (label, "module:Class" or "module", attribute). None
#: calls another, so their times add up.
STEPS = [
    ("authenticate the caller", "metaclaw.proxy.pipeline:TurnPipeline", "authenticate"),
    ("decode and check the body", "metaclaw.proxy.edge", "decode_body"),
    ("parse the turn", "metaclaw.proxy.pipeline", "parse_turn"),
    ("identify the session", "metaclaw.proxy.pipeline", "identify_session"),
    ("thread alike conversations", "metaclaw.proxy.sessions:ReplyThreads", "resolve"),
    ("check the skill generation", "metaclaw.skills:SkillLibrary", "current"),
    ("retrieve and inject skills", "metaclaw.proxy.pipeline:TurnPipeline", "select_and_inject"),
    ("build the turn's row", "metaclaw.proxy.pipeline", "record_row"),
    ("complete and submit the row", "metaclaw.proxy.pipeline:_Relay", "finish"),  # with the thread
    ("commit the turns on the loop", "metaclaw.proxy.pipeline:Recorder", "_commit_on_loop"),
    ("commit the turns in the thread", "metaclaw.proxy.pipeline:Recorder", "_commit"),
    ("checkpoint the log (thread)", "metaclaw.store:Store", "checkpoint"),
]
#: Runs the proxy with its steps timed (the first argument of this script's child mode).
TIMED_PROXY = "--timed-proxy"


# ---------------------------------------------------------------------------------------------
# the proxy's side: `bench_proxy_steps.py --timed-proxy REPORT serve ...`
# ---------------------------------------------------------------------------------------------
def timed(fn: Callable[..., Any], total: list[float]) -> Callable[..., Any]:
    """``fn`` adding its calls and its thread CPU seconds to ``total``."""
    clock = time.thread_time

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += 1
            total[1] += clock() - started
    return step


def run_timed_proxy(report: Path, cli_args: list[str]) -> int:
    """``metaclaw <cli_args>`` with :data:`STEPS` timed; ``SIGUSR1`` writes the totals to
    ``report`` as JSON (label -> [calls, seconds], and how many reports were written)."""
    totals: dict[str, Any] = {label: [0, 0.0] for label, _, _ in STEPS}
    for label, where, attribute in STEPS:
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        if cls:
            owner = getattr(owner, cls)
        setattr(owner, attribute, timed(getattr(owner, attribute), totals[label]))
    written = [0]

    def write_report(*_: Any) -> None:
        written[0] += 1
        part = report.with_suffix(".part")
        part.write_text(json.dumps({"steps": totals, "written": written[0]}))
        part.replace(report)

    signal.signal(signal.SIGUSR1, write_report)
    from metaclaw.cli import main

    return main(cli_args)


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def read_steps(pid: int, report: Path, seq: list[int]) -> dict[str, list[float]]:
    """Ask the proxy for its step totals and wait for them."""
    seq[0] += 1
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            data = json.loads(report.read_text())
            if data["written"] == seq[0]:
                return data["steps"]
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise RuntimeError("the timed proxy did not report its steps within 30 s")


def measure(targets: dict[str, ProxyProcess], report: Path, requests: int,
            warmup: int) -> dict[str, dict[str, float]]:
    """Per mode (non-streaming, streaming): each process's CPU microseconds per request, and the
    proxy's steps' (the proxy is the target named CHECKED, the floor FLOOR)."""
    clients = {name: httpx.Client(timeout=httpx.Timeout(180.0)) for name in targets}
    reports, message = [0], [0]
    pid = targets[CHECKED].proc.pid
    figures = {}

    def send(call: Callable[..., Any], count: int) -> None:
        for i in range(count):  # alternating, the order flipped every request
            for name in (list(targets) if i % 2 else list(targets)[::-1]):
                call(clients[name], name, targets[name].url, message[0])
            message[0] += 1

    try:
        for mode, call in (("non-streaming", call_plain), ("streaming", call_stream)):
            send(call, warmup)
            steps_before = read_steps(pid, report, reports)
            cpu_before = {name: cpu_seconds(p.proc.pid) for name, p in targets.items()}
            send(call, requests)
            cpu = {name: (cpu_seconds(p.proc.pid) - cpu_before[name]) / requests * 1e6
                   for name, p in targets.items()}
            steps_after = read_steps(pid, report, reports)
            figures[mode] = {
                "floor": cpu[FLOOR], "proxy": cpu[CHECKED],
                **{label: (steps_after[label][1] - steps_before[label][1]) / requests * 1e6
                   for label, _, _ in STEPS}}
    finally:
        for client in clients.values():
            client.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500,
                        help="measured requests per target and mode (default 500)")
    parser.add_argument("--warmup", type=int, default=50,
                        help="unmeasured requests per target and mode first (default 50)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        parser.error("--requests must be at least 1 and --warmup at least 0")

    tmp = Path(tempfile.mkdtemp(prefix="metaclaw-bench-steps-"))
    report = tmp / "steps.json"
    double, double_url = start_double()
    started: list[ProxyProcess] = []
    figures: dict[str, dict[str, float]] = {}
    try:
        started.append(start_passthrough(double_url))
        started.append(start_proxy("lexical", double_url, tmp / "proxy",
                                   name=f"{CHECKED} (steps timed)",
                                   launcher=(str(Path(__file__).resolve()), TIMED_PROXY,
                                             str(report))))
        floor, proxy = started
        figures = measure({FLOOR: floor, CHECKED: proxy}, report, args.requests, args.warmup)
        recorded = stop_proxy(started.pop())
    finally:
        for p in started:
            p.proc.terminate()
            p.proc.wait(timeout=30)
        double.stdin.close()
        double.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)

    modes = list(figures)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())

    def line(label: str, key: Callable[[dict[str, float]], float]) -> str:
        return f"  {label:<44}" + "".join(f"{key(figures[m]):>15.0f}" for m in modes)

    def step_sum(figure: dict[str, float]) -> float:
        return sum(figure[label] for label, _, _ in STEPS)

    print(f"CPU per request in place, microseconds: {args.requests} sequential requests per "
          f"target and mode, alternating, after {args.warmup} unmeasured; 20 skills, top-k 3; "
          f"{os.cpu_count()} CPUs; load average {load}")
    print(f"  {'':<44}" + "".join(f"{m:>15}" for m in modes))
    print(line(f"{FLOOR} (whole process)", lambda f: f["floor"]))
    print(line(f"{CHECKED}, steps timed (whole process)", lambda f: f["proxy"]))
    print(line("difference", lambda f: f["proxy"] - f["floor"]))
    print("  of which the proxy's own steps (thread CPU, as they ran):")
    for label, _, _ in STEPS:
        print(line(f"  {label}", lambda f, label=label: f[label]))
    print(line("  sum of the steps", step_sum))
    print(line("  the rest (relaying, stream events, the ack)",
               lambda f: f["proxy"] - f["floor"] - step_sum(f)))
    print(line("what a CPU target of 1.5x the floor leaves", lambda f: 0.5 * f["floor"]))
    sent = 2 * (args.warmup + args.requests)
    print(f"  {CHECKED} recorded {recorded} turns in its store (sent {sent})")
    return 0 if recorded == sent else 1

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == TIMED_PROXY:
        sys.exit(run_timed_proxy(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(main())
