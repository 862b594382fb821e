"""What two steps of the proxy's request path cost, each measured beside what it replaced.

- Generation check: :meth:`SkillLibrary.current` asks the store whether another process committed
  a generation (``PRAGMA data_version`` on a private connection) before returning the skills.
  Measured against reading the in-memory skills without asking, and against re-reading the
  skills folder (what a per-request directory scan would cost), over a library of ``--skills``.
- Query extraction: :func:`metaclaw.asks.extract_ask` against taking the last user message's
  text (what retrieval used before), on plain SDK requests and on requests captured from the
  real OpenClaw CLI (tests/fixtures/requests/openclaw, ~60 KB each).

Runs are interleaved in rounds so machine noise falls on both sides alike; printed are the
median microseconds per call and the added cost.

    python benchmarks/bench_request_path.py [--skills 20] [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from metaclaw.asks import content_text, extract_ask
from metaclaw.skills import Skill, SkillLibrary, load_skills_dir
from metaclaw.store import Store

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "requests" / "openclaw"


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def compare(label: str, pairs: dict, calls: int, rounds: int = 7) -> None:
    times = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, fn in pairs.items():
            times[name].append(per_call_us(fn, calls))
    medians = {name: statistics.median(v) for name, v in times.items()}
    base = next(iter(medians.values()))
    print(f"\n{label}")
    for name, value in medians.items():
        extra = "" if value is base else f"   (+{value - base:.1f} us)"
        print(f"  {name:<48} {value:9.2f} us/call{extra}")


def last_user_text(messages):
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content")).strip()
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skills", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

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
