"""Experiments (metaclaw.fastloop.experiments): datasets, variants, resumable runs through the one replay
engine, paired summaries, the CLI. The upstream and the judge are the offline SIMULATED model."""

from __future__ import annotations

import asyncio
import json

import pytest

from metaclaw import cli
from metaclaw.bench.data import small_bench_dir
from metaclaw.demo import run_mode
from metaclaw.fastloop import experiments as ex, proposals
from metaclaw.fastloop.gate import Gate
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.replay import Replayer
from metaclaw.offline.simmodel import serve_sim_model
from metaclaw.skills.library import SkillLibrary, SkillOp
from metaclaw.skills.retrieval import LexicalRetriever
from metaclaw.store import Store


@pytest.fixture(scope="module")
def sim():
    server = serve_sim_model()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def recorded(sim, tmp_path_factory):
    """A skills-mode run of day01: judged turns, failures, skill generations."""
    out = tmp_path_factory.mktemp("exp") / "run"
    run_mode("skills", small_bench_dir(), "day01", out, sim.url, "sim-agent", api_key_env="X",
             retrieval="lexical", top_k=5, min_score=0.0, budget_chars=12000, parallel=1,
             judge_url=sim.url, judge_model="sim-judge", evolver_url=sim.url,
             evolver_model="sim-evolver", votes=1, evolve_every="round", on_round=None)
    return out


@pytest.fixture()
def workspace(recorded, tmp_path):
    import shutil

    shutil.copytree(recorded, tmp_path / "run")
    store = Store(tmp_path / "run" / "metaclaw.db")
    library = SkillLibrary(tmp_path / "run" / "skills", store)
    yield store, library
    store.close()


def _replayer(sim) -> Replayer:
    # the retrieval the recorded run used, so that every replay of a variant with skills gets some
    return Replayer(Judge(sim.url, "sim-judge", votes=1), sim.url,
                    retriever=LexicalRetriever(), min_score=0.0)


def test_datasets(workspace):
    store, _ = workspace
    failures = ex.dataset(store, "fails", failures=True)
    assert failures and all(store.turn(i)["reward"] <= 0 for i in failures)
    assert ex.dataset_ids(store, "fails") == failures
    assert ex.dataset(store, "two", turn_ids=failures[:2]) == failures[:2]
    with pytest.raises(ex.ExperimentError, match="exists"):
        ex.dataset(store, "two", turn_ids=failures[:1])
    assert ex.dataset(store, "two", turn_ids=failures[:1], replace=True) == failures[:1]
    with pytest.raises(ex.ExperimentError, match="no turn with id 999999"):
        ex.dataset(store, "bad", turn_ids=[999999])
    with pytest.raises(ex.ExperimentError, match="would be empty"):
        ex.dataset(store, "none", session="no-such-session")
    with pytest.raises(ex.ExperimentError, match="dataset name"):
        ex.dataset(store, "bad name; drop table", failures=True)
    with pytest.raises(ex.ExperimentError, match="there are: fails, two"):
        ex.dataset_ids(store, "missing")


def test_variants(workspace):
    store, library = workspace
    assert ex.Variant.parse("gen:1~a-b~c@gpt-x") == ex.Variant("gen:1~a-b~c@gpt-x", "gen:1",
                                                                  ("a-b", "c"), "gpt-x")
    for bad in ("gen", "gen:x", "latest", "proposal:", "current~", "current-x", ""):
        with pytest.raises(ex.ExperimentError, match="variant"):
            ex.Variant.parse(bad)
    assert ex.Variant.parse("none").skills(library) == []
    current = ex.Variant.parse("current").skills(library)
    assert [s.name for s in current] == [s.name for s in library.skills()] and current
    name = current[0].name
    assert name not in [s.name for s in ex.Variant.parse(f"current~{name}").skills(library)]
    with pytest.raises(ex.ExperimentError, match="no skill nope"):
        ex.Variant.parse("current~nope").skills(library)
    with pytest.raises(ex.ExperimentError, match="generation 99 does not exist"):
        ex.Variant.parse("gen:99").skills(library)
    assert ex.Variant.parse("gen:0").skills(library) == []
    held = proposals.record(store, [SkillOp("remove", name=name)], origin="manual",
                            status=proposals.HELD, base_generation=library.generation)
    assert name not in [s.name for s in ex.Variant.parse(f"proposal:{held}").skills(library)]


