"""The fast loop: judge new turns in the background, keep the buffers, evolve the skills.

    loop = FastLoop(store, library, judge, evolver, every_n=5).attach(proxy)   # starts it
    ...                                  # the agent talks through the proxy
    loop.events                          # what happened (also: loop.on_event(callback))
    loop.evolve_now()                    # manual trigger
    loop.stop()

How it works. :meth:`FastLoop.attach` registers :meth:`FastLoop.submit` as a turn listener of a
:class:`~metaclaw.proxy.app.Proxy`; the work runs on the loop's own event loop in a background thread,
never on the proxy's. For each recorded turn:

1. a successful task turn (``main`` or ``stage:<name>``) enters the buffers as ``query / live``
   (see :mod:`metaclaw.buffers`);
2. it is judged once its feedback is known: when the next turn of its thread (same session, same
   turn type: a stage's retry follows that stage, not the next stage) arrives (its new user
   message is the feedback), when the session is marked done (``X-Session-Done``), or after
   ``feedback_wait`` seconds without a next turn. All votes run concurrently;
3. the verdict makes a failure (``reward < judge.threshold``) of the current generation part of
   the next evolution's evidence (the support set); it stays ``query / live`` until a new
   generation consumes it (:mod:`metaclaw.buffers`, rule 2);
4. the evolver is triggered when a session reaches a multiple of ``every_n`` judged turns, when a
   session ends (``on_session_end``: marked done, or, holding judged failures, idle for
   ``feedback_wait`` seconds, seen at a sweep), or when the failure rate of the current
   generation's judged turns exceeds ``failure_rate`` (once at least ``min_judged`` turns are
   judged). An automatic
   trigger runs only when the support set holds failures the previous attempt did not see, so
   a "no change" answer is not asked for again and again;
5. on this automatic path the evolver's candidate goes live only through the verification gate
   (:mod:`metaclaw.fastloop.gate`): a safety check, then a replay of its failures and of recent successes
   with and without it, judged. Promoted, it becomes a generation marked ``automatic`` (its
   evidence on file in ``proposals``, undone by :func:`metaclaw.fastloop.proposals.revert`); held back, it
   is stored as a proposal for review (:mod:`metaclaw.fastloop.proposals`). Without a ``gate`` every
   automatic candidate is held back. A manual :meth:`FastLoop.evolve_now` applies directly;
6. a new generation marks the support turns that produced it ``consumed`` and purges older query
   turns, on this automatic path exactly as on the manual one. Any other change of the library
   (a manual edit, a rollback) purges the older live turns as well;
7. with ``auto_keys``, skills that have no retrieval keys (an imported folder, a hand-written
   skill) get them from the evolver model (:mod:`metaclaw.fastloop.keys`), as one generation of
   kind ``keys``: without keys a skill reaches far fewer of the asks that need it. The keys only
   decide which asks retrieve a skill, not what it says, so no gate replays them. Like any
   change of the library, that generation purges the older live turns, so it is made only
   while there are none: right after any other change of the library (an import, a hand edit,
   an evolution: each starts a generation with none) and at a sweep that finds none, a batch
   of ``KEYS_BATCH`` skills a generation while none appears; a turn recorded during the keys
   requests (seconds, minutes for a slow evolver) is purged. Skills a held proposal edits wait
   for its review. A skill whose keys could not be written is tried again after 1, 2, 4, ...
   sweeps, ``MAX_RETRIES`` times.

What waits lives in memory, so the store is swept too (:meth:`FastLoop._sweep`): on start and
every ``SWEEP_S`` seconds the loop judges the current generation's turns that have no verdict
although their feedback wait is over (recorded by a process killed before judging them, left by
a stopped loop, or whose judge call failed: retried with doubling pauses, ``MAX_RETRIES`` times),
oldest first, ``SWEEP_LIMIT`` at a time. The judge's leases (:func:`metaclaw.fastloop.judge.lease_turns`)
keep two processes sweeping one workspace from judging a turn twice. The first sweep also
evolves when a trigger holds in the store (the failure rate, an ended session or ``every_n``
judged turns of a session, with failures no attempt saw): a process killed between a verdict
and the evolution it triggered leaves it to the next one. One process of a workspace evolves at
a time (an exclusive lock file beside the database, freed by the OS when its holder dies); the
other waits, then evolves from what is left of the support set. Failures a proposal of the
current generation was made from count as attempted in every process.

Every step is recorded as a :class:`FastLoopEvent` in :attr:`FastLoop.events` and passed to the
callbacks registered with :meth:`FastLoop.on_event` (called from the loop's thread). A judge or
evolver call that fails (wrong model name, authentication, invalid JSON, timeout) is logged with
its endpoint, model and the upstream's message and recorded in the store's ``events`` table
(:meth:`metaclaw.store.Store.events`), so every process and view can count it.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

from metaclaw import buffers
from metaclaw.fastloop import proposals
from metaclaw.fastloop.evolver import EvolveError, Evolver, EvolveResult
from metaclaw.fastloop.gate import Gate, GateReport, safety_check
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.keys import KeysResult, has_keys
from metaclaw.fastloop.llm import record_call_failure
from metaclaw.skills.library import Skill, SkillConflict, SkillLibrary
from metaclaw.store import IN_IDS, OutageLog, Store, StoreUnavailable, id_list
from metaclaw.training_lease import TrainingLease
from metaclaw.turns import TASK_TURNS_SQL, is_task_turn

log = logging.getLogger("metaclaw.fastloop")
#: Warnings about an unreachable workspace, rate-limited (every turn meets it meanwhile).
_OUTAGES = OutageLog(log)
T = TypeVar("T")

#: Kinds of :class:`FastLoopEvent`.
EVENT_KINDS = ("turn", "judged", "judge_failed", "evolve_started", "evolved", "evolve_skipped",
               "evolve_no_change", "evolve_rejected", "evolve_held", "evolve_failed",
               "keys_written", "keys_failed", "generation", "error")


#: Kinds that mean a judge or evolver call failed (logged and recorded in the store).
FAILURE_KINDS = ("judge_failed", "evolve_failed", "keys_failed")
#: What an evolver run decided, also recorded in the store's ``events`` table (``metaclaw
#: events`` shows it beside the loop's failures, whoever ran the loop).
OUTCOME_KINDS = ("evolved", "evolve_held", "evolve_no_change", "evolve_rejected")


@dataclass
class FastLoopEvent:
    """One thing the fast loop did. ``detail`` holds kind-specific data (score, trigger, ...)."""

    kind: str
    at: float
    session_id: str | None = None
    turn_id: int | None = None
    generation: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = " ".join(x for x in (
            f"session {self.session_id}" if self.session_id else "",
            f"turn {self.turn_id}" if self.turn_id is not None else "",
            f"generation {self.generation}" if self.generation is not None else "") if x)
        info = ", ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{self.kind}: {where}{' — ' + info if info else ''}"


def _user_messages(turn: dict[str, Any]) -> int:
    """How many user messages the turn's request carried."""
    return sum(1 for m in turn.get("request_messages") or []
               if isinstance(m, dict) and m.get("role") == "user")


