"""The turn pipeline: one protocol-neutral path for every request the proxy serves.

    parse -> identify session and turn type -> extract the retrieval query -> retrieve
          -> fit the context budget -> inject -> forward -> relay (streaming or not) -> record

Each step is a small function or method below, named for what it does. Protocol specifics stay
in the adapters (:mod:`metaclaw.protocols`): the client's protocol parses and validates the wire
body and injects the skill block into it; when the upstream (:mod:`metaclaw.proxy.upstreams`) speaks
another protocol, request, reply and stream events are translated through the OpenAI chat shape.
A :class:`Turn` carries the request through the steps; its ``messages`` are the neutral view
(OpenAI chat messages) that retrieval reads and the store records, whatever the protocol.

Ordering contract of the relay and record steps: the event that ends a reply for the client
(OpenAI's ``data: [DONE]``, Anthropic's ``message_stop``) and the whole of a non-streaming reply
are sent only after :meth:`Recorder.submit` has taken the turn and
:meth:`TurnPipeline.acknowledge` has returned. With ``ProxyConfig.durable_acks`` (the default)
that means the turn is committed to SQLite: a reply the client received in full is never lost, even to
``kill -9`` (and, with ``ProxyConfig.fsync_acks``, a power loss: the commit is then fsynced).
The recorder commits in groups, so this costs a request about one commit of latency however many
are in flight, and no throughput. Without it, the turn is queued and
committed right after. Every turn that reached the upstream is recorded with a status saying how
it ended (see :class:`_Relay`): a client that leaves before the headers or mid-stream leaves a
``client_disconnected`` turn with what was relayed so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import hmac
import logging
import os
import queue
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from aiohttp import web

from metaclaw import buffers
from metaclaw.jsonlib import LONE_SURROGATE as _SURROGATE, dumpb, dumps
from metaclaw.protocols import ProxyError, WireProtocol
from metaclaw.proxy import context_budget, edge
from metaclaw.proxy.sessions import FINGERPRINT, Identity, ReplyThreads, Thread, identify
from metaclaw.proxy.upstreams import NO_KEY, ResponderUpstream, Upstream, policy_columns
from metaclaw.redact import mask, mask_bytes, mask_json, secrets_of, url_secrets
from metaclaw.skills import block as skill_block, retrieval
from metaclaw.skills.library import offered_to, visible
from metaclaw.store import BUSY_TIMEOUT_S, OutageLog, StoreUnavailable, lock_busy
from metaclaw.turns import IdentityError, is_task_turn

if TYPE_CHECKING:  # pragma: no cover
    from metaclaw.store import Store

log = logging.getLogger("metaclaw.proxy")
#: Warnings about an unreachable workspace, rate-limited (every turn meets it meanwhile).
_OUTAGES = OutageLog(log)

#: Longest wait for a turn's commit before its reply is withheld with a 503: longer than a
#: write may wait for the store's lock (``BUSY_TIMEOUT_S``) and for a connection, so only a
#: store that stopped answering reaches it.
ACK_TIMEOUT_S = 45.0

#: Body fields understood by the proxy itself; removed before forwarding.
PROXY_FIELDS = ("session_id", "turn_type", "session_done")
#: Retrievers that run on the event loop once their index is built (``indexed(skills)``): pure
#: Python over an in-memory index (a fraction of a millisecond for 20 skills), which a worker
#: thread would not take off the interpreter lock, only add two thread switches to every turn.
#: Building the index (seconds for 10,000 skills), and other retrievers (a model encoding the
#: query), run in the retrieval pool, so that no request waits behind it.
INLINE_RETRIEVERS = ("lexical",)
#: Request bodies at least this large are decoded, parsed, identified and matched to skills in
#: worker threads: done on the event loop, a body of megabytes held every other client's turns
#: and streams for seconds (about 0.2 s per MB).
OFF_LOOP_BYTES = 256 * 1024
#: A body holding this may carry an earlier turn's skill block (checked on the raw bytes; the
#: tag's name alone, as some JSON encoders escape "<" and ">").
BLOCK_TAG = skill_block.BLOCK_TAG.strip("<>").encode()
#: Chat fields recorded in their own columns rather than in ``request_params``.
_OWN_COLUMNS = ("messages", "model", "stream")


@dataclass
class Turn:
    """One request on its way through the pipeline.

    ``body``: the client's wire body (proxy fields removed, model set), later with skills
    injected. ``chat``: the same request in the OpenAI chat shape (the neutral view; ``body``
    itself for OpenAI clients). ``messages``: the neutral messages as recorded (skills injected).
    """

    protocol: WireProtocol
    body: dict[str, Any]
    chat: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    session_id: str = ""
    turn_type: str = "main"
    done: bool = False
    identified_by: dict[str, str] = field(default_factory=dict)
    #: whom the turn served: the person and the agent (headers, else the proxy's configuration)
    person: str | None = None
    agent: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    query: str = ""
    generation: int = 0
    injected: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    #: each injected skill's retrieval keys: (its "use when" line, how many example, anticipated
    #: and near-miss asks)
    keys: list[tuple[str, int, int, int]] = field(default_factory=list)
    #: the nearest miss: the best skill offered that scored too low, and the floor it missed
    missed: tuple[str, float, float] | None = None
    #: the skills its near-miss asks lowered: by name, (near-miss ask, its cosine, the own asks'
    #: best, the score lost, the score left) (:meth:`~metaclaw.skills.retrieval.HybridRetriever.
    #: last_held`): those injected all the same, and those it kept out (they scored the floor
    #: ``held_below`` before and not after); the others it changed nothing for
    held: dict[str, tuple] = field(default_factory=dict)
    held_below: float = 0.0
    budget: dict[str, Any] | None = None
    #: the ask's features as recorded (:func:`metaclaw.skills.retrieval.ask_features`)
    features: str | None = None
    retrieval_error: str | None = None
    thread: Thread | None = None  # a fingerprinted task turn's place among its conversations


# ---------------------------------------------------------------------------------------------
# the steps (pure functions of the turn, each separately testable)
# ---------------------------------------------------------------------------------------------
def parse_turn(protocol: WireProtocol, body: dict[str, Any], raw: bytes,
               model: str | None = None, **parse: Any) -> Turn:
    """Step 1: validate the wire body (raises :class:`ProxyError`) and build the turn.

    Field types are checked first (:func:`metaclaw.proxy.edge.check_fields`); ``null`` fields mean
    "not given" and are not forwarded."""
    body = edge.check_fields(protocol, body)
    model, stream = protocol.parse_request(body, model, **parse)
    forward = {k: v for k, v in body.items() if k not in PROXY_FIELDS}
    forward["model"] = model
    chat = protocol.to_chat(forward)
    return Turn(protocol, forward, chat, raw, model, stream, messages=chat["messages"])


def identify_session(headers: Mapping[str, str], body: Mapping[str, Any],
                     principals: tuple[str | None, str | None] = (None, None)) -> Identity:
    """Step 2: the session, turn type and done flag, with the rule that decided each
    (:func:`metaclaw.proxy.sessions.identify`: headers, body fields, ids the framework embeds, a
    conversation fingerprint; side calls recognised by their content). A session id or turn
    type the client gave that cannot be accepted is a 400 naming the field. ``principals``: the
    proxy's configured person and agent, where the headers name none."""
    try:
        return identify(headers, dict(body), principals)
    except IdentityError as exc:
        raise ProxyError(400, str(exc), param=exc.param) from None


def _scored(name: str, score: float, keys: tuple[str, int, int, int] | None) -> dict[str, Any]:
    """One injected skill as recorded in ``retrieval_scores``: its name and score, and the
    retrieval keys it carried (``use_when``; ``example_asks``, ``anticipated_asks``,
    ``near_miss_asks``: how many) where it had any."""
    entry: dict[str, Any] = {"name": name, "score": round(float(score), 4)}
    use_when, examples, anticipated, near = keys or ("", 0, 0, 0)
    if use_when:
        entry["use_when"] = use_when
    if examples:
        entry["example_asks"] = examples
    if anticipated:
        entry["anticipated_asks"] = anticipated
    if near:
        entry["near_miss_asks"] = near
    return entry