def test_run_is_resumable_and_summarised(workspace, sim):
    store, library = workspace
    cases = ex.dataset(store, "fails", failures=True)
    run = ex.Experiment.create(store, "old-vs-new", "fails", ["none", "current"])
    plan = run.plan(votes=1)
    assert (plan.replays, plan.judge_calls, plan.done) == (2 * len(cases), 2 * len(cases), 0)
    # a budget stops it part way; what finished is kept
    run.run(_replayer(sim), library, max_calls=4)
    assert len(run.frame()) == 2 and run.plan(votes=1).done == 2
    seen = []
    run.run(_replayer(sim), library, on_progress=seen.append)
    assert seen[-1].done == seen[-1].total == 2 * len(cases) - 2
    frame = run.frame()
    assert len(frame) == 2 * len(cases) and frame["score"].null_count() == 0
    assert run.plan(votes=1).replays == 0
    current = frame.filter(frame["variant"] == "current")
    assert all(json.loads(s) for s in current["skills"])  # the skills the replay was given
    summary = run.summary()
    assert summary["variant"].to_list() == ["none", "current"]
    row = summary.row(1, named=True)
    assert row["paired"] == len(cases) and row["diff_vs_first"] is not None
    assert row["mcnemar_p"] is not None and 0 <= row["mcnemar_p"] <= 1
    # the SIMULATED agent follows a convention only when a skill states it: skills help here
    assert row["mean_reward"] >= summary.row(0, named=True)["mean_reward"]
    assert run.chart().to_dict()["data"]["values"]
    # reopened from the store, extended with a variant
    again = ex.Experiment.open(store, "old-vs-new")
    again.add_variants(["gen:1"])
    assert again.plan(votes=1).replays == len(cases)
    with pytest.raises(ex.ExperimentError, match="exists"):
        ex.Experiment.create(store, "old-vs-new", "fails", ["none", "current"])
    with pytest.raises(ex.ExperimentError, match="at least two"):
        ex.Experiment.create(store, "one", "fails", ["none"])


def test_gate_and_experiment_replays_agree(workspace, sim):
    """One replay engine: the gate's replay of a case and an experiment's give one result."""
    store, library = workspace
    turn = store.turn(ex.dataset(store, "fails", failures=True)[0])
    skills = library.skills()
    judge = Judge(sim.url, "sim-judge", votes=1)
    gate = Gate(judge, sim.url)

    async def both():
        try:
            by_gate = await gate._replay(turn, skills)
            by_user = await gate.replayer.areplay(turn, skills)
            fresh = await Replayer(judge, sim.url).areplay(turn, skills)
            return by_gate, by_user, fresh
        finally:
            await gate.aclose()
            await judge.aclose()

    by_gate, by_user, fresh = asyncio.run(both())
    assert (by_gate["score"], by_gate["reply"]) == (by_user.score, by_user.reply) \
        == (fresh.score, fresh.reply)
    assert fresh.skills == by_user.skills


def test_upstream_failures_are_kept_and_retried(workspace, sim):
    store, library = workspace
    ex.dataset(store, "two", turn_ids=ex.dataset(store, "f", failures=True)[:2])
    run = ex.Experiment.create(store, "down", "two", ["none", "current"])
    dead = Replayer(Judge(sim.url, "sim-judge", votes=1), "http://127.0.0.1:9/v1", timeout=2,
                    retriever=LexicalRetriever(), min_score=0.0)
    run.run(dead, library)
    frame = run.frame()
    assert len(frame) == 4 and frame["upstream_failed"].all()
    assert frame["error"].str.contains("upstream failed").all()
    assert run.plan(votes=1).replays == 4  # failed replays run again
    run.run(_replayer(sim), library)
    assert not run.frame()["upstream_failed"].any()