class FastLoop:
    """Background judge + buffers + evolver for a proxy.

    ``store`` / ``library``: the workspace; ``judge`` / ``evolver``: the models. ``every_n``:
    evolve after every N judged turns of a session (0 turns it off); ``failure_rate`` /
    ``min_judged``: evolve when more than this share of the current generation's judged turns
    (at least ``min_judged``) failed (``None`` turns it off); ``on_session_end``: evolve when a
    session is marked done. ``feedback_wait``: seconds to wait for a session's next turn before
    judging a turn without feedback (0 judges at once; default 600: a person driving an agent
    answers after reading its work, often minutes later, and a turn judged before that reaction
    arrived was never judged again). ``concurrency``: votes in flight at most.
    ``on_event``: a callback for every :class:`FastLoopEvent`. ``gate``: the
    :class:`metaclaw.fastloop.gate.Gate` automatic candidates must pass (``None``: all are held back).
    ``auto_keys``: the evolver model writes the retrieval keys of skills that have none (step 7
    above; give it only for an evolver that is a language model).
    """

    #: Seconds between two looks at turns another process is judging (see :meth:`_judge`).
    LEASE_RECHECK_S = 30.0
    #: Seconds between two sweeps of the store for turns left without a verdict (:meth:`_sweep`).
    SWEEP_S = 30.0
    #: Seconds before an idle session's failures that an evolver attempt left unseen (it
    #: failed) set off another (at least; ``feedback_wait`` where longer).
    IDLE_RETRY_S = 300.0
    #: Turns one sweep judges at most, oldest first.
    SWEEP_LIMIT = 100
    #: Times a sweep retries a turn whose judge call failed (after 1, 2, 4, ... ``SWEEP_S``);
    #: then it is left to ``metaclaw score`` or a restarted loop.
    MAX_RETRIES = 6
    #: Skills whose retrieval keys one generation of kind ``keys`` writes at most.
    KEYS_BATCH = 16

    def __init__(self, store: Store, library: SkillLibrary, judge: Judge, evolver: Evolver,
                 every_n: int = 5, failure_rate: float | None = 0.5, min_judged: int = 3,
                 on_session_end: bool = True, *, feedback_wait: float = 600.0,
                 concurrency: int = 64, on_event: Callable[[FastLoopEvent], None] | None = None,
                 max_events: int = 10_000, gate: Gate | None = None, auto_keys: bool = False):
        if every_n < 0:
            raise ValueError(f"every_n must be 0 (off) or more, got {every_n}")
        if failure_rate is not None and not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be between 0 and 1 (or None), got {failure_rate}")
        self.store = store
        self.library = library
        self.judge = judge
        self.evolver = evolver
        self.gate = gate
        self.every_n = int(every_n)
        self.failure_rate = failure_rate
        self.min_judged = int(min_judged)
        self.on_session_end = bool(on_session_end)
        self.feedback_wait = float(feedback_wait)
        self.concurrency = int(concurrency)
        self.max_events = int(max_events)
        self.auto_keys = bool(auto_keys)
        self._stopping = False
        # (skill name, content hash) -> (keys requests failed, monotonic time before which no
        # sweep retries it)
        self._keys_retries: dict[tuple[str, str], tuple[int, float]] = {}
        self.events: list[FastLoopEvent] = []
        self._callbacks: list[Callable[[FastLoopEvent], None]] = [on_event] if on_event else []
        self._events_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # (session, turn type) -> (turn ids waiting for the thread's next user message, timer,
        # user messages seen)
        self._waiting: dict[tuple[str, str], tuple[list[int], asyncio.TimerHandle, int]] = {}
        self._judged: dict[str, int] = {}
        self._ended: set[str] = set()
        # the unseen failures the last idle trigger evolved from, and when
        self._idle_tried: tuple[frozenset[int], float] = (frozenset(), float("-inf"))
        self._last_attempt: frozenset[int] = frozenset()
        self._evolve_lock: asyncio.Lock | None = None
        # one process of a workspace evolves at a time: a lock freed if its holder dies
        self._evolve_lease = TrainingLease.for_store(store, "evolve")
        # turn id -> (judge calls failed, monotonic time before which no sweep retries it)
        self._retries: dict[int, tuple[int, float]] = {}
        self._sweeper: asyncio.Task[Any] | None = None
        self._proxy: Any = None
        self._subscribed = False
        self.last_result: EvolveResult | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "FastLoop":
        """Start the background thread and its event loop (no-op when running)."""
        if self.running:
            return self
        self._stopping = False
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="metaclaw-fastloop", daemon=True)
        self._thread.start()
        ready.wait()
        self._evolve_lock = None
        loop.call_soon_threadsafe(self._start_sweeping)
        if not self._subscribed:
            self.library.subscribe(self._on_generation)
            self._subscribed = True
        return self

    def attach(self, proxy: Any) -> "FastLoop":
        """Listen to ``proxy``'s recorded turns (and start, if needed). Returns ``self``."""
        if not callable(getattr(proxy, "add_turn_listener", None)):
            raise TypeError("attach needs a metaclaw.proxy.app.Proxy (an object with "
                            f"add_turn_listener), got {type(proxy).__name__}")
        self.start()
        if self._proxy is not None and self._proxy is not proxy:
            self.detach()
        proxy.add_turn_listener(self.submit)
        self._proxy = proxy
        return self

    def detach(self) -> None:
        """Stop listening to the attached proxy."""
        if self._proxy is not None:
            remove = getattr(self._proxy, "remove_turn_listener", None)
            if remove is not None:
                remove(self.submit)
            self._proxy = None

    def stop(self, timeout: float = 30.0) -> None:
        """Detach, finish the work in flight (up to ``timeout`` s) and stop the thread.

        Turns still waiting for feedback are left unjudged: the next fast loop on this
        workspace judges them (its sweep), or ``Judge.judge_turns``.
        """
        self.detach()
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        shutdown = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            shutdown.result(timeout)
        except TimeoutError:  # the calls still in flight are abandoned, and said so
            in_flight = len(self._tasks)
            loop.call_soon_threadsafe(lambda: [task.cancel() for task in list(self._tasks)])
            self._emit("error", message=f"stopped with {in_flight} judge or evolver call(s) "
                       f"still running after {timeout:g} s: cancelled (their turns stay "
                       "unjudged, their failures stay in the support set; a skill change "
                       "already being committed completes, and is reported)")
            with contextlib.suppress(Exception):
                shutdown.result(10)  # closes the clients once the cancelled calls end
        except Exception:  # noqa: BLE001 - stopping must not raise
            log.exception("fast loop did not shut down cleanly")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()
        # a restart runs a new event loop: nothing of this one may be waited on there
        self._loop = self._thread = self._evolve_lock = None
        self._tasks, self._waiting = set(), {}

    async def _shutdown(self) -> None:
        self._stopping = True  # no new keys run (a listener may still fire while this waits)
        if self._sweeper is not None:  # no new sweep; one in flight is in _tasks
            self._sweeper.cancel()
            self._sweeper = None
        for _ids, handle, _users in self._waiting.values():
            handle.cancel()
        self._waiting.clear()
        while self._tasks:  # and the tasks they started meanwhile
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.judge.aclose()
        await self.evolver.aclose()
        if self.gate is not None:
            await self.gate.aclose()

    def __enter__(self) -> "FastLoop":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- events ---------------------------------------------------------------------------
    def on_event(self, callback: Callable[[FastLoopEvent], None]) -> None:
        """Call ``callback(event)`` for every new event (from the loop's thread)."""
        self._callbacks.append(callback)

    def _emit(self, kind: str, **fields: Any) -> FastLoopEvent:
        keys = ("session_id", "turn_id", "generation")
        event = FastLoopEvent(kind, time.time(), **{k: fields.pop(k) for k in keys if k in fields},
                              detail=fields)
        if kind in FAILURE_KINDS:
            self._report_failure(event)
        elif kind in OUTCOME_KINDS:
            self._record_outcome(event)
        with self._events_lock:
            self.events.append(event)
            if len(self.events) > self.max_events:
                del self.events[: len(self.events) - self.max_events]
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception:  # a broken display must not stop the loop
                log.exception("fast loop event callback %r failed", callback)
        return event

    def _record_outcome(self, event: FastLoopEvent) -> None:
        """An evolver run's decision as a store event: what it changed or held, and why."""
        detail = event.detail
        ops = ", ".join(detail.get("ops") or []) or "no change"
        message = f"{ops}: {detail.get('reason') or detail.get('status')}"
        if detail.get("proposal_id") is not None and event.kind == "evolve_held":
            message += f" (metaclaw proposals show {detail['proposal_id']})"
        try:
            self.store.record_event(source="fast_loop", kind=event.kind,
                                    message=f"{message} [trigger: {detail.get('trigger')}]",
                                    generation=event.generation,  # (info: no failure)
                                    support=detail.get("support") or [])
        except Exception:  # noqa: BLE001 - the decision stands; only its record is missing
            log.exception("could not record the fast loop's %s event", event.kind)

    def _report_failure(self, event: FastLoopEvent) -> None:
        """A failed judge or evolver call is never silent: it is logged with the endpoint, the
        model and the upstream's message, and recorded in the store's ``events`` table, where
        ``%metaclaw status``, ``metaclaw events`` and the notebook views count it."""
        client = self.judge if event.kind == "judge_failed" else self.evolver
        error = str(event.detail.get("error") or event.detail.get("reason") or "unknown error")
        try:
            message = record_call_failure(
                self.store, event.kind, client, error, source="fast_loop",
                session_id=event.session_id, turn_id=event.turn_id, generation=event.generation)
        except Exception:  # the store may be closing: the log line still tells
            log.exception("could not record the fast loop failure")
            message = f"{event.kind}: {error}"
        log.warning("fast loop: %s", message)

    def events_frame(self):
        """The events as a ``polars.DataFrame``: kind, at, session_id, turn_id, generation,
        detail (JSON text)."""
        import json

        import polars as pl

        with self._events_lock:
            rows = list(self.events)
        return pl.DataFrame({
            "kind": [e.kind for e in rows], "at": [e.at for e in rows],
            "session_id": [e.session_id for e in rows], "turn_id": [e.turn_id for e in rows],
            "generation": [e.generation for e in rows],
            "detail": [json.dumps(e.detail, default=str) for e in rows],
        }, schema={"kind": pl.Utf8, "at": pl.Float64, "session_id": pl.Utf8,
                   "turn_id": pl.Int64, "generation": pl.Int64, "detail": pl.Utf8})

    # -- input ----------------------------------------------------------------------------
    def submit(self, turn_id: int) -> None:
        """Hand a recorded turn to the loop (thread-safe; this is the proxy's turn listener)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            log.warning("fast loop is not running; turn %s is not judged", turn_id)
            return
        loop.call_soon_threadsafe(self._spawn, self._on_turn(int(turn_id)))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, StoreUnavailable):  # every task meets it while it lasts
                _OUTAGES.warning("fast loop task failed: %s", exc)
            else:
                log.error("fast loop task failed: %s", exc, exc_info=exc)
            self._emit("error", error=f"{type(exc).__name__}: {exc}")

    async def _on_turn(self, turn_id: int) -> None:
        turn = self.store.turn(turn_id)
        if turn is None:
            self._emit("error", turn_id=turn_id, error=f"turn {turn_id} is not in the store")
            return
        session = turn["session_id"]
        task_ok = is_task_turn(turn.get("turn_type")) and turn.get("status") == "ok"
        self._emit("turn", session_id=session, turn_id=turn_id,
                   generation=turn.get("skill_generation"), turn_type=turn.get("turn_type"),
                   status=turn.get("status"))
        if task_ok:
            buffers.refresh(self.store, [turn_id])
        if not is_task_turn(turn.get("turn_type")):
            return
        row = self.store.session(session) or {}
        done = bool(row.get("done"))
        # A turn's feedback is the user's next message in its thread (its session's turns of
        # its type). A call that adds no user message (the next step of a tool loop) continues
        # the same task: its turns wait together.
        users = _user_messages(turn)
        thread = (session, turn["turn_type"])
        ready: list[int] = []
        pending: list[int] = []
        previous = self._waiting.pop(thread, None)
        if previous is not None:
            previous[1].cancel()
            if users > previous[2] or done:
                ready.extend(previous[0])  # this turn carries the feedback on them
            else:
                pending.extend(previous[0])
        if done:  # the session ended: its other threads get no further feedback either
            for other in [key for key in self._waiting if key[0] == session]:
                ids, handle, _users = self._waiting.pop(other)
                handle.cancel()
                ready.extend(ids)
        if task_ok:
            pending.append(turn_id)
        if pending and (done or self.feedback_wait <= 0):
            ready.extend(pending)
            pending = []
        if pending:
            handle = asyncio.get_running_loop().call_later(
                self.feedback_wait, self._feedback_timeout, thread, pending)
            self._waiting[thread] = (pending, handle, users)
        if ready:
            await self._judge(session, ready)
        if done and self.on_session_end and session not in self._ended:
            self._ended.add(session)
            await self._evolve(f"session {session} ended")

    def _feedback_timeout(self, thread: tuple[str, str], turn_ids: list[int]) -> None:
        waiting = self._waiting.get(thread)
        if waiting is not None and waiting[0] is turn_ids:
            del self._waiting[thread]
            self._spawn(self._judge(thread[0], list(turn_ids)))

    def judge_pending(self, timeout: float = 60.0) -> None:
        """Judge now the turns still waiting for their session's next message; blocks until done."""
        async def run() -> None:
            waiting = list(self._waiting.items())
            self._waiting.clear()
            for _thread, (_ids, handle, _users) in waiting:
                handle.cancel()
            await asyncio.gather(*(self._judge(session, list(ids))
                                   for (session, _type), (ids, _h, _u) in waiting))

        self._call(run(), timeout)

    # -- sweeping the store ---------------------------------------------------------------
    def _start_sweeping(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        """Sweep now, then every ``SWEEP_S`` s. Each sweep runs as a task of its own (in
        ``_tasks``: :meth:`wait_idle` waits for it, :meth:`stop` finishes it); this driver is
        not one, or the loop would never be idle."""
        first = True
        while True:
            await asyncio.wait([self._spawn(self._sweep(resume=first))])
            first = False
            await asyncio.sleep(self.SWEEP_S)

    def unjudged_turns(self, limit: int | None = None) -> list[dict[str, Any]]:
        """``id`` and ``session_id`` of the current generation's task turns that have no verdict
        (neither the judge's nor a person's) though their feedback wait is over, and that no
        judge holds a lease on and this loop does not wait on or hold back for a retry; oldest
        first, at most ``limit`` (default ``SWEEP_LIMIT``). A turn of an older generation is
        purged from the buffers: its verdict would move nothing."""
        now, clock = time.time(), time.monotonic()
        mine = {i for ids, _h, _u in self._waiting.values() for i in ids}
        mine |= {i for i, (_n, after) in self._retries.items() if after > clock}
        return self.store.query(
            f"SELECT id, session_id FROM turns WHERE {TASK_TURNS_SQL} AND status = 'ok' "
            "AND reward IS NULL AND human_label IS NULL "
            "AND (response IS NOT NULL OR tool_calls IS NOT NULL) "  # else nothing to judge
            "AND skill_generation = ? AND COALESCE(buffer_state, 'live') = 'live' "
            "AND created_at <= ? AND (judge_lease_until IS NULL OR judge_lease_until < ?) "
            f"AND id NOT {IN_IDS} ORDER BY id LIMIT ?",
            (buffers.current_generation(self.store), now - self.feedback_wait, now,
             id_list(mine), self.SWEEP_LIMIT if limit is None else int(limit)))

    async def _sweep(self, resume: bool = False) -> None:
        """Judge the turns :meth:`unjudged_turns` finds, by session (so that the triggers count
        them); with ``resume``, then evolve if a trigger holds in the store."""
        by_session: dict[str, list[int]] = {}
        for row in self.unjudged_turns():
            by_session.setdefault(row["session_id"], []).append(int(row["id"]))
        if by_session:
            log.info("fast loop: judging %d turn(s) left without a verdict",
                     sum(map(len, by_session.values())))
            # each session's call keeps its own votes within ``concurrency``; a backlog of many
            # one-turn sessions would otherwise send them all at once (300 requests for 100)
            sessions = asyncio.Semaphore(max(1, self.concurrency // max(1, self.judge.votes)))

            async def judge(session: str, ids: list[int]) -> None:
                async with sessions:
                    await self._judge(session, ids)

            await asyncio.gather(*(judge(session, ids) for session, ids in by_session.items()))
        trigger = self._trigger_in_store() if resume else None
        if trigger is None:
            trigger = self._idle_session()
        if trigger is not None:
            await self._evolve(trigger)
        if self.auto_keys:
            await self._write_missing_keys()

    def _idle_session(self) -> str | None:
        """With ``on_session_end``: a session whose judged failures wait in the support set,
        unseen by any attempt, and that has sent no turn for ``feedback_wait`` seconds: its
        user has moved on, as far as the loop can tell. No agent says that a session ended
        (``X-Session-Done`` is MetaClaw's own), so without this one correction in a Claude Code
        or Codex session (two failed turns among its four) set off no trigger at all."""
        if not self.on_session_end:
            return None
        failing = buffers.support_set(self.store, threshold=self.judge.threshold)
        if not failing:  # (every sweep: the rest only where a failure waits)
            return None
        generation = buffers.current_generation(self.store)
        seen = self._last_attempt | proposals.proposed_support(self.store, generation) \
            | self._no_change_elsewhere(generation)
        failing = [t for t in failing if int(t["id"]) not in seen]
        waiting = sorted({t["session_id"] for t in failing})
        unseen = frozenset(int(t["id"]) for t in failing)
        now = time.time()
        tried, when = self._idle_tried
        if tried and tried <= unseen and now - when < max(self.feedback_wait, self.IDLE_RETRY_S):
            # the last attempt left its failures unseen: the evolver failed (down), and is not
            # asked again at every sweep, nor at each failure judged since
            return None
        quiet = max(self.feedback_wait, self.SWEEP_S)  # (a wait of 0: quiet for a sweep)
        for session in waiting:
            last = self.store.query("SELECT MAX(created_at) AS at FROM turns WHERE "
                                    "session_id = ?", (session,))[0]["at"]
            if last is not None and last <= now - quiet:
                self._idle_tried = (unseen, now)
                return f"session {session} idle for {quiet:g} s with judged failures"
        return None

    def _no_change_elsewhere(self, generation: int) -> frozenset[int]:
        """The failures of ``generation`` an evolver run answered "no change" for, in any
        process (a workspace event: another proxy, or this one before a restart), so that an
        idle session's trigger does not ask again about them."""
        ids: set[int] = set()
        for row in self.store.events(kind="evolve_no_change", limit=50):
            detail = row.get("detail") or {}
            if detail.get("generation") == generation:
                ids.update(int(i) for i in detail.get("support") or ())
        return frozenset(ids)

    def _trigger_in_store(self) -> str | None:
        """A trigger that holds in the store now, as :meth:`_check_triggers` and the session-end
        trigger would have fired it (a process killed before it evolved loses its counts):
        ``None`` when there is none, or when the live support set holds no failure."""
        generation = buffers.current_generation(self.store)
        failing = {int(t["id"]): t["session_id"]
                   for t in buffers.support_set(self.store, threshold=self.judge.threshold)}
        if not failing:
            return None
        if self.failure_rate is not None:
            judged, failed = self.failure_stats()
            if judged >= self.min_judged and failed / judged > self.failure_rate:
                return (f"failure rate {failed}/{judged} of the current generation exceeds "
                        f"{self.failure_rate:g} (found on start)")
        sessions = sorted(set(failing.values()))
        if self.on_session_end:
            for session in sessions:
                if (self.store.session(session) or {}).get("done"):
                    return f"session {session} ended (found on start)"
        if self.every_n:
            for session in sessions:
                n = self.store.query(
                    f"SELECT COUNT(*) AS n FROM turns WHERE session_id = ? AND {TASK_TURNS_SQL} "
                    "AND skill_generation = ? AND (reward IS NOT NULL OR human_label IS NOT "
                    "NULL)", (session, generation))[0]["n"]
                if n >= self.every_n:
                    return (f"{n} judged turns in session {session} (every {self.every_n}, "
                            "found on start)")
        return None

    # -- judging --------------------------------------------------------------------------
    async def _judge(self, session: str, turn_ids: list[int]) -> None:
        results = await self.judge.ajudge_turns(self.store, turn_ids,
                                                concurrency=self.concurrency)
        judged, leased = 0, []
        for result in results:
            if result.skipped == "judged":  # another process's verdict counts here too
                self._retries.pop(result.turn_id, None)
                judged += 1
            elif result.skipped == "leased":
                leased.append(result.turn_id)
            elif result.ok:
                self._retries.pop(result.turn_id, None)
                judged += 1
                self._emit("judged", session_id=session, turn_id=result.turn_id,
                           score=result.score, votes=[v["score"] for v in result.votes],
                           failed=result.failed, unparsable=result.unparsable,
                           rationale=result.rationale)
            else:
                # the sweep tries it again after 1, 2, 4, ... sweeps: a judge down for minutes
                # loses no turn, and one down for good does not flood the events table
                failures = self._retries.get(result.turn_id, (0, 0.0))[0] + 1
                wait = self.SWEEP_S * 2 ** (failures - 1)
                retry = failures <= self.MAX_RETRIES
                self._retries[result.turn_id] = (
                    failures, time.monotonic() + wait if retry else float("inf"))
                self._emit("judge_failed", session_id=session, turn_id=result.turn_id,
                           error=result.error, failed=result.failed,
                           unparsable=result.unparsable,
                           retry=f"in about {wait:g} s" if retry else "no more retries here")
        if leased:  # another process is judging them: look again later, so that they count
            # when its verdicts land, and are judged here if it stopped (its lease ended)
            asyncio.get_running_loop().call_later(
                min(self.LEASE_RECHECK_S, self.judge.lease_s),
                lambda: self._spawn(self._judge(session, leased)))
        if judged:
            await self._check_triggers(session, judged)

    def failure_stats(self, generation: int | None = None) -> tuple[int, int]:
        """``(judged, failed)`` task turns of ``generation`` (default: the current one); a turn
        a person labelled counts as judged, and its label decides whether it failed."""
        gen = buffers.current_generation(self.store) if generation is None else generation
        row = self.store.query(  # a person's label counts as a verdict, and outranks the judge
            f"SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN {buffers.FAILURE_SQL} THEN 1 ELSE 0 "
            f"END), 0) AS f FROM turns WHERE {TASK_TURNS_SQL} AND status = 'ok' "
            "AND skill_generation = ? AND (reward IS NOT NULL OR human_label IS NOT NULL)",
            (self.judge.threshold, gen))[0]
        return int(row["n"]), int(row["f"])

    async def _check_triggers(self, session: str, newly_judged: int) -> None:
        before = self._judged.get(session, 0)
        after = before + newly_judged
        self._judged[session] = after
        if self.every_n and after // self.every_n > before // self.every_n:
            await self._evolve(f"{after} judged turns in session {session} (every {self.every_n})")
            return
        if self.failure_rate is not None:
            judged, failed = self.failure_stats()
            if judged >= self.min_judged and failed / judged > self.failure_rate:
                await self._evolve(f"failure rate {failed}/{judged} of the current generation "
                                   f"exceeds {self.failure_rate:g}")

    # -- retrieval keys -------------------------------------------------------------------
    def _keyless(self) -> list[Skill]:
        """The skills of the current generation without retrieval keys that are due (never
        failed, or failed and waited out, at most ``MAX_RETRIES`` times in their present
        form), leaving out those a proposal held for review edits (new keys would change the
        skill it was made from, and its promotion would be refused); at most ``KEYS_BATCH``."""
        clock = time.monotonic()
        due = []
        for skill in self.library.current()[1]:
            failures, after = self._keys_retries.get((skill.name, skill.content_hash), (0, 0.0))
            if not has_keys(skill) and failures <= self.MAX_RETRIES and after <= clock:
                due.append(skill)
        if due:
            held = {op.name for proposal in proposals.held(self.store) for op in proposal.ops}
            due = [skill for skill in due if skill.name not in held]
        return due[:self.KEYS_BATCH]

    def _any_live_turn(self) -> bool:
        """Whether a new generation would purge a live buffer turn (of the current generation's
        query set, or a failure waiting for the evolver). Newest first: where there is one, it
        is found among the last turns."""
        return bool(self.store.query(
            "SELECT id FROM turns WHERE buffer_state = 'live' ORDER BY id DESC LIMIT 1"))

    async def _write_missing_keys(self) -> None:
        """Step 7: the evolver writes the keys of the skills :meth:`_keyless` finds, a batch
        at a time, each batch one generation, while this process holds the workspace's evolve
        lock (a process that finds it taken leaves them to a later sweep), and only while no
        live buffer turn would be purged by that generation (right after another change of the
        library, or at a sweep that finds none)."""
        if self._stopping or not self._keyless() or self._any_live_turn():
            return
        if self._evolve_lock is None:
            self._evolve_lock = asyncio.Lock()
        async with self._evolve_lock:
            if not self._evolve_lease.acquire("writing retrieval keys"):
                return
            try:
                self.library.sync()  # another process may have written them meanwhile
                while not self._stopping and not self._any_live_turn():
                    todo = self._keyless()
                    if not todo:
                        break
                    generation = self.library.generation
                    try:
                        result = await self.evolver.awrite_keys([s.name for s in todo])
                    except Exception as exc:  # noqa: BLE001 - reported, the loop keeps running
                        # (a conflict too: the library changed during the requests)
                        result = KeysResult(None, failed=dict.fromkeys(
                            (s.name for s in todo), f"{type(exc).__name__}: {exc}"))
                    self._keys_done(todo, result, generation)
            finally:
                self._evolve_lease.release()

    def _keys_done(self, todo: list[Skill], result: KeysResult, generation: int) -> None:
        """Record a batch's outcome: its failures wait 1, 2, 4, ... sweeps before the next try
        (the last one says so); the events say what was written and what failed."""
        clock, exhausted = time.monotonic(), []
        for skill in todo:
            key = (skill.name, skill.content_hash)
            if skill.name not in result.failed:
                self._keys_retries.pop(key, None)
                continue
            failures = self._keys_retries.get(key, (0, 0.0))[0] + 1
            self._keys_retries[key] = (failures, clock + self.SWEEP_S * 2 ** (failures - 1))
            if failures > self.MAX_RETRIES:
                exhausted.append(skill.name)
        if result.written:
            self._emit("keys_written", generation=result.generation, written=result.written,
                       failed=result.failed)
        if result.failed:
            reasons = sorted(set(result.failed.values()))
            self._emit("keys_failed", generation=generation if result.generation is None
                       else result.generation, skills=sorted(result.failed),
                       error=f"retrieval keys not written for {len(result.failed)} skill(s): "
                             f"{reasons[0]}" + (f" (and {len(reasons) - 1} other reasons)"
                                                if len(reasons) > 1 else ""),
                       retry=(f"no more retries here for {', '.join(exhausted)}" if exhausted
                              else "at a later sweep"))

    # -- evolving -------------------------------------------------------------------------
    async def _evolve(self, trigger: str, *, manual: bool = False,
                      dry_run: bool = False) -> EvolveResult | None:
        if self._evolve_lock is None:
            self._evolve_lock = asyncio.Lock()
        async with self._evolve_lock:
            # another process evolving from the same failures would spend the same calls and
            # leave its candidate stale: wait for it, then evolve from what it left
            while not self._evolve_lease.acquire("evolving skills"):
                await asyncio.sleep(0.2)
            try:
                return await self._evolve_alone(trigger, manual=manual, dry_run=dry_run)
            finally:
                self._evolve_lease.release()

    async def _evolve_alone(self, trigger: str, *, manual: bool,
                            dry_run: bool) -> EvolveResult | None:
        self.library.sync()  # a generation another process committed while this waited
        buffers.refresh(self.store)
        support = buffers.support_set(self.store, threshold=self.judge.threshold)
        ids = frozenset(int(t["id"]) for t in support)
        generation = self.library.generation
        if not ids:
            self._emit("evolve_skipped", generation=generation, trigger=trigger,
                       reason="no live support turns in the current generation")
            if manual:
                return await self.evolver.aevolve(dry_run=dry_run, support_turns=[])
            return None
        # a proposal made from this generation (by any process, before a restart too)
        # attempted its failures as surely as this process's last attempt did
        seen = self._last_attempt | proposals.proposed_support(self.store, generation)
        if not manual and not (ids - seen):
            self._emit("evolve_skipped", generation=generation, trigger=trigger,
                       reason="no new failures since the last attempt")
            return None
        attempted_before = self._last_attempt
        if not dry_run:
            self._last_attempt = ids
        self._emit("evolve_started", generation=generation, trigger=trigger,
                   support=sorted(ids))
        try:
            if manual:
                result = await self.evolver.aevolve(dry_run=dry_run, support_turns=support)
            else:
                result = await self._gated_evolve(support)
        except asyncio.CancelledError:  # stopped midway: nothing was decided either
            self._last_attempt = attempted_before
            raise
        except Exception as exc:  # noqa: BLE001 - reported, the loop keeps running
            # a failed call decided nothing about these failures: the next trigger retries
            self._last_attempt = attempted_before
            if isinstance(exc, EvolveError) and exc.kind != "failed":  # nothing failed
                self._emit("evolve_skipped", generation=generation, trigger=trigger,
                           reason=exc.reason)
            elif isinstance(exc, EvolveError):
                self._emit("evolve_failed", generation=generation, trigger=trigger,
                           error=exc.reason, attempts=exc.attempts)
            else:
                log.exception("evolver failed")
                self._emit("evolve_failed", generation=generation, trigger=trigger,
                           error=f"{type(exc).__name__}: {exc}")
            if manual:
                raise
            return None
        self.last_result = result
        kind = {"applied": "evolved", "rejected": "evolve_rejected", "held": "evolve_held",
                "no_change": "evolve_no_change"}.get(result.status, "evolve_skipped")
        gated = {} if result.gate is None else {
            "gate": result.gate.decision, "judge_calls": result.gate.judge_calls,
            "proposal_id": result.proposal_id}
        self._emit(kind, generation=result.generation if result.applied else generation,
                   trigger=trigger, status=result.status, parent=result.parent,
                   ops=[f"{op.op} {op.name}" for op in (result.proposal.ops
                                                       if result.proposal else [])],
                   consumed=result.consumed, purged=result.purged, reason=result.reason,
                   support=sorted(ids), **gated)
        return result

    async def _gated_evolve(self, support: list[dict[str, Any]]) -> EvolveResult:
        """The automatic path: propose, check with the gate, then promote or hold back."""
        proposal = await self.evolver.apropose(support)
        parent = proposal.base_generation
        if not proposal.ops:
            dropped = "; ".join(f"{d['name']}: {d['reason']}" for d in proposal.dropped)
            return EvolveResult("no_change", parent, proposal=proposal,
                                reason="the evolver proposed no change" if not dropped else
                                f"every change the evolver proposed was dropped ({dropped})")
        if self.gate is not None:
            report = await self.gate.areview(proposal.ops, self.library, self.store,
                                             proposal.support_ids, parent)
        else:
            findings = safety_check(proposal.ops)
            report = GateReport("hold", "no verification gate is configured, so automatic "
                                "changes wait for review", parent,
                                safety=[vars(f) for f in findings])
        summary = "; ".join(f"{op.op} {op.name}" for op in proposal.ops)
        if report.promoted:
            recorded: list[int] = []

            def record_promotion(generation: int) -> None:  # in the generation's transaction
                recorded.append(proposals.record(
                    self.library.store, proposal.ops, origin="auto", status=proposals.PROMOTED,
                    base_generation=parent, support_ids=proposal.support_ids, report=report,
                    decided_by="gate", generation=generation))

            try:  # verified against generation `parent`: applied to it or not at all
                generation, moved = await _to_the_end(asyncio.to_thread(
                    proposals.apply_ops, self.library, proposal.ops, proposal.support_ids,
                    reason=f"{proposals.AUTO_PREFIX} (verification gate): {summary}; "
                           f"{report.reason}",
                    base_generation=parent, then=record_promotion))
            except SkillConflict as exc:
                report.decision = "hold"
                report.reason = f"the library changed during verification ({exc})"
            else:
                return EvolveResult("applied", parent, generation, proposal,
                                    consumed=moved["consumed_ids"], purged=moved["purged"],
                                    reason=summary, gate=report, proposal_id=recorded[0])
        proposal_id = proposals.record(
            self.store, proposal.ops, origin="auto", status=proposals.HELD,
            base_generation=parent, support_ids=proposal.support_ids, report=report)
        # one held proposal per run of failures, not one per failure of it
        replaced = proposals.supersede(self.store, proposal_id)
        return EvolveResult("held", parent, proposal=proposal, gate=report,
                            proposal_id=proposal_id,
                            reason=f"held back as proposal #{proposal_id}: {report.reason}"
                            + (f" (replaces {', '.join(f'#{i}' for i in replaced)})"
                               if replaced else ""))

    def evolve_now(self, dry_run: bool = False, timeout: float | None = 600.0) -> EvolveResult:
        """Run the evolver now on the current support set (manual trigger) and return its
        result. Raises :class:`~metaclaw.fastloop.evolver.EvolveError` when the evolver fails."""
        if not self.running:
            return self.evolver.evolve(dry_run=dry_run)
        return self._call(self._evolve("manual", manual=True, dry_run=dry_run), timeout)

    def _generation_changed(self, generation: int) -> None:
        moved = buffers.advance(self.store, generation)
        self._emit("generation", generation=generation, purged=moved["purged"])

    def _on_generation(self, generation: int) -> None:
        """Library listener: purge the buffers of older generations on any change. Generations
        made by the evolver are left to it: it advances the buffers itself, marking the support
        turns it learned from consumed (not purged). With ``auto_keys``, then write the keys of
        skills that have none (step 7), after any change but the keys' own."""
        row = self.store.generation(generation) if self.running else None
        if row is not None and row["kind"] != "evolve":
            self._generation_changed(generation)
        loop = self._loop
        if self.auto_keys and row is not None and row["kind"] != "keys" and loop is not None \
                and not self._stopping:  # a new generation starts with nothing live to purge
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(lambda: self._spawn(self._write_missing_keys()))

    # -- helpers --------------------------------------------------------------------------
    def _call(self, coro: Any, timeout: float | None) -> Any:
        if not self.running or self._loop is None:
            coro.close()
            raise RuntimeError("the fast loop is not running; call start() or attach(proxy)")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("call this from outside the fast loop's own thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def wait_idle(self, timeout: float = 30.0, settle: float = 0.05) -> bool:
        """Block until no work is in flight (turns waiting for feedback do not count).

        Returns False on timeout. ``settle``: how long the loop must stay idle.
        """
        deadline = time.monotonic() + timeout
        quiet_since = None
        while time.monotonic() < deadline:
            if self._loop is None:
                return True
            busy = self._call(self._busy(), timeout)
            now = time.monotonic()
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= settle:
                return True
            time.sleep(0.01)
        return False

    async def _busy(self) -> bool:
        return bool(self._tasks)

    def status(self) -> dict[str, Any]:
        """A summary for displays: running, generation, buffers, waiting turns, last evolve."""
        judged, failed = self.failure_stats()
        return {
            "running": self.running,
            "generation": self.library.generation,
            "judged_current_generation": judged,
            "failed_current_generation": failed,
            "waiting_for_feedback": sum(len(w[0]) for w in self._waiting.values()),
            "buffers": buffers.buffer_counts(self.store),
            "events": len(self.events),
            "last_evolve": str(self.last_result).splitlines()[0] if self.last_result else None,
        }

    def __repr__(self) -> str:
        return (f"FastLoop(running={self.running}, every_n={self.every_n}, "
                f"failure_rate={self.failure_rate}, on_session_end={self.on_session_end})")

    def _repr_html_(self) -> str:
        info = self.status()
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                       for k, v in info.items())
        recent = "".join(f"<li>{html.escape(str(e))}</li>" for e in self.events[-10:])
        return (f"<div><b>Fast loop</b><table>{rows}</table>"
                + (f"<p>Recent events:</p><ul>{recent}</ul>" if recent else "") + "</div>")


async def _to_the_end(work: Awaitable[T]) -> T:
    """Await ``work`` (a thread committing a change) to its end even when the waiting task is
    cancelled: a thread cannot be stopped halfway, so the change lands anyway, and what it did
    must still be reported."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        return await future
