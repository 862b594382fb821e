"""Smoke tests of the benchmark scripts: tiny runs end to end (bench_proxy.py with real processes
and sockets) print every figure they promise."""

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_proxy_tiny_run_prints_ratios():
    proc = run_benchmark("bench_proxy.py", "--requests", "20", "--concurrency", "4",
                         "--rounds", "2", timeout=240)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    latency_ratios = re.findall(r"ratio proxied/direct proxy\[lexical\]((?:\s+[\d.]+){4})\s+x", out)
    assert len(latency_ratios) == 3, out  # non-streaming, first chunk, whole stream
    for numbers in latency_ratios:
        assert all(float(x) > 0 for x in numbers.split())
    throughput = re.findall(r"ratio proxied/direct throughput proxy\[lexical\]: ([\d.]+)x", out)
    assert len(throughput) == 2 and all(float(x) > 0 for x in throughput), out
    sent = re.search(r"recorded (\d+) turns in its store \(sent (\d+)\)", out)
    assert sent and sent.group(1) == sent.group(2), out
    assert "n=20 per target" in out
    # the floor (a bare aiohttp pass-through) in the same run, and the targets against it
    assert len(re.findall(r"added by floor\[pass-through\]((?:\s+-?[\d.]+){4})\s+ms", out)) == 3
    targets = re.findall(r"^  (added p50|throughput c=4|CPU per request).*= +([\d.]+|inf)x .*"
                         r"(PASS|FAIL)$", out, re.MULTILINE)
    assert len(targets) == 5, out
    # the recording floor (the CPU target's baseline): every exchange committed; the ratios
    # with no target: added p50 against it, CPU against the bare floor
    assert re.search(r"floor\[pass-through\+sqlite\] recorded (\d+) exchanges in its database "
                     r"\(sent \1\)", out), out
    reference = out.split("for reference (no target)")[1]
    assert len(re.findall(r"^  (added p50|CPU per request).*= +[\d.]+x$", reference,
                          re.MULTILINE)) == 2, out
    # the Anthropic side, measured in the same run: pass-through and translated
    for kind in ("anthropic", "openai"):
        name = re.escape(f"proxy[lexical] anthropic->{kind}")
        assert len(re.findall(rf"ratio proxied/direct {name}((?:\s+[\d.]+){{4}})\s+x", out)) == 3
        assert len(re.findall(rf"ratio proxied/direct throughput {name}: [\d.]+x", out)) == 2
        assert re.search(rf"{name} recorded (\d+) turns in its store \(sent \1\)", out), out


def test_bench_proxy_rejects_bad_flags():
    proc = run_benchmark("bench_proxy.py", "--requests", "0", timeout=30)
    assert proc.returncode == 2
    assert "--requests must be at least 1" in proc.stderr


def test_bench_request_path_tiny_run_prints_each_step():
    proc = run_benchmark("bench_request_path.py", "--calls", "40", "--skills", "5",
                         "--evict-mb", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    steps = re.findall(r"^  (parse the body|\+ retrieve|\+ commit the turn).* ([\d.]+) us/call",
                       out, re.MULTILINE)
    # hot, then with 2 MB written before each turn
    assert [name for name, _ in steps] == ["parse the body", "+ retrieve", "+ commit the turn"] * 2
    assert "2 MB written before each turn" in out
    assert all(float(us) > 0 for _, us in steps)
    for section in ("generation check (5 skills)", "query extraction, plain SDK request"):
        assert section in out


def test_bench_proxy_steps_tiny_run_splits_the_difference():
    proc = run_benchmark("bench_proxy_steps.py", "--requests", "20", "--warmup", "5", timeout=180)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    for label in ("difference", "identify the session", "retrieve and inject skills",
                  "commit the turns on the loop", "sum of the steps", "the rest"):
        row = re.search(rf"^ +{re.escape(label)}.*?((?:\s+-?\d+){{2}})$", out, re.MULTILINE)
        assert row, (label, out)
        if label in ("identify the session", "retrieve and inject skills",
                     "commit the turns on the loop"):  # its clock ran in the proxy
            assert all(int(x) > 0 for x in row.group(1).split()), (label, out)
    assert re.search(r"recorded 50 turns in its store \(sent 50\)", out), out