def test_cli(workspace, sim, capsys):
    store, library = workspace
    base = ["--db", str(store.target), "--skills", str(library.directory)]
    argv = ["experiment", "run", "cli-exp", "--failures", "--last", "3", "--variant", "none",
            "--variant", "current", "--upstream", sim.url, "--judge-url", sim.url,
            "--judge-model", "sim-judge", "--votes", "1"] + base
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "dataset cli-exp: 3 turns" in out
    assert "6 replays to make (0 done already): 6 upstream calls and up to 6 judge calls" in out
    assert "current" in out and "McNemar" in out
    assert cli.main(["experiment", "list"] + base) == 0
    assert "cli-exp" in capsys.readouterr().out
    assert cli.main(["experiment", "show", "cli-exp", "--json"] + base) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == ["none", "current"] and rows[1]["paired"] == 3
    assert cli.main(["experiment", "show", "nope"] + base) == 2
    assert "no experiment 'nope' (there are: cli-exp)" in capsys.readouterr().err
    assert cli.main(["experiment", "run", "x", "--variant", "gen:", "--variant", "none",
                     "--upstream", sim.url, "--judge-url", sim.url, "--judge-model", "j"]
                    + base) == 2
    assert "variant 'gen:'" in capsys.readouterr().err
    assert not store.query("SELECT 1 FROM datasets WHERE name = 'x'")  # nothing left behind
    # run again with more cases: the dataset grows and only the new cases are replayed; the
    # variant compared with stays the first one, as the note says
    more = ex.dataset_ids(store, "cli-exp")
    others = [r["id"] for r in store.query("SELECT id FROM turns WHERE status = 'ok' AND "
                                           "turn_type = 'main' ORDER BY id")
              if r["id"] not in more][:1]
    assert cli.main(["experiment", "run", "cli-exp", "--turns", ",".join(map(str, others)),
                     "--variant", "current", "--variant", "none", "--upstream", sim.url,
                     "--judge-url", sim.url, "--judge-model", "sim-judge", "--votes", "1"]
                    + base) == 0
    captured = capsys.readouterr()
    assert "dataset cli-exp: 4 turns (1 added)" in captured.out
    assert "2 replays to make (6 done already)" in captured.out
    assert "compares with its first variant 'none'" in captured.err


def test_cli_refuses_what_would_break_an_experiment_before_storing_anything(workspace, sim,
                                                                           capsys):
    """A variant naming a generation, proposal or skill the workspace lacks, no second variant,
    or turn ids that are not numbers: refused, and no experiment or dataset is left behind
    (the name stays free to run again)."""
    store, library = workspace
    run = ["--upstream", sim.url, "--judge-url", sim.url, "--judge-model", "sim-judge",
           "--votes", "1", "--db", str(store.target), "--skills", str(library.directory)]
    for variants, says in ((["none", "gen:99"], "generation 99"),
                           (["none", "proposal:99"], "proposal"),
                           (["none", "current~no-such-skill"], "no skill no-such-skill"),
                           (["none"], "at least two variants")):
        argv = ["experiment", "run", "g99", "--turns", "1"]
        for v in variants:
            argv += ["--variant", v]
        assert cli.main(argv + run) == 2, variants
        assert says in capsys.readouterr().err
    assert cli.main(["experiment", "run", "g99", "--turns", "1,abc", "--variant", "none",
                     "--variant", "current"] + run) == 2
    assert "--turns takes turn ids" in capsys.readouterr().err
    assert not store.query("SELECT 1 FROM experiments WHERE name = 'g99'")
    assert not store.query("SELECT 1 FROM datasets WHERE name = 'g99'")


