"""Benchmark mode ``full``: the agent is served by the trained policy, which learns every night.

The day's graders are the slow loop's programmatic reward. For a query-set turn of round ``r``
of a day, a sampled completion is rewarded with what round ``r``'s grader says about it:

- ``multi_choice``: the grader's partial-credit score of the completion (``score_choice``);
- ``file_check``: the completion's tool calls are applied to a copy of the workspace as it stood
  when round ``r`` was graded, and the round's check command runs there: 1 when it passes, else 0.

A completion cut at ``max_tokens`` loses ``overlong_penalty`` (it never finished its answer), so
even a model too weak to pass any check gets a signal to end its replies. Turns outside any
round (the closing message) have no grader and are left to the judge, which sees their
consequence (the next user message).

:class:`FullMode` holds the pieces (the slow loop serving through the proxy, the round snapshots)
and gives :func:`metaclaw.demo.run_mode` its hooks: ``on_round`` (snapshot the workspace),
``night`` (train on the day's query set before the next adaptation) and ``label`` (what served
the run, per day, with the policy versions and training figures).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from metaclaw.bench.data import Day, Round, load_benchmark, select_days
from metaclaw.turns import TASK_TURNS_SQL

OVERLONG_PENALTY = 0.1


def round_of(turn: dict[str, Any], days: dict[str, Day]) -> tuple[Day, Round] | None:
    """The benchmark round a recorded turn belongs to: the day from its session id
    (``bench-<run>-<day>``), the round whose question ends the turn's last user message."""
    from metaclaw.buffers import last_user_text

    day = days.get(str(turn.get("session_id", "")).rsplit("-", 1)[-1])
    if day is None:
        return None
    text = last_user_text(turn.get("request_messages")).rstrip()
    for round_ in day.rounds:
        if text.endswith(round_.question.rstrip()):
            return day, round_
    return None


class GraderReward:
    """The reward of completions of one round's turn, by that round's grader (module docstring).

    ``snapshot``: the workspace folder as it stood when the round was graded (file checks);
    ``initial_files``: the day's input files (not graded as outputs).
    """

    def __init__(self, round_: Round, snapshot: Path | None, initial_files: list[str]):
        self.round, self.snapshot, self.initial_files = round_, snapshot, initial_files
        self._unchanged: float | None = None

    def __call__(self, text: str) -> float:
        from metaclaw.bench.grading import score_choice
        from metaclaw.bench.workspace import Workspace, execute_tool
        from metaclaw.slowloop.policy import parse_tool_calls

        content, calls = parse_tool_calls(text)
        if self.round.type == "multi_choice":
            return float(score_choice(content or "", self.round).score)
        if self.snapshot is None:
            return 0.0
        if not calls:  # nothing written: the check sees the workspace as it was graded
            if self._unchanged is None:
                self._unchanged = self._check(self.snapshot)
            return self._unchanged
        with tempfile.TemporaryDirectory(prefix="metaclaw-reward-") as tmp:
            root = Path(tmp) / "ws"
            shutil.copytree(self.snapshot, root)
            workspace = Workspace(root)
            for call in calls:
                execute_tool(workspace, call["function"]["name"], call["function"]["arguments"])
            return self._check(root)

    def _check(self, root: Path) -> float:
        from metaclaw.bench.grading import run_check

        check = run_check(self.round, root, timeout=30.0, initial_files=self.initial_files)
        return 1.0 if check.passed else 0.0

    def __repr__(self) -> str:
        return f"GraderReward({self.round.id}, {self.round.type})"


