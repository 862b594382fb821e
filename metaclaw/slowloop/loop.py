"""The slow loop: GRPO on the query set while the user is away, served hot-swapped.

:class:`SlowLoop` wires the parts of opportunistic policy optimization together:

- **data**: the prompts of every step are the live query-set turns of the *current* skill
  generation (:func:`metaclaw.slowloop.grpo.prompts_from_query_set`), re-read at every step, so a new
  skill generation immediately stops older query data from being trained;
- **reward**: the PRM judge (a :class:`metaclaw.fastloop.judge.Judge`; each completion is scored as a
  turn ``{request_messages: the prompt's messages, response: the completion}``, tool calls
  parsed out of the completion) or any callable ``(prompt, completion_text) -> float``;
- **training**: a :class:`metaclaw.slowloop.grpo.GRPOTrainer` on a training backend, one step at a time,
  its state (weights, optimizer, step counter) kept between steps and, with a ``state_dir``,
  saved so that a later process resumes it;
- **serving**: with a proxy, a :class:`metaclaw.slowloop.policy.PolicyResponder` answers the proxy's chat
  requests from the current policy and every publish hot-swaps it (in-flight requests finish on
  the old weights, new requests get the new ones, turns record their policy version);
- **when**: the idle-gated :class:`metaclaw.slowloop.scheduler.Scheduler` calls :meth:`SlowLoop.step`
  in a background thread only inside a training window and pauses at a step boundary when the
  user returns, unless training is forced (:meth:`SlowLoop.train_now`, ``start(now=True)``).

Example::

    backend = make_backend("local", "/path/to/model")
    loop = SlowLoop(store, backend, judge=judge, proxy=proxy, state_dir=".metaclaw/train")
    loop.start()                  # background: trains in idle windows, returns at once
    loop.status()                 # policy version, query turns, scheduler state ...
    loop.train_now(steps=5)       # or: train right now, blocking
"""

from __future__ import annotations

import dataclasses
import html
import logging
import threading
import time
from typing import Any, Callable

from metaclaw import buffers
from metaclaw.buffers import message_text
from metaclaw.progress import ProgressFn
from metaclaw.slowloop.grpo import (GRPOConfig, GRPOResult, GRPOTrainer, Prompt, current_generation,
                                    prompts_from_query_set, select_query_turns)
from metaclaw.training_lease import TrainingLease

log = logging.getLogger("metaclaw.slowloop")

Reward = Callable[[Prompt, str], Any]


def nothing_to_train(store) -> str | None:
    """Why training now would find nothing to train (no live query-set turns of the current
    skill generation), said before a model loads; None when there is something."""
    from metaclaw.slowloop.grpo import select_query_turns

    buffers.refresh(store)  # as each step does before it reads the query set
    if select_query_turns(store):
        return None
    return ("nothing to train: no live query-set turns of the current skill generation; serve "
            "turns through the proxy first (metaclaw buffers shows the query set)")


def turn_evidence(store, turn: dict[str, Any] | None) -> str | None:
    """The recorded consequence of a served turn, as the judge's evidence: the results of its
    tool calls and the user's next message (both read from the session's next turns), and an
    explicit label when the turn has one. None when nothing is known yet."""
    from metaclaw.fastloop.judge import next_user_message

    if store is None or not turn or turn.get("id") is None:
        return None
    later = store.turns("session_id = ? AND id > ? AND turn_type = ?",  # its thread's next turns
                        (turn.get("session_id"), turn["id"], turn.get("turn_type") or "main"))
    parts = []
    n_sent = len(turn.get("request_messages") or [])
    if later:  # tool results of this turn's calls: the tool messages right after its context
        for message in (later[0].get("request_messages") or [])[n_sent:]:
            if isinstance(message, dict) and message.get("role") == "tool":
                parts.append("Tool result of the served reply: "
                             + message_text(message.get("content"))[:1500])
    feedback = next_user_message(turn, later)
    if feedback:
        parts.append("The user's next message after the served reply: " + feedback)
    label = turn.get("human_label")  # a person's verdict (metaclaw.fastloop.labels), with their note
    if label in ("pass", "fail"):
        note = (store.query("SELECT note, corrected FROM labels WHERE turn_id = ? ORDER BY id "
                            "DESC LIMIT 1", (turn["id"],)) or [{}])[0]
        parts.append(f"A person labelled the served reply: {label}"
                     + (f" ({note['note']})" if note.get("note") else "")
                     + (f"; the corrected answer: {note['corrected'][:1500]}"
                        if note.get("corrected") else ""))
    return "\n".join(parts) or None