def test_current_is_the_library_of_the_first_run_and_a_lost_variant_is_left_out(workspace,
                                                                               sim):
    """Resumed after the library changed, ``current`` replays the generation of the first run
    (its results are one library's); a variant that no longer resolves (its skill gone) is left
    out, said, while the others run."""
    store, library = workspace
    ex.dataset(store, "two", failures=True)
    cases = len(ex.dataset_ids(store, "two"))
    name = library.skills()[0].name
    run = ex.Experiment.create(store, "pinned", "two", ["none", "current", f"current~{name}"])
    run.run(_replayer(sim), library, max_calls=2)
    first = run.config["current_generation"]
    assert first == library.generation and run.skipped == {}
    library.rollback(0)  # the library changes: generation 0 holds none of these skills
    again = ex.Experiment.open(store, "pinned")
    again.run(_replayer(sim), library)
    assert again.config["current_generation"] == first and again.skipped == {}
    frame = again.frame()
    assert len(frame) == 3 * cases
    current = {json.dumps(sorted(json.loads(s))) for s in
               frame.filter(frame["variant"] == "current")["skills"]}
    assert len(current) == 1 and current != {"[]"}  # one library, not the rolled back one
    # a variant whose skill is not in its library: the others still run
    gone = ex.Experiment.create(store, "gone", "two", ["none", "gen:0~" + name])
    gone.run(_replayer(sim), library)
    assert list(gone.skipped) == ["gen:0~" + name] and "no skill" in gone.skipped["gen:0~" + name]
    assert set(gone.frame()["variant"]) == {"none"}


def test_the_summary_says_when_the_judge_could_not_tell_the_variants_apart(capsys):
    import polars as pl

    class Judged:
        def __init__(self, scores):
            self.scores = scores

        def summary(self, threshold=None):
            return pl.DataFrame({"variant": ["none", "current"], "cases": [2, 2],
                                 "scored": [2, 2], "mean_reward": [0.0, 0.0],
                                 "pass_rate": [0.0, 0.0], "paired": [None, 2],
                                 "diff_vs_first": [None, 0.0],
                                 "diff_low": [None, 0.0], "diff_high": [None, 0.0],
                                 "mcnemar_p": [None, 1.0]})

        def frame(self):
            return pl.DataFrame({"score": self.scores}, schema={"score": pl.Float64})

        def settings(self):
            return {}

    cli._show_experiment(Judged([0.0, 0.0, 0.0, None]), as_json=False)
    assert "the judge found every reply unclear (0)" in capsys.readouterr().out
    cli._show_experiment(Judged([0.0, -1.0, 1.0, 0.0]), as_json=False)
    assert "unclear" not in capsys.readouterr().out


