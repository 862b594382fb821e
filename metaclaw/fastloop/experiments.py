"""Experiments: does a skill (a generation, a proposal, a model) help on turns you choose?

    from metaclaw.fastloop import experiments as ex
    ex.dataset(store, "date-failures", failures=True, last=50)     # a named selection of turns
    run = ex.Experiment.create(store, "gen3-vs-gen5", "date-failures",
                               ["gen:3", "gen:5", "proposal:12", "none"])
    run.plan(votes=3)              # how many upstream and judge calls it will make
    run.run(replayer, library)     # resumable: what finished is kept, a second run does the rest
    run.frame()                    # one row per case and variant (polars)
    run.summary()                  # per variant, and paired against the first variant
    run.chart()                    # per-case differences (altair)

A **dataset** is a stored, named selection of recorded turns: an explicit list, a session, the
judged failures, the labelled turns, or an SQL condition, fixed when it is made (the turn ids
are stored, so a dataset does not grow under an experiment).

An **experiment** replays each case (the turn's messages as sent, its skill block removed)
once per **variant** through :class:`metaclaw.fastloop.replay.Replayer`, the engine the verification gate
uses, and the PRM judges each reply. A variant is written as a short spec:

- ``current``: the library as it was when the experiment first ran (kept, so that every run
  of it replays the same skills); ``gen:G``: skill generation ``G``; ``none``: no skills;
- ``proposal:P``: proposal ``P``'s operations applied to the generation it was written for;
- ``gen:G~NAME`` / ``current~NAME``: that library without the skill ``NAME`` (``~A~B`` removes
  several; retrieval picks from what is left, so the next-ranked skill may take its place);
- any of them followed by ``@MODEL``: the replay asks the upstream for ``MODEL`` instead of the
  turn's own model (another model, or a policy served under its own name).

The first run pins what decides a verdict (the judge's model, votes and threshold, the model,
the retrieval: :meth:`Replayer.settings`); a later run with other settings is refused.
Every result is stored as it arrives, so an interrupt keeps what finished and :meth:`run`
again does only what is missing (or failed); adding a variant or extending the dataset and running
again extends the experiment. Where a case has a human label with a corrected answer, each reply
is compared with it (``label_similarity``: difflib's ratio, 0..1).

The summary compares each variant with the first, on the cases both scored: the mean difference
of the judge's reward with a paired bootstrap 95% interval (2,000 resamples, fixed seed), and on
pass / fail (reward above the judge's threshold) McNemar's exact test on the discordant pairs.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

from metaclaw import jsonlib
from metaclaw.buffers import FAILURE_SQL
from metaclaw.gctune import fewer_collections
from metaclaw.progress import ProgressFn, notify
from metaclaw.skills.library import Skill, SkillNotFound, apply_in_memory
from metaclaw.store import IN_IDS, Store, id_list
from metaclaw.turns import TASK_TURNS_SQL, judge_verdict

log = logging.getLogger(__name__)

#: The columns of an experiment result a replay writes (after its key).
_RESULT_COLUMNS = ("created_at, score, verdict, votes, reply, tool_calls, skills, error, "
                   "upstream_failed, latency_ms, prompt_tokens, completion_tokens, label_similarity")

#: Replays in flight by default: the case-variants of a moderate experiment (200 cases x 2
#: variants) all at once, each holding one case in memory and, with its votes, 1 + votes
#: connections (512 x 4 sockets fit the connection limit of the clients,
#: :data:`metaclaw.fastloop.llm.MAX_CONNECTIONS`).
CONCURRENCY = 512


def replays_in_flight(per_replay: int, wanted: int | None = None, reserve: int = 256) -> int:
    """How many replays of ``per_replay`` concurrent calls (one connection each) fit in the
    process's open-file limit, ``reserve`` descriptors left for the store and the rest (at least
    one; no bound where the platform has no such limit). With ``wanted`` replays, a soft limit
    too low for them is first raised as far as the hard limit allows (the usual defaults, 256 on
    macOS and 1,024 on many Linux desktops, would run a moderate experiment in waves)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1 << 30
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    per_replay = max(1, per_replay)
    if wanted is not None:
        needed = reserve + int(wanted) * per_replay
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (OSError, ValueError):
                pass  # kept as it was: fewer replays in flight
    return max(1, (soft - reserve) // per_replay)


class ExperimentError(ValueError):
    """A dataset, a variant or an experiment that cannot be made or run (one sentence why)."""


# -- datasets ------------------------------------------------------------------------------
def dataset(store: Store, name: str, *, turn_ids: Iterable[int] | None = None,
            session: str | None = None, failures: bool = False, labelled: bool = False,
            given: str | None = None, where: str | None = None, params: Iterable[Any] = (),
            last: int | None = None, description: str = "", replace: bool = False,
            extend: bool = False, threshold: float = 0.0) -> list[int]:
    """Store the turns selected by the arguments as dataset ``name``; returns their ids.

    ``turn_ids``: an explicit list; otherwise the successful task turns, narrowed by
    ``session``, ``failures`` (judged below ``threshold`` and not labelled pass, or labelled
    fail: :data:`metaclaw.buffers.FAILURE_SQL`; a reward at the threshold, the judge unable to
    tell, is not a failure), ``labelled`` (with a
    human label), ``given`` (the turns the skill of that name was injected into: replayed with
    ``current`` and ``current~NAME``, they answer "does it help?"), ``where`` (an SQL
    condition on ``turns`` with ``params``), and ``last`` (the most recent N). An existing
    name is an error unless ``replace`` (the selection replaces its turns) or ``extend`` (the
    selection is added to them: an experiment on it then replays the new cases when run
    again)."""
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]{1,80}", name):
        raise ExperimentError(f"dataset name {name!r}: use 1-80 letters, digits, '_', '.', '-'")
    selection: dict[str, Any] = {"session": session, "failures": failures,
                                 "labelled": labelled, "given": given, "where": where,
                                 "last": last}
    if turn_ids is not None:
        ids = sorted({int(i) for i in turn_ids})
        missing = store.absent_turns(ids)
        if missing:
            raise ExperimentError(f"no turn with id {', '.join(map(str, missing[:10]))} in "
                                  f"{store.location}")
        selection = {"turn_ids": ids}
    else:
        clauses, args = [f"{TASK_TURNS_SQL} AND status = 'ok'"], []
        if session:
            clauses.append("session_id = ?")
            args.append(session)
        if failures:
            clauses.append(FAILURE_SQL)
            args.append(float(threshold))
            selection["threshold"] = float(threshold)
        if labelled:
            clauses.append("human_label IS NOT NULL")
        if given:
            clauses.append(f"id IN (SELECT t.id FROM turns t, "
                           f"{store.json_values('t.injected_skills', 'j')} WHERE j.value = ?)")
            args.append(given)
        if where:
            clauses.append(f"({where})")
            args.extend(params)
        rows = store.query(f"SELECT id FROM turns WHERE {' AND '.join(clauses)} "
                           "ORDER BY id DESC" + (f" LIMIT {int(last)}" if last else ""), args)
        ids = sorted(r["id"] for r in rows)
    if not ids:
        raise ExperimentError(f"dataset {name!r} would be empty: no turn matches "
                              f"{ {k: v for k, v in selection.items() if v} or 'the selection'}")
    with store.transaction():
        exists = store.query("SELECT selection, turn_ids FROM datasets WHERE name = ?", (name,))
        if exists and not (replace or extend):
            raise ExperimentError(f"dataset {name!r} exists; pass replace=True, extend=True "
                                  "(or another name)")
        if exists and extend:
            ids = sorted(set(jsonlib.loads(exists[0]["turn_ids"])) | set(ids))
            selection = {"earlier": jsonlib.loads(exists[0]["selection"] or "null"),
                         "added": selection}
        store.execute("INSERT INTO datasets (name, created_at, description, selection, turn_ids) "
                      "VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET created_at = "
                      "excluded.created_at, description = excluded.description, selection = "
                      "excluded.selection, turn_ids = excluded.turn_ids",
                      (name, time.time(), description, jsonlib.dumps(selection),
                       jsonlib.dumps(ids)))
    return ids