class JudgeReward:
    """Adapter: a :class:`metaclaw.fastloop.judge.Judge` as a GRPO reward ``(prompt, text) -> score``.

    The completion is judged as a turn with the prompt's messages and the completion as the
    reply (``<tool_call>`` blocks become the reply's tool calls), with the evidence the PRM
    uses: the served turn's recorded consequence (:func:`turn_evidence`: tool results, the
    user's next message, an explicit label) in the judge's feedback section. Calls return
    coroutines, so the GRPO step judges all samples of all groups concurrently; a completion
    the judge cannot score (every vote failed) raises, which costs its group, never the step.
    """

    def __init__(self, judge: Any, store: Any = None):
        self.judge = judge
        self.store = store
        self._evidence: dict[int, str | None] = {}

    def new_step(self) -> None:
        """Forget the evidence read for the last step: a query turn is trained again in later
        steps, and by then its consequence (the user's next message, a tool result, a label)
        may have been recorded."""
        self._evidence.clear()

    def evidence(self, prompt: Prompt) -> str | None:
        if prompt.turn_id is None:
            return None
        if prompt.turn_id not in self._evidence:
            self._evidence[prompt.turn_id] = turn_evidence(self.store, prompt.turn)
        return self._evidence[prompt.turn_id]

    async def __call__(self, prompt: Prompt, text: str) -> float:
        from metaclaw.slowloop.policy import parse_tool_calls

        content, calls = parse_tool_calls(text)
        turn = {"request_messages": prompt.messages or [], "response": content,
                "tool_calls": calls or None}
        result = await self.judge.ajudge(turn, next_user=self.evidence(prompt))
        if result.score is None:
            raise RuntimeError(result.error or "the judge gave no score")
        return float(result.score)

    async def aclose(self) -> None:
        """Close the judge's HTTP client of the running event loop (called by the GRPO step)."""
        await self.judge.aclose()

    def __repr__(self) -> str:
        return f"JudgeReward({self.judge!r})"


def as_reward(judge: Any, store: Any = None) -> Reward | None:
    """The GRPO reward for ``judge``: a :class:`~metaclaw.fastloop.judge.Judge` (anything with
    ``ajudge``) is wrapped in :class:`JudgeReward`, a callable ``(prompt, text) -> float`` is
    used as it is, None stays None. Anything else raises TypeError."""
    if judge is None:
        return None
    if callable(getattr(judge, "ajudge", None)):
        return JudgeReward(judge, store)
    if callable(judge):
        return judge
    raise TypeError(f"judge must be a metaclaw.fastloop.judge.Judge or a callable (prompt, "
                    f"completion_text) -> float, not {type(judge).__name__}")