def held_back(held: dict[str, tuple], selected: list[Any], skills: list[Any],
              turn_type: str | None, config: Any, parts: Any,
              missed: tuple[Any, float] | None) -> tuple[dict[str, tuple], float]:
    """What the near-miss hold-back did to a turn (``held``: :meth:`~metaclaw.skills.retrieval.
    HybridRetriever.last_held`), kept where it changed something a person should see: an
    injected skill it lowered, and a skill offered to the turn that it kept out (its score
    before the hold-back would have taken a place: it reached the floor the turn had, and beat
    the last skill injected where all the places were taken). Returns those and the floor."""
    if not held:
        return {}, 0.0
    retriever = parts.retriever
    threshold = retriever.default_min_score if config.min_score is None else config.min_score
    margin = getattr(retriever, "default_margin", None)
    floor = missed[1] if missed is not None else threshold
    if missed is None and selected and margin is not None:
        floor = max(threshold, selected[0].score - margin)
    injected = {s.skill.name for s in selected}
    full = len(selected) >= config.top_k
    last = min((s.score for s in selected), default=float("inf"))
    offered = offered_to(turn_type)
    others = held.keys() - injected  # (the library is scanned only for a skill kept out)
    by_name = {s.name: s for s in skills if s.name in others} if others else {}
    kept = {}
    for name, found in held.items():
        before = found[4] + found[3]
        if name in injected:
            kept[name] = found
        elif (name in by_name and offered(by_name[name]) and found[4] < floor <= before
              and (not full or before > last)):
            kept[name] = found
    return kept, floor


def retrieval_query(turn: Turn) -> str:
    """Step 3: the text to retrieve skills for: the user's real ask in the neutral view
    (:func:`metaclaw.skills.asks.extract_ask`, via :func:`metaclaw.skills.retrieval.query_text`)."""
    return retrieval.query_text(turn.messages)


def record_row(turn: Turn, policy_version: int) -> dict[str, Any]:
    """The turn's store columns known before forwarding (one schema for every protocol)."""
    row = {
        "session_id": turn.session_id,
        "turn_type": turn.turn_type,
        "model": turn.model,
        "stream": int(turn.stream),
        "request_messages": turn.messages,
        "request_params": {k: v for k, v in turn.chat.items()
                           if k not in _OWN_COLUMNS and k not in PROXY_FIELDS},
        "skill_generation": turn.generation,
        "injected_skills": turn.injected,
        "policy_version": policy_version,
        "error": turn.retrieval_error,
        "identified_by": turn.identified_by,
        # why the turn got its skills: the query retrieval used, the selected skills' scores
        "retrieval_query": turn.query or None,
        "ask_features": turn.features,
        "retrieval_scores": [_scored(name, score, keys) for name, score, keys
                             in itertools.zip_longest(turn.injected, turn.scores, turn.keys)],
    }
    if turn.missed is not None:  # why a skill the person may expect was not injected
        name, score, below = turn.missed
        row["retrieval_scores"].append({"name": name, "score": round(float(score), 4),
                                        "injected": False, "below": round(float(below), 4)})
    for name, (ask, near, own, lost, score) in turn.held.items():
        # a skill its near-miss asks lowered: on its entry (injected, or the nearest miss), or
        # one of its own (kept out)
        out = lost >= retrieval.NEAR_MISS_OUT  # the near miss itself: out whatever its score
        score = score + lost if out else score  # (its score before, not the sentinel's)
        said = {"ask": ask, "near": round(near, 4), "own": round(own, 4),
                "lost": None if out else round(lost, 4)}
        entry = next((e for e in row["retrieval_scores"] if e["name"] == name), None)
        if entry is None:
            entry = {"name": name, "injected": False, "below": round(turn.held_below, 4)}
            row["retrieval_scores"].append(entry)
        if out or entry.get("injected") is False:
            entry["score"] = round(score, 4)
        entry["held_back"] = said
    row["protocol"] = turn.protocol.name
    if turn.person is not None:
        row["person"] = turn.person
    if turn.agent is not None:
        row["agent"] = turn.agent
    if turn.budget is not None:
        row["context_budget"] = turn.budget
    return row


class Scrubber:
    """The proxy's secrets, never relayed, stored or logged: the upstream key (read from the
    environment variable ``key_env`` when used), the credentials written in ``upstream_url``
    (:func:`metaclaw.redact.url_secrets`), the proxy ``token`` and a caller's own key, masked by
    the rule of :mod:`metaclaw.redact`."""

    def __init__(self, key_env: str, token: str | None = None, upstream_url: str | None = None):
        self.key_env = key_env
        self.token = token
        self.in_url = url_secrets(upstream_url)

    def secrets(self, *extra: str | None) -> tuple[str, ...]:
        """The secrets to mask: the upstream key and URL credentials, the proxy token and
        ``extra``."""
        found = (os.environ.get(self.key_env), *self.in_url, self.token, *extra)
        return secrets_of(*(s for s in found if s != NO_KEY))

    def text(self, text: str | None, *extra: str | None) -> str | None:
        """``text`` with the secrets (and ``extra``) masked."""
        return mask(text, self.secrets(*extra)) if text else text

    def error(self, error: ProxyError, caller_key: str | None = None) -> ProxyError:
        """``error`` with every secret masked in its message, payloads and headers."""
        secrets = self.secrets(caller_key)
        if not secrets:
            return error
        error.message = mask(error.message, secrets)
        error.payload = mask_json(error.payload, secrets)
        if error.upstream is not None:
            error.upstream = (error.upstream[0], mask_json(error.upstream[1], secrets))
        error.headers = mask_json(error.headers, secrets)
        return error