def dataset_ids(store: Store, name: str) -> list[int]:
    rows = store.query("SELECT turn_ids FROM datasets WHERE name = ?", (name,))
    if not rows:
        known = [r["name"] for r in store.query("SELECT name FROM datasets ORDER BY name")]
        raise ExperimentError(f"no dataset {name!r}" + (f" (there are: {', '.join(known)})"
                                                        if known else " (none yet)"))
    return list(jsonlib.loads(rows[0]["turn_ids"]))


# -- variants ------------------------------------------------------------------------------
_SPEC = re.compile(r"(?P<base>current|none|gen:\d+|proposal:\d+)(?P<without>(~[\w.-]+)*)"
                   r"(@(?P<model>\S+))?")


@dataclass(frozen=True)
class Variant:
    """One way of replaying the cases (see the module's docstring for the spec)."""

    spec: str
    base: str
    without: tuple[str, ...] = ()
    model: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        match = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
        if match is None:
            raise ExperimentError(
                f"variant {spec!r}: write current, none, gen:G or proposal:P, optionally "
                "followed by ~NAME (without that skill) and @MODEL (another model)")
        without = tuple(n for n in (match["without"] or "").split("~") if n)
        return cls(spec.strip(), match["base"], without, match["model"])

    def skills(self, library: Any) -> list[Skill]:
        """The skills this variant replays with."""
        if self.base == "none":
            chosen: dict[str, Skill] = {}
        elif self.base == "current":
            chosen = {s.name: s for s in library.skills()}
        elif self.base.startswith("gen:"):
            generation = int(self.base[4:])
            try:
                chosen = dict(library.snapshot(generation))
            except SkillNotFound as exc:
                raise ExperimentError(f"variant {self.spec!r}: {exc.args[0]}") from None
        else:
            from metaclaw.fastloop import proposals

            try:
                proposal = proposals.get(library.store, int(self.base[9:]))
            except proposals.ProposalError as exc:
                raise ExperimentError(f"variant {self.spec!r}: {exc}") from None
            chosen = apply_in_memory(library.snapshot(proposal.base_generation), proposal.ops)
        missing = [n for n in self.without if n not in chosen]
        if missing:
            raise ExperimentError(f"variant {self.spec!r}: no skill {', '.join(missing)} in "
                                  f"that library")
        return [chosen[n] for n in sorted(chosen) if n not in self.without]


