"""The offline research pipeline: stage checks, the simulated model's request-only behaviour, and
stage-specific skills cutting retries and refine cycles (all SIMULATED)."""

from __future__ import annotations

import pytest

from metaclaw.double import DoubleServer
from metaclaw.evolver import Evolver
from metaclaw.research_pipeline import (STAGES, SimulatedResearchModel, check, review, run_pipeline,
                               run_table, runtime_hooks, stage_table)
from metaclaw.runtime import Runtime

RULE = "- Include a line starting with `{}:` in the plan stage output."


def ask(model, system, user, *feedback):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user},
                *({"role": "user", "content": f} for f in feedback)]
    return model.answer(messages)


def test_the_simulated_model_follows_only_its_request():
    model = SimulatedResearchModel(slip=0.0)
    plain = ask(model, "You are a research assistant.", "Stage: plan\nTopic: x\nPlan it.")
    assert not check("plan", plain)[0] and "`Metric:`" in check("plan", plain)[1]
    ruled = ask(model, "You are a research assistant.\n\n## Skills\n\n"
                + "\n".join(RULE.format(k) for k in ("Metric", "Baseline")),
                "Stage: plan\nTopic: x\nPlan it.")
    assert check("plan", ruled) == (True, "the plan stage output passed its check")
    fixed = ask(model, "You are a research assistant.", "Stage: plan\nTopic: x\nPlan it.",
                "The check failed: missing `Metric:`, `Baseline:`. Fix it.")
    assert check("plan", fixed)[0]
    assert ask(model, "sys", "Stage: plan\nTopic: x") == ask(model, "sys", "Stage: plan\nTopic: x")
    assert not review({"plan": "Metric: f1", "write": "Title: t"})[0]
    assert review({"plan": "Metric: f1", "write": "Metric: f1"})[0]


def test_stage_skills_cut_retries_and_refine_cycles(tmp_path):
    topics = ["sparse attention", "tool-use agents", "code repair", "table QA", "log triage",
              "schema matching"]
    with DoubleServer(SimulatedResearchModel(slip=0.1),
                      models=("sim-research", "sim-evolver")) as double:
        runtime = Runtime.start(upstream_url=double.url, model="sim-research",
                                db_path=str(tmp_path / "m.db"),
                                skills_dir=str(tmp_path / "skills"), retrieval="lexical", top_k=1)
        try:
            chat, verdict = runtime_hooks(runtime)
            base = [run_pipeline(chat, verdict, f"b{i}", t) for i, t in enumerate(topics[:3])]
            result = Evolver(double.url, "sim-evolver", runtime.library, runtime.store,
                             dedupe_threshold=None, max_support=500).evolve()
            assert result.applied
            assert {op.name for op in result.proposal.ops} == {f"{s}-stage-conventions"
                                                               for s in STAGES}
            after = [run_pipeline(chat, verdict, f"s{i}", t) for i, t in enumerate(topics[3:])]
            injected = runtime.store.turns("session_id = 's0/search'")[0]["injected_skills"]
            assert injected == ["search-stage-conventions"]  # stage-specific
        finally:
            runtime.stop()
            runtime.store.close()
    before, with_skills = stage_table(base, "baseline"), stage_table(after, "skills")
    assert before["first_try"].sum() == 0  # the default drafts miss every stage's conventions
    assert with_skills["retries"].sum() < before["retries"].sum()
    assert with_skills["first_try"].mean() > 0.5
    runs_before, runs_after = run_table(base, "b"), run_table(after, "s")
    assert runs_after["refine_cycles"].sum() < runs_before["refine_cycles"].sum()
    assert runs_after["robustness"].mean() > runs_before["robustness"].mean()
    assert 0 <= runs_after["robustness"].min() <= runs_after["robustness"].max() <= 1
