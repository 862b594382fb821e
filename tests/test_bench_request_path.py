"""Smoke test of benchmarks/bench_request_path.py: a tiny run prints every section."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_request_path.py"


def test_bench_request_path_tiny_run_prints_each_step():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--calls", "40", "--skills", "5",
                           "--evict-mb", "2"], capture_output=True, text=True, timeout=120)
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
