"""How long one large request holds every other client of the proxy.

Starts ``metaclaw serve --sim`` (the offline SIMULATED model) on a free port, sends one
Anthropic Messages request of ``--parts`` text blocks (300,000: about 16 MB), and meanwhile polls
``/healthz`` every 20 ms: the worst wait of a poll is how long the proxy's event loop was held,
the time every other agent's turn and stream waited too. Bodies of 256 KB or more are decoded,
parsed and matched in worker threads (``metaclaw.proxy.pipeline.OFF_LOOP_BYTES``).

    python benchmarks/bench_large_body.py [--parts 300000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import shutil
import tempfile
import threading
import time

import httpx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=300_000)
    args = parser.parse_args()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    work = tempfile.mkdtemp(prefix="metaclaw-large-body-")
    server = subprocess.Popen([sys.executable, "-m", "metaclaw", "serve", "--sim", "--port",
                               str(port), "--db", f"{work}/w.db", "--skills", f"{work}/skills"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "METACLAW_PROXY_TOKEN": ""})
    try:
        deadline = time.time() + 60
        while True:
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.HTTPError:
                if time.time() > deadline or server.poll() is not None:
                    print("error: metaclaw serve did not answer /healthz within 60 s",
                          file=sys.stderr)
                    return 1
                time.sleep(0.2)
        parts = [{"type": "text", "text": f"part {i} of the task"} for i in range(args.parts)]
        body = json.dumps({"model": "m", "max_tokens": 10,
                           "messages": [{"role": "user", "content": parts}]}).encode()
        worst, stop = [0.0], [False]

        def poll() -> None:
            while not stop[0]:
                started = time.perf_counter()
                httpx.get(url + "/healthz", timeout=120)
                worst[0] = max(worst[0], time.perf_counter() - started)
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        started = time.perf_counter()
        reply = httpx.post(url + "/v1/messages", content=body, timeout=300,
                           headers={"content-type": "application/json",
                                    "anthropic-version": "2023-06-01"})
        took = time.perf_counter() - started
        time.sleep(0.3)
        stop[0] = True
        poller.join()
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"one {len(body) / 1e6:.1f} MB Anthropic request ({args.parts} text blocks): HTTP "
              f"{reply.status_code} in {took:.2f} s; the worst /healthz wait meanwhile "
              f"{worst[0]:.2f} s (load average {load:.1f})")
        if reply.status_code != 200:
            print(f"error: the request was answered HTTP {reply.status_code}: "
                  f"{reply.text[:300]}", file=sys.stderr)
            return 1
        return 0
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
