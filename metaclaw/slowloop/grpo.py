"""GRPO on the query set (or on a task list with a programmatic reward), readable top to bottom.

One step:

1. take ``P`` prompts (query-set turns of the *current* skill generation, rendered with the
   backend's chat template, or tasks);
2. sample a group of ``G`` completions per prompt from the currently published policy, keeping
   each completion's exact tokens and sampling logprobs;
3. reward each completion (the task's programmatic reward, or the judge);
4. compute advantages within each group (``group`` / ``batch`` / ``none``); a group whose
   rewards have zero variance carries no signal and is skipped and counted, never trained;
5. build one :class:`~metaclaw.slowloop.backends.Datum` per completion (prompt tokens masked), run
   ``forward_backward`` + ``optim_step`` (``backend.train_step``), publish the new weights (a
   new policy version, handed to ``on_publish`` so a responder can hot-swap), and record the
   step in the store.

``skipped_groups`` in a step record counts zero-variance groups, groups whose reward call
failed or gave NaN / inf (``metrics.reward_failures``) and query-set groups that went stale
during the step or that another trainer's step holds (``metrics.stale_groups``).

The query turns a step trains on are claimed before its gradient step, for a while that the
step renews as it runs (:func:`metaclaw.buffers.claim_for_training`); the claim becomes a
count of trained steps on the turns when the step is recorded. A trainer killed mid-step
leaves claims that expire: its turns count as untrained again.

:class:`GRPOTrainer` holds a run between steps: its :meth:`~GRPOTrainer.step` runs exactly one
step (what the idle-gated scheduler calls in a training window) and :meth:`~GRPOTrainer.train`
loops over it, checking ``should_stop()`` at every step boundary (the scheduler's pause);
:func:`train_grpo` is that loop in one call. The state is saved so the next window resumes
where this one stopped.

Tensor-dimension naming used in names below (as in tinker-cookbook):
``P`` prompts (groups) in a step, ``G`` samples per group, ``T`` tokens of one sequence;
e.g. ``rewards_P_G`` is a list of P lists of G rewards, ``advantages_G`` one group's advantages,
``tokens_G_T`` the G sampled token lists of one group.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence

from metaclaw import buffers
from metaclaw.aio import run_sync
from metaclaw.fileio import fsync_path, write_atomic
from metaclaw.progress import ProgressFn, notify
from metaclaw.slowloop.backends import (BackendError, Datum, check_loss_fn, locate_checkpoint,
                                       render_request)

log = logging.getLogger(__name__)
ADVANTAGE_MODES = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    """Knobs of a GRPO run (defaults suit the tiny offline model; lower the learning rate for
    real models, e.g. 1e-5 .. 4e-5 on Tinker)."""

    steps: int = 20
    groups_per_step: int = 4          # P
    group_size: int = 8               # G
    max_tokens: int = 16
    temperature: float = 1.0          # must be 1.0: sampling logprobs = policy logprobs
    overlong_penalty: float = 0.0     # subtracted from a completion cut at max_tokens (DAPO)
    learning_rate: float = 1e-2
    loss_fn: str = "importance_sampling"
    advantage_norm: str = "group"     # group | batch | none
    zero_variance_eps: float = 1e-8   # a group with reward std below this is skipped
    publish_every: int = 1
    save_every: int = 10              # 0 = only when stopping / finishing / publishing
    keep_checkpoints: int = 3         # saved states kept besides the published versions' ones
    state_dir: str | None = None      # where training state is saved; enables resume
    resume: bool = True
    seed: int = 0

    def check(self) -> "GRPOConfig":
        check_loss_fn(self.loss_fn)
        if self.advantage_norm not in ADVANTAGE_MODES:
            raise ValueError(f"unknown advantage_norm {self.advantage_norm!r}; choose one of "
                             f"{', '.join(ADVANTAGE_MODES)}")
        for name in ("steps", "groups_per_step", "group_size", "max_tokens", "publish_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name} must be at least 1")
        if self.group_size < 2:
            raise ValueError("GRPOConfig.group_size must be at least 2: GRPO compares samples "
                             "within a group")
        if self.temperature != 1.0:
            # The sampler reports logprobs of softmax(logits / T); the learner computes
            # softmax(logits). Their ratio would not be the policy's importance ratio.
            raise ValueError(f"GRPOConfig.temperature must be 1.0 (got {self.temperature:g}): "
                             "the importance-sampling ratio compares the learner's logprobs "
                             "with the sampling logprobs, which are those of the policy only "
                             "at temperature 1")
        if self.overlong_penalty < 0:
            raise ValueError("GRPOConfig.overlong_penalty must be >= 0")
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            # a negative rate climbs the loss (unlearns what the rewards favour), 0 trains
            # nothing while counting steps as trained, NaN destroys the weights
            raise ValueError(f"GRPOConfig.learning_rate must be a positive number, got "
                             f"{self.learning_rate!r}")
        return self


@dataclass
class Prompt:
    """One prompt to sample a group for: its tokens, and how to reward a completion.

    ``reward`` (programmatic) takes the completion text and returns a float; when it is None
    the run's ``judge(prompt, completion_text)`` is used. ``turn_id`` / ``skill_generation``
    link a query-set prompt back to its turn; ``turn`` is that recorded turn (the judge reads
    its consequence: tool results, the next user message, a label).
    """

    tokens: list[int]
    messages: list[dict[str, Any]] | None = None
    reward: Callable[[str], float] | None = None
    turn_id: int | None = None
    skill_generation: int = 0
    turn: dict[str, Any] | None = field(default=None, repr=False)  # the recorded turn, if any


@dataclass
class Task:
    """A verifiable task: a prompt (text or chat messages) and a reward on the completion text."""

    prompt: str | list[dict[str, Any]]
    reward: Callable[[str], float]


@dataclass
class GRPOResult:
    """What a run did: steps completed, whether it stopped early and why, per-step records."""

    run_id: str
    steps_done: int
    stopped: bool
    reason: str
    policy_version: int
    history: list[dict[str, Any]] = field(default_factory=list)

    def _repr_html_(self) -> str:
        def fmt(value: Any) -> str:
            return "" if value is None else f"{value:.4g}"

        rows = "".join(
            f"<tr><td>{h['step']}</td><td>{h['policy_version']}</td><td>{fmt(h['loss'])}</td>"
            f"<td>{fmt(h['reward_mean'])}</td><td>{h['skipped_groups']}/{h['groups']}</td>"
            f"<td>{h['tokens']}</td></tr>" for h in self.history)
        status = f"stopped: {self.reason}" if self.stopped else "finished"
        return (f"<b>GRPO run {self.run_id}</b>: {self.steps_done} "
                f"step{'' if self.steps_done == 1 else 's'}, {status}, policy "
                f"version {self.policy_version}<table><tr><th>step</th><th>policy</th>"
                f"<th>loss</th><th>reward</th><th>skipped</th><th>tokens</th></tr>{rows}</table>")


# -- prompts ---------------------------------------------------------------------------------
def current_generation(store) -> int:
    """The store's latest skill generation (0 when none was recorded yet)."""
    latest = store.latest_generation()
    return 0 if latest is None else int(latest)


