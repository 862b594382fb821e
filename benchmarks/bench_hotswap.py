"""Hot-swapping the served policy through the proxy: failed requests and added latency.

    python benchmarks/bench_hotswap.py [--waves 20] [--concurrency 50] [--swap-every-ms 10]

A real proxy (127.0.0.1, ephemeral port, SQLite store, BM25 skill retrieval) answers from a
PolicyResponder. Waves of ``--concurrency`` concurrent chat requests (half streaming) are sent
with an aiohttp client in three conditions, interleaved in one run (their order rotated every
wave): no swap (A), while the served policy is swapped every ``--swap-every-ms``
(``responder.swap`` from another thread, what every GRPO publish does), and no swap again (B).
It prints failed requests and p50 / p99 latency per condition, how many requests were in flight
across a swap, the p99 the swaps add over the no-swap waves (difference and ratio), and the
A-vs-B difference as the noise floor of the machine. p99 is given pooled over all requests of
a condition and as the median over waves of each wave's p99: on a shared CPU a single wave
stalled by the machine (other processes, a garbage collection) moves the pooled p99 by hundreds
of ms whichever condition it hits.

It runs twice: with a constant-time sampler double (a fixed 8-token reply, so the number shows the
serving path's own cost, not model compute drowned in CPU noise) and with the tiny model's real
published samplers (generation on a shared CPU dominates the spread there).
``benchmarks/bench_grpo.py`` measures the same at the responder level, without the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class FixedSampler:
    """A constant-time sampler double (fixed 8-token reply, then end of sequence)."""

    def __init__(self, policy_version: int, token: int, eos: int):
        self.policy_version = policy_version
        self.tokens = [token] * 7 + [eos]

    def sample(self, prompt_tokens, n=1, max_tokens=64, temperature=1.0, seed=None):
        from metaclaw.slowloop.backends import Sample

        toks = self.tokens[:max_tokens]
        return [Sample(list(toks), [-0.1] * len(toks), "stop") for _ in range(n)]


async def wave(session, url: str, n: int, responder, samplers, swap_every_s: float | None):
    """One wave of ``n`` concurrent requests; with ``swap_every_s`` a thread swaps the served
    policy at that interval meanwhile. Returns (latencies ms, failures, swap times, request
    (start, end) times)."""
    stop = threading.Event()
    swap_times: list[float] = []

    def swapper() -> None:
        while not stop.is_set():
            sampler = samplers[len(swap_times) % len(samplers)]
            responder.swap(sampler, sampler.policy_version)
            swap_times.append(time.perf_counter())
            time.sleep(swap_every_s)

    thread = threading.Thread(target=swapper, daemon=True) if swap_every_s else None
    if thread:
        thread.start()
    latencies: list[float] = []
    spans: list[tuple[float, float]] = []
    failures: list[str] = []

    async def one(i: int) -> None:
        body = {"model": "policy", "messages": [{"role": "user", "content": "please say yes"}],
                "max_tokens": 8, "seed": i, "stream": i % 2 == 1}
        t = time.perf_counter()
        try:
            async with session.post(url, json=body) as response:
                text = await response.text()
                status = response.status
            if status != 200 or ("data: [DONE]" not in text if body["stream"]
                                 else '"choices"' not in text):
                failures.append(f"HTTP {status}: {text[:200]}")
                return
            if "metaclaw" in text:
                failures.append("the metaclaw object reached the client")
                return
            end = time.perf_counter()
            latencies.append((end - t) * 1000)
            spans.append((t, end))
        except Exception as exc:  # noqa: BLE001 - counted as a failed request
            failures.append(repr(exc))

    await asyncio.gather(*(one(i) for i in range(n)))
    stop.set()
    if thread:
        thread.join()
    return latencies, failures, swap_times, spans


async def bench(proxy, responder, samplers, waves: int, concurrency: int, swap_every_s: float,
                label: str) -> None:
    import aiohttp

    url = proxy.url + "/chat/completions"
    conditions = {"no swap (A)": None, "swapping": swap_every_s, "no swap (B)": None}
    waves_of = {name: [] for name in conditions}   # per condition: one latency list per wave
    fails = {name: [] for name in conditions}
    swaps = straddling = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await wave(session, url, concurrency, responder, samplers, None)  # warm-up
        names = list(conditions)
        for k in range(waves):  # interleaved and rotated, so load drifts and order effects
            for name in names[k % 3:] + names[:k % 3]:  # hit every condition alike
                latencies, failures, swap_times, spans = await wave(
                    session, url, concurrency, responder, samplers, conditions[name])
                waves_of[name].append(latencies)
                fails[name] += failures
                swaps += len(swap_times)
                straddling += sum(1 for a, b in spans if any(a < t < b for t in swap_times))
    proxy.flush()

    def pooled(name: str) -> list[float]:
        return [x for latencies in waves_of[name] for x in latencies]

    def wave_p99(name: str) -> float:  # robust to one wave stalled by the machine
        return statistics.median(percentile(w, 99) for w in waves_of[name] if w)

    print(f"\nhot-swap through the proxy, {label}: {waves} waves x {concurrency} concurrent "
          f"requests per condition (half streaming); {swaps} swaps (one every "
          f"{swap_every_s * 1000:g} ms) with {straddling} requests in flight across a swap")
    print(f"  {'condition':<12} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'median wave p99 ms':>19}")
    for name in conditions:
        values = pooled(name)
        print(f"  {name:<12} {len(fails[name]):>6} {statistics.median(values):>8.2f} "
              f"{percentile(values, 99):>8.2f} {wave_p99(name):>19.2f}")
        for reason in sorted(set(fails[name]))[:3]:
            print(f"               e.g. {reason}")
    base = pooled("no swap (A)") + pooled("no swap (B)")
    swapped = pooled("swapping")
    p99_base, p99_swap = percentile(base, 99), percentile(swapped, 99)
    wave_base = statistics.median(percentile(w, 99) for n in ("no swap (A)", "no swap (B)")
                                  for w in waves_of[n] if w)
    print(f"  p99 added by swapping: {p99_swap - p99_base:+.2f} ms pooled (ratio "
          f"{p99_swap / p99_base:.3f}), {wave_p99('swapping') - wave_base:+.2f} ms median per "
          f"wave (ratio {wave_p99('swapping') / wave_base:.3f})")
    floor = percentile(pooled("no swap (A)"), 99) - percentile(pooled("no swap (B)"), 99)
    wave_floor = wave_p99("no swap (A)") - wave_p99("no swap (B)")
    print(f"  noise floor (no swap A vs B): {floor:+.2f} ms pooled, {wave_floor:+.2f} ms median "
          f"per wave; failed requests while swapping: {len(fails['swapping'])}")
    return sum(len(f) for f in fails.values())


def run(model_dir: str, root: Path, waves: int, concurrency: int, swap_every_s: float,
        fixed: bool) -> int:
    """One condition's waves; returns the failed requests."""
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import Skill, SkillLibrary
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.policy import PolicyResponder
    from metaclaw.store import Store

    backend = make_backend("local", model_dir, lora_rank=8, seed=0)
    if fixed:
        yes = backend.encode("yes")[0]
        samplers = [FixedSampler(v, yes, backend.eos_token_id) for v in range(3)]
    else:
        samplers = [backend.sampler()]
        for _ in range(2):  # two more published versions to swap between
            backend.publish()
            samplers.append(backend.sampler())
    name = "fixed" if fixed else "tiny"
    store = Store(root / f"{name}.db")
    skills = root / f"skills-{name}"
    skill = Skill("say-yes", "Say yes when asked to say yes.", "general", "Answer: yes")
    (skills / skill.name).mkdir(parents=True)
    (skills / skill.name / "SKILL.md").write_text(skill.to_markdown())
    library = SkillLibrary(skills, store)
    responder = PolicyResponder(backend, samplers[0], 0, max_workers=8)
    proxy = Proxy(ProxyConfig(retrieval="lexical"), store, library).start()
    proxy.set_responder(responder)
    try:
        label = "constant-time sampler double" if fixed else "tiny model samplers"
        return asyncio.run(bench(proxy, responder, samplers, waves, concurrency, swap_every_s,
                                 label))
    finally:
        proxy.stop()
        responder.close()
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--swap-every-ms", type=float, default=10.0,
                        help="interval between swaps in the swapping condition")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("error: this benchmark trains and samples with torch: pip install "
              "'metaclaw-jupyter[training]'", file=sys.stderr)
        return 2

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = str(write_tiny_model(root / "tiny", seed=0))
        every = args.swap_every_ms / 1000
        failed = run(model_dir, root, args.waves, args.concurrency, every, fixed=True)
        failed += run(model_dir, root, args.waves, args.concurrency, every, fixed=False)
    if failed:
        print(f"error: {failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