class FullMode:
    """Mode ``full`` of the benchmark: a :class:`~metaclaw.slowloop.loop.SlowLoop` serving the agent
    through ``proxy`` from ``backend``'s policy and trained each night on the day's query set,
    rewarded by the day's graders.

    In: the run's ``store``, the training ``backend``, the ``proxy``, the ``judge`` (for turns
    outside any round), the benchmark ``data`` folder and ``days``, ``train_steps`` per night,
    ``work_dir`` (round snapshots), and an optional :class:`~metaclaw.slowloop.grpo.GRPOConfig`.
    """

    def __init__(self, store, backend, proxy, judge, data: Path, days: Any, *,
                 train_steps: int = 4, work_dir: Path, config=None):
        import dataclasses

        from metaclaw.slowloop.grpo import GRPOConfig
        from metaclaw.slowloop.loop import SlowLoop

        bench = load_benchmark(data)
        self.days = {d.id: d for d in select_days(bench, days)}
        self.store, self.backend, self.train_steps = store, backend, int(train_steps)
        self.work_dir = Path(work_dir)
        self.snapshots: dict[tuple[str, str], Path] = {}
        self.initial_files: dict[str, list[str]] = {}
        self.nights: list[dict[str, Any]] = []
        self._kept: set[str] = set()   # the runner's kept workspaces, removed by close()
        config = config or GRPOConfig(overlong_penalty=OVERLONG_PENALTY)
        if not config.overlong_penalty:
            config = dataclasses.replace(config, overlong_penalty=OVERLONG_PENALTY)
        self.slow = SlowLoop(store, backend, config=config, judge=judge, proxy=proxy, serve=True,
                             reward_for=self.reward_for)
        self.model_name = f"{backend.kind}:{backend.base_model}"

    # -- hooks ----------------------------------------------------------------------------
    def on_round(self, record: dict[str, Any]) -> None:
        """Keep the workspace as the round was graded (needs ``keep_workspaces=True``)."""
        ws = record.get("workspace")
        if ws:
            self._kept.add(ws)
        if not ws or record.get("type") != "file_check":
            return
        dest = self.work_dir / "snapshots" / record["day"] / record["round"]
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(ws, dest, symlinks=False)
        self.snapshots[(record["day"], record["round"])] = dest

    def reward_for(self, turn: dict[str, Any]) -> Callable[[str], float] | None:
        """The grader reward of a query turn's completions, None outside any round."""
        found = round_of(turn, self.days)
        if found is None:
            return None
        day, round_ = found
        return GraderReward(round_, self._snapshot(day.id, round_.id), self._initial_files(day))

    def _snapshot(self, day: str, round_id: str) -> Path | None:
        known = self.snapshots.get((day, round_id))
        if known is not None:
            return known
        # a resumed run finishing the night of a day the killed process ran: that process's
        # snapshots are still in the run's folder (a new run clears them), only not in memory
        path = self.work_dir / "snapshots" / day / round_id
        return path if path.is_dir() else None

    def _initial_files(self, day: Day) -> list[str]:
        if day.id not in self.initial_files:
            from metaclaw.bench.workspace import Workspace

            ws = Workspace.create(day.workspace_src, day.id)
            try:
                self.initial_files[day.id] = ws.files()
            finally:
                shutil.rmtree(ws.root, ignore_errors=True)
        return self.initial_files[day.id]

    def night(self, day_summary: dict[str, Any], threshold: float = 0.0) -> dict[str, Any]:
        """Train on the day's live query set (before the next adaptation purges it)."""
        from metaclaw import buffers
        from metaclaw.slowloop.grpo import select_query_turns

        buffers.refresh(self.store)
        query = select_query_turns(self.store)
        before = self.backend.policy_version
        result = self.slow.train_now(self.train_steps) if query else None
        history = result.history if result is not None else []
        night = {
            "day": day_summary.get("day"), "query_turns": len(query),
            "graded_turns": sum(1 for t in query if self.reward_for(t) is not None),
            "steps": len(history), "policy_version_before": before,
            "policy_version_after": self.backend.policy_version,
            "published": self.backend.policy_version - before,
            "reward_first": history[0]["reward_mean"] if history else None,
            "reward_last": history[-1]["reward_mean"] if history else None,
            "groups": sum(h["groups"] for h in history),
            "skipped_groups": sum(h["skipped_groups"] for h in history),
            "zero_variance_groups": sum(h["metrics"].get("zero_variance_groups", 0)
                                        for h in history),
            "stopped": None if result is None else (result.reason if result.stopped else None),
        }
        self.nights.append(night)
        return night

    def label(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Label the run with what served it: the policy (backend, base model) and the policy
        versions that answered each day's turns, plus the nights' training figures."""
        rows = self.store.query(
            "SELECT session_id, MIN(policy_version) AS lo, MAX(policy_version) AS hi, "
            f"COUNT(*) AS n FROM turns WHERE {TASK_TURNS_SQL} GROUP BY session_id")
        per_day = {str(r["session_id"]).rsplit("-", 1)[-1]: [r["lo"], r["hi"], r["n"]]
                   for r in rows}
        summary["agent_model"] = summary.get("model")
        summary["model"] = self.model_name
        summary["served_by"] = {
            "policy": self.model_name, "backend": self.backend.kind,
            "base_model": self.backend.base_model,
            "policy_versions_by_day": {d: {"min": lo, "max": hi, "turns": n}
                                       for d, (lo, hi, n) in per_day.items()},
        }
        summary["nights"] = self.nights
        summary["training"] = self.store.query(
            "SELECT step, policy_version, skill_generation, loss, reward_mean, reward_std, "
            "groups, skipped_groups FROM training_steps ORDER BY id")
        summary["policy_version"] = self.backend.policy_version
        return summary

    def close(self) -> None:
        self.slow.close()
        shutil.rmtree(self.work_dir / "snapshots", ignore_errors=True)
        for ws in self._kept:
            shutil.rmtree(ws, ignore_errors=True)