def select_query_turns(store, generation: int | None = None) -> list[dict[str, Any]]:
    """Query-set turns that may be trained on: ``buffer_set='query'``, ``buffer_state='live'``
    and ``skill_generation`` equal to the current generation (or ``generation``).

    Turns of older generations are stale (served with skills that no longer exist) and are
    never returned, whatever their buffer state.
    """
    gen = current_generation(store) if generation is None else int(generation)
    return store.turns("buffer_set = 'query' AND buffer_state = 'live' AND skill_generation = ?",
                       (gen,))


def prompts_from_query_set(store, backend, generation: int | None = None, *,
                           reward_for: Callable[[dict[str, Any]], Callable[[str], float] | None]
                           | None = None) -> list[Prompt]:
    """Prompts for the live query-set turns of the current generation, rendered exactly as they
    were served: :func:`metaclaw.slowloop.backends.render_request` on the recorded request (the messages
    as sent, skills injected, and the offered tools in the chat template).

    ``reward_for(turn)``: a programmatic reward for a turn's completions (e.g. the benchmark's
    graders), or None to leave the turn to the judge.
    """
    prompts = []
    for turn in select_query_turns(store, generation):
        unreadable = {"request_messages", "request_params"} & set(turn.get("malformed_columns", ()))
        if unreadable:  # not the request it was served: training on it would teach another one
            log.warning("query turn %s is not trained on: its stored %s are not valid JSON",
                        turn["id"], " and ".join(sorted(unreadable)))
            continue
        prompts.append(Prompt(tokens=render_request(backend, turn),
                              messages=turn["request_messages"],
                              reward=reward_for(turn) if reward_for is not None else None,
                              turn_id=turn["id"], skill_generation=turn["skill_generation"],
                              turn=turn))
    return prompts


def prompts_from_tasks(backend, tasks: Sequence[Task]) -> list[Prompt]:
    """Prompts for verifiable tasks (a string prompt becomes one user message)."""
    prompts = []
    for task in tasks:
        messages = ([{"role": "user", "content": task.prompt}] if isinstance(task.prompt, str)
                    else task.prompt)
        prompts.append(Prompt(tokens=backend.render_chat(messages), messages=messages,
                              reward=task.reward))
    return prompts


# -- advantages ------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def compute_advantages(rewards_P_G: Sequence[Sequence[float]], mode: str = "group",
                       eps: float = 1e-8) -> tuple[list[list[float] | None], int]:
    """Advantages per sample, computed in this one place.

    In: rewards, P groups of G floats; ``mode``:

    - ``group``: ``(r - mean_group) / std_group``
    - ``batch``: ``(r - mean_group) / std_batch`` (std of all rewards of the kept groups)
    - ``none``:  ``r - mean_group``

    (std is the population std.) A group with ``std_group < eps`` is skipped: its entry is
    ``None``. Out: ``(advantages_P_G, skipped_groups)``.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {ADVANTAGE_MODES}")
    kept = [list(map(float, g)) if len(g) > 1 and _std(g) >= eps else None
            for g in rewards_P_G]
    skipped = sum(1 for g in kept if g is None)
    batch_std = _std([r for g in kept if g is not None for r in g]) if skipped < len(kept) else 0
    advantages_P_G: list[list[float] | None] = []
    for rewards_G in kept:
        if rewards_G is None:
            advantages_P_G.append(None)
            continue
        mean = _mean(rewards_G)
        scale = {"group": _std(rewards_G), "batch": batch_std, "none": 1.0}[mode]
        advantages_P_G.append([(r - mean) / scale for r in rewards_G])
    return advantages_P_G, skipped


# -- rewards ---------------------------------------------------------------------------------
def _reward_values(prompt: Prompt, texts_G: list[str], judge) -> list[Any]:
    """One group's raw reward values (floats, or awaitables from an async judge)."""
    if prompt.reward is not None:
        return [prompt.reward(text) for text in texts_G]
    values: list[Any] = []
    try:
        for text in texts_G:
            values.append(judge(prompt, text))
    except BaseException:
        for value in values:  # never leave a started coroutine un-awaited
            if inspect.iscoroutine(value):
                value.close()
        raise
    return values