# -- experiments ---------------------------------------------------------------------------
@dataclass
class Plan:
    """What a run will do: ``cases`` x ``variants`` replays still to make, each one upstream
    call and at most ``votes`` judge calls (one, for all its votes, where the judge's server
    gives several choices: :class:`metaclaw.fastloop.judge.Judge`)."""

    replays: int
    upstream_calls: int
    judge_calls: int
    done: int

    def __str__(self) -> str:
        return (f"{self.replays} replays to make ({self.done} done already): "
                f"{self.upstream_calls} upstream calls and up to {self.judge_calls} judge calls")


class Experiment:
    """A stored experiment (see the module's docstring). Open one with :meth:`open`, make one
    with :meth:`create`."""

    def __init__(self, store: Store, row: dict[str, Any]):
        self.store = store
        self.id, self.name, self.dataset = row["id"], row["name"], row["dataset"]
        self.variants = [Variant.parse(v) for v in jsonlib.loads(row["variants"])]
        self.config = jsonlib.loads(row["config"] or "{}")

    def __repr__(self) -> str:
        return (f"Experiment({self.name!r}, dataset={self.dataset!r}, "
                f"variants={[v.spec for v in self.variants]})")

    @classmethod
    def create(cls, store: Store, name: str, dataset_name: str,
               variants: Iterable[str]) -> "Experiment":
        parsed = [Variant.parse(v) for v in variants]
        if len(parsed) < 2:
            raise ExperimentError("an experiment compares at least two variants")
        specs = [v.spec for v in parsed]
        if len(set(specs)) != len(specs):
            raise ExperimentError(f"variants repeat: {specs}")
        dataset_ids(store, dataset_name)  # exists
        with store.transaction():
            if store.query("SELECT 1 FROM experiments WHERE name = ?", (name,)):
                raise ExperimentError(f"experiment {name!r} exists; open it with "
                                      "Experiment.open (add variants with add_variants)")
            store.execute("INSERT INTO experiments (name, created_at, dataset, variants) "
                          "VALUES (?, ?, ?, ?)",
                          (name, time.time(), dataset_name, jsonlib.dumps(specs)))
        return cls.open(store, name)

    @classmethod
    def open(cls, store: Store, name: str) -> "Experiment":
        rows = store.query("SELECT * FROM experiments WHERE name = ?", (name,))
        if not rows:
            known = [r["name"] for r in store.query("SELECT name FROM experiments ORDER BY id")]
            raise ExperimentError(f"no experiment {name!r}" + (
                f" (there are: {', '.join(known)})" if known else " (none yet)"))
        return cls(store, rows[0])

    def add_variants(self, variants: Iterable[str]) -> None:
        """Extend the experiment with more variants (run again to fill them in)."""
        specs = [v.spec for v in self.variants]
        for spec in variants:
            variant = Variant.parse(spec)
            if variant.spec not in specs:
                specs.append(variant.spec)
                self.variants.append(variant)
        self.store.execute("UPDATE experiments SET variants = ? WHERE id = ?",
                           (jsonlib.dumps(specs), self.id))

    # running -------------------------------------------------------------------------------
    #: The variants :meth:`run` left out, with why (they no longer resolve: a generation or
    #: proposal that is gone, ``~NAME`` of a skill no longer in that library).
    skipped: dict[str, str] = {}

    def _skills(self, variant: Variant, library: Any) -> list[Skill]:
        """The skills ``variant`` replays with; ``current`` is the library's generation when
        the experiment first ran (recorded then), so that a run resumed after the library
        changed does not mix two libraries in one variant's results."""
        if variant.base == "current":
            pinned = self.config.get("current_generation")
            if pinned is None:
                with self.store.transaction():  # two processes' first runs pin one generation
                    row = self.store.query("SELECT config FROM experiments WHERE id = ?",
                                           (self.id,))[0]
                    self.config = jsonlib.loads(row["config"] or "{}")
                    pinned = self.config.setdefault("current_generation",
                                                    int(library.generation))
                    self.store.execute("UPDATE experiments SET config = ? WHERE id = ?",
                                       (jsonlib.dumps(self.config), self.id))
            variant = Variant(variant.spec, f"gen:{pinned}", variant.without, variant.model)
        return variant.skills(library)

    #: The replay settings a later run must share (:meth:`Replayer.settings`), with the option
    #: that sets each in ``metaclaw experiment run``.
    SETTINGS = {"judge_model": "--judge-model", "votes": "--votes", "threshold": "--threshold",
                "model": "--model", "retrieval": "--retrieval", "top_k": "--top-k",
                "min_score": "--min-score", "budget_chars": "--budget-chars"}

    def settings(self) -> dict[str, Any]:
        """The settings the experiment's results were replayed and judged with (pinned by its
        first run; empty before it)."""
        return dict(self.config.get("settings") or {})

    def _pin(self, settings: dict[str, Any]) -> None:
        """Pin ``settings`` at the first run; a later run with others is refused: results
        judged with two pass thresholds (or votes, models, retrieval) in one table compare
        nothing (a variant run again with a lower threshold passed every case)."""
        with self.store.transaction():
            row = self.store.query("SELECT config FROM experiments WHERE id = ?", (self.id,))[0]
            self.config = jsonlib.loads(row["config"] or "{}")
            pinned = self.config.get("settings")
            if pinned is None:
                self.config["settings"] = dict(settings)
                self.store.execute("UPDATE experiments SET config = ? WHERE id = ?",
                                   (jsonlib.dumps(self.config), self.id))
                return
        self.check_settings(settings)

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Raise :class:`ExperimentError` naming each of ``settings`` that differs from the
        pinned ones (nothing before the first run)."""
        pinned = self.settings()
        differ = [f"{self.SETTINGS.get(k, k)} {pinned[k]!r} (now {v!r})"
                  for k, v in settings.items() if k in pinned and pinned[k] != v]
        if differ:
            raise ExperimentError(
                f"experiment {self.name!r} was replayed and judged with "
                f"{', '.join(differ)}: run it with those settings (leaving an option out "
                "takes the experiment's), or start a new experiment to compare others")

    def _done(self) -> set[tuple[int, str]]:
        """(turn id, variant) pairs with a result that need not run again (an upstream
        failure is retried)."""
        return {(r["turn_id"], r["variant"]) for r in self.store.query(
            "SELECT turn_id, variant FROM experiment_results WHERE experiment_id = ? AND "
            "upstream_failed = 0", (self.id,))}

    def _todo(self) -> list[tuple[int, Variant]]:
        done = self._done()
        return [(turn_id, v) for turn_id in dataset_ids(self.store, self.dataset)
                for v in self.variants if (turn_id, v.spec) not in done]

    def plan(self, votes: int = 3) -> Plan:
        """What :meth:`run` will do now (say it before spending anything)."""
        todo = len(self._todo())
        total = len(dataset_ids(self.store, self.dataset)) * len(self.variants)
        return Plan(todo, todo, todo * int(votes), total - todo)

    def run(self, replayer: Any, library: Any, *, max_calls: int | None = None,
            concurrency: int = CONCURRENCY, on_progress: ProgressFn | None = None) -> Plan:
        """Replay and judge what is missing; every result is stored as it arrives. ``replayer``:
        a :class:`metaclaw.fastloop.replay.Replayer` (upstream, judge, retrieval settings); ``library``:
        the :class:`metaclaw.skills.library.SkillLibrary` the variants' generations come from;
        ``max_calls``: the most upstream plus judge calls to spend (the replays beyond it are
        left for a later run); ``concurrency``: replays in flight at most (each with its judge
        votes; the process's open-file limit is raised for their connections where the hard
        limit allows, and fewer run where it would not hold them, :func:`replays_in_flight`).
        Returns the plan it ran."""
        from metaclaw.fastloop.llm import run_sync

        with fewer_collections():
            return run_sync(lambda: self.arun(replayer, library, max_calls=max_calls,
                                              concurrency=concurrency, on_progress=on_progress),
                            replayer.upstream, replayer.judge._client)

    async def arun(self, replayer: Any, library: Any, *, max_calls: int | None = None,
                   concurrency: int = CONCURRENCY, on_progress: ProgressFn | None = None) -> Plan:
        """The async form of :meth:`run`. Memory stays bounded whatever the dataset's size:
        ``concurrency`` workers each hold one case (read from the store when its turn comes)."""
        self._pin(replayer.settings())
        skills: dict[str, list[Skill]] = {}
        self.skipped = {}
        for v in self.variants:  # one that no longer resolves (a skill gone) is left out, said
            try:
                skills[v.spec] = self._skills(v, library)
            except ExperimentError as exc:
                self.skipped[v.spec] = str(exc)
                log.warning("experiment %s: %s; its cases are not replayed", self.name, exc)
        todo = [(turn_id, v) for turn_id, v in self._todo() if v.spec in skills]
        per_replay = 1 + replayer.judge.votes
        if max_calls is not None and len(todo) * per_replay > max_calls:
            todo = todo[:max(0, int(max_calls) // per_replay)]
        corrected = _corrected(self.store, {i for i, _ in todo})
        plan = Plan(len(todo), len(todo), len(todo) * replayer.judge.votes,
                    len(self._done()))
        pending = iter(todo)  # shared by the workers (one event loop: no lock needed)
        finished = [0]
        task = f"experiment {self.name}"
        notify(on_progress, task, 0, len(todo))

        async def worker() -> None:
            for turn_id, variant in pending:
                turn = self.store.turn(turn_id)
                if turn is None:  # deleted since the dataset was made
                    continue
                replay = await replayer.areplay(turn, skills[variant.spec], model=variant.model)
                self._store(turn_id, variant.spec, replay, replayer.judge.threshold,
                            corrected.get(turn_id))
                finished[0] += 1
                notify(on_progress, task, finished[0], len(todo),
                       f"turn #{turn_id} {variant.spec}: "
                       + ("failed" if replay.score is None else f"{replay.score:+g}"))

        workers: list[asyncio.Future] = []
        try:
            wanted = min(max(1, int(concurrency)), len(todo))
            for _ in range(min(wanted, replays_in_flight(per_replay, wanted))):
                workers.append(asyncio.ensure_future(worker()))
                # a loop turn between starts: the workers started earlier move on and their
                # requests go out at once, rather than after every case has been prepared (the
                # first replies then come back while the last cases are still being sent)
                await asyncio.sleep(0)
            await asyncio.gather(*workers)
        except BaseException:  # cancelled or failed: no worker goes on alone
            for started in workers:
                started.cancel()
            raise
        return plan

    def _store(self, turn_id: int, variant: str, replay: Any, threshold: float,
               corrected: str | None) -> None:
        verdict = judge_verdict(replay.score, threshold)
        similarity = (round(difflib.SequenceMatcher(None, corrected, replay.reply).ratio(), 4)
                      if corrected is not None and not replay.upstream_failed else None)
        with self.store.transaction(fsync=False):  # survives kill -9; see Store.transaction
            self._insert(turn_id, variant, replay, verdict, similarity)

    def _insert(self, turn_id: int, variant: str, replay: Any, verdict: str | None,
                similarity: float | None) -> None:
        self.store.execute(
            f"INSERT INTO experiment_results (experiment_id, turn_id, variant, {_RESULT_COLUMNS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (experiment_id, turn_id, variant) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in _RESULT_COLUMNS.split(", ")),
            (self.id, turn_id, variant, time.time(), replay.score, verdict,
             jsonlib.dumps(replay.vote_scores or []), replay.reply,
             jsonlib.dumps(replay.tool_calls) if replay.tool_calls else None,
             jsonlib.dumps(replay.skills or []), replay.error, int(replay.upstream_failed),
             replay.latency_ms, replay.prompt_tokens, replay.completion_tokens, similarity))

    # reading -------------------------------------------------------------------------------
    def frame(self):
        """One row per case and variant with a result (polars)."""
        import polars as pl

        rows = self.store.query(
            "SELECT turn_id, variant, score, verdict, votes, skills, error, upstream_failed, "
            "latency_ms, prompt_tokens, completion_tokens, label_similarity, reply "
            "FROM experiment_results WHERE experiment_id = ? ORDER BY turn_id, variant",
            (self.id,))
        schema = {"turn_id": pl.Int64, "variant": pl.Utf8, "score": pl.Float64,
                  "verdict": pl.Utf8, "votes": pl.Utf8, "skills": pl.Utf8, "error": pl.Utf8,
                  "upstream_failed": pl.Boolean, "latency_ms": pl.Float64,
                  "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
                  "label_similarity": pl.Float64, "reply": pl.Utf8}
        for row in rows:
            row["upstream_failed"] = bool(row["upstream_failed"])
            for key in ("votes", "skills"):
                if not isinstance(row[key], str):
                    row[key] = jsonlib.dumps(row[key])
        return pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(
            schema=schema)

    def summary(self, *, resamples: int = 2000, seed: int = 0, threshold: float | None = None):
        """Per variant: cases, scored, mean reward, pass rate, tokens, latency; and against
        the first variant on the cases both scored: how many (``paired``), the mean difference
        with its paired bootstrap 95% interval, and McNemar's exact p on passing or not
        (polars). A reply passes when its reward is above ``threshold`` (default: the threshold
        the experiment was judged with), fails below it and is unclear at it
        (:func:`metaclaw.turns.judge_verdict`): the pass rate and McNemar's test count an
        unclear reply as not passing."""
        import polars as pl

        results = self.frame()
        if threshold is None:
            threshold = self.settings().get("threshold")
        if threshold is not None:  # one threshold for every result, whatever run stored them
            results = results.with_columns(verdict=pl.col("score").map_elements(
                lambda score: judge_verdict(score, threshold), return_dtype=pl.Utf8))
        order = [v.spec for v in self.variants]
        by = {v: {r["turn_id"]: r for r in results.filter(pl.col("variant") == v)
                  .iter_rows(named=True)} for v in order}
        baseline = by[order[0]]
        rows = []
        for spec in order:
            mine = by[spec]
            scored = [r for r in mine.values() if r["score"] is not None]
            pairs = [(baseline[t]["score"], r["score"]) for t, r in mine.items()
                     if r["score"] is not None and t in baseline
                     and baseline[t]["score"] is not None]
            diffs = [b - a for a, b in pairs]
            low, high = _bootstrap(diffs, resamples, seed) if spec != order[0] else (None, None)
            verdicts = [(baseline[t]["verdict"], r["verdict"]) for t, r in mine.items()
                        if t in baseline and r["verdict"] and baseline[t]["verdict"]]
            rows.append({
                "variant": spec, "cases": len(mine), "scored": len(scored),
                "mean_reward": sum(r["score"] for r in scored) / len(scored) if scored else None,
                "pass_rate": (sum(r["verdict"] == "pass" for r in scored) / len(scored)
                              if scored else None),
                "completion_tokens": sum(r["completion_tokens"] or 0 for r in mine.values()),
                "median_latency_ms": _median([r["latency_ms"] for r in mine.values()
                                              if r["latency_ms"] is not None]),
                "paired": len(pairs) if spec != order[0] else None,
                "diff_vs_first": (sum(diffs) / len(diffs)) if diffs and spec != order[0]
                else None,
                "diff_low": low, "diff_high": high,
                "mcnemar_p": mcnemar_p(verdicts) if spec != order[0] else None,
            })
        return pl.DataFrame(rows, orient="row", schema={
            "variant": pl.Utf8, "cases": pl.Int64, "scored": pl.Int64,
            "mean_reward": pl.Float64, "pass_rate": pl.Float64, "completion_tokens": pl.Int64,
            "median_latency_ms": pl.Float64, "paired": pl.Int64, "diff_vs_first": pl.Float64,
            "diff_low": pl.Float64, "diff_high": pl.Float64, "mcnemar_p": pl.Float64})

    def chart(self):
        """Per-case difference of each variant's reward from the first variant's (altair)."""
        import altair as alt

        results = self.frame()
        first = self.variants[0].spec
        base = {r["turn_id"]: r["score"] for r in results.iter_rows(named=True)
                if r["variant"] == first and r["score"] is not None}
        values = [{"turn": r["turn_id"], "variant": r["variant"],
                   "difference": r["score"] - base[r["turn_id"]]}
                  for r in results.iter_rows(named=True)
                  if r["variant"] != first and r["score"] is not None and r["turn_id"] in base]
        return alt.Chart(alt.Data(values=values)).mark_bar().encode(
            x=alt.X("turn:O", title="case (turn id)"),
            y=alt.Y("difference:Q", title=f"reward minus {first}"),
            color=alt.Color("variant:N", title=None), xOffset="variant:N",
            tooltip=["turn:O", "variant:N", alt.Tooltip("difference:Q", format="+.2f")],
        ).properties(title=f"Experiment {self.name}: per-case differences from {first}")


def list_experiments(store: Store):
    """Every experiment with its dataset, variants and how many results it has (polars)."""
    import polars as pl

    rows = store.query(
        "SELECT e.name, e.dataset, e.variants, e.created_at, COUNT(r.id) AS results "
        "FROM experiments e LEFT JOIN experiment_results r ON r.experiment_id = e.id "
        "GROUP BY e.id ORDER BY e.id")
    for row in rows:
        if not isinstance(row["variants"], str):
            row["variants"] = jsonlib.dumps(row["variants"])
    return pl.DataFrame(rows, orient="row", schema={
        "name": pl.Utf8, "dataset": pl.Utf8, "variants": pl.Utf8, "created_at": pl.Float64,
        "results": pl.Int64})


def _corrected(store: Store, turns: Iterable[int]) -> dict[int, str]:
    """The latest corrected answer of each of the turns ``turns`` (ids) that has one."""
    rows = store.query(f"SELECT turn_id, corrected FROM labels WHERE corrected IS NOT NULL AND "
                       f"turn_id {IN_IDS} ORDER BY id", (id_list(turns),))
    return {r["turn_id"]: r["corrected"] for r in rows}


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _bootstrap(diffs: list[float], resamples: int, seed: int) -> tuple[float | None,
                                                                         float | None]:
    """Paired bootstrap 95% interval of the mean of ``diffs`` (None with fewer than 2)."""
    if len(diffs) < 2:
        return None, None
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def mcnemar_p(pairs: list[tuple[str, str]]) -> float | None:
    """McNemar's exact two-sided p on verdict pairs (first, variant), passing or not (a fail
    and an unclear verdict alike); None without pairs."""
    if not pairs:
        return None
    gained = sum(a != "pass" and b == "pass" for a, b in pairs)
    lost = sum(a == "pass" and b != "pass" for a, b in pairs)
    n = gained + lost
    if n == 0:
        return 1.0
    from math import comb

    tail = sum(comb(n, k) for k in range(0, min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