class TurnListeners:
    """The functions called with each recorded turn's id, in order, in one worker thread
    (:meth:`start` makes it, :meth:`stop` lets it go); a listener's error is logged."""

    def __init__(self) -> None:
        self.fns: list[Callable[[int], None]] = []
        self.pool: ThreadPoolExecutor | None = None

    def add(self, fn: Callable[[int], None]) -> None:
        self.fns.append(fn)

    def remove(self, fn: Callable[[int], None]) -> None:
        with contextlib.suppress(ValueError):
            self.fns.remove(fn)

    def start(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="metaclaw-listeners")

    def stop(self) -> None:
        """No new calls; a slow listener is not waited for."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def notify(self, ids: list[int | None]) -> None:
        """Call the listeners with each id of ``ids`` that is a turn's (nothing before
        :meth:`start` or after :meth:`stop`)."""
        pool = self.pool
        if self.fns and pool is not None:
            for turn_id in ids:
                if isinstance(turn_id, int):
                    with contextlib.suppress(RuntimeError):  # the pool has shut down
                        pool.submit(self._call, turn_id)

    def _call(self, turn_id: int) -> None:
        for fn in list(self.fns):
            try:
                fn(turn_id)
            except Exception:
                log.exception("turn listener %r failed for turn %d", fn, turn_id)


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------
class Recorder:
    """Writes finished turns to the store with group commit, and notifies the turn listeners.

    The turns submitted while the event loop runs one round of callbacks form a group, written in
    one transaction (one commit for the whole group), so waiting for durability costs a request
    about one commit however many requests are in flight. The commit survives ``kill -9`` of the
    proxy; with ``fsync`` (``ProxyConfig.fsync_acks``) it is also fsynced (``synchronous=FULL``:
    it survives an OS crash or power loss too, for about one fsync per group). On a database
    server (PostgreSQL) every commit waits for the server's flush (``synchronous_commit`` on),
    so that a crash of the server loses nothing acknowledged either, and every group is written
    by the writer thread: the event loop never waits on the network.

    Where a group is written: a commit without fsync takes a fraction of a millisecond, less than
    handing it to a thread costs (the interpreter lock passed back and forth, two wake-ups), so
    it is written on the event loop when the store is free at once. Otherwise the group goes to
    the writer thread, and the loop never waits for the store: when another thread or process
    holds the write lock, when an earlier group is still waiting for the thread (turns stay in
    order), with ``fsync``, and for a while after a commit on the loop was slow (a slow disk).
    Checkpoints of the write-ahead log, which fsync, are taken by the writer thread too, every
    :attr:`CHECKPOINT_EVERY` commits, instead of by whichever commit fills the log.

    :meth:`submit` returns at once with a future that resolves to the turn id once its group is
    committed (``None`` if it could not be written); :meth:`drain` waits for every submitted turn.
    """

    #: Most turns written in one transaction.
    MAX_GROUP = 256
    #: A commit on the loop that took longer sends the next groups to the writer thread for
    #: :attr:`THREAD_AFTER_SLOW_S` seconds.
    SLOW_COMMIT_S = 0.02
    THREAD_AFTER_SLOW_S = 1.0
    #: Commits between two checkpoints of the write-ahead log (SQLite's own is every 1,000 pages,
    #: which is about 200 turns).
    CHECKPOINT_EVERY = 64

    def __init__(self, store: Store, fsync: bool = False,
                 listeners: TurnListeners | None = None):
        self.store = store
        # a database server's crash (an out-of-memory kill restarts all its backends) must not
        # lose what the proxy acknowledged: its commits wait for the server's flush always
        self.fsync = fsync or getattr(store, "engine", "sqlite") != "sqlite"
        self.listeners = listeners if listeners is not None else TurnListeners()
        self.pending: set[asyncio.Future[Any]] = set()
        self._group: list[tuple[Any, ...]] = []  # submitted, not yet flushed
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop_store: "Store | bool | None" = None  # what the loop writes on (_loop_writer)
        self._handed = 0  # groups handed to the writer thread (counted on the loop)
        self._written = 0  # groups the writer thread has finished (counted by the thread)
        self._thread_until = 0.0  # monotonic time before which groups go to the thread
        self._loop_commits = 0
        self._thread_commits = 0
        self._loop_cpu_s = 0.0  # CPU time the commits took, on the loop and in the thread
        self._thread_cpu_s = 0.0
        self._since_checkpoint = 0

    @property
    def commits(self) -> int:
        """Transactions written (fewer than turns when groups form)."""
        return self._loop_commits + self._thread_commits

    @property
    def commit_cpu_s(self) -> float:
        """CPU seconds spent writing turns (transactions on the loop and in the writer thread,
        checkpoints excluded): what recording costs the proxy, reported by ``/healthz``."""
        return self._loop_cpu_s + self._thread_cpu_s

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metaclaw-record", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Write what is queued, then end the writer thread."""
        if self._group:  # submitted on a loop that stopped before flushing: written all the same
            self._hand_over(self._group)
            self._group = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def submit(self, row: dict[str, Any], done: bool) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)
        self._group.append((row, done, future, loop))
        if len(self._group) == 1:  # the first of a group: written after this round of callbacks
            loop.call_soon(self._flush)
        return future

    async def drain(self) -> None:
        while self.pending:
            await asyncio.gather(*list(self.pending), return_exceptions=True)

    def _flush(self) -> None:
        group, self._group = self._group, []
        for first in range(0, len(group), self.MAX_GROUP):
            part = group[first:first + self.MAX_GROUP]
            if not self._commit_on_loop(part):
                self._hand_over(part)

    def _hand_over(self, group: list[tuple[Any, ...]]) -> None:
        """Queue ``group`` for the writer thread (later groups follow it there, in order)."""
        self.start()
        self._handed += 1
        self._queue.put(group)

    def _commit_on_loop(self, group: list[tuple[Any, ...]]) -> bool:
        """Write ``group`` now if the store is free; ``False`` (nothing written) hands it over."""
        if (self.fsync or self._handed != self._written
                or time.monotonic() < self._thread_until):
            return False
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            if self._loop_store is None:
                self._loop_store = self._loop_writer(self.store)
            store = self._loop_store
            if store is False:  # a database server: its writes wait on the network
                return False
            ids = self._write_all(store, group, False, wait=False)
        except Exception:  # busy, closed, or a row the store refuses: rolled back, nothing
            return False   # written; the writer thread sorts it out (or answers None)
        finally:
            self._loop_cpu_s += time.thread_time() - cpu
        if time.perf_counter() - started > self.SLOW_COMMIT_S:
            self._thread_until = time.monotonic() + self.THREAD_AFTER_SLOW_S
        self._loop_commits += 1
        self._deliver(group, ids)
        self._since_checkpoint += 1
        if self._since_checkpoint >= self.CHECKPOINT_EVERY:
            self._since_checkpoint = 0
            self.start()
            self._queue.put(_CHECKPOINT)
        return True

    @staticmethod
    def _loop_writer(store: Store) -> "Store | bool":
        """The store the loop writes on: its loop writer, the store itself where it has none
        and is in memory, ``False`` (never on the loop) for a database server."""
        if getattr(store, "engine", "sqlite") != "sqlite":
            return False
        return store.loop_writer() or store

    # -- the writer thread ----------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = None in items
            groups = [item for item in items if isinstance(item, list)]
            rows = [row for group in groups for row in group]
            for first in range(0, len(rows), self.MAX_GROUP):
                self._commit(rows[first:first + self.MAX_GROUP])
            self._written += len(groups)
            if _CHECKPOINT in items or stopping and self._loop_commits:
                try:
                    self.store.checkpoint()
                except Exception:  # the next one copies these pages as well
                    log.warning("could not checkpoint the store's write-ahead log", exc_info=True)

    def _commit(self, group: list[tuple[Any, ...]]) -> None:
        store, fsync, cpu = self.store, self.fsync, time.thread_time()
        ids: list[Any]  # a turn id, None (refused), UNREACHABLE or BUSY
        try:
            ids = self._write_all(store, group, fsync)
            self._thread_commits += 1
        except StoreUnavailable as exc:  # the database is down: one by one would fail alike
            _OUTAGES.warning("could not record %d turns: %s", len(group), exc)
            ids = [UNREACHABLE] * len(group)
        except Exception as exc:
            if not lock_busy(exc):
                ids = self._one_by_one(store, group, fsync)
            else:  # the write lock stayed taken: one by one would wait as long for each turn
                log.warning("could not record %d turns: another process held the store's write "
                            "lock for %.0f s (%s)", len(group), BUSY_TIMEOUT_S, exc)
                ids = [BUSY] * len(group)
        self._thread_cpu_s += time.thread_time() - cpu
        self._deliver(group, ids)

    def _one_by_one(self, store: Store, group: list[tuple[Any, ...]], fsync: bool) -> list[Any]:
        """One bad row must not lose the others: the group's turns written one by one."""
        ids: list[Any] = []
        for row, done, _, _ in group:
            try:  # strings cleaned of what SQLite cannot encode (lone surrogates)
                ids += self._write_all(store, [(_encodable(row), done)], fsync)
            except Exception:
                log.exception("could not record a turn of session %r", row.get("session_id"))
                ids.append(None)
        return ids

    def _deliver(self, group: list[tuple[Any, ...]], ids: list[int | None]) -> None:
        """Resolve each turn's future on its own loop (at once on the running one), then tell
        the listeners. With ``-v`` (INFO), a line per recorded turn."""
        if log.isEnabledFor(logging.INFO):
            for (row, *_), turn_id in zip(group, ids):
                # a turn the store could not take is named so, never as a turn served "ok"
                shown = f"#{turn_id}" if isinstance(turn_id, int) else \
                    f"not recorded ({turn_id or 'failed'}): served"
                log.info("turn %s %s, session %s: %s in %.1f s; skills: %s", shown,
                         row.get("protocol"), row.get("session_id"), row.get("status"),
                         (row.get("latency_ms") or 0) / 1000,
                         ", ".join(row.get("injected_skills") or []) or "none")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # the writer thread
            running = None
        by_loop: dict[Any, list[tuple[asyncio.Future[Any], int | None]]] = {}
        for (_, _, future, loop), turn_id in zip(group, ids):
            by_loop.setdefault(loop, []).append((future, turn_id))
        for loop, results in by_loop.items():  # one wake-up of each loop for the whole group
            if loop is running:
                _resolve(results)
                continue
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(_resolve, results)
        self.listeners.notify(ids)

    @staticmethod
    def _write_all(store: "Store", group: list[tuple[Any, ...]], fsync: bool,
                   wait: bool = True) -> list[int]:
        """Write the turns of ``group`` (its entries start with ``row, done``) in one
        transaction. A turn that entered the buffers as live (:func:`metaclaw.buffers.classify`,
        when it was served) but was served under an older generation than the store's latest is
        recorded purged: another process committed that generation after this one last looked,
        and its purge of older live turns ran before this turn existed. The store checks as it
        writes, under the write lock: no generation can land between the check and the write."""
        return store.record_turns([(row, done) for row, done, *_ in group], fsync=fsync,
                                  wait=wait, stale={buffers.LIVE: buffers.PURGED})