def load_reward(spec: str) -> Any:
    """The reward function ``spec`` names: ``package.module:function`` (importable) or
    ``path/to/file.py:function``; it is called as ``function(prompt, completion_text) -> float``
    (``prompt.messages``: the turn's messages, ``prompt.turn_id``: its turn). A
    :class:`ValueError` in one sentence where it cannot be found."""
    import importlib
    import importlib.util

    import sys

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"--reward {spec!r}: name it as module:function or file.py:function")
    if where.endswith(".py") and not os.path.isfile(where):
        raise ValueError(f"--reward {spec!r}: no file {where}")
    try:
        if where.endswith(".py"):  # imported as a module of its own (dataclasses need that)
            module_name = "metaclaw_reward_" + hashlib.sha256(
                os.path.abspath(where).encode()).hexdigest()[:12]
            found = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(found)  # type: ignore[arg-type]
            sys.modules[module_name] = module
            try:
                found.loader.exec_module(module)  # type: ignore[union-attr]
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
        else:
            if os.getcwd() not in sys.path:  # a module beside the user, as `python -m` finds
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except Exception as exc:  # the user's module failed to import: say why in one line
        raise ValueError(f"--reward {spec!r}: cannot load {where}: {type(exc).__name__}: "
                         f"{exc}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--reward {spec!r}: {where} has no function {name}")
    return function


