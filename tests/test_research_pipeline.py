"""The offline research pipeline: stage checks, the simulated model's request-only behaviour, and
stage-specific skills cutting retries and refine cycles (all SIMULATED)."""

from __future__ import annotations

import pytest

from metaclaw.fastloop.evolver import Evolver, build_evolver_messages
from metaclaw.offline.double import DoubleServer
from metaclaw.offline.research_pipeline import (STAGES, SimulatedResearchModel, check, review,
                                                run_pipeline, run_table, runtime_hooks, stage_table)
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
    """One session per run, one ``stage:<stage>`` turn per call; the evolver scopes each skill
    to the stage whose failures it cites, retrieval offers a stage only its own skill (top-k 3,
    five skills in the library), and the per-stage figures come from the recorded turns."""
    topics = ["sparse attention", "tool-use agents", "code repair", "table QA", "log triage",
              "schema matching"]
    with DoubleServer(SimulatedResearchModel(slip=0.1),
                      models=("sim-research", "sim-evolver")) as double:
        runtime = Runtime.start(upstream_url=double.url, model="sim-research",
                                db_path=str(tmp_path / "m.db"),
                                skills_dir=str(tmp_path / "skills"), retrieval="lexical", top_k=3)
        try:
            chat, verdict = runtime_hooks(runtime)
            base = [run_pipeline(chat, verdict, f"b{i}", t) for i, t in enumerate(topics[:3])]
            store = runtime.store
            turns = store.turns()
            assert {t["session_id"] for t in turns} == {"b0", "b1", "b2"}
            assert {t["turn_type"] for t in turns} == {f"stage:{s}" for s in STAGES}
            assert all(t["buffer_set"] == "query" for t in turns)  # stage turns are buffered
            result = Evolver(double.url, "sim-evolver", runtime.library, store,
                             dedupe_threshold=None, max_support=500).evolve()
            assert result.applied
            assert {op.name: op.skill.stage for op in result.proposal.ops} == {
                f"{s}-stage-conventions": s for s in STAGES}
            skill_md = (tmp_path / "skills" / "plan-stage-conventions" / "SKILL.md").read_text()
            assert "metadata:\n  stage: plan\n" in skill_md
            after = [run_pipeline(chat, verdict, f"s{i}", t) for i, t in enumerate(topics[3:])]
            for stage in STAGES:  # each stage sees its own skill only, though top-k is 3
                for turn in store.turns("session_id = 's0' AND turn_type = ?",
                                        (f"stage:{stage}",)):
                    assert turn["injected_skills"] == [f"{stage}-stage-conventions"]
            before = stage_table(store, base, "baseline")
            with_skills = stage_table(store, after, "skills")
            runs_before, runs_after = run_table(store, base, "b"), run_table(store, after, "s")
        finally:
            runtime.stop()
            runtime.store.close()
    assert list(before["turn_type"]) == [f"stage:{s}" for s in STAGES]
    assert before["first_try"].sum() == 0  # the default drafts miss every stage's conventions
    assert with_skills["retries"].sum() < before["retries"].sum()
    assert with_skills["first_try"].mean() > 0.5
    assert runs_after["refine_cycles"].sum() < runs_before["refine_cycles"].sum()
    assert runs_after["robustness"].mean() > runs_before["robustness"].mean()
    assert 0 <= runs_after["robustness"].min() <= runs_after["robustness"].max() <= 1
    # the figures read from the turns agree with what the runner saw
    for records, frame in ((base, runs_before), (after, runs_after)):
        for record, row in zip(records, frame.iter_rows(named=True)):
            assert row["run"] == record.run
            assert row["refine_cycles"] == record.refine_cycles
            assert row["completed"] == record.completed
            assert row["retries"] == sum(s.attempts - 1 for s in record.stages)
            assert row["robustness"] == pytest.approx(record.robustness)


def test_the_sim_evolver_reads_the_stage_from_the_turn_type():
    """The simulated evolver's stage comes from the support turns' ``turn_type`` in its prompt
    (not from the task text); main turns give it nothing to scope."""
    support = [{"id": 7, "turn_type": "stage:analyze", "task": "anything", "tools": "",
                "reply": "r", "rationale": "missing the line(s) `Interval:`", "feedback": "",
                "reward": -1},
               {"id": 8, "turn_type": "main", "task": "Stage: plan", "tools": "", "reply": "r",
                "rationale": "missing the line(s) `Metric:`", "feedback": "", "reward": -1}]
    prompt = build_evolver_messages(support, [], 0)[-1]["content"]
    [op] = SimulatedResearchModel().evolve(prompt)["operations"]
    assert op["name"] == "analyze-stage-conventions" and op["evidence"] == [7]
    assert "`Interval:`" in op["body"]


def test_tables_count_a_run_listed_twice_once_and_keep_columns_when_empty(tmp_path):
    from metaclaw.offline.research_pipeline import run_table, stage_table
    from metaclaw.store import Store

    store = Store(tmp_path / "w.db")
    for reward in (-1.0, 1.0):  # plan passed after one retry
        store.record_turn(session_id="r1", status="ok", request_messages=[],
                          turn_type="stage:plan", reward=reward)
    assert stage_table(store, ["r1", "r1"], "x")["retries"].to_list() == [1.0]
    assert run_table(store, ["r1", "r1"], "x")["retries"].to_list() == [1]
    assert stage_table(store, [], "x").columns[-1] == "robustness"
    assert run_table(store, [], "x")["run"].to_list() == []
