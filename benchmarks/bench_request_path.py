"""What two steps of the proxy's request path cost, each measured beside what it replaced.

- Generation check: :meth:`SkillLibrary.current` asks the store whether another process committed
  a generation (``PRAGMA data_version`` on a private connection) before returning the skills.
  Measured against reading the in-memory skills without asking, and against re-reading the
  skills folder (what a per-request directory scan would cost), over a library of ``--skills``.
- Query extraction: :func:`metaclaw.skills.asks.extract_ask` against taking the last user message's
  text (what retrieval used before), on plain SDK requests and on requests captured from the
  real OpenClaw CLI (tests/fixtures/requests/openclaw, ~60 KB each).
- One turn's own steps, cumulatively, on ``benchmarks/bench_proxy.py``'s workload (its 20 skills
  and request bodies, a new session per request): parse and identify; then retrieve, inject and
  serialise the forwarded body and build the turn's row; then commit the turn to SQLite the way
  the proxy's event loop does (:meth:`Store.loop_writer`, one turn per transaction). In a hot
  loop without sockets: what the proxy computes per turn beyond relaying bytes, which the
  pass-through floor of ``bench_proxy.py`` does not. Then the same with ``--evict-mb`` of memory
  written before each turn (not counted): in the running proxy the client and the upstream run
  between two requests, so each turn starts with cold caches.

Runs are interleaved in rounds so machine noise falls on both sides alike; printed are the
median microseconds per call and the added cost.

    python benchmarks/bench_request_path.py [--skills 20] [--calls 2000] [--evict-mb 32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import orjson
from bench_proxy import request_body, write_skills

from metaclaw.protocols.openai_chat import OPENAI
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.proxy.pipeline import identify_session, parse_turn, record_row
from metaclaw.skills.asks import content_text, extract_ask
from metaclaw.skills.library import Skill, SkillLibrary, load_skills_dir
from metaclaw.store import Store

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "requests" / "openclaw"


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def compare(label: str, pairs: dict, calls: int, rounds: int = 7,
            timer=per_call_us, cumulative: bool = False) -> None:
    """Median time per call of each of ``pairs`` (interleaved rounds) and what each adds: to the
    first, or with ``cumulative`` (each step includes the one before) to the one before."""
    times = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, fn in pairs.items():
            times[name].append(timer(fn, calls))
    medians = {name: statistics.median(v) for name, v in times.items()}
    base = previous = next(iter(medians.values()))
    print(f"\n{label}")
    for name, value in medians.items():
        extra = "" if value is base else f"   (+{value - previous:.1f} us)"
        print(f"  {name:<48} {value:9.2f} us/call{extra}")
        previous = value if cumulative else base


def last_user_text(messages):
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content")).strip()
    return ""


#: Request numbers, never repeated: each turn is a new request (no cache helps) of a new session.
_REQUEST_NUMBERS = itertools.count()


def cpu_per_turn_us(step, calls: int) -> float:
    """CPU microseconds per call of ``step(i)``, each call with a new request number ``i``."""
    numbers = list(itertools.islice(_REQUEST_NUMBERS, calls))
    start = time.thread_time()
    for i in numbers:
        step(i)
    return (time.thread_time() - start) / calls * 1e6


def cold_timer(evict_mb: int):
    """A timer as :func:`cpu_per_turn_us` that first writes one byte in every 64 (a cache line)
    of ``evict_mb`` MB before each call, not counted: the caches then hold none of the proxy's
    code and objects, as after the client and the upstream ran between two requests."""
    memory = bytearray(evict_mb * 2**20)
    lines = len(memory[::64])

    def cold_cpu_per_turn_us(step, calls: int) -> float:
        spent = 0.0
        for i in itertools.islice(_REQUEST_NUMBERS, calls):
            memory[::64] = bytes(lines)
            start = time.thread_time()
            step(i)
            spent += time.thread_time() - start
        return spent / calls * 1e6

    return cold_cpu_per_turn_us


def turn_steps(folder: Path) -> dict:
    """The proxy's own steps for one turn of ``bench_proxy.py``'s workload, cumulatively."""
    write_skills(folder / "skills")
    store = Store(folder / "turns.db")
    proxy = Proxy(ProxyConfig(retrieval="lexical"), store,
                  SkillLibrary(folder / "skills", store))
    pipeline, writer = proxy._pipeline, store.loop_writer()
    headers = {"Content-Type": "application/json"}

    def parse(i: int):
        raw = orjson.dumps(request_body(i, stream=i % 2 == 1))
        body = orjson.loads(raw)
        turn = parse_turn(OPENAI, body, raw)
        identity = identify_session(headers, body)
        turn.session_id, turn.turn_type, turn.identified_by = (
            identity.session_id, identity.turn_type, identity.how)
        turn.generation, skills = proxy.library.current()
        return turn, skills

    def inject(i: int):
        turn, skills = parse(i)
        pipeline.select_and_inject(turn, skills)
        body, _ = OPENAI.prepare_forward(turn.body, stream_usage=True)
        orjson.dumps(body)
        return {**record_row(turn, 0), "status": "ok", "http_status": 200,
                "response": f"echo: {turn.query}", "finish_reason": "stop",
                "usage": {"prompt_tokens": 480, "completion_tokens": 17, "total_tokens": 497},
                "latency_ms": 2.5}

    def commit(i: int) -> None:
        row = inject(i)
        with writer.transaction(False, wait=False):
            writer.record_turn(**row)
        if i % 64 == 0:  # as the proxy's writer thread does, so the log stays short
            store.checkpoint()

    return {"parse the body, identify the session": parse,
            "+ retrieve, inject, serialise, build the row": inject,
            "+ commit the turn (one transaction)": commit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skills", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--evict-mb", type=int, default=32,
                        help="memory written before each turn of the cold-cache run (default 32: "
                             "this machine's last-level cache)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        steps, calls = turn_steps(Path(tmp)), max(args.calls // 4, 50)
        compare("one turn's own steps, cumulative (bench_proxy.py's workload, CPU per turn)",
                steps, calls, timer=cpu_per_turn_us, cumulative=True)
        compare(f"the same, {args.evict_mb} MB written before each turn (cold caches, as in the "
                "running proxy)", steps, calls, timer=cold_timer(args.evict_mb), cumulative=True)

    with tempfile.TemporaryDirectory() as tmp:
        library = SkillLibrary(Path(tmp) / "skills", Store(Path(tmp) / "ws.db"))
        for i in range(args.skills):
            library.add(Skill(name=f"skill-{i}", description=f"Skill number {i} about topic {i}.",
                              category="ops", body="Do the thing carefully. " * 20))
        library.store.record_turn(session_id="s", request_messages=[], status="ok")
        compare(f"generation check ({args.skills} skills)", {
            "in-memory skills, no check": lambda: list(library._sorted),
            "current() with the data_version check": library.current,
            "re-reading the skills folder per request": lambda: load_skills_dir(library.directory),
        }, max(args.calls // 20, 20))

    plain = [{"role": "system", "content": "You are helpful."},
             {"role": "user", "content": "Rename notes.txt to notes-2026.txt in my workspace"}]
    openclaw = [json.loads(p.read_text())["body"]["messages"] for p in sorted(FIXTURES.glob("*.json"))]
    compare("query extraction, plain SDK request", {
        "last user message": lambda: last_user_text(plain),
        "extract_ask": lambda: extract_ask(plain),
    }, args.calls)
    compare(f"query extraction, {len(openclaw)} captured OpenClaw requests (each call: all)", {
        "last user message": lambda: [last_user_text(m) for m in openclaw],
        "extract_ask": lambda: [extract_ask(m) for m in openclaw],
    }, max(args.calls // 10, 10))


if __name__ == "__main__":
    main()