def compute_rewards(batch: Sequence[Prompt], texts_P_G: Sequence[list[str]],
                    judge, errors: list[str] | None = None) -> list[list[float] | None]:
    """Rewards of a step's groups: for each prompt its programmatic reward, else ``judge``.

    In: P prompts and P lists of G completion texts; ``judge(prompt, text)`` returns a float or
    an awaitable (async judges of all groups then run concurrently on one event loop, and a
    judge with an ``aclose()`` coroutine method is closed on that loop afterwards).
    Out: ``rewards_P_G``, P lists of G finite floats, with ``None`` for a group whose reward
    call failed or gave a value that is not a finite number (a failing judge costs that group,
    never the step). ``errors``: where given, why each failed group failed, one line each.
    """
    said = errors if errors is not None else []

    def failed(exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        said.append(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)

    values_P_G: list[list[Any] | None] = []
    for prompt, texts_G in zip(batch, texts_P_G):
        try:
            values_P_G.append(_reward_values(prompt, texts_G, judge))
        except Exception as exc:
            failed(exc)
            values_P_G.append(None)

    if any(inspect.isawaitable(v) for values_G in values_P_G if values_G for v in values_G):
        async def settle_group(values_G: list[Any] | None) -> list[Any] | None:
            if values_G is None:
                return None
            try:
                return list(await asyncio.gather(*[_as_awaitable(v) for v in values_G]))
            except Exception as exc:
                failed(exc)
                return None

        async def settle_all() -> list[list[Any] | None]:
            try:
                return list(await asyncio.gather(*[settle_group(v) for v in values_P_G]))
            finally:
                aclose = getattr(judge, "aclose", None)
                if callable(aclose):
                    await aclose()

        values_P_G = run_sync(settle_all)

    rewards_P_G: list[list[float] | None] = []
    for values_G in values_P_G:
        try:
            rewards_G = None if values_G is None else [float(v) for v in values_G]
        except (TypeError, ValueError):  # a judge that answered something that is no number
            said.append(f"a reward that is not a number: {values_G!r:.80}")
            rewards_G = None
        if rewards_G is not None and not all(map(math.isfinite, rewards_G)):
            # NaN or inf (a 0/0 in a reward function, a judge answering "NaN") has no
            # advantage: kept, it read as a zero-variance group and made the step's reward
            # mean NaN or inf; it is a failed reward call
            said.append(f"a reward that is not a finite number: {rewards_G!r:.80}")
            rewards_G = None
        rewards_P_G.append(rewards_G)
    return rewards_P_G


def _raise(exc: OSError) -> None:
    raise exc


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file under ``path``, then every folder (deepest first, ``path`` last), so
    that after an OS crash or power loss the state saved there is whole, not empty or
    truncated files. Raises OSError where a file or folder cannot be read or synced."""
    for folder, _, files in os.walk(path, topdown=False, onerror=_raise):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder), directory=True)


async def _as_awaitable(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


# -- the trainer -----------------------------------------------------------------------------
class _ClaimRenewer:
    """Renews a step's claim on its turns every third of ``seconds`` while the step runs (a
    gradient step, a publish or a save may outlast one claim), in a daemon thread."""

    def __init__(self, store, claim_id: str, seconds: float):
        self.store, self.claim_id, self.seconds = store, claim_id, float(seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metaclaw-grpo-claim",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                buffers.renew_training_claim(self.store, self.claim_id, self.seconds)
            except Exception:  # a busy or closed store: the next round tries again
                log.warning("could not renew the claim of GRPO step %s", self.claim_id,
                            exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _saved_identity(saved: dict[str, Any], checkpoint: str) -> tuple[str, str] | None:
    """(backend, base model) a saved training state was made with: from ``latest.json``, or
    from the local state's own record (states saved before ``latest.json`` named them); None
    where neither says."""
    if saved.get("base_model") is not None:
        return str(saved.get("backend")), str(saved["base_model"])
    record = Path(checkpoint) / "metaclaw_state.json"
    try:
        meta = json.loads(record.read_text()) if record.is_file() else {}
    except (OSError, ValueError):
        return None
    if isinstance(meta, dict) and meta.get("base_model") is not None:
        return str(meta.get("backend")), str(meta["base_model"])
    return None


class GRPOTrainer:
    """A GRPO run that advances one step at a time and keeps its state between calls.

    In: a :class:`~metaclaw.slowloop.backends.TrainingBackend`; prompts (a list, or a callable
    re-evaluated at every step, e.g. ``lambda: prompts_from_query_set(store, backend)`` so that
    a new skill generation immediately drops stale prompts); optional ``config``, ``store``
    (steps and policy versions recorded), ``judge(prompt, completion_text) -> float`` (or an
    awaitable) for prompts without a programmatic reward, ``on_step(record)`` (live charts),
    ``on_publish(sampler, version)`` (hot-swap), ``skill_generation`` (fixed generation to
    record instead of the store's current one) and ``run_id``.

    With ``config.state_dir`` set and ``config.resume`` true, the latest saved state there
    (weights, optimizer, step counter, run id) is restored when the trainer is created.

    :meth:`step` runs one step (what a scheduler calls); :meth:`train` runs several, checking
    ``should_stop()`` at every step boundary; :meth:`save` writes the state to ``state_dir``.
    """

    def __init__(self, backend, prompts: Sequence[Prompt] | Callable[[], Sequence[Prompt]], *,
                 config: GRPOConfig | None = None, store=None,
                 judge: Callable[[Prompt, str], float | Awaitable[float]] | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_publish: Callable[[Any, int], None] | None = None,
                 skill_generation: int | None = None, run_id: str | None = None,
                 on_progress: ProgressFn | None = None):
        self.backend, self.prompts, self.store, self.judge = backend, prompts, store, judge
        self.config = (config or GRPOConfig()).check()
        self.on_step, self.on_publish = on_step, on_publish
        #: hears of the work within a step (:mod:`metaclaw.progress`): each group sampled,
        #: the rewards, the update
        self.on_progress = on_progress
        self.skill_generation = skill_generation
        # absolute: the checkpoint paths it records are read by processes started elsewhere
        self.state_dir = (Path(self.config.state_dir).expanduser().resolve()
                          if self.config.state_dir else None)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.start_step = 0
        self.history: list[dict[str, Any]] = []   # records of the steps run by this trainer
        self.claim_lease_s = buffers.TRAIN_CLAIM_S  # how long a step's claim lasts unrenewed
        self.last_reason = ""                     # why the last step() returned None
        # published versions not adopted (the reason logged once), with the checkpoint they had
        self._declined: set[tuple[int, str | None]] = set()

        # Resume: load the latest saved state of this state_dir (weights, optimizer, counters).
        if self.state_dir is not None and self.config.resume \
                and (self.state_dir / "latest.json").is_file():
            latest = self.state_dir / "latest.json"
            try:
                saved = json.loads(latest.read_text())
                checkpoint = locate_checkpoint(saved["checkpoint"], self.state_dir)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"cannot resume from {latest}: it is not a training state "
                                 f"record ({type(exc).__name__}: {exc}); remove it to start "
                                 "afresh") from None
            step = int(saved["step"])
            other = _saved_identity(saved, checkpoint)
            if other is not None and other != (backend.kind, backend.base_model):
                raise ValueError(
                    f"the training state in {self.state_dir} was saved for base model "
                    f"{other[1]} ({other[0]} backend), not {backend.base_model}: its weights "
                    "cannot continue there; train this model in a state folder of its own "
                    "(--state-dir DIR), or remove that folder to start afresh")
            try:
                backend.load_state(checkpoint)
                backend.policy_version = int(saved.get("policy_version",
                                                       backend.policy_version))
            except BackendError as exc:  # damaged or gone: the newest older state that loads
                step = self._resume_older(checkpoint, exc)
            backend.sampler().policy_version = backend.policy_version
            self.start_step, self.run_id = step + 1, saved["run_id"]
            if store is not None:
                self._forget_unsaved_steps(store)
        if store is not None:  # the store is the truth: serve its latest published version
            self.sync_with_store()
        self.next_step = self.start_step          # the number of the next step to run
        self._saved_step: int | None = self.start_step - 1 if self.start_step else None
        self._dirty_step: int | None = None       # a step whose update no saved state holds

    def _forget_unsaved_steps(self, store: Any) -> None:
        """The steps of this run recorded after its saved state (a process stopped between
        two saves: their weights went with it) are trained again under the same numbers: their
        rows go, so that each step of a run has one row (a chart showed 331, 332, 330, 331),
        and an event says which were lost. Not while another process trains the workspace
        (the steps may be its own, not yet saved)."""
        from metaclaw.training_lease import TrainingLease

        if TrainingLease.for_store(store).training_elsewhere():
            return
        with store.transaction():
            lost = store.query("SELECT COUNT(*) AS n, MIN(step) AS first, MAX(step) AS last "
                               "FROM training_steps WHERE run_id = ? AND step >= ?",
                               (self.run_id, self.start_step))[0]
            if not lost["n"]:
                return
            store.execute("DELETE FROM training_steps WHERE run_id = ? AND step >= ?",
                          (self.run_id, self.start_step))
            store.record_event(
                source="training", kind="training_steps_lost", level="warning",
                message=f"run {self.run_id}: steps {lost['first']}-{lost['last']} were recorded "
                        f"but not saved (the process stopped before its next save); their "
                        f"weights are lost and they are trained again from step "
                        f"{self.start_step}", run_id=self.run_id, first=lost["first"],
                last=lost["last"])

    def _resume_older(self, checkpoint: str, error: BackendError) -> int:
        """The latest saved state ``checkpoint`` cannot be loaded (``error``): load the newest
        older state of the folder that can (its policy version is the one it was saved with;
        the store's newer versions are adopted only where their state loads, see
        :meth:`sync_with_store`), saying which was skipped. Returns its step; re-raises
        ``error`` where none loads."""
        older = sorted((p for p in self.state_dir.glob("step-*")
                        if p.is_dir() and str(p) != str(checkpoint)
                        and (p / "metaclaw_state.json").is_file()),
                       key=lambda p: p.name, reverse=True)
        for path in older:
            try:
                self.backend.load_state(str(path))
            except BackendError:
                continue
            log.warning("cannot resume from the latest training state (%s); resumed from the "
                        "newest one that loads, %s%s", error, path,
                        "" if (path / "optimizer.pt").exists() else
                        " (an older published version's weights: the optimizer starts afresh)")
            return int(path.name.split("-")[1].split(".")[0])
        raise error

    def sync_with_store(self) -> int:
        """Make the backend's policy the store's latest published version (the store is shared
        by every process of a workspace, so it is the truth): when that version is newer than
        the backend's and its checkpoint is a saved state here, of this backend and base model,
        load it. Any other version is not adopted: one without a checkpoint (no weights to
        serve under its number), of another backend or base model, or whose saved state is
        gone or unreadable; the backend keeps its weights under their own number. Returns the
        version."""
        backend = self.backend
        rows = self.store.query("SELECT version, backend, base_model, checkpoint "
                                "FROM policy_versions ORDER BY version DESC LIMIT 1")
        if not rows or int(rows[0]["version"]) <= backend.policy_version:
            return backend.policy_version
        version, checkpoint = int(rows[0]["version"]), rows[0]["checkpoint"]
        if checkpoint:  # recorded before the workspace's folder moved: found in state_dir
            checkpoint = locate_checkpoint(checkpoint, self.state_dir, version)
        if (version, checkpoint) in self._declined:  # said once: this runs before every step
            return backend.policy_version
        if not checkpoint:  # published without saved weights (a trainer without a state_dir)
            log.warning("policy version %d has no saved weights; serving version %d", version,
                        backend.policy_version)
            self._declined.add((version, checkpoint))
            return backend.policy_version
        # Taking the number without loading its weights would label this backend's weights as
        # that version (turns recorded as served by it, the next publish built on them).
        why = None
        if (rows[0]["backend"], rows[0]["base_model"]) != (backend.kind, backend.base_model):
            why = (f"it was trained with the {rows[0]['backend']} backend on "
                   f"{rows[0]['base_model']}")
        elif not (Path(checkpoint) / "metaclaw_state.json").is_file():
            why = f"its saved state {checkpoint} is not here"
        else:
            try:
                backend.load_state(checkpoint)
            except BackendError as exc:
                why = str(exc)
        if why is not None:
            log.warning("not adopting policy version %d (%s); serving version %d", version, why,
                        backend.policy_version)
            self._declined.add((version, checkpoint))
            return backend.policy_version
        backend.policy_version = version
        backend.sampler().policy_version = version
        return version

    def _prune_checkpoints(self) -> list[str]:
        """Retention: keep the last ``keep_checkpoints`` saved states, the one ``latest.json``
        points to, and the weights of every state a published policy version points to (the
        store's ``policy_versions.checkpoint``; their optimizer state is dropped: a resume
        starts from the newest states, kept whole, and one from such an older state starts its
        optimizer afresh); delete the others. Returns the deleted paths."""
        import shutil

        if self.state_dir is None or self.config.keep_checkpoints < 1:
            return []
        saved = sorted(p for p in self.state_dir.glob("step-*") if p.is_dir())
        # by folder name: the recorded paths name the folder as its trainer saw it, which a
        # moved or copied workspace no longer is (a published version's weights are never lost)
        keep = {p.name for p in saved[-self.config.keep_checkpoints:]}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            # the state a resume starts from, whichever trainer saved it last
            latest = json.loads((self.state_dir / "latest.json").read_text())["checkpoint"]
            keep.add(Path(latest).name)
        published = set()
        if self.store is not None:
            published = {Path(r["checkpoint"]).name for r in self.store.query(
                "SELECT checkpoint FROM policy_versions WHERE checkpoint IS NOT NULL")}
        deleted = []
        for path in saved:
            if path.name in keep:
                continue
            if path.name in published:  # served from its weights alone: the optimizer's state
                # (the larger part, 2/3 of a LoRA state) is only for resuming, from the newest
                with contextlib.suppress(OSError):
                    (path / "optimizer.pt").unlink(missing_ok=True)
                continue
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(str(path))
        return deleted

    @property
    def steps_done(self) -> int:
        """Steps run by this trainer (a resumed run's earlier steps not counted)."""
        return self.next_step - self.start_step

    def generation_now(self) -> int:
        """The skill generation recorded with a step (fixed, or the store's current one)."""
        if self.skill_generation is not None:
            return int(self.skill_generation)
        return current_generation(self.store) if self.store is not None else 0

    def _claim(self, groups: list[tuple[Any, ...]],
               claim_id: str) -> tuple[set[int], list[tuple[Any, ...]]]:
        """(turn ids claimed for this step, the groups of turns that are stale or that another
        step is training on): query-set groups are claimed in the store for ``claim_id``
        (:func:`metaclaw.buffers.claim_for_training`); without a store, a group is stale when
        its turn's generation is not the one recorded now."""
        turns = [g for g in groups if g[0].turn_id is not None]  # tasks have nothing to claim
        if not turns:
            return set(), []
        if self.store is None:
            generation = self.generation_now()
            return set(), [g for g in turns if g[0].skill_generation != generation]
        claimed = buffers.claim_for_training(self.store, [g[0].turn_id for g in turns],
                                             claim_id, self.claim_lease_s)
        return claimed, [g for g in turns if g[0].turn_id not in claimed]

    def _commit_claim(self, claim_id: str, claimed: set[int],
                      metrics: dict[str, Any]) -> None:
        """Count this step on the turns of ``claimed`` it still holds a claim on (called inside
        the transaction that publishes or records the step); a turn whose claim was lost
        meanwhile (it expired and an evolution made the turn support) is named in
        ``metrics['claims_lost']``."""
        if claimed:
            lost = claimed - buffers.commit_training_claim(self.store, claim_id)
            if lost:
                metrics["claims_lost"] = sorted(lost)
                log.warning("GRPO step %s lost its claim on turns %s before it was recorded",
                            claim_id, sorted(lost))

    def save(self, step: int | None = None) -> str | None:
        """Save the training state after ``step`` (default: the last completed step) in
        ``state_dir`` and point ``latest.json`` at it; returns the checkpoint path, or None
        without a ``state_dir`` or when nothing new was trained. (A step that publishes saves
        its own state before recording the version, see :meth:`step`.)

        Each save writes a new directory (``step-NNNNNN``, or ``step-NNNNNN.K`` when that name
        is taken), never into an existing one: a published version's checkpoint keeps the
        weights it was published with, even when a run restarted afresh (``resume=False``) or
        a second trainer (another process) saves into the same folder. Writing a state, and
        pointing ``latest.json`` at it and pruning, each happen under the folder's lock, so one
        trainer never prunes a state another is writing.

        The saved files, their folder and ``latest.json`` are synced to disk (:func:`fsync_tree`,
        :func:`metaclaw.fileio.write_atomic` with ``durable``): after an OS crash or power loss
        a recorded checkpoint is never empty or truncated files. Where the state cannot be
        written or synced this raises OSError naming the folder."""
        if step is None:  # the last completed step, or a later one that trained and failed
            step = max(self.next_step - 1,
                       -1 if self._dirty_step is None else self._dirty_step)
        if self.state_dir is None or step < 0 or (step == self._saved_step
                                                   and self._dirty_step is None):
            return None  # (a step retried under a saved one's number still saves its update)
        checkpoint = self._save_state(step)
        self._point_latest(step, checkpoint, self.backend.policy_version)
        return checkpoint

    @contextlib.contextmanager
    def _writing_state(self) -> Iterator[None]:
        """The folder's lock, and an OSError that names the folder and what to do."""
        try:
            with self._state_dir_lock():
                yield
        except OSError as exc:
            raise OSError(f"cannot save the training state in {self.state_dir} "
                          f"({type(exc).__name__}: {exc}); make the folder writable, free "
                          "space there, or set state_dir to another folder") from exc

    def _save_state(self, step: int) -> str:
        """The training state after ``step`` written and synced into a new folder of
        ``state_dir``, which nothing points at yet; returns its checkpoint."""
        with self._writing_state():
            path = self._new_state_path(step)
            checkpoint = self.backend.save_state(str(path))
            if checkpoint == str(path):
                fsync_tree(path)
            else:  # a remote state (Tinker): the folder stays unused
                with contextlib.suppress(OSError):
                    path.rmdir()
        return checkpoint

    def _point_latest(self, step: int, checkpoint: str, version: int) -> None:
        """Make ``checkpoint`` the state a resumed trainer loads, as policy ``version`` (for a
        published state: the number the store recorded, also written into the state itself
        where it holds another), then prune."""
        with self._writing_state():
            state = Path(checkpoint) / "metaclaw_state.json"  # a local state names its version
            if state.is_file():
                meta = json.loads(state.read_text())
                if meta.get("policy_version") != version:
                    write_atomic(state, json.dumps({**meta, "policy_version": version}),
                                 durable=True)
            write_atomic(self.state_dir / "latest.json",
                         json.dumps({"run_id": self.run_id, "step": step,
                                     "checkpoint": checkpoint, "policy_version": version,
                                     "backend": getattr(self.backend, "kind", None),
                                     "base_model": getattr(self.backend, "base_model",
                                                           None)}),
                         durable=True)
            self._saved_step = step
            self._dirty_step = None
            self._prune_checkpoints()

    def _new_state_path(self, step: int) -> Path:
        """A directory for the state after ``step`` that did not exist (created here)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:06d}"
        for k in itertools.count():
            path = self.state_dir / (name if k == 0 else f"{name}.{k}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
        raise AssertionError("unreachable")

    def _state_dir_lock(self) -> Any:
        """An exclusive lock on ``state_dir`` across processes (released by the OS if the
        process dies), to hold in a ``with`` block."""
        from filelock import FileLock

        self.state_dir.mkdir(parents=True, exist_ok=True)
        return FileLock(self.state_dir / ".lock")

    def step(self) -> dict[str, Any] | None:
        """Run one GRPO step. Out: the step's record (also stored and handed to ``on_step``),
        or None when there is nothing to train (no prompts; :attr:`last_reason` says why)."""
        config, backend, store = self.config, self.backend, self.store
        step = self.next_step
        t0 = time.perf_counter()
        if store is not None:  # another process may have trained and published meanwhile
            version = backend.policy_version
            if self.sync_with_store() != version and self.on_publish is not None:
                self.on_publish(backend.sampler(), backend.policy_version)
        pool = list(self.prompts() if callable(self.prompts) else self.prompts)
        if not pool:
            self.last_reason = "no prompts (no live query-set turns of the current generation)"
            return None
        gen = self.generation_now()
        sampler = backend.sampler()
        sampling_version = sampler.policy_version

        # 1. Choose this step's P prompts (deterministic round robin).
        P = config.groups_per_step
        batch = [pool[(step * P + i) % len(pool)] for i in range(min(P, len(pool)))]
        if self.judge is None and any(prompt.reward is None for prompt in batch):
            raise ValueError("these prompts have no programmatic reward; pass judge=... (a "
                             "callable (prompt, completion_text) -> float, e.g. the PRM judge)")

        # 2. Sample a group of G per prompt from the published policy.
        seeds_P = [config.seed * 1_000_003 + step * 1_000 + i for i in range(len(batch))]
        task, phases = f"training step {step}", len(batch) + 2  # groups, rewards, update
        notify(self.on_progress, task, 0, phases, f"sampling {len(batch)} groups of "
               f"{config.group_size}")
        if hasattr(sampler, "sample_many"):  # remote samplers: all groups in flight at once
            samples_P_G = sampler.sample_many([p.tokens for p in batch], config.group_size,
                                              config.max_tokens, config.temperature, seeds_P)
        else:
            samples_P_G = []
            for i, (p, seed) in enumerate(zip(batch, seeds_P)):
                samples_P_G.append(sampler.sample(p.tokens, n=config.group_size,
                                                  max_tokens=config.max_tokens,
                                                  temperature=config.temperature, seed=seed))
                notify(self.on_progress, task, i + 1, phases, f"sampled group {i + 1}")

        # 3. Reward each sample (a failing reward call costs its group, never the run).
        notify(self.on_progress, task, len(batch), phases, "rewarding the samples")
        as_text = getattr(backend, "reward_text", backend.decode)  # special tokens visible
        texts_P_G = [[as_text(s.tokens) for s in samples_G] for samples_G in samples_P_G]
        reward_errors: list[str] = []
        rewarded_P_G = compute_rewards(batch, texts_P_G, self.judge, reward_errors)
        notify(self.on_progress, task, len(batch) + 1, phases, "updating the weights")
        reward_failures = sum(1 for rewards_G in rewarded_P_G if rewards_G is None)
        if reward_failures:
            said = (f"training step {step}: the reward of {reward_failures} of {len(batch)} "
                    f"groups failed, so they do not train: "
                    f"{reward_errors[0] if reward_errors else 'no reason given'}")
            log.warning("%s", said)
            if store is not None:
                with contextlib.suppress(Exception):  # the step goes on; the log holds it
                    store.record_event(source="slowloop", kind="reward_failed", level="error",
                                       message=said, groups=reward_failures, step=step)
        if config.overlong_penalty:  # a completion cut at max_tokens never finished its answer
            rewarded_P_G = [None if rewards_G is None else
                            [r - (config.overlong_penalty if s.stop_reason != "stop" else 0.0)
                             for r, s in zip(rewards_G, samples_G)]
                            for rewards_G, samples_G in zip(rewarded_P_G, samples_P_G)]
        groups = [(prompt, samples_G, rewards_G) for prompt, samples_G, rewards_G
                  in zip(batch, samples_P_G, rewarded_P_G) if rewards_G is not None]

        # 4. Advantages within each group; zero-variance groups are skipped and counted.
        rewards_P_G = [rewards_G for _, _, rewards_G in groups]
        advantages_P_G, skipped = compute_advantages(rewards_P_G, config.advantage_norm,
                                                     config.zero_variance_eps)

        # A new skill generation may have arrived while sampling and judging: the query turns
        # it made stale (or turned into support) must not be trained. Claiming the turns checks
        # that and claims them in one transaction, so an evolution landing after this point
        # keeps them in the query set (see buffers.claim_for_training). The claim expires
        # unless renewed, and becomes a count of trained steps only when the step is recorded
        # (or its weights published): if this process dies first, its turns count as
        # untrained again, as they are, and may still become support.
        claim_id = buffers.new_claim_id(f"{self.run_id}/{step}")
        claimed, stale = self._claim([g for g, advantages_G in zip(groups, advantages_P_G)
                                      if advantages_G is not None], claim_id)
        renewer = _ClaimRenewer(store, claim_id, self.claim_lease_s) if claimed else None
        trained = None
        try:
            if stale:
                groups = [g for g in groups if all(g is not s for s in stale)]
                rewards_P_G = [rewards_G for _, _, rewards_G in groups]
                advantages_P_G, skipped = compute_advantages(rewards_P_G, config.advantage_norm,
                                                             config.zero_variance_eps)
            zero_variance = [{"turn_id": prompt.turn_id, "reward": rewards_G[0],
                              "reason": f"all {len(rewards_G)} samples rewarded "
                                        f"{rewards_G[0]:g}: no completion did better or worse "
                                        "than another"}
                             for (prompt, _, rewards_G), advantages_G
                             in zip(groups, advantages_P_G) if advantages_G is None]

            # 5. One datum per sampled completion: exact sampled tokens and sampling logprobs.
            datums = [Datum.from_sample(prompt.tokens, s.tokens, s.logprobs, a)
                      for (prompt, samples_G, _), advantages_G in zip(groups, advantages_P_G)
                      if advantages_G is not None
                      for s, a in zip(samples_G, advantages_G) if s.tokens]
            trained = backend.train_step(datums, config.loss_fn, config.learning_rate) \
                if datums else None
            if trained is not None:  # weights no saved state holds yet: save() writes them,
                self._dirty_step = step  # also where the step then fails (close() saves)
            loss, metrics = None, {"reward_failures": reward_failures,
                                   "reward_errors": list(dict.fromkeys(reward_errors))[:3],
                                   "stale_groups": len(stale),
                                   "zero_variance_groups": len(zero_variance),
                                   "zero_variance": zero_variance}
            if trained is not None:
                loss = trained.get("loss")
                metrics.update({k: v for k, v in trained.items() if k != "loss"})
            elif claimed:  # nothing was trained: the turns may still become support
                buffers.release_training_claim(store, claim_id)
                claimed = set()

            # 6. Publish the new weights (a new policy version) and hand them to the server.
            published = None
            if datums and (step + 1 - self.start_step) % config.publish_every == 0:
                published = backend.publish(backend.policy_version + 1)
                if store is not None:
                    # The weights are saved before their version is recorded, and become the
                    # state to resume from only after, under the number recorded: a process
                    # killed in between resumes the state before and its claim expires (the
                    # turns are trained again), never a version without weights, nor turns
                    # counted as trained into weights that were lost.
                    saved = self._save_state(step) if self.state_dir is not None else None
                    with store.transaction():  # the published weights trained on the turns
                        recorded = store.add_policy_version(
                            backend=backend.kind, base_model=backend.base_model,
                            skill_generation=gen,
                            checkpoint=getattr(backend, "last_sampler_path", None) or saved,
                            run_id=self.run_id, step=step)
                        self._commit_claim(claim_id, claimed, metrics)
                    claimed = set()  # counted: nothing left to give back
                    if recorded != published:  # another writer added a version meanwhile
                        backend.policy_version = recorded
                        backend.sampler().policy_version = recorded
                        published = recorded
                    if saved is not None:
                        self._point_latest(step, saved, published)
                if self.on_publish is not None:
                    self.on_publish(backend.sampler(), published)

            # 7. Record the step.
            all_rewards = [r for rewards_G in rewards_P_G for r in rewards_G]
            tokens = sum(d.n_completion_tokens for d in datums)
            wall = time.perf_counter() - t0
            metrics.update({"published_version": published, "tokens_per_s": tokens / wall,
                            "samples": sum(len(s) for _, s, _ in groups)})
            record = {
                "run_id": self.run_id, "step": step, "backend": backend.kind,
                "policy_version": sampling_version, "skill_generation": gen, "loss": loss,
                # no reward observed (every reward call failed): none, not a 0 on the chart
                "reward_mean": _mean(all_rewards) if all_rewards else None,
                "reward_std": _std(all_rewards) if all_rewards else None,
                "groups": len(batch), "skipped_groups": skipped + reward_failures + len(stale),
                "tokens": tokens, "wall_time_s": wall, "metrics": metrics,
            }
            if store is not None:
                with store.transaction():  # the step counts on its turns when it is recorded
                    self._commit_claim(claim_id, claimed, metrics)
                    store.record_training_step(**record)
                claimed = set()
            self.history.append(record)
            notify(self.on_progress, task, phases, phases, "done")
            try:
                if self.on_step is not None:
                    self.on_step(record)
            finally:  # counted as done only now: whoever polls steps_done sees the new policy
                self.next_step = step + 1  # already served and the step's listeners called
        except BaseException:
            if claimed and trained is None:  # nothing was trained: may still become support
                buffers.release_training_claim(store, claim_id)
            elif claimed:  # the weights of this process did train on the turns: count it
                try:
                    self._commit_claim(claim_id, claimed, {})
                except Exception:  # the store failed too: the claim expires; raise the first
                    log.exception("could not count GRPO step %s on its turns", claim_id)
            raise
        finally:
            if renewer is not None:
                renewer.stop()
        if config.save_every and (step + 1) % config.save_every == 0:
            self.save()
        return record

    def train(self, steps: int | None = None,
              should_stop: Callable[[], bool] | None = None) -> GRPOResult:
        """Run up to ``steps`` steps (default ``config.steps``), checking ``should_stop()`` at
        every step boundary (the scheduler's pause); stops early when there is nothing to train.
        The state is saved at the end so the next run resumes where this one stopped.
        Out: a :class:`GRPOResult` of the steps run by this call."""
        steps = self.config.steps if steps is None else int(steps)
        first = len(self.history)
        stopped, reason = False, "finished"
        for _ in range(steps):
            if should_stop is not None and should_stop():  # 0. Step boundary.
                stopped, reason = True, "paused"
                break
            if self.step() is None:
                stopped, reason = True, self.last_reason
                break
        self.save()
        history = self.history[first:]
        return GRPOResult(run_id=self.run_id, steps_done=len(history), stopped=stopped,
                          reason=reason, policy_version=self.backend.policy_version,
                          history=history)


def train_grpo(backend, prompts: Sequence[Prompt] | Callable[[], Sequence[Prompt]], *,
               config: GRPOConfig | None = None, store=None,
               judge: Callable[[Prompt, str], float | Awaitable[float]] | None = None,
               should_stop: Callable[[], bool] | None = None,
               on_step: Callable[[dict[str, Any]], None] | None = None,
               on_publish: Callable[[Any, int], None] | None = None,
               skill_generation: int | None = None, run_id: str | None = None) -> GRPOResult:
    """Run GRPO with ``backend`` on ``prompts`` for ``config.steps`` steps.

    In: as :class:`GRPOTrainer`, plus ``should_stop`` (checked at each step boundary).
    Out: a :class:`GRPOResult`. Equivalent to
    ``GRPOTrainer(backend, prompts, ...).train(config.steps, should_stop)``, holding the
    workspace's training lease when ``store`` is given (one trainer per workspace, see
    :mod:`metaclaw.training_lease`; :class:`~metaclaw.training_lease.TrainingBusy` names the
    process that trains it now): another process's trainer takes the claims it finds under the
    lease for a dead trainer's.
    """
    from metaclaw.training_lease import TrainingLease

    trainer = GRPOTrainer(backend, prompts, config=config, store=store, judge=judge,
                          on_step=on_step, on_publish=on_publish,
                          skill_generation=skill_generation, run_id=run_id)
    if store is None:
        return trainer.train(should_stop=should_stop)
    with TrainingLease.for_store(store).holding("GRPO training (train_grpo)"):
        return trainer.train(should_stop=should_stop)


__all__ = ["ADVANTAGE_MODES", "GRPOConfig", "GRPOResult", "GRPOTrainer", "Prompt", "Task",
           "compute_advantages", "compute_rewards", "current_generation", "load_reward",
           "prompts_from_query_set", "prompts_from_tasks", "select_query_turns", "train_grpo"]
