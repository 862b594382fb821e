"""Local GRPO throughput on the tiny model, and the cost of hot-swapping the serving policy.

    python benchmarks/bench_grpo.py [--steps 10] [--threads 1] [--device cpu|cuda|mps|auto]
    python benchmarks/bench_grpo.py --memory-only --model smollm2 [--batch 8 --tokens 110]

Part 1 runs GRPO steps (sample P x G completions, reward, forward_backward + optim_step,
publish) with the local backend and prints tokens/s per step (completion tokens trained per
second of step wall time) and overall.

Part 2 sends waves of 50 concurrent chat requests to a PolicyResponder, alternately with no swap
and while the policy is swapped every 2 ms, in one run, and prints failed requests and p50 / p99
latency of both, plus the p99 difference (the swap's added latency). It runs once with a
constant-time sampler (the serving path's own cost) and once with the tiny model (real
generation, where CPU load on a shared machine dominates the latency spread).

Part 3 (``--memory``, or alone with ``--memory-only``) measures the peak memory of one training
step (forward + backward) on B sequences of T tokens, each configuration in a fresh process,
side by side: the whole batch in one pass with full-vocabulary fp32 logits, against micro-batches
with chunked, recomputed log-probabilities (the backend's defaults). ``--model smollm2`` runs it
on the packaged SmolLM2-135M-Instruct (``--model PATH`` on any local model).

``--device cuda`` runs everything on a GPU (bf16 weights where supported, fp32 adapters). What
to expect there: sampling and training are no longer the bottleneck for the tiny model (Python
overhead is); for SmolLM2 a GRPO step of 4 x 8 samples takes about a second, and the memory
part reports ``torch.cuda.max_memory_allocated``: the chunked configuration's peak grows with
``micro_batch_size x logprob_chunk`` rather than ``B x T x vocabulary``, which is what makes
8 x 2k-token batches of a 49k-vocabulary model fit where the full-logits pass would not.
``--device cpu`` reports the peak resident set size of the process (``ru_maxrss``).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def bench_grpo(model_dir: str, steps: int, device: str = "cpu") -> None:
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOConfig, Task, prompts_from_tasks, train_grpo

    backend = make_backend("local", model_dir, lora_rank=8, seed=0, device=device)

    def reward(text: str) -> float:
        words = text.split()
        return sum(w == "yes" for w in words) / max(len(words), 1)

    tasks = [Task(p, reward) for p in ["say yes", "please say yes", "answer yes", "hello"]]
    config = GRPOConfig(steps=steps, groups_per_step=4, group_size=8, max_tokens=16, seed=0)
    print(f"GRPO on the tiny model ({backend.device}, {backend.dtype}): P={config.groups_per_step} prompts x G={config.group_size} "
          f"samples, max_tokens={config.max_tokens}, loss={config.loss_fn}")
    print(f"{'step':>4} {'wall s':>8} {'tokens':>7} {'tokens/s':>9} {'reward':>7} {'skipped':>7}")
    t0 = time.perf_counter()
    result = train_grpo(backend, prompts_from_tasks(backend, tasks), config=config)
    total = time.perf_counter() - t0
    for h in result.history:
        print(f"{h['step']:>4} {h['wall_time_s']:>8.3f} {h['tokens']:>7} "
              f"{h['metrics']['tokens_per_s']:>9.0f} {h['reward_mean']:>7.3f} "
              f"{h['skipped_groups']:>7}")
    tokens = sum(h["tokens"] for h in result.history)
    samples = sum(h["metrics"]["samples"] for h in result.history)
    print(f"overall: {tokens} trained tokens, {samples} samples in {total:.2f} s -> "
          f"{tokens / total:.0f} tokens/s, {samples / total:.0f} samples/s, "
          f"{total / len(result.history):.3f} s/step")


async def _wave(responder, n: int, swap_every_s: float | None, new_samplers) -> tuple:
    stop = threading.Event()
    swaps = 0

    def swapper() -> None:
        nonlocal swaps
        while not stop.is_set():
            sampler = new_samplers[swaps % len(new_samplers)]
            responder.swap(sampler, sampler.policy_version)
            swaps += 1
            time.sleep(swap_every_s)

    thread = threading.Thread(target=swapper) if swap_every_s else None
    if thread:
        thread.start()
    latencies, failures = [], 0

    async def one(i: int) -> None:
        nonlocal failures
        t = time.perf_counter()
        try:
            await responder.complete({"messages": [{"role": "user", "content": "say yes"}],
                                      "max_tokens": 8, "seed": i})
            latencies.append((time.perf_counter() - t) * 1000)
        except Exception:
            failures += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    stop.set()
    if thread:
        thread.join()
    return latencies, failures, swaps


class FixedSampler:
    """A constant-time sampler (fixed 8-token reply): isolates the serving path's own cost from
    model compute, so the swap's added latency is not drowned in CPU noise."""

    def __init__(self, policy_version: int):
        self.policy_version = policy_version

    def sample(self, prompt_tokens, n=1, max_tokens=64, temperature=1.0, seed=None):
        from metaclaw.slowloop.backends import Sample

        return [Sample([7] * 7 + [2], [-0.1] * 8, "stop") for _ in range(n)]