class SlowLoop:
    """GRPO on the query set, gated by the idle scheduler, served through a hot-swapped policy.

    In:

    - ``store``: the workspace :class:`~metaclaw.store.Store` (query set in, steps, policy
      versions and scheduler transitions out);
    - ``backend``: a training backend (:func:`metaclaw.slowloop.backends.make_backend`);
    - ``config``: a :class:`~metaclaw.slowloop.grpo.GRPOConfig` (its ``steps`` is only the default of
      :meth:`train_now`);
    - ``judge``: a :class:`~metaclaw.fastloop.judge.Judge` or a callable ``(prompt, text) -> float``;
      needed to train (the query set has no programmatic reward);
    - ``proxy``: a :class:`~metaclaw.proxy.app.Proxy`; with ``serve=True`` its chat requests are
      answered from the trained policy (a :class:`~metaclaw.slowloop.policy.PolicyResponder` set with
      ``proxy.set_responder``) and every publish hot-swaps it;
    - ``scheduler_config``: the :func:`metaclaw.slowloop.scheduler.from_config` dict used by
      :meth:`start` (default: :func:`metaclaw.slowloop.scheduler.load_config` ``(None)``);
    - ``state_dir``: where training state is saved and resumed from (overrides
      ``config.state_dir``);
    - ``clock``: the scheduler's clock (epoch seconds; injectable for tests);
    - ``reward_for``: ``turn -> reward(text)`` or None: a programmatic reward for a query
      turn's completions (the benchmark's graders); turns without one go to the judge.

    Creating a SlowLoop restores the latest state saved in ``state_dir``. Attributes:
    ``trainer`` (the :class:`~metaclaw.slowloop.grpo.GRPOTrainer`), ``responder`` (or None),
    ``scheduler`` (the last one :meth:`start` built, or None), ``lease`` (the workspace's
    :class:`~metaclaw.training_lease.TrainingLease`).

    One process trains a workspace at a time: every step, forced run and scheduled training
    run holds the workspace's training lease. Another process's scheduler waits for it; its
    :meth:`step` and :meth:`train_now` raise :class:`~metaclaw.training_lease.TrainingBusy`
    naming the holder. Each step first adopts the policy another process published meanwhile
    (:meth:`~metaclaw.slowloop.grpo.GRPOTrainer.sync_with_store`), so training continues from it.
    """

    def __init__(self, store, backend, *, config: GRPOConfig | None = None, judge: Any = None,
                 proxy: Any = None, serve: bool = True,
                 scheduler_config: dict[str, Any] | None = None, state_dir: Any = None,
                 clock: Callable[[], Any] = time.time,
                 reward_for: Callable[[dict[str, Any]], Any] | None = None):
        config = dataclasses.replace(config or GRPOConfig())
        if state_dir is not None:
            config.state_dir = str(state_dir)
        self.store, self.backend, self.config = store, backend, config.check()
        self.judge = judge
        self.reward = as_reward(judge, store)
        self.reward_for = reward_for
        self.proxy = proxy
        self.scheduler_config = scheduler_config
        self.clock = clock
        self.scheduler: Any = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._step_lock = threading.Lock()   # one step at a time, whoever calls
        self.lease = TrainingLease.for_store(store)  # one process at a time, whoever it is
        self.trainer = GRPOTrainer(backend, self.prompts, config=config, store=store,
                                   judge=self.reward, on_step=self._on_step,
                                   on_publish=self._on_publish)
        self.responder: Any = None
        if proxy is not None and serve:
            from metaclaw.slowloop.policy import PolicyResponder

            self.responder = PolicyResponder(backend)  # after the resume: the restored policy
            proxy.set_responder(self.responder)

    # -- data ---------------------------------------------------------------------------------
    def prompts(self) -> list[Prompt]:
        """This step's prompt pool: the live query-set turns of the current skill generation.

        The buffers are brought up to date first (:func:`metaclaw.buffers.refresh`): turns
        recorded unclassified (by another program, or before the proxy classified what it
        records) would otherwise never train, and live turns of a generation another process
        replaced are purged rather than shown live."""
        buffers.refresh(self.store)
        if isinstance(self.reward, JudgeReward):
            self.reward.new_step()
        return prompts_from_query_set(self.store, self.backend, reward_for=self.reward_for)

    def _release_orphaned_claims(self) -> None:
        """Under the lease: drop the claims a trainer killed mid-step left behind."""
        dropped = buffers.release_orphaned_claims(self.store)
        if dropped:
            self.store.record_event(
                source="slowloop", kind="training_claims_released", level="warning",
                message=f"released the training claims on {dropped} turns left by a trainer "
                        "that stopped mid-step; they count as untrained", turns=dropped)

    # -- hooks --------------------------------------------------------------------------------
    def add_step_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` after every training step (in the training thread; errors are
        logged, never stop training). ``record`` is the step's ``training_steps`` row as a dict:
        ``run_id, step, policy_version, skill_generation, loss, reward_mean, reward_std, groups,
        skipped_groups, tokens, wall_time_s, metrics``."""
        self._listeners.append(fn)

    def set_progress(self, fn: ProgressFn | None) -> None:
        """Hand ``fn`` the work within each training step (:mod:`metaclaw.progress`): the
        groups sampled, the rewards, the update (called in the training thread)."""
        self.trainer.on_progress = fn

    def remove_step_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _on_step(self, record: dict[str, Any]) -> None:
        for fn in list(self._listeners):
            try:
                fn(record)
            except Exception:
                log.exception("step listener %r failed at step %s", fn, record.get("step"))

    def _on_publish(self, sampler: Any, version: int) -> None:
        if self.responder is not None:
            self.responder.swap(sampler, version)

    # -- training -----------------------------------------------------------------------------
    def _need_judge(self) -> None:
        if self.reward is None:
            raise ValueError("the slow loop needs a reward for the query set: pass judge=... "
                             "(a metaclaw.fastloop.judge.Judge or a callable (prompt, text) -> float)")

    def step(self) -> dict[str, Any] | bool:
        """Run one GRPO step now (what the scheduler calls in a training window).

        Out: the step's record, or ``False`` when there is nothing to train (no live query-set
        turn of the current generation). The training state always stays in memory for the
        next window; with a ``state_dir`` it is also saved when the scheduler asks to pause,
        when its step budget is used up, when there is nothing to train, every
        ``config.save_every`` steps, and by :meth:`stop`.
        """
        self._need_judge()
        with self._step_lock, self.lease.holding("a training step"):
            self._release_orphaned_claims()
            record = self.trainer.step()
            scheduler = self.scheduler
            boundary = scheduler is not None and (
                scheduler.should_stop() or (scheduler.max_steps is not None
                                            and scheduler.steps + 1 >= scheduler.max_steps))
            if record is None or boundary:
                self.trainer.save()
        return False if record is None else record

    def train_now(self, steps: int | None = None,
                  on_step: Callable[[dict[str, Any]], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> GRPOResult:
        """Train right now, ignoring the idle signals (forced), and block until done.

        In: ``steps`` (default ``config.steps``), ``on_step(record)`` for this call only,
        ``should_stop()`` checked at each step boundary. Stops early when there is nothing to
        train. Out: a :class:`~metaclaw.slowloop.grpo.GRPOResult` of this call's steps.
        Raises RuntimeError while the scheduler is training in the background, and
        :class:`~metaclaw.training_lease.TrainingBusy` while another process trains this
        workspace.
        """
        self._need_judge()
        if self.scheduler is not None and self.scheduler.state in ("training", "pausing"):
            raise RuntimeError("training is already running in the background; call stop() "
                               "first, or use start(now=True)")
        if on_step is not None:
            self.add_step_listener(on_step)
        try:
            with self._step_lock, self.lease.holding("forced training"):
                self._release_orphaned_claims()
                return self.trainer.train(steps, should_stop)
        finally:
            if on_step is not None:
                self.remove_step_listener(on_step)

    def start(self, now: bool = False, steps: int | None = None, poll_s: float = 5.0):
        """Train in the background whenever the scheduler opens a training window; returns the
        :class:`~metaclaw.slowloop.scheduler.Scheduler` at once (also kept as :attr:`scheduler`).

        ``now``: train immediately regardless of the signals until ``steps`` (default
        ``config.steps``) are done or there is nothing to train. ``steps``: the step budget of
        this scheduler (None without ``now`` = no limit: every window trains until the user
        returns). ``poll_s``: seconds between signal readings.
        """
        from metaclaw.slowloop.scheduler.machine import from_config, load_config

        self._need_judge()
        if self.scheduler is not None:
            if self.scheduler.status(last=0)["running"]:
                raise RuntimeError("the slow loop is already running; call stop() first")
            self.scheduler.close()  # release the previous scheduler's signals
        overrides: dict[str, Any] = {}
        if now:
            overrides["force"] = True
            steps = self.config.steps if steps is None else steps
        if steps is not None:
            overrides["max_steps"] = steps
        config = self.scheduler_config if self.scheduler_config is not None else load_config(None)
        self.scheduler = from_config(config, train_step=self.step, store=self.store,
                                     clock=self.clock, lease=self.lease, **overrides)
        self.scheduler.step_number = lambda: self.trainer.next_step
        self.scheduler.run(poll_s)
        return self.scheduler

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the scheduler: a running step finishes, training pauses at that step boundary
        and its state is saved; serving from the trained policy continues."""
        if self.scheduler is not None:
            self.scheduler.stop(timeout)
        with self._step_lock:
            self.trainer.save()

    def close(self) -> str | None:
        """:meth:`stop`, release the scheduler's signals, save what the trainer has not saved
        yet, and hand the proxy back to its upstream (the responder is removed and closed).
        Returns the checkpoint saved now (None: nothing was left to save)."""
        if self.scheduler is not None:
            self.scheduler.close()
        with self._step_lock:
            saved = self.trainer.save()
        if self.responder is not None:
            if self.proxy is not None and getattr(self.proxy, "responder", None) is self.responder:
                self.proxy.set_responder(None)
            self.responder.close()
        return saved

    # -- views --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What the slow loop is doing, as a plain dict.

        Keys: ``policy_version`` (latest published), ``serving_version`` (what the proxy serves
        new requests with, None when not serving), ``backend``, ``base_model``, ``run_id``,
        ``steps_done`` (steps of this process), ``next_step``, ``skill_generation``,
        ``query_turns`` (live query turns of the current generation), ``last_step`` (the last
        step record or None), ``nothing_to_train`` (why the last step found no prompts, or
        ""), ``state_dir``, ``scheduler`` (its ``status()`` or None).
        """
        trainer = self.trainer
        return {
            "policy_version": self.backend.policy_version,
            "serving_version": None if self.responder is None else self.responder.policy_version,
            "backend": self.backend.kind,
            "base_model": self.backend.base_model,
            "run_id": trainer.run_id,
            "steps_done": trainer.steps_done,
            "next_step": trainer.next_step,
            "skill_generation": current_generation(self.store),
            "query_turns": len(select_query_turns(self.store)),
            "last_step": trainer.history[-1] if trainer.history else None,
            "nothing_to_train": trainer.last_reason,
            "state_dir": self.config.state_dir,
            "scheduler": None if self.scheduler is None else self.scheduler.status(last=5),
        }

    def _repr_html_(self) -> str:
        s = self.status()
        last = s["last_step"]
        last_text = "no step yet" if last is None else (
            f"step {last['step']}: reward "
            f"{'-' if last['reward_mean'] is None else format(last['reward_mean'], '.3f')}, loss "
            f"{'' if last['loss'] is None else format(last['loss'], '.4g')}, skipped "
            f"{last['skipped_groups']}/{last['groups']}, {last['tokens']} tokens")
        scheduler = s["scheduler"]
        sched_text = "not started" if scheduler is None else (
            f"{scheduler['state']} ({html.escape(scheduler['reason'])})")
        serving = ("not serving" if s["serving_version"] is None
                   else f"serving policy version {s['serving_version']}")
        rows = [("backend", f"{s['backend']} · {html.escape(str(s['base_model']))}"),
                ("policy", f"version {s['policy_version']} · {serving}"),
                ("run", f"{s['run_id']} · {s['steps_done']} steps here, next step "
                        f"{s['next_step']}"),
                ("query set", f"{s['query_turns']} live turns of skill generation "
                              f"{s['skill_generation']}"),
                ("last step", html.escape(last_text)),
                ("scheduler", sched_text)]
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>"
                       for k, v in rows)
        return f"<div><b>Slow loop</b><table>{body}</table></div>"

    def __repr__(self) -> str:
        return (f"SlowLoop(backend={self.backend.kind!r}, policy_version="
                f"{self.backend.policy_version}, steps_done={self.trainer.steps_done})")


__all__ = ["JudgeReward", "SlowLoop", "as_reward"]