def test_every_case_variant_is_in_flight_at_once_within_the_open_file_limit(tmp_path,
                                                                            monkeypatch):
    """At the default concurrency the replays of a moderate experiment all go out in one wave
    (every upstream request arrives before the first reply leaves); with a low open-file limit
    fewer replays are in flight, each holding one connection per call."""
    import resource
    import threading
    import time

    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.skills.library import Skill

    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(Skill(name="iso-dates", description="Write dates as ISO 8601",
                      body="Every date you write uses YYYY-MM-DD."), reason="test")
    ids = [store.record_turn(session_id="s", status="ok", response=f"answer {i}",
                             request_messages=[{"role": "user", "content": f"date {i}"}])
           for i in range(60)]
    ex.dataset(store, "cases", turn_ids=ids)
    arrivals: list[float] = []
    delay = [1.0]
    lock = threading.Lock()

    def reply(body: dict) -> Reply:
        if body.get("model") == "judge":
            return Reply(content='{"score": 1, "rationale": "fine"}')
        with lock:
            arrivals.append(time.monotonic())
        return Reply(content="2026-01-01", delay=delay[0])

    assert ex.CONCURRENCY >= 400  # 200 cases x 2 variants in one wave
    import gc

    thresholds = gc.get_threshold()
    with DoubleServer(reply) as double:
        replayer = Replayer(Judge(double.url, "judge", votes=1), double.url, "upstream")
        experiment = ex.Experiment.create(store, "wave", "cases", ["none", "current"])
        experiment.run(replayer, library)
        assert gc.get_threshold() == thresholds  # collected less often only while it ran
        assert len(arrivals) == 120 and max(arrivals) - min(arrivals) < 1.0
        assert experiment.frame()["score"].null_count() == 0

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        monkeypatch.setattr(resource, "getrlimit", lambda which: (256 + 40, hard))
        assert ex.replays_in_flight(2) == 20 and ex.replays_in_flight(1 + 3) == 10
        monkeypatch.setattr(resource, "getrlimit", lambda which: (100, hard))
        assert ex.replays_in_flight(4) == 1  # never none
        # a soft limit too low for the replays wanted is raised as far as the hard one allows
        raised = []
        monkeypatch.setattr(resource, "setrlimit", lambda which, limits: raised.append(limits))
        monkeypatch.setattr(resource, "getrlimit", lambda which: (256 + 40, 256 + 400))
        assert ex.replays_in_flight(4, wanted=60) == 60 and raised == [(256 + 240, 256 + 400)]
        assert ex.replays_in_flight(4, wanted=500) == 100 and raised[-1] == (256 + 400, 256 + 400)
        assert ex.replays_in_flight(4, wanted=5) == 10  # enough already: left alone
        assert len(raised) == 2
        # where the hard limit allows no more, the replays run in waves
        monkeypatch.setattr(resource, "getrlimit", lambda which: (256 + 40, 256 + 40))
        arrivals.clear()
        delay[0] = 0.4
        experiment = ex.Experiment.create(store, "bounded", "cases", ["none", "current"])
        started = time.monotonic()
        experiment.run(replayer, library)
        # 120 replays, 20 at a time, 0.4 s each: six waves
        assert len(arrivals) == 120 and time.monotonic() - started >= 6 * 0.4
    store.close()


def test_a_run_with_other_judge_or_retrieval_settings_is_refused_and_show_recounts(
        workspace, sim, capsys):
    """Every result of an experiment is replayed and judged alike: its first run pins the
    judge's model, votes and threshold, the model and the retrieval; a later run with others
    is refused before anything is replayed (a variant added with a lower threshold passed every
    case, and McNemar's test called that p = 2e-12), and one that leaves the options out takes
    the pinned ones. ``show --threshold`` counts passes again from the stored rewards."""
    store, library = workspace
    base = ["--db", str(store.target), "--skills", str(library.directory)]
    judge = ["--upstream", sim.url, "--judge-url", sim.url, "--judge-model", "sim-judge",
             "--retrieval", "lexical", "--min-score", "0"]
    assert cli.main(["experiment", "run", "pinned", "--failures", "--last", "2", "--variant",
                     "none", "--variant", "current", "--votes", "1"] + judge + base) == 0
    out = capsys.readouterr().out
    assert " paired " in out.splitlines()[1] or "paired" in out  # the column is shown
    assert "replayed with --judge-model sim-judge, --votes 1, --threshold 0.0" in out
    assert cli.main(["experiment", "run", "pinned", "--variant", "gen:0", "--votes", "1",
                     "--threshold", "-0.5"] + judge + base) == 2
    said = capsys.readouterr().err
    assert "--threshold 0.0 (now -0.5)" in said and "start a new experiment" in said
    assert [v.spec for v in ex.Experiment.open(store, "pinned").variants] == ["none",
                                                                               "current"]
    # the options left out: the pinned ones (votes 1, lexical, min-score 0)
    assert cli.main(["experiment", "run", "pinned", "--variant", "gen:0", "--upstream",
                     sim.url, "--judge-url", sim.url] + base) == 0
    capsys.readouterr()
    run = ex.Experiment.open(store, "pinned")
    assert set(run.frame()["variant"]) == {"none", "current", "gen:0"}
    # a pass threshold below every reward: every scored case passes, for every variant alike
    assert (run.summary(threshold=-2.0)["pass_rate"].drop_nulls() == 1.0).all()
    assert cli.main(["experiment", "show", "pinned", "--threshold", "-2"] + base) == 0
    assert "100%" in capsys.readouterr().out


