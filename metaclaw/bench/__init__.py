"""MetaClaw-Bench: run the benchmark's simulated workdays through a tool-using agent and grade them.

Modules: ``data`` (load the benchmark), ``workspace`` (per-day workspaces and confined file tools),
``graders`` (the five convention checkers), ``grading`` (run a round's check, score multiple
choice), ``agent`` (the built-in tool-calling agent), ``runner`` (``run_bench``, ``format_table``),
``oracle`` (answer-key agent doubles for tests and timing).

    from metaclaw.bench import run_bench, format_table
    summary = run_bench("metaclaw-bench-small", "all", "baseline", base_url=url, model="m",
                        out_dir="runs/baseline", parallel=4)
    print(format_table(summary))

The names below are imported on first use, so the checker scripts (``metaclaw.bench.scripts``)
start without loading the agent or the ``openai`` SDK.

May import: the shared modules and every wing (skills, protocols, proxy, fast and slow loop, the
offline doubles): the benchmark is an outer layer. Never the notebook layer, the command line,
the demo (which import it) or the runtime (checked by ``tests/test_architecture.py``).
"""

_EXPORTS = {
    "run_bench": "runner", "arun_bench": "runner", "format_table": "runner", "summarize": "runner",
    "load_benchmark": "data", "select_days": "data", "Benchmark": "data", "Day": "data",
    "Round": "data", "BenchDataError": "data", "Workspace": "workspace",
    "AgentConfig": "agent", "DayAgent": "agent",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"metaclaw.bench.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'metaclaw.bench' has no attribute {name!r}")