async def bench_swap(model_dir: str, waves: int, fixed: bool, device: str = "cpu") -> int:
    """The swap part; returns the failed requests."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.policy import PolicyResponder

    backend = make_backend("local", model_dir, lora_rank=8, seed=0, device=device)
    if fixed:
        samplers = [FixedSampler(v) for v in range(3)]
    else:
        samplers = [backend.sampler()]
        for _ in range(2):  # two more published versions to swap between
            backend.publish()
            samplers.append(backend.sampler())
    responder = PolicyResponder(backend, samplers[0], 0, max_workers=8)
    await _wave(responder, 50, None, samplers)  # warm-up
    base, swapped, fail_base, fail_swap, n_swaps = [], [], 0, 0, 0
    for _ in range(waves):  # interleave the two conditions so load drifts affect both alike
        lat, f, _ = await _wave(responder, 50, None, samplers)
        base += lat
        fail_base += f
        lat, f, s = await _wave(responder, 50, 0.002, samplers)
        swapped += lat
        fail_swap += f
        n_swaps += s
    responder.close()
    label = "fixed-output sampler" if fixed else "tiny model sampler"
    print(f"\nhot-swap, {label}: {waves} waves x 50 concurrent requests per condition, "
          f"{n_swaps} swaps during the swap waves")
    for name, lat, fails in (("no swap", base, fail_base), ("swapping", swapped, fail_swap)):
        print(f"  {name:<9} failed {fails}  p50 {statistics.median(lat):8.2f} ms  "
              f"p99 {percentile(lat, 99):8.2f} ms")
    print(f"  p99 added by swapping: {percentile(swapped, 99) - percentile(base, 99):+.2f} ms")
    return fail_base + fail_swap


MEMORY_CONFIGS = (("whole batch, full-vocabulary logits", 10 ** 6, 10 ** 9),
                  ("micro-batches of 2, logprob chunks of 256", 2, 256))


def memory_child(args) -> None:
    """One configuration in this (fresh) process: load, one forward_backward, print JSON."""
    import json
    import random
    import resource

    import torch

    from metaclaw.slowloop.backends import Datum, make_backend

    backend = make_backend("local", args.model, lora_rank=8, seed=0, device=args.device,
                           micro_batch_size=args.mb, logprob_chunk=args.chunk)
    cuda = backend.device.type == "cuda"
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_loaded = torch.cuda.max_memory_allocated() / 1024 ** 3
    rng = random.Random(0)
    vocab = len(backend.tokenizer)
    prompt_len = args.tokens // 2
    datums = [Datum.from_sample([rng.randrange(vocab) for _ in range(prompt_len)],
                                [rng.randrange(vocab) for _ in range(args.tokens - prompt_len)],
                                [-5.0] * (args.tokens - prompt_len), rng.choice([-1.0, 1.0]))
              for _ in range(args.batch)]
    t = time.perf_counter()
    backend.forward_backward(datums, "importance_sampling")
    if cuda:
        torch.cuda.synchronize()
    out = {"step_s": time.perf_counter() - t, "rss_loaded_gb": rss_loaded,
           "rss_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2,
           "vocab": vocab, "device": str(backend.device)}
    if cuda:
        out["cuda_loaded_gb"] = cuda_loaded
        out["cuda_peak_gb"] = torch.cuda.max_memory_allocated() / 1024 ** 3
    print("MEMORY " + json.dumps(out))


def bench_memory(args, model: str) -> None:
    import json
    import subprocess
    import sys

    print(f"\npeak memory of one training step: model {args.model}, {args.batch} sequences x "
          f"{args.tokens} tokens, device {args.device} (each configuration in a fresh process)")
    results = []
    for name, mb, chunk in MEMORY_CONFIGS:
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", "--model", model, "--device",
             args.device, "--mb", str(mb), "--chunk", str(chunk), "--batch", str(args.batch),
             "--tokens", str(args.tokens), "--threads", str(args.threads)],
            capture_output=True, text=True, check=True)
        line = next(l for l in proc.stdout.splitlines() if l.startswith("MEMORY "))
        results.append((name, json.loads(line[7:])))
    key = "cuda_peak_gb" if "cuda_peak_gb" in results[0][1] else "rss_peak_gb"
    for name, r in results:
        extra = (f", after load {r['cuda_loaded_gb']:.2f} GB" if key == "cuda_peak_gb"
                 else f", after load {r['rss_loaded_gb']:.2f} GB")
        print(f"  {name:<44} peak {r[key]:6.2f} GB{extra}, step {r['step_s']:.2f} s")
    ratio = results[0][1][key] / results[1][1][key]
    print(f"  peak ratio whole-batch / chunked: {ratio:.2f}x ({key}, vocabulary "
          f"{results[0][1]['vocab']})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument("--model", default="tiny",
                        help="memory part: tiny, smollm2, or a local model path")
    parser.add_argument("--memory", action="store_true", help="also run the memory part")
    parser.add_argument("--memory-only", action="store_true", help="only the memory part")
    parser.add_argument("--batch", type=int, default=8, help="memory part: sequences")
    parser.add_argument("--tokens", type=int, default=110, help="memory part: tokens each")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("error: this benchmark trains and samples with torch: pip install "
              "'metaclaw-jupyter[training]'", file=sys.stderr)
        return 2

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(tmp, seed=0))
        if not args.memory_only:
            bench_grpo(model_dir, args.steps, args.device)
            failed += asyncio.run(bench_swap(model_dir, args.waves, fixed=True,
                                             device=args.device))
            failed += asyncio.run(bench_swap(model_dir, args.waves, fixed=False,
                                             device=args.device))
        if args.memory or args.memory_only:
            bench_memory(args, model_dir if args.model == "tiny" else args.model)
    if failed:
        print(f"error: {failed} requests failed while the policy was swapped", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