#: A turn's record when the store could not be reached (its future's result, like ``None`` for
#: a turn the store refused): answered with a 503 the client may retry.
UNREACHABLE = "unreachable"

#: A turn's record when another process held the store's write lock past its busy timeout:
#: answered with a 503 the client may retry.
BUSY = "busy"


#: Queued for the writer thread: checkpoint the write-ahead log.
_CHECKPOINT = "checkpoint"


def _resolve(results: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, value in results:
        if not future.done():
            future.set_result(value)


def _encodable(value: Any) -> Any:
    """``value`` with every string made UTF-8 encodable (lone surrogates become U+FFFD)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encodable(v) for v in value]
    return value


class FailureLog:
    """A warning in the proxy's log when turns fail (an unreachable upstream, a relayed 401, a
    stream cut): whoever runs ``metaclaw serve`` sees that the agent is failing, not only the
    agent. At most one line per HTTP status every :attr:`EVERY_S` seconds; the next one counts
    those left out."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[Any, tuple[float, int]] = {}
        #: Sessions whose failures are shown where they were sent (a notebook's chat cell), not
        #: repeated in the log.
        self.shown_elsewhere: set[str] = set()

    def warn(self, status: Any, message: str, session: str | None = None) -> None:
        """``status``: the turn's HTTP status; 200 is a stream that failed after it began."""
        if session in self.shown_elsewhere:
            return
        status = "200, mid-stream" if status == 200 else status
        now = time.monotonic()
        with self._lock:
            last, left_out = self._last.get(status, (float("-inf"), 0))
            if now - last < self.EVERY_S:
                self._last[status] = (last, left_out + 1)
                return
            self._last[status] = (now, 0)
        more = f" ({left_out} more turns failed with it since the last such line)" if left_out else ""
        log.warning("a turn failed (HTTP %s): %s%s", status, message[:300], more)

    def close(self, db_option: Callable[[], str] = str) -> None:
        """Say the failures no line has counted yet (when the proxy stops); ``db_option``: what
        the command it names needs to open the workspace (:meth:`Store.db_option`; asked only
        when there is something to say)."""
        with self._lock:
            left = {status: n for status, (_, n) in self._last.items() if n}
            self._last.clear()
        for status, n in left.items():
            log.warning("%d more turn%s failed (HTTP %s) since the last such line; `metaclaw "
                        "turns%s --status error --why` lists them", n, "s" * (n != 1), status,
                        db_option())


# ---------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------
@dataclass
class Collaborators:
    """What the turn pipeline works with, given to it by whoever runs it: the
    :class:`~metaclaw.proxy.app.Proxy` builds one, a test can build one without a proxy.

    ``config``: a :class:`~metaclaw.proxy.app.ProxyConfig` (the token, caller-auth, the model,
    the body limits and timeouts, retrieval, context budget, stream usage and durable-ack
    settings are read from it). ``library``: the skill library whose current generation is
    injected; ``retriever``: its retriever; ``recorder``: where turns are written (it calls the
    turn listeners); ``scrubber``: the secrets to mask; ``threads``: which of alike-opening
    conversations a turn continues; ``token_counter``: the context budget's counter.

    Set by the owner while it serves (a request reads them when it arrives): ``upstream`` (the
    HTTP upstream, opened on the server's loop; ``None``: none configured), ``responder`` (a
    local policy answering instead, see :meth:`metaclaw.proxy.app.Proxy.set_responder`),
    ``retrieval_pool`` (the threads model-based retrieval runs in) and ``stopping`` (the server
    is shutting down: a turn cancelled now was stopped by the proxy, not by its client).
    """

    config: Any
    library: Any
    retriever: Any
    recorder: Recorder
    scrubber: Scrubber
    threads: ReplyThreads
    token_counter: context_budget.TokenCounter
    upstream: Upstream | None = None
    responder: Any = None
    retrieval_pool: Executor | None = None
    stopping: bool = False
    failures: FailureLog = field(default_factory=FailureLog)


#: Claude Code's User-Agent (``claude-cli/<version> ...``).
CLAUDE_CODE_AGENT = "claude-cli/"


def token_refused(headers: Any, message: str, code: str,
                  caller_auth: bool = False) -> ProxyError:
    """The answer to a missing or wrong proxy token: a 401 ``authentication_error``; to Claude
    Code a 403 ``permission_error`` with its own settings named. Claude Code takes a 401 for its
    login expiring (it retried ten times over three minutes, then said "Not logged in · Please
    run /login") and any message naming the x-api-key header for its user's key being wrong; a
    403's message it shows at once. ``caller_auth``: the token comes in ``X-MetaClaw-Token``
    (Claude Code sends it through ``ANTHROPIC_CUSTOM_HEADERS``)."""
    if not headers.get("User-Agent", "").startswith(CLAUDE_CODE_AGENT):
        return ProxyError(401, message, type="authentication_error", code=code)
    what = "missing" if code == "missing_token" else "invalid"
    if caller_auth:
        return ProxyError(403, f"{what} proxy token: this proxy forwards your own API key and "
                               "takes its token in the header X-MetaClaw-Token; add the line "
                               "'X-MetaClaw-Token: <the token metaclaw serve was given>' to "
                               "ANTHROPIC_CUSTOM_HEADERS where Claude Code runs (one header a "
                               "line)",
                          type="permission_error", code=code)
    return ProxyError(403, f"{what} proxy token: Claude Code must send the token `metaclaw "
                           "serve` was given (--token or $METACLAW_PROXY_TOKEN): wired by `metaclaw "
                           "wire claude-code`, its settings.json holds the token and wins over the "
                           "shell, so wire it again with that --token (after --undo); else set "
                           "ANTHROPIC_AUTH_TOKEN where Claude Code runs", type="permission_error",
                      code=code)