def test_a_run_whose_replays_all_failed_says_so_and_fails(workspace, sim, capsys):
    store, library = workspace
    base = ["--db", str(store.target), "--skills", str(library.directory)]
    argv = ["experiment", "run", "down-cli", "--failures", "--last", "2", "--variant", "none",
            "--variant", "current", "--upstream", "http://127.0.0.1:9/v1", "--judge-url",
            sim.url, "--judge-model", "sim-judge", "--votes", "1"] + base
    assert cli.main(argv) == 1
    said = capsys.readouterr().err
    assert "note: 4 of the 4 replays of this run failed (run again to retry them)" in said
    assert "upstream failed" in said
    # run again, still down: this run's 4 retries failed too (counted as this run's), exit 1
    assert cli.main(argv[:3] + argv[10:]) == 1
    assert "note: 4 of the 4 replays of this run failed" in capsys.readouterr().err
    # a variant added while the upstream is down: that run's every replay failed, exit 1, though
    # the experiment scored cases before
    up = [a if a != "http://127.0.0.1:9/v1" else sim.url for a in argv]
    assert cli.main(up[:3] + up[10:]) == 0
    capsys.readouterr()
    assert cli.main(argv[:3] + ["--variant", "gen:0"] + argv[10:]) == 1
    assert "note: 2 of the 2 replays of this run failed" in capsys.readouterr().err


def test_does_a_skill_help_the_turns_it_was_given_replayed_without_it(workspace, sim, capsys):
    """`--given-skill NAME` selects the turns skill NAME was injected into; replayed with
    `current~NAME` and `current`, they compare the library with and without it on the very
    turns it served (the path `metaclaw skills stats` points to)."""
    store, library = workspace
    given = [t for t in store.turns() if t["injected_skills"]]
    assert given, "the recorded run injected no skill"
    name = given[-1]["injected_skills"][0]
    ids = ex.dataset(store, "given", given=name)
    assert ids == sorted(t["id"] for t in store.turns()
                         if name in (t["injected_skills"] or []) and t["status"] == "ok"
                         and t["turn_type"] == "main")
    base = ["--db", str(store.target), "--skills", str(library.directory)]
    assert cli.main(["experiment", "run", f"{name}-helps", "--given-skill", name, "--last", "2",
                     "--variant", f"current~{name}", "--variant", "current", "--upstream",
                     sim.url, "--judge-url", sim.url, "--judge-model", "sim-judge", "--votes",
                     "1", "--retrieval", "lexical", "--min-score", "0"] + base) == 0
    out = capsys.readouterr().out
    assert f"dataset {name}-helps: 2 turns" in out and f"current~{name}" in out
    frame = ex.Experiment.open(store, f"{name}-helps").frame()
    with_it = frame.filter(frame["variant"] == "current")["skills"].to_list()
    without = frame.filter(frame["variant"] == f"current~{name}")["skills"].to_list()
    assert all(name in s for s in with_it) and not any(name in s for s in without)


def test_an_unclear_reply_is_said_so_and_counts_as_not_passing():
    """A replay whose judge votes tie (0 at the threshold 0) is unclear, as everywhere else;
    the pass rate and McNemar's test count it as not passing."""
    from metaclaw.fastloop.experiments import mcnemar_p
    from metaclaw.turns import judge_verdict

    assert judge_verdict(0.0) == "unclear"
    assert mcnemar_p([("unclear", "pass")] * 6) == mcnemar_p([("fail", "pass")] * 6) == 0.03125
    assert mcnemar_p([("unclear", "fail")] * 6) == 1.0  # neither passed: nothing changed
