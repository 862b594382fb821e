"""Durability under kill -9: no turn acknowledged to a client is missing from the store.

Each cycle starts ``python -m metaclaw serve`` on one workspace database, drives it with
concurrent streaming and non-streaming requests of both protocols (OpenAI chat completions and
Anthropic Messages), and kills it with SIGKILL at a random moment while requests are in flight.
A turn counts as *acknowledged* when its client read the whole reply: a 200 JSON reply, or a
stream that reached ``data: [DONE]`` / ``event: message_stop``. After each kill the database is
opened afresh (SQLite recovers its WAL as after a crash) and every acknowledged turn is looked
up by its unique session id. The next cycle restarts the proxy on the same database.

Upstream: the offline double (:class:`metaclaw.offline.double.DoubleServer`, scripted echo, not a model)
in this process. Printed: turns sent, acknowledged, lost (must be 0), turns recorded that the
client never saw acknowledged (in flight at the kill: allowed), throughput, and the proxy's
group-commit batches when available. Exits 1 when a turn is lost.

    python benchmarks/soak_kill9.py [--turns 5000] [--concurrency 48] [--cycles 10] [--db TARGET]
        [--crash proxy|database]

``--db``: the workspace (default: a new SQLite file); ``--db postgresql://...`` a PostgreSQL
database, or ``--db postgresql`` a throwaway PostgreSQL cluster started for the run (needs
``initdb`` on PATH; ``tests/pgcluster.py``). With that cluster, ``--crash database`` crashes the
database server instead (``pg_ctl stop -m immediate``, as an out-of-memory kill of a backend
restarts them all, then started again) while the proxy serves on, then kills the proxy to end
the cycle: what the server acknowledged before its crash must be there after it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from metaclaw.offline.double import DoubleServer
from metaclaw.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import pgcluster  # noqa: E402  the throwaway cluster of --db postgresql

KINDS = ("openai", "openai-stream", "anthropic", "anthropic-stream")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_proxy(upstream: str, db: str, skills: Path, port: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "metaclaw", "serve", "--upstream", upstream, "--db", db,
               "--skills", str(skills), "--retrieval", "lexical", "--port",
               str(port), "--model", "double-model"]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the proxy did not start within 60 s")


async def one_turn(client: httpx.AsyncClient, base: str, kind: str, session: str) -> bool:
    """Send one turn; True when the client read the whole reply (acknowledged)."""
    stream = kind.endswith("-stream")
    text = f"Summarise the deployment notes for {session} in one sentence, please."
    if kind.startswith("openai"):
        url, body = base + "/v1/chat/completions", {
            "model": "double-model", "stream": stream,
            "messages": [{"role": "user", "content": text}]}
        end = b"data: [DONE]"
    else:
        url, body = base + "/v1/messages", {
            "model": "double-model", "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": text}]}
        end = b"event: message_stop"
    try:
        async with client.stream("POST", url, json=body, headers={"X-Session-Id": session}) as reply:
            data = b"".join([chunk async for chunk in reply.aiter_raw()])
            if reply.status_code != 200:
                return False
        if stream:
            return end in data
        payload = json.loads(data)
        return bool(payload.get("choices") or payload.get("content"))
    except (httpx.HTTPError, ValueError):
        return False


async def load(base: str, cycle: int, concurrency: int, kill_at: int,
               proc: subprocess.Popen, crash=None) -> tuple[list[str], list[str]]:
    """Drive requests until ``kill_at`` are acknowledged, then SIGKILL the proxy mid-load; with
    ``crash`` (a function), call it instead while the load goes on, then (a second later) kill
    the proxy."""
    sent: list[str] = []
    acked: list[str] = []
    queue = itertools.count()
    killed = asyncio.Event()
    triggered: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def crash_then_kill() -> None:
        await asyncio.get_running_loop().run_in_executor(None, crash)
        await asyncio.sleep(1.0)
        os.kill(proc.pid, signal.SIGKILL)
        killed.set()

    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        async def worker() -> None:
            for i in queue:
                if killed.is_set():
                    return
                session = f"c{cycle}-t{i}"
                sent.append(session)
                if await one_turn(client, base, KINDS[i % len(KINDS)], session):
                    acked.append(session)
                    if len(acked) >= kill_at and not triggered and not killed.is_set():
                        if crash is None:
                            os.kill(proc.pid, signal.SIGKILL)
                            killed.set()
                        else:
                            triggered.append(asyncio.create_task(crash_then_kill()))

        await asyncio.gather(*(worker() for _ in range(concurrency)), *triggered)
        for task in triggered:  # created while the workers ran
            await task
    if not killed.is_set():
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return sent, acked


def recorded_sessions(db: str) -> set[str]:
    """Session ids of the recorded turns, read by a fresh connection after the crash."""
    with Store(db) as store:
        return {row["session_id"] for row in store.query("SELECT DISTINCT session_id FROM turns")}


def run(turns: int, concurrency: int, cycles: int, seed: int,
        target: str | None = None, crash_database: bool = False) -> dict[str, float]:
    rng = random.Random(seed)
    per_cycle = max(1, -(-turns // cycles))
    totals = {"sent": 0, "acknowledged": 0, "lost": 0, "unacknowledged_recorded": 0}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="metaclaw-soak-") as tmp, \
            DoubleServer(models=("double-model",)) as double:
        cluster = None
        if target == "postgresql":
            cluster = pgcluster.start(fsync=True)
            if cluster is None:
                raise SystemExit(f"no PostgreSQL: {'; '.join(pgcluster.WHY_NOT)}")
            target = cluster.new_database("soak")
        db = target or str(Path(tmp) / "metaclaw.db")
        log = open(Path(tmp) / "proxy.log", "w")
        cycle = 0
        while totals["sent"] < turns:
            port = free_port()
            proc = start_proxy(double.url, db, Path(tmp) / "skills", port, log)
            left = turns - totals["sent"]
            kill_at = min(left, rng.randint(max(1, per_cycle // 2), per_cycle))
            crash = None
            if crash_database:
                def crash() -> None:
                    cluster.stop("immediate")
                    cluster.start()
            sent, acked = asyncio.run(load(f"http://127.0.0.1:{port}", cycle, concurrency,
                                           kill_at, proc, crash))
            have = recorded_sessions(db)
            lost = [s for s in acked if s not in have]
            extra = [s for s in sent if s in have and s not in set(acked)]
            totals["sent"] += len(sent)
            totals["acknowledged"] += len(acked)
            totals["lost"] += len(lost)
            totals["unacknowledged_recorded"] += len(extra)
            cycle += 1
            print(f"cycle {cycle}: sent {len(sent)}, acknowledged {len(acked)}, "
                  f"killed after {kill_at} acknowledged, lost {len(lost)}"
                  + (f" (e.g. {lost[:3]})" if lost else ""), flush=True)
        log.close()
        if cluster is not None:
            cluster.remove()
    elapsed = time.perf_counter() - started
    totals["seconds"] = elapsed
    totals["cycles"] = cycle
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5000,
                        help="turns to send in all (each cycle is killed mid-load)")
    parser.add_argument("--concurrency", type=int, default=48, help="requests in flight")
    parser.add_argument("--cycles", type=int, default=10,
                        help="about this many kill -9 / restart cycles")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--db", help="the workspace: a file, postgresql://..., or postgresql "
                                     "for a throwaway cluster (default: a new SQLite file)")
    parser.add_argument("--crash", choices=["proxy", "database"], default="proxy",
                        help="what each cycle crashes: the proxy (kill -9), or, with --db "
                        "postgresql, the database server (then the proxy)")
    args = parser.parse_args(argv)
    if args.turns < 1 or args.concurrency < 1 or args.cycles < 1:
        parser.error("--turns, --concurrency and --cycles must be positive")
    if args.crash == "database" and args.db != "postgresql":
        parser.error("--crash database needs --db postgresql (a throwaway cluster to crash)")
    totals = run(args.turns, args.concurrency, args.cycles, args.seed, args.db,
                 crash_database=args.crash == "database")
    what = "database crashes" if args.crash == "database" else "kill -9"
    print(f"turns under {what}: sent {totals['sent']}, acknowledged {totals['acknowledged']}, "
          f"lost {totals['lost']}; recorded but not acknowledged (in flight at the kill): "
          f"{totals['unacknowledged_recorded']}; {totals['sent'] / totals['seconds']:.0f} turns/s "
          f"over {totals['seconds']:.1f} s including {totals['cycles']} crashes and restarts")
    return 1 if totals["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