class TurnPipeline:
    """Runs the steps for one request of any protocol, with ``parts``
    (:class:`Collaborators`)."""

    def __init__(self, parts: Collaborators):
        self.parts = parts
        self.config = parts.config
        # the skills each (person, agent) may be offered, of one generation (see visible_skills)
        self._scoped: dict[Any, Any] = {}

    #: Most (person, agent) pairs whose visible skills are kept for the current generation.
    MAX_SCOPED = 256

    def visible_skills(self, generation: int, skills: list[Any], person: str | None,
                       agent: str | None) -> list[Any]:
        """The skills of ``generation`` a turn serving ``person`` through ``agent`` may be
        offered (:func:`metaclaw.skills.library.visible`: shared ones and its own private
        ones), filtered before ranking. Kept per generation and pair, so a library without
        private skills costs one check per generation, and each pair ranks one unchanging list
        (the retriever's index of it stays cached)."""
        scoped = self._scoped
        if scoped.get("generation") != generation:
            scoped.clear()
            scoped["generation"] = generation
            scoped["private"] = any(getattr(s, "private", False) for s in skills)
        if not scoped["private"]:
            return skills
        key = (person, agent)
        found = scoped.get(key)
        if found is None:
            if len(scoped) > self.MAX_SCOPED + 2:
                for old in [k for k in scoped if isinstance(k, tuple)]:
                    del scoped[old]
            found = scoped[key] = visible(skills, person, agent)
        return found

    # -- checks and parsing ---------------------------------------------------------------
    def authenticate(self, request: web.Request) -> str | None:
        """Check the proxy token; return the caller's own upstream key under caller-auth."""
        config = self.config
        headers = request.headers
        scheme, _, bearer = headers.get("Authorization", "").partition(" ")
        bearer = bearer.strip() if scheme.lower() == "bearer" else ""
        api_key = headers.get("x-api-key", "").strip()
        caller_key = None
        if config.caller_auth:
            caller_key = api_key or bearer
            if not caller_key:
                raise ProxyError(401, "this proxy forwards each caller's own upstream key: send "
                                      "your API key (x-api-key or 'Authorization: Bearer <key>')",
                                 type="authentication_error", code="missing_caller_key")
            if not (caller_key.isascii() and caller_key.isprintable()):
                raise ProxyError(401, "the API key holds bytes that are not printable ASCII, so "
                                      "it cannot be forwarded to the upstream; send the key as "
                                      "it was issued", type="authentication_error",
                                 code="invalid_caller_key")
            given = headers.get("X-MetaClaw-Token", "").strip()
            where = "the header 'X-MetaClaw-Token: <token>'"
        else:
            given = bearer or api_key
            where = ("the header 'Authorization: Bearer <token>' or 'x-api-key: <token>' (the "
                     "OpenAI or Anthropic client's api_key)")
        token = config.token
        if not token:
            return caller_key
        if not given:
            raise token_refused(headers, f"missing token: this proxy requires {where}",
                                "missing_token", config.caller_auth)
        # a header's bytes that are not UTF-8 arrive as lone surrogates: compared as sent
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
            fix = ("send the proxy's token in 'X-MetaClaw-Token' (the api_key is your own "
                   "upstream key here)" if config.caller_auth else "set the client's api_key "
                   "(sent as 'Authorization: Bearer' or 'x-api-key') to the proxy's token")
            raise token_refused(headers, f"invalid token: {fix}", "invalid_token",
                                config.caller_auth)
        return caller_key

    def too_large(self) -> ProxyError:
        return edge.too_large(self.config.max_body_bytes)

    async def read_body(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        """The body, within ``body_timeout`` (408) and ``max_body_bytes`` (413, as sent and
        once decompressed), decoded from its Content-Encoding by :class:`metaclaw.proxy.edge.BodyDecoder`
        and checked by :func:`metaclaw.proxy.edge.decode_body` (400 naming what is wrong)."""
        if (request.content_length is not None
                and request.content_length > self.config.max_body_bytes):
            raise self.too_large()
        decoder = edge.BodyDecoder(request.headers.get("Content-Encoding"),
                                   self.config.max_body_bytes)
        try:
            if request.content.is_eof():  # the whole body is here already: no timer to set
                await _feed(request, decoder)
            else:
                async with asyncio.timeout(self.config.body_timeout):
                    await _feed(request, decoder)
            raw = decoder.finish()
        except TimeoutError:
            raise ProxyError(408, f"the request body did not arrive within "
                                  f"{self.config.body_timeout:g} s; send it at once",
                             code="body_timeout") from None
        except ProxyError as exc:  # corrupt, truncated or too large
            if not request.content.is_eof():  # refused mid-body: the rest is never read
                # answer, then close the connection (a client still sending cannot start a next
                # request on it); closed gracefully, so that the answer is not lost to a reset
                exc.headers = {**exc.headers, "Connection": "close"}
                request.protocol.close()
                linger = getattr(request.protocol, "_linger_on_close", None)
                if linger is not None:
                    linger()
            raise
        except (web.HTTPException, ConnectionError):
            raise
        except Exception as exc:  # the HTTP framing of the body is broken (bad chunked encoding)
            reason = edge._printable(edge._parser_reason(exc, None), 200)
            raise ProxyError(400, f"cannot read the request body ({type(exc).__name__}: "
                                  f"{reason}); send a well-formed body",
                             code="bad_request_body") from None
        if len(raw) >= OFF_LOOP_BYTES:
            return raw, await asyncio.to_thread(edge.decode_body, raw)
        return raw, edge.decode_body(raw)

    # -- retrieve, fit the budget, inject -------------------------------------------------
    def select_and_inject(self, turn: Turn, skills: list[Any]) -> None:
        """Steps 3-6 for a main or stage turn, by :func:`metaclaw.skills.retrieval.select_and_inject`:
        query, retrieve (a stage turn: its stage's and general skills), fit the context budget,
        inject; the same block goes into the wire body."""
        parts, config = self.parts, self.config
        try:
            turn.query = retrieval_query(turn)
            window = context_budget.context_window(turn.model, config.context_windows,
                                                   config.context_window)

            allowed = self.output_tokens(turn)[1]

            def fit(selected: list[Any], render: Any) -> int:
                budget = context_budget.fit_skills([s.skill.name for s in selected], render,
                                                   turn.raw, window, allowed,
                                                   parts.token_counter)
                turn.budget = budget.record  # (prepare adds what the client asked for)
                return budget.keep

            last_held = getattr(parts.retriever, "last_held", None)
            if last_held is not None:  # a selection that scores nothing must not read the last
                parts.retriever.forget_held()
            done = retrieval.select_and_inject(
                parts.retriever, turn.messages, skills, turn_type=turn.turn_type,
                top_k=config.top_k, min_score=config.min_score, budget_chars=config.budget_chars,
                query=turn.query, fit=fit if window is not None else None)
            selected = done.selected
            turn.injected = [s.skill.name for s in selected]
            turn.scores = [s.score for s in selected]
            turn.keys = [(s.skill.use_when, len(s.skill.example_asks),
                          len(s.skill.anticipated_asks), len(s.skill.near_miss_asks))
                         for s in selected]
            if done.missed is not None:
                near, below = done.missed
                turn.missed = (near.skill.name, near.score, below)
            if last_held is not None:
                turn.held, turn.held_below = held_back(
                    last_held(done.query), selected, skills, turn.turn_type, config, parts,
                    done.missed)
            turn.features = retrieval.ask_features(parts.retriever, turn.query)
            if done.block or BLOCK_TAG in turn.raw:  # or a resent earlier block, to take out
                turn.body = turn.protocol.inject(turn.body, done.block)
                turn.messages = done.messages
        except Exception as exc:  # serve the turn without skills rather than fail the agent
            log.exception("skill retrieval failed; serving this turn without skills")
            turn.injected, turn.scores, turn.keys, turn.held = [], [], [], {}
            turn.retrieval_error = f"skill retrieval failed (served without skills): {exc}"

    async def prepare(self, protocol: WireProtocol, request: web.Request,
                      **parse: Any) -> tuple[Turn, str | None]:
        """Authenticate, read, parse, identify, then retrieve and inject (off the event loop unless
        the retriever is one of :data:`INLINE_RETRIEVERS` with its index built)."""
        caller_key = self.authenticate(request)
        raw, body = await self.read_body(request)
        large = len(raw) >= OFF_LOOP_BYTES

        def parsed() -> tuple[Turn, Identity]:
            turn = parse_turn(protocol, body, raw, self.config.model, **parse)
            # a protocol without a top-level message list (Responses' ``input``) is identified
            # by its messages in the chat form
            return turn, identify_session(request.headers, body if "messages" in body
                                          else {**body, "messages": turn.messages},
                                          (self.config.user, self.config.agent))

        turn, identity = await asyncio.to_thread(parsed) if large else parsed()
        turn.session_id, turn.turn_type, turn.done = (identity.session_id, identity.turn_type,
                                                      identity.done)
        turn.identified_by = identity.how
        self.identify_principals(turn, identity)
        if (identity.how["session"] == FINGERPRINT and is_task_turn(turn.turn_type)
                and not parse.get("count_only")):
            # conversations opening alike are told apart by the replies they continue (a count
            # of tokens is no turn: it would take the session its conversation's turn is due)
            threads = self.parts.threads
            if threads.reads_network or large:  # it may look up the recorded sessions, or
                # hash megabytes: off the loop
                resolving = asyncio.get_running_loop().run_in_executor(
                    None, threads.resolve, identity.session_id, turn.messages)
                try:
                    turn.session_id, how, turn.thread = await asyncio.wait_for(
                        asyncio.shield(resolving), ACK_TIMEOUT_S)
                except (asyncio.CancelledError, asyncio.TimeoutError) as exc:
                    # the session it takes is freed once taken
                    resolving.add_done_callback(
                        lambda done: done.cancelled() or done.exception() is not None
                        or threads.settle(done.result()[2], False))
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    raise ProxyError(  # a database that stopped answering: an error, no hang
                        503, f"the workspace's store did not answer within "
                             f"{ACK_TIMEOUT_S:.0f} s while this conversation's session was "
                             "looked up; retry the request", type="server_error",
                        code="store_unavailable", headers={"Retry-After": "5"}) from None
            else:
                turn.session_id, how, turn.thread = threads.resolve(identity.session_id,
                                                                    turn.messages)
            turn.identified_by = {**turn.identified_by, "session": how}
        try:
            turn.generation, skills = self.parts.library.current()
            skills = self.visible_skills(turn.generation, skills, turn.person, turn.agent)
            if is_task_turn(turn.turn_type) and skills:
                retriever = self.parts.retriever
                indexed = getattr(retriever, "indexed", None)  # not in the Retriever protocol
                if getattr(retriever, "kind", None) in INLINE_RETRIEVERS and not large \
                        and indexed is not None and indexed(skills):
                    self.select_and_inject(turn, skills)
                else:
                    await asyncio.get_running_loop().run_in_executor(
                        self.parts.retrieval_pool, self.select_and_inject, turn, skills)
            else:
                if is_task_turn(turn.turn_type):  # no skill to choose: the ask is still shown
                    try:  # (turns --why, the trace)
                        turn.query = (await asyncio.to_thread(retrieval_query, turn) if large
                                      else retrieval_query(turn))
                    except Exception:  # noqa: BLE001 - served all the same
                        log.exception("could not find the ask of a turn")
                if BLOCK_TAG in turn.raw:
                    # a turn served no skills (a side call, an empty library) that resends an
                    # earlier turn's block: taken out, so the upstream sees no skills here either
                    turn.body = turn.protocol.inject(turn.body, "")
                    turn.messages = skill_block.inject(turn.messages, "")
        except BaseException:  # cancelled (its client hung up): the session it took is free
            if turn.thread is not None:
                self.parts.threads.settle(turn.thread, False)
            raise
        asked, allowed = self.output_tokens(turn)
        if allowed != asked:  # the upstream is asked for less: the turn says so, whether or not
            # skills were fitted to a budget (which then says more)
            turn.budget = {"reserved_output": allowed, **(turn.budget or {}),
                           "asked_output": asked}
        return turn, caller_key

    def identify_principals(self, turn: Turn, identity: Identity) -> None:
        """Whom ``turn`` serves: the person and the agent its headers name
        (``X-MetaClaw-User`` / ``X-MetaClaw-Agent``), else the proxy's configured ``user`` /
        ``agent``; which source decided is added to ``identified_by`` (``person`` / ``agent``)
        when there is one."""
        how = dict(turn.identified_by)
        for key, option, given, header in (("person", "user", identity.person, "X-MetaClaw-User"),
                                           ("agent", "agent", identity.agent, "X-MetaClaw-Agent")):
            configured = getattr(self.config, option, None)
            value = given if given is not None else configured or None
            setattr(turn, key, value)
            if value is not None:
                how[key] = f"header:{header}" if given is not None else f"config:{option}"
        turn.identified_by = how

    # -- forwarding -----------------------------------------------------------------------
    def upstream(self) -> Upstream:
        responder = self.parts.responder
        if responder is not None:
            return ResponderUpstream(responder)
        if self.parts.upstream is None:
            raise ProxyError(503, "no upstream is configured: start the proxy with an upstream "
                                  "URL (ProxyConfig.upstream_url or metaclaw serve --upstream URL) "
                                  "or set a responder", type="server_error", code="no_upstream")
        return self.parts.upstream

    def output_tokens(self, turn: Turn) -> tuple[int | None, int | None]:
        """(the output tokens the client asked for, what the upstream is asked for): a request
        translated to another protocol asks for at most the model's output limit where it is
        known (:func:`metaclaw.proxy.context_budget.output_limit`); one in the upstream's own
        protocol asks for what its client asked, as sent."""
        asked = turn.protocol.max_output_tokens(turn.body)
        upstream = None if self.parts.responder is not None else self.parts.upstream
        if upstream is None or upstream.protocol is turn.protocol or not asked:
            return asked, asked
        limit = context_budget.output_limit(turn.model, self.config.max_output_tokens)
        return asked, (min(asked, limit) if limit else asked)

    def forward_body(self, turn: Turn, upstream: Upstream) -> tuple[dict[str, Any], bool]:
        """The body in the upstream's protocol (translated when the client's differs: from the
        chat form the turn already holds, its messages with the skills, which is what the
        client protocol's ``to_chat`` of the injected body gives). A translated request asks
        for at most the output the upstream model gives (:meth:`output_tokens`): its client
        asked with another model's limit in mind (Claude Code asks for 128,000 tokens, which
        a gpt-4o refuses)."""
        target = upstream.protocol
        if target is turn.protocol:
            body = turn.body
        else:
            chat = {**turn.chat, "messages": turn.messages}
            asked, allowed = self.output_tokens(turn)
            if allowed != asked:
                for key in ("max_completion_tokens", "max_tokens"):
                    if chat.get(key):
                        chat[key] = allowed
            body = target.from_chat(chat)
        forward, client_asked = target.prepare_forward(body, self.config.stream_usage)
        if target is not turn.protocol:  # what the client asked for, in its own protocol
            client_asked = turn.protocol.asks_for_usage(turn.body)
        return forward, client_asked

    @staticmethod
    def upstream_headers(turn: Turn, upstream: Upstream, request: web.Request) -> dict[str, str]:
        """The client's headers an upstream of its own protocol receives as they came (the
        protocol's ``forward_headers``)."""
        if upstream.protocol is turn.protocol:
            return {k: request.headers[k] for k in turn.protocol.forward_headers
                    if k in request.headers}
        return {}

    async def serve(self, protocol: WireProtocol, request: web.Request) -> web.StreamResponse:
        """The whole pipeline for one request of ``protocol``."""
        started = time.perf_counter()
        try:
            turn, caller_key = await self.prepare(protocol, request)
        except asyncio.CancelledError:
            if not self.parts.stopping:
                raise
            return protocol.error_response(STOPPED)
        responder = self.parts.responder
        policy_version = int(getattr(responder, "policy_version", 0)) if responder else 0
        record = record_row(turn, policy_version)
        headers = {"X-MetaClaw-Skill-Generation": str(turn.generation),
                   "X-MetaClaw-Injected-Skills": ",".join(turn.injected),
                   "X-MetaClaw-Policy-Version": str(policy_version)}
        relay = _Relay(self, turn, record, headers, caller_key, started)
        try:
            upstream = self.upstream()
        except ProxyError as exc:
            return await relay.fail(exc, None)
        if turn.stream:
            return await relay.stream(request, upstream)
        return await relay.complete(request, upstream)

    async def acknowledge(self, recorded: asyncio.Future[Any]) -> int | None:
        """Called between recording a turn and sending the client the end of its reply
        (``[DONE]``, ``message_stop``, a non-streaming body).

        With ``ProxyConfig.durable_acks`` (the default) this waits until the turn's group is
        committed to the store, so a turn a client received in full survives ``kill -9``; the
        group-commit writer makes the wait one shared commit. A turn the store could not take
        raises a 500 :class:`ProxyError`: the reply's end is withheld rather than acknowledging
        a turn the store does not hold. Without durable acks the record is only queued (still
        found by :meth:`Proxy.flush`)."""
        if not self.config.durable_acks:
            return None
        deadline = asyncio.get_running_loop().time() + ACK_TIMEOUT_S
        while True:
            try:
                turn_id = await asyncio.wait_for(asyncio.shield(recorded),
                                                 deadline - asyncio.get_running_loop().time())
                break
            except asyncio.TimeoutError:  # a database that takes the commit and never answers
                raise ProxyError(503, f"the workspace's store did not confirm this turn's "
                                      f"record within {ACK_TIMEOUT_S:.0f} s, so the proxy does "
                                      "not acknowledge the reply; retry the request (the turn "
                                      "may still be recorded once the store answers)",
                                 type="server_error", code="store_unavailable",
                                 headers={"Retry-After": "5"}) from None
            except asyncio.CancelledError:  # the stop's cut-off: this turn is recorded (the
                if not self.parts.stopping:  # stop drains it), so its client gets its reply
                    raise
        if turn_id is UNREACHABLE:
            raise ProxyError(503, "the workspace database is unreachable, so this turn's record "
                                  "was not confirmed and the proxy does not acknowledge the "
                                  "reply; retry the request when it is back", type="server_error",
                             code="store_unavailable", headers={"Retry-After": "5"})
        if turn_id is BUSY:
            raise ProxyError(503, f"another process held the workspace's write lock for over "
                                  f"{BUSY_TIMEOUT_S:.0f} s, so this turn was not recorded and "
                                  "the proxy does not acknowledge the reply; retry the request",
                             type="server_error", code="store_busy",
                             headers={"Retry-After": "5"})
        if turn_id is None:
            raise ProxyError(500, "the proxy could not record this turn in its store (see the "
                                  "proxy log), so it does not acknowledge the reply; retry the "
                                  "request", type="server_error", code="record_failed")
        return turn_id

    # -- count_tokens ---------------------------------------------------------------------
    async def count_tokens(self, protocol: WireProtocol, request: web.Request) -> web.Response:
        """Tokens of the request as the proxy would forward it (skills injected): the Anthropic
        upstream's own count when it is one, else the proxy's count (module context_budget)."""
        turn, caller_key = await self.prepare(protocol, request, count_only=True)
        upstream = self.parts.upstream
        if (self.parts.responder is None and upstream is not None
                and upstream.protocol is protocol and hasattr(upstream, "count_tokens")):
            try:
                payload = await upstream.count_tokens(
                    turn.body, caller_key, self.upstream_headers(turn, upstream, request))
            except Exception as exc:
                error = self.parts.scrubber.error(upstream.map_error(exc), caller_key)
                return protocol.error_response(error)
            return web.Response(body=payload, content_type="application/json")
        count = self.parts.token_counter.count(dumps(
            {k: turn.body.get(k) for k in ("system", "messages", "tools") if k in turn.body}))
        return web.json_response({"input_tokens": count})


async def _feed(request: web.Request, decoder: edge.BodyDecoder) -> None:
    """Hand each chunk of the request body to ``decoder`` as it arrives."""
    while chunk := await request.content.readany():
        decoder.feed(chunk)


class _ClientGone(Exception):
    """The client closed its connection while the proxy was writing to it."""


def _is_error_event(event: dict[str, Any] | None) -> bool:
    return event is not None and ("error" in event or event.get("type") == "error")


class _Relay:
    """Forward and relay steps for one turn, and its record at the end.

    Every way a turn can end is recorded with a status: ``ok``; ``error`` (the upstream failed,
    answered garbage or cut its stream short; the client got an error in its protocol);
    ``client_disconnected`` (the client left before the headers or mid-stream; the record holds
    what the upstream sent until then); ``cancelled`` (the proxy stopped while the turn was in
    flight).
    """

    def __init__(self, pipeline: TurnPipeline, turn: Turn, record: dict[str, Any],
                 headers: dict[str, str], caller_key: str | None, started: float):
        self.pipeline = pipeline
        self.parts = pipeline.parts
        self.turn = turn
        self.record = record
        self.headers = headers
        self.caller_key = caller_key
        self.started = started
        self.secrets = self.parts.scrubber.secrets(caller_key)
        self.secret_bytes = tuple(secret.encode() for secret in self.secrets)
        self.sent = 0  # body bytes written to the client

    def finish(self, **fields: Any) -> asyncio.Future[Any]:
        """The record step: the row joins the recorder's next group commit (:class:`Recorder`)."""
        row = {**self.record, **fields,
               "latency_ms": (time.perf_counter() - self.started) * 1000.0}
        if row.get("status") == "ok":  # a served task turn enters the buffers as it is recorded
            row["buffer_set"], row["buffer_state"] = buffers.classify(
                row, generation=self.parts.library.generation)
        if self.secrets:
            for key in ("response", "error"):
                if isinstance(row.get(key), str):
                    row[key] = self.parts.scrubber.text(row[key], self.caller_key)
        if row.get("status") == "error":
            self.parts.failures.warn(row.get("http_status"), str(row.get("error") or ""),
                                     row.get("session_id"))
        if self.turn.thread is not None:
            self.parts.threads.settle(self.turn.thread, row.get("status") == "ok",
                                      row.get("response"), row.get("tool_calls"))
        return self.parts.recorder.submit(row, self.turn.done)

    def error(self, exc: BaseException, upstream: Upstream | None,
              midstream: bool = False) -> ProxyError:
        error = exc if isinstance(exc, ProxyError) or upstream is None else upstream.map_error(
            exc, midstream)
        return self.parts.scrubber.error(error, self.caller_key)

    async def fail(self, exc: BaseException, upstream: Upstream | None) -> web.Response:
        """Record the turn as failed and answer with the client protocol's error for ``exc``."""
        error = self.error(exc, upstream)
        recorded = self.finish(status="error", http_status=error.status, error=error.message)
        with contextlib.suppress(ProxyError):
            await self.pipeline.acknowledge(recorded)
        return self.turn.protocol.error_response(error, self.headers)

    def cancelled(self, **fields: Any) -> None:
        """The turn's handler was cancelled: the proxy is stopping, or the client hung up (the
        server cancels the handler of a closed connection, and with it the upstream call)."""
        if self.parts.stopping:
            self.finish(status="cancelled",
                        error="the proxy stopped while this turn was in flight", **fields)
            return
        where = "mid-stream" if self.sent else "before the reply"
        self.finish(status="client_disconnected", error=f"the client disconnected {where}; "
                    "the upstream request was cancelled", **fields)

    def stopped(self) -> web.Response:
        """The proxy's stop cut this turn off before its reply's first byte: recorded as
        cancelled, answered with a 503 ``proxy_stopped`` the client may retry."""
        self.cancelled(http_status=STOPPED.status)
        return self.turn.protocol.error_response(STOPPED, self.headers)

    async def complete(self, request: web.Request, upstream: Upstream) -> web.Response:
        turn, client = self.turn, self.turn.protocol
        try:
            body, _ = self.pipeline.forward_body(turn, upstream)
            payload, data, policy = await upstream.complete(
                body, self.caller_key, self.pipeline.upstream_headers(turn, upstream, request))
            if "policy_version" in policy:
                self.headers["X-MetaClaw-Policy-Version"] = str(policy["policy_version"])
            if upstream.protocol.complete_reply(data):  # e.g. a tool call's missing id
                payload = dumpb(data)
            if upstream.protocol is not client:
                payload = dumpb(client.reply_from_chat(
                    upstream.protocol.reply_to_chat(data), turn.body))
        except asyncio.CancelledError:
            if not self.parts.stopping:
                self.cancelled()
                raise
            return self.stopped()
        except Exception as exc:
            return await self.fail(exc, upstream)
        payload = mask_bytes(payload, self.secret_bytes)
        columns = {**upstream.protocol.reply_columns(data), **policy}
        if request.transport is None or request.transport.is_closing():
            # the client gave up waiting (an SDK timeout): nobody saw this reply, so it is not
            # a served turn to judge or train on
            self.finish(status="client_disconnected", http_status=200,
                        error="the client disconnected before the reply", **columns)
            return web.Response(body=payload, status=200, content_type="application/json",
                                headers=self.headers)
        recorded = self.finish(status="ok", http_status=200, **columns)
        try:
            await self.pipeline.acknowledge(recorded)
        except ProxyError as exc:
            return client.error_response(exc, self.headers)
        return web.Response(body=payload, status=200, content_type="application/json",
                            headers=self.headers)

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        try:
            await response.write(data)
        except ConnectionError:  # aiohttp's ClientConnectionResetError among them
            raise _ClientGone() from None
        self.sent += len(data)

    async def stream(self, request: web.Request, upstream: Upstream) -> web.StreamResponse:
        turn, client, source = self.turn, self.turn.protocol, upstream.protocol
        same = source is client
        assembler = source.assembler()
        captured: dict[str, Any] = {}  # the responder's ``metaclaw`` object, kept from the client

        def columns() -> dict[str, Any]:
            return {**assembler.columns(), **policy_columns(captured.get("metaclaw"))}

        async with contextlib.AsyncExitStack() as stack:
            try:
                body, client_asked = self.pipeline.forward_body(turn, upstream)
                events = await upstream.stream(
                    body, self.caller_key, self.pipeline.upstream_headers(turn, upstream, request),
                    stack, captured)
            except asyncio.CancelledError:
                if not self.parts.stopping:
                    self.cancelled()
                    raise
                return self.stopped()
            except Exception as exc:
                return await self.fail(exc, upstream)
            to_chat = None if same else source.stream_to_chat()
            from_chat = None if same else client.stream_from_chat(turn.body)
            chunks = source.pivot  # a chat upstream's events are chat chunks already

            def translate(event: dict[str, Any] | None) -> list[dict[str, Any] | None]:
                if chunks:
                    return from_chat.feed(event)
                return [out for chunk in to_chat.feed(event) for out in from_chat.feed(chunk)]

            response = web.StreamResponse(status=200, headers={
                **self.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"})
            status, failure = "ok", None
            held: list[bytes] = []  # the terminal event goes out after the record is committed
            ends_failed = False  # that terminal event says the response failed (it then stays)
            # the first and the last event sent: an error event follows them
            first: dict[str, Any] | None = None
            last: dict[str, Any] | None = None

            def note_sent(event: Any) -> None:
                nonlocal first, last
                if isinstance(event, dict):
                    first, last = first or event, event
            try:
                if request.transport is None or request.transport.is_closing():
                    raise _ClientGone()
                try:
                    await response.prepare(request)
                except ConnectionError:
                    raise _ClientGone() from None
                ended = False
                async for batch in events:  # the events that arrived together go out together
                    relayed: list[bytes] = []
                    for raw, event in batch:
                        terminal = source.is_terminal(raw, event)
                        ended = ended or terminal
                        if _is_error_event(event):  # an upstream error may quote the key
                            event = mask_json(event, self.secrets)
                        assembler.add(event)
                        if same:  # relayed as it came (one event: no list to build)
                            if terminal:
                                held.append(raw)
                                ends_failed = ends_failed or client.ends_failed(event)
                            elif not client.is_private(event, client_asked):
                                relayed.append(raw)
                                note_sent(event)
                            continue
                        for out in translate(event):
                            data = client.encode_event(out)
                            if client.is_terminal(data, out):
                                held.append(data)
                                ends_failed = ends_failed or client.ends_failed(out)
                            elif not client.is_private(out, client_asked):
                                relayed.append(data)
                                note_sent(out)
                    if relayed:  # masked as a whole: an upstream may quote the key anywhere
                        await self.write(response, mask_bytes(b"".join(relayed),
                                                              self.secret_bytes))
                if not ended and assembler.error is None and \
                        source.complete_without_terminal(assembler):
                    ended = True  # a whole reply whose upstream left out the terminal event
                    if same:
                        held.append(client.encode_event(None))
                if not ended and assembler.error is None:
                    raise ProxyError(502, f"the upstream {_where(upstream)} ended its stream "
                                          "before the final event (truncated reply); retry the "
                                          "request", type="upstream_error",
                                     code="upstream_truncated")
                if not same and assembler.error is None:  # the end of the translated stream
                    tail = [out for chunk in to_chat.close() for out in from_chat.feed(chunk)]
                    relayed = []
                    for out in [*tail, *from_chat.close()]:
                        data = client.encode_event(out)
                        if client.is_terminal(data, out):
                            held.append(data)
                        elif not client.is_private(out, client_asked):
                            relayed.append(data)
                            note_sent(out)
                    if relayed:  # one write, masked like the events before it
                        await self.write(response, mask_bytes(b"".join(relayed),
                                                              self.secret_bytes))
            except _ClientGone:
                where = "mid-stream" if self.sent else "before the reply's first byte"
                self.finish(status="client_disconnected", http_status=200,
                            error=f"the client disconnected {where}", **columns())
                return response
            except asyncio.CancelledError:
                self.cancelled(http_status=200, **columns())
                if self.parts.stopping and response.prepared:  # the agent is told why the
                    # reply ended, in a whole reply (a cut chunked body reads as a network error)
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(response.write_eof(_error_event(
                            client, STOPPED, first, last)), STOPPED_WRITE_S)
                raise
            except Exception as exc:
                error = self.error(exc, upstream, midstream=True)
                status, failure, held, ends_failed = "error", error.message, [], True
                try:
                    with contextlib.suppress(_ClientGone):
                        await self.write(response, _error_event(client, error, first, last))
                except asyncio.CancelledError:  # cut off as it says why (its client left,
                    # the proxy stopped): the failed turn is recorded all the same
                    self.finish(status=status, http_status=200, error=failure, **columns())
                    raise
            if failure is None and assembler.error is not None:
                status = "error"
                failure = ("upstream stream error: "
                           f"{assembler.error.get('message', assembler.error)}")
                if not ends_failed:  # an errored stream does not also end as if complete;
                    held = []        # one whose last event says it failed ends with that
                ends_failed = True
            recorded = self.finish(status=status, http_status=200,
                                   error=failure or self.record.get("error"), **columns())
            try:
                await self.pipeline.acknowledge(recorded)
            except ProxyError as exc:  # one failure said per stream: a stream that already
                # ended in its failure gets nothing more; else this error is its end
                held = [] if ends_failed and not held else [_error_event(client, exc, first, last)]
            with contextlib.suppress(_ClientGone, ConnectionError):  # the end and the last chunk
                await response.write_eof(mask_bytes(b"".join(held),
                                                                  self.secret_bytes))
            return response


#: What a request still running when the proxy stops gets after its grace period: a 503 (a client
#: may retry it) before the reply's first byte, else its stream's error event; so the agent says
#: why the reply ended instead of "connection closed".
STOPPED = ProxyError(503, "the MetaClaw proxy stopped before this reply was complete; retry the "
                          "request once the proxy is back",
                     type="server_error", code="proxy_stopped")
#: How long the proxy waits to write :data:`STOPPED` (a client that reads nothing gets none).
STOPPED_WRITE_S = 1.0


def _error_event(client: WireProtocol, error: ProxyError, first: dict[str, Any] | None,
                 last: dict[str, Any] | None) -> bytes:
    """``client.stream_error_event`` for ``error`` after the events ``first`` .. ``last``; a
    protocol written to the one-argument form is called with ``error`` alone, and one that
    cannot say it at all ends the stream without it: the turn is recorded either way."""
    try:
        try:
            return client.stream_error_event(error, first, last)
        except TypeError:
            return client.stream_error_event(error)
    except Exception:  # noqa: BLE001 - the record must not be lost to a protocol's bug
        log.exception("the %s protocol could not write a stream's error event", client.name)
        return b""


def _where(upstream: Upstream) -> str:
    from metaclaw.redact import safe_url

    return safe_url(getattr(upstream, "url", None)) or upstream.kind
