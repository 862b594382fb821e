"""Opening and stepping through a long session in the trace view stays fast (lazy loading).

One session of ``--turns`` turns is recorded the way an agent produces them: each request carries
the system prompt with an injected skill block and the last ``--window`` messages of the
conversation (a tool call and its result every 5th turn), each turn judged with 3 votes, one in
7 a failure. Measured side by side in one run:

- eager: reading every turn of the session in full (``Store.turns``: what a view that decodes
  the whole session would pay before showing anything);
- open:  ``TraceWidget(store, session)``: the index (scalar columns and previews computed in
  SQLite), the first page of rows and the first turn in full;
- step:  one step to the next turn (the detail of one turn), mean of ``--steps``;
- next failure, failures-only filter, and the synced state's size vs the session's.

PASS when open is at least 3x faster than eager and a step takes under a tenth of eager.

    python benchmarks/bench_trace.py [--turns 2000] [--window 40] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def build(store, turns: int, window: int) -> str:
    from metaclaw.skills.block import BLOCK_HEADER

    system = ("You are a careful assistant working in a user's files.\n\n" + BLOCK_HEADER
              + "\n\n### backup-before-modify\nCopy a file to .bak before changing it.\n\n"
              "### cite-sources\nSay which tool result each fact came from.")
    history: list[dict] = []
    with store.transaction():
        for i in range(turns):
            history.append({"role": "user", "content": f"Step {i}: please update record {i} in "
                            "data/records.json and tell me what changed. " * 2})
            tool_calls = None
            if i % 5 == 0:
                call = {"id": f"c{i}", "type": "function",
                        "function": {"name": "read_file",
                                     "arguments": json.dumps({"path": "data/records.json"})}}
                history.append({"role": "assistant", "content": None, "tool_calls": [call]})
                history.append({"role": "tool", "tool_call_id": f"c{i}",
                                "content": json.dumps({"records": list(range(i, i + 30))})})
            messages = [{"role": "system", "content": system}, *history[-window:]]
            reply = f"Updated record {i}: status set to done, timestamp refreshed."
            failed = i % 7 == 3
            store.record_turn(
                session_id="long", request_messages=messages, status="ok", response=reply,
                model="agent", skill_generation=i // 500, policy_version=i // 700,
                injected_skills=["backup-before-modify", "cite-sources"], tool_calls=tool_calls,
                reward=-1.0 if failed else 1.0,
                judge_votes=[{"score": -1 if failed else 1, "rationale": "checked the record",
                              "error": None}] * 3)
            history.append({"role": "assistant", "content": reply})
    return "long"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--window", type=int, default=40)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    import metaclaw.skills.library  # noqa: F401 - the widget imports it on its first open: a
    # cost paid once per kernel, not per open, so not timed here
    from metaclaw.notebook.widgets import TraceWidget
    from metaclaw.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "trace.db")
        t0 = time.perf_counter()
        session = build(store, args.turns, args.window)
        build_s = time.perf_counter() - t0
        db_mb = (Path(tmp) / "trace.db").stat().st_size / 1e6

        t0 = time.perf_counter()
        full = store.turns("session_id = ?", (session,), order="turn_index")
        eager_s = time.perf_counter() - t0
        full_bytes = len(json.dumps(full, default=str))
        del full

        t0 = time.perf_counter()
        widget = TraceWidget(store, session)
        open_s = time.perf_counter() - t0
        synced = {k: v for k, v in widget.get_state().items() if not k.startswith("_")}
        state_bytes = len(json.dumps(synced, default=str))

        t0 = time.perf_counter()
        for _ in range(args.steps):
            widget.step(1)
        step_s = (time.perf_counter() - t0) / args.steps

        t0 = time.perf_counter()
        for _ in range(args.steps):
            widget.step(1, failures=True)
        fail_step_s = (time.perf_counter() - t0) / args.steps

        t0 = time.perf_counter()
        widget.failures_only = True
        filter_s = time.perf_counter() - t0
        assert widget.matched == widget.failure_count > 0
        store.close()

    print(f"session: {args.turns} turns (window {args.window} messages), store {db_mb:.1f} MB, "
          f"built in {build_s:.1f} s")
    print(f"{'what':<34}{'time':>12}")
    print(f"{'eager: every turn in full':<34}{eager_s * 1000:>10.0f} ms")
    print(f"{'open TraceWidget (lazy)':<34}{open_s * 1000:>10.0f} ms")
    print(f"{'step to the next turn':<34}{step_s * 1000:>10.1f} ms")
    print(f"{'step to the next failure':<34}{fail_step_s * 1000:>10.1f} ms")
    print(f"{'filter to failures':<34}{filter_s * 1000:>10.0f} ms")
    print(f"synced state {state_bytes / 1e3:.0f} kB vs the session in full "
          f"{full_bytes / 1e6:.1f} MB ({full_bytes / max(state_bytes, 1):.0f}x smaller)")
    ratio = eager_s / open_s
    ok = ratio >= 3 and step_s <= eager_s / 10
    print(f"open is {ratio:.1f}x faster than eager; a step is {eager_s / step_s:.0f}x faster "
          f"than eager: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
