"""The proxy: inject skills, forward upstream, record every turn, for OpenAI and Anthropic clients.

An agent points its OpenAI client (``base_url=proxy.url``) or its Anthropic client
(``base_url=proxy.base_url``) at the proxy. Every ``POST /v1/chat/completions`` and
``POST /v1/messages`` goes through one turn pipeline (:mod:`metaclaw.proxy.pipeline`):

1. check the optional token (or take the caller's own upstream key under caller-auth) and the
   request body (errors in the client protocol's shape: 400 malformed, 401 token, 413 too large);
2. identify the session and turn type; on *main* turns retrieve the most relevant skills of the
   current library generation (a model-based retriever in a worker thread, never on the event
   loop; the lexical one inline, see :data:`metaclaw.proxy.pipeline.INLINE_RETRIEVERS`), keep those that fit
   the model's context window (:mod:`metaclaw.proxy.context_budget`) and add them to the system prompt;
3. forward the request to the upstream (:mod:`metaclaw.proxy.upstreams`: any OpenAI-compatible base URL
   or an Anthropic Messages endpoint, through one pooled aiohttp session, translating when the
   client speaks the other protocol, see :mod:`metaclaw.protocols`) or, when a local
   policy is set with :meth:`Proxy.set_responder`, answer from it. Streams are relayed event by
   event as they arrive;
4. record the turn in the :class:`~metaclaw.store.Store` in one schema whatever the protocol (what
   was sent upstream after injection, as OpenAI chat messages; the reply, tool calls, usage,
   latency, status, the skill generation and policy version that served it) and call the turn
   listeners with the new turn id. A responder's reply may carry a ``metaclaw`` object (the
   policy version that produced it, the prompt and completion token ids and the completion's
   sampling logprobs, see :mod:`metaclaw.slowloop.policy`): it is recorded with the turn and removed
   before the reply reaches the client. A request the responder refuses (``PolicyRequestError``)
   gets a 400 error.

Upstream failures map to the client protocol's error JSON with the right status: upstream HTTP
errors keep their status and message (an error object answered with HTTP 200 becomes a 502 with
its message), a redirect is a 502 naming where it points, a timeout is 504, an unreachable
upstream 502, and a stream the upstream drops midway ends with an error event. Failed turns are
recorded too.

Session headers (compatible with upstream MetaClaw): ``X-Session-Id`` (or body ``session_id``),
``X-Turn-Type`` (``main`` | ``side``), ``X-Session-Done``. Clients that send none of them still
get sessions and side-call detection (:mod:`metaclaw.proxy.sessions` has the precedence). They and the
client's ``Authorization`` / ``x-api-key`` headers are never forwarded; the upstream key comes
from the environment variable named by ``ProxyConfig.api_key_env`` (or, with
``ProxyConfig.caller_auth``, is the caller's own key) and is never logged or stored.

Each turn is committed to the store before the end of its reply is sent (with
``ProxyConfig.durable_acks``, the default; see :class:`metaclaw.proxy.pipeline.Recorder` for where the
commit runs); call :meth:`Proxy.flush` to wait until every turn answered so far is recorded.
Each reply carries ``X-MetaClaw-Skill-Generation``, ``X-MetaClaw-Injected-Skills`` and ``X-MetaClaw-Policy-Version``
headers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

from aiohttp import web

from metaclaw.jsonlib import dumpb, loads
from metaclaw.protocols import ProxyError
from metaclaw.protocols.registry import PROTOCOLS, client_protocol
from metaclaw.proxy.context_budget import TokenCounter
from metaclaw.proxy.edge import EdgeRunner
from metaclaw.proxy.pipeline import (Collaborators, Recorder, Scrubber, TurnListeners,
                                     TurnPipeline)
from metaclaw.proxy.server import BackgroundServer, ServedApp, _base_url
from metaclaw.proxy.sessions import ReplyThreads
from metaclaw.proxy.upstreams import make_upstream
from metaclaw.redact import safe_url
from metaclaw.skills import retrieval
from metaclaw.skills.block import BUDGET_CHARS, TOP_K
from metaclaw.store import Store, StoreUnavailable
from metaclaw.turns import IdentityError, check_principal

if TYPE_CHECKING:  # pragma: no cover
    from metaclaw.skills.library import SkillLibrary

log = logging.getLogger("metaclaw.proxy")


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class ProxyConfig:
    """How the proxy listens, where it forwards, and how it retrieves skills.

    ``upstream_url``: OpenAI-compatible base URL (e.g. ``http://127.0.0.1:8000/v1``); ``None``
    means no upstream (requests get 503 unless a responder is set). ``model``: when set, replaces
    the model of every request. ``api_key_env``: name of the environment variable holding the
    upstream key (a placeholder key is sent when it is unset). ``token``: when set, clients must
    send ``Authorization: Bearer <token>``. ``retrieval``/``embedding_model``: passed to
    :func:`metaclaw.skills.retrieval.make_retriever`. ``top_k``/``min_score``/``budget_chars``: passed
    to :func:`metaclaw.skills.retrieval.select`. ``timeout``: seconds to wait for the upstream (per read
    while streaming). ``max_body_bytes``: larger request bodies get 413. ``max_retries``: retries
    of upstream calls on 408/409/429/5xx, only before any byte reached the client, waiting as the
    upstream's Retry-After says (a longer wait than 20 s is relayed instead); 0 where the client
    retries on its own (``metaclaw serve``'s default), or each of its attempts would cost up to
    ``max_retries + 1`` upstream calls. A connection that could not be opened is tried once more
    even at 0 (it reached no upstream).
    ``stream_usage``: ask the upstream for the usage chunk on every stream so the turn's token
    counts are recorded (the chunk is relayed only to clients that asked for it).
    ``upstream_protocol``: the wire protocol of the upstream, the name of a registered protocol
    that declares an upstream path (:func:`metaclaw.protocols.registry.upstream_protocols`:
    ``"openai"`` for any OpenAI-compatible server, ``"responses"``, ``"anthropic"`` for an
    Anthropic Messages endpoint, its base URL with or without ``/v1``). ``caller_auth``:
    forward each caller's own key (``x-api-key`` or ``Authorization: Bearer``) to the upstream
    instead of the server key; the proxy token, when set, then comes in ``X-MetaClaw-Token``.
    ``context_window``/``context_windows``/``tokenizer``: the context budget (see
    :mod:`metaclaw.proxy.context_budget`): the window for models not otherwise known, the
    windows per model name, and a ``tokenizer.json`` path (or ``str -> int`` callable) to count
    with instead of the estimate. ``max_output_tokens``: the most output tokens the upstream
    model gives in a reply, for models the proxy does not know by name
    (:func:`metaclaw.proxy.context_budget.output_limit`): a request translated from another
    protocol asks for no more, and no more is reserved in the budget. ``durable_acks`` (default
    on): send the end of each reply only once its turn is committed to the store (group commit,
    see :mod:`metaclaw.proxy.pipeline`), so an acknowledged turn survives ``kill -9``; off, the
    turn is committed right after the reply is sent (:meth:`Proxy.flush` waits for it). ``fsync_acks`` (default off): fsync each group commit
    too (SQLite ``synchronous=FULL``), so that an acknowledged turn also survives an OS crash or
    a power loss, for about one fsync of latency per group (milliseconds on many disks);
    off, a commit is written to the operating system without the fsync (``synchronous=NORMAL``):
    it survives ``kill -9`` of the proxy, and an OS crash or power loss may lose the last turns
    (never the database). On PostgreSQL every acknowledged turn is flushed by the server
    (``synchronous_commit`` on) whatever ``fsync_acks`` says. ``header_timeout``: seconds a client connection may
    take to send a whole request line and headers (and stay idle between requests);
    ``body_timeout``: seconds to receive the request body (408 after); ``max_connections``: open
    client connections beyond it get a 503 and are closed (slow or stuck clients cannot hold the
    proxy). ``user`` / ``agent``: the person and the agent a turn serves when its request does
    not say (headers ``X-MetaClaw-User`` / ``X-MetaClaw-Agent`` win); recorded on the turn, and
    they decide which private skills it may be offered (see :mod:`metaclaw.proxy.sessions`).

    The fields :class:`metaclaw.runtime.RuntimeConfig` also declares (the ``serve`` options)
    are written in both, as the proxy cannot import that outer layer; they keep one default and
    one type (checked by ``tests/test_runtime_config.py``).
    """

    upstream_url: str | None = None
    model: str | None = None
    api_key_env: str = "METACLAW_UPSTREAM_API_KEY"
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    retrieval: str = "auto"
    embedding_model: str | None = None
    top_k: int = TOP_K
    min_score: float | None = None
    budget_chars: int = BUDGET_CHARS
    timeout: float = 120.0
    max_body_bytes: int = 32 * 2**20
    max_retries: int = 2
    stream_usage: bool = True
    upstream_protocol: str = "openai"
    durable_acks: bool = True
    fsync_acks: bool = False
    caller_auth: bool = False
    context_window: int | None = None
    context_windows: dict[str, int] | None = None
    max_output_tokens: int | None = None
    tokenizer: Any = None
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    user: str | None = None
    agent: str | None = None

    def __post_init__(self) -> None:
        for name in ("user", "agent"):
            value = getattr(self, name)
            if value is not None and value != "":
                try:
                    setattr(self, name, check_principal(value, name, f"ProxyConfig.{name}"))
                except IdentityError as exc:
                    raise ValueError(str(exc)) from None
            else:
                setattr(self, name, None)


class Responder(Protocol):
    """A local policy answering instead of the upstream (the slow loop's trained weights).

    ``complete(body)`` returns an OpenAI ``chat.completion`` dict; ``stream(body)`` yields
    ``chat.completion.chunk`` dicts. ``body`` is the request as it would go upstream (skills
    injected, proxy fields removed). ``policy_version`` is recorded with every turn it serves.
    """

    policy_version: int

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...



def _protocol_of(request: web.Request) -> Any:
    """The protocol whose shape errors on ``request`` take
    (:func:`metaclaw.protocols.registry.client_protocol`)."""
    return client_protocol(request.path, request.headers)


class _SecretFilter(logging.Filter):
    """Masks the proxy's secrets in its log records (message, arguments and traceback): an
    upstream exception's text can quote the key it was sent."""

    def __init__(self, scrubber: Scrubber):
        super().__init__()
        self.scrubber = scrubber

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.scrubber.secrets():
            return True
        message = record.getMessage()
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        record.msg, record.args = self.scrubber.text(message), None
        if record.exc_text:
            record.exc_text = self.scrubber.text(record.exc_text)
        return True


class Proxy(ServedApp):
    """The proxy in front of an upstream (OpenAI and Anthropic clients), with skills and recording.

    ``config``: :class:`ProxyConfig`. ``store``: where turns are recorded. ``library``: the
    :class:`~metaclaw.skills.library.SkillLibrary` whose current generation is injected. ``retriever``:
    any :class:`~metaclaw.skills.retrieval.Retriever`; built from ``config.retrieval`` when omitted.
    """

    def __init__(self, config: ProxyConfig, store: Store, library: "SkillLibrary",
                 retriever: Any = None):
        self.config = config
        self.store = store
        self.library = library
        self.retriever = retriever if retriever is not None else retrieval.make_retriever(
            config.retrieval, config.embedding_model)
        self.token_counter = TokenCounter(config.tokenizer)
        self.threads = ReplyThreads(store)  # which of alike-opening conversations a turn is
        self._listeners = TurnListeners()
        self._recorder = Recorder(store, fsync=config.fsync_acks, listeners=self._listeners)
        # what the pipeline works with; upstream, responder, retrieval pool and stopping are
        # set on it as the proxy starts, swaps its responder and stops
        self._parts = Collaborators(config, library, self.retriever, self._recorder,
                                    Scrubber(config.api_key_env, config.token,
                                             config.upstream_url), self.threads,
                                    self.token_counter)
        self._pipeline = TurnPipeline(self._parts)
        self._log_filter = _SecretFilter(self._parts.scrubber)
        self._in_flight: set[asyncio.Task[Any]] = set()  # the handlers serving a turn now
        # this process's row of the workspace's proxy_activity (see _report_activity)
        self._activity_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._activity: asyncio.Task[Any] | None = None
        self._reported = False  # a row of this proxy's is in proxy_activity
        #: set once the retriever's models are loaded (or failed to load) after start; how long
        #: that took in ``retrieval_warm_s``
        self.retrieval_ready = threading.Event()
        self.retrieval_warm_s: float | None = None
        # A client that hangs up (an SDK timeout, Ctrl-C) cancels its handler, and with it the
        # upstream request: the upstream stops generating (and billing) a reply nobody reads.
        runner = functools.partial(EdgeRunner, header_timeout=config.header_timeout,
                                   max_connections=config.max_connections,
                                   handler_cancellation=True)
        self._server = BackgroundServer(self._make_app, config.host, config.port, "metaclaw-proxy",
                                        runner=runner)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Proxy":
        """Serve in a background thread with its own event loop; returns when listening."""
        super().start()
        log.info("MetaClaw proxy listening on %s (upstream: %s)", self.url,
                 safe_url(self.config.upstream_url) or "none")
        return self

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve in the calling thread until Ctrl-C or SIGTERM (what ``metaclaw serve`` runs).

        ``on_ready(url)`` is called once the socket listens (useful with ``port=0``). On exit,
        pending turns are recorded before the store is left alone.
        """
        def ready() -> None:
            log.info("MetaClaw proxy listening on %s (upstream: %s)", self.url,
                     safe_url(self.config.upstream_url) or "none")
            if on_ready is not None:
                on_ready(self.url)

        self._server.serve_forever(on_ready=ready)

    def __repr__(self) -> str:
        where = self.url if self.running else "not running"
        return (f"Proxy({where} -> {safe_url(self.config.upstream_url) or 'no upstream'}, "
                f"policy v{self.policy_version})")

    def flush(self, timeout: float = 30.0) -> None:
        """Block until every turn answered so far is in the store (call from outside the loop)."""
        if self._server.loop is not None:
            self._server.call(self._drain(), timeout)

    def show_failures_elsewhere(self, session_id: str) -> None:
        """The turns of ``session_id`` fail in front of whoever sent them (a notebook's chat
        cell says why): the proxy's log does not say it again."""
        self._parts.failures.shown_elsewhere.add(session_id)

    # -- seams for the loops --------------------------------------------------------------
    def add_turn_listener(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(turn_id)`` in a worker thread after each turn is recorded (errors are logged)."""
        self._listeners.add(fn)

    def remove_turn_listener(self, fn: Callable[[int], None]) -> None:
        self._listeners.remove(fn)

    def set_responder(self, responder: Any) -> None:
        """Answer from a local policy instead of the upstream (``None`` goes back to upstream).

        ``responder`` has ``async complete(body) -> dict`` (a chat.completion),
        ``stream(body) -> AsyncIterator[dict]`` (chat.completion.chunk dicts) and an int
        ``policy_version`` that is recorded with every turn it serves (or, more exactly, the
        ``metaclaw`` object of each reply, which is stripped before the client sees it). The
        swap is atomic: a request uses the responder that was set when it arrived.
        """
        if responder is not None:
            missing = [name for name in ("complete", "stream") if not callable(
                getattr(responder, name, None))]
            if missing or not hasattr(responder, "policy_version"):
                raise TypeError("a responder needs async complete(body), stream(body) and a "
                                f"policy_version attribute; {type(responder).__name__} lacks "
                                f"{', '.join(missing) or 'policy_version'}")
        self._parts.responder = responder

    @property
    def responder(self) -> Any:
        return self._parts.responder

    @property
    def stopping(self) -> bool:
        """Whether the server has begun to shut down."""
        return self._parts.stopping

    @property
    def policy_version(self) -> int:
        responder = self._parts.responder
        return int(getattr(responder, "policy_version", 0)) if responder is not None else 0

    # -- application ----------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """Base URL for Anthropic clients (``http://127.0.0.1:PORT``, no ``/v1``)."""
        return _base_url(self._server.host, self._server.port)

    @property
    def _pending(self) -> set[asyncio.Future[Any]]:
        return self._recorder.pending

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_middleware])
        for prefix in ("/v1", ""):
            for protocol in PROTOCOLS.values():
                for route in protocol.routes:
                    app.router.add_post(prefix + route, self._handler(protocol))
            for protocol in PROTOCOLS.values():
                if protocol.count_tokens_route:
                    app.router.add_post(prefix + protocol.count_tokens_route,
                                        self._count_tokens(protocol))
            app.router.add_get(prefix + "/models", self._models)
            app.router.add_get(prefix + "/models/{model_id:.+}", self._model)
        app.router.add_get("/healthz", self._health)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    def _handler(self, protocol: Any) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            task = asyncio.current_task()
            self._in_flight.add(task)
            try:
                return await self._pipeline.serve(protocol, request)
            finally:
                self._in_flight.discard(task)
        return handle

    def _count_tokens(self, protocol: Any) -> Callable[[web.Request], Any]:
        async def count(request: web.Request) -> web.Response:
            return await self._pipeline.count_tokens(protocol, request)
        return count

    async def _on_startup(self, app: web.Application) -> None:
        parts = self._parts
        parts.stopping = False
        pool = parts.retrieval_pool = ThreadPoolExecutor(  # embedding queries batch
            8, thread_name_prefix="metaclaw-retrieval")
        self._recorder.start()
        self._listeners.start()
        log.addFilter(self._log_filter)
        if self.config.upstream_url:
            parts.upstream = make_upstream(self.config.upstream_protocol,
                                           self.config.upstream_url, self.config.api_key_env,
                                           self.config.timeout, self.config.max_retries)
            parts.upstream.caller_auth = self.config.caller_auth
            await parts.upstream.open()
        if callable(getattr(self.retriever, "warm", None)):  # load models before the first turn
            asyncio.get_running_loop().run_in_executor(pool, self._warm)
        else:
            self.retrieval_ready.set()
        self._activity = asyncio.create_task(self._report_activity())

    #: Seconds between two reports of a request in flight (:meth:`_report_activity`).
    ACTIVITY_EVERY_S = 5.0

    async def _report_activity(self) -> None:
        """While a request is in flight, tell the workspace every :data:`ACTIVITY_EVERY_S`
        seconds (:meth:`~metaclaw.store.Store.mark_proxy_busy`): a turn is recorded when its
        reply ends, so without this the scheduler's proxy signal would read a reply that runs
        longer than its idle threshold as idle time and train through it. Nothing is written
        while the proxy is idle, and nothing on the request path."""
        failed = False
        while True:
            await asyncio.sleep(self.ACTIVITY_EVERY_S)
            if not any(not task.done() for task in self._in_flight):
                continue
            try:
                await asyncio.to_thread(self.store.mark_proxy_busy, self._activity_id)
                self._reported, failed = True, False
            except Exception as exc:  # noqa: BLE001 - a busy store: the next report is soon
                if not failed:
                    log.warning("could not report a request in flight to the workspace (the "
                                "scheduler may read the proxy as idle meanwhile): %s", exc)
                failed = True

    def _warm(self) -> None:
        started = time.monotonic()
        try:
            self.retriever.warm(self.library.skills())
        except Exception:
            log.exception("could not prepare the skill retriever; retrieval will retry per turn")
        finally:
            self.retrieval_warm_s = time.monotonic() - started
            self.retrieval_ready.set()

    async def _on_shutdown(self, app: web.Application) -> None:
        # before the server closes the connections: a turn cancelled from now on was stopped
        # by the proxy, not by its client
        self._parts.stopping = True
        busy = [task for task in self._in_flight if not task.done()]
        if not busy:
            return
        grace = self._server.shutdown_timeout
        log.warning("stopping: %d request(s) in flight get %g s to finish; those still running "
                    "then are cut off and recorded as cancelled", len(busy), grace)
        _, late = await asyncio.wait(busy, timeout=grace)
        # cut off here, while their connections are open: a stream ends with its protocol's
        # error event (the agent says why), not with a closed socket
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _on_cleanup(self, app: web.Application) -> None:
        log.removeFilter(self._log_filter)
        if self._activity is not None:
            self._activity.cancel()
            self._activity = None
        if self._reported:  # its row goes, unless the write lock is taken (it only ages)
            await asyncio.to_thread(self._forget_activity)
        # handlers whose client hung up while the upstream was still answering: the server
        # stops tracking a lost connection, so its shutdown neither waits for nor cancels them;
        # left alone they would be destroyed pending with the loop, their turns never recorded
        orphans = [task for task in self._in_flight if not task.done()]
        for task in orphans:
            task.cancel()
        await asyncio.gather(*orphans, return_exceptions=True)
        self._parts.failures.close(self.store.db_option)
        await self._drain()
        if self._parts.upstream is not None:
            await self._parts.upstream.close()
            self._parts.upstream = None
        self._recorder.stop()  # every answered turn reaches the store
        # a model still loading or a slow listener never blocks stop()
        if self._parts.retrieval_pool is not None:
            self._parts.retrieval_pool.shutdown(wait=False)
        self._listeners.stop()

    def _forget_activity(self) -> None:
        try:
            with self.store.transaction(fsync=False, wait=False):
                self.store.forget_proxy(self._activity_id)
            self._reported = False
        except Exception:  # noqa: BLE001 - a stale row only reads as an older request
            log.debug("could not drop this proxy's activity row", exc_info=True)

    async def _drain(self) -> None:
        await self._recorder.drain()

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as exc:
            return _protocol_of(request).error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return _protocol_of(request).error_response(self._pipeline.too_large())
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            served = ", ".join([f"POST /v1{route}" for p in PROTOCOLS.values()
                                for route in p.routes] + [
                f"POST /v1{p.count_tokens_route}" for p in PROTOCOLS.values()
                if p.count_tokens_route] + ["GET /v1/models", "GET /v1/models/{id}",
                                            "GET /healthz"])
            # the route, not a model, is what is missing: said so, as some clients read any 404
            # as "model not found"
            message = {404: f"no route {request.method} {request.path} on this MetaClaw proxy "
                            f"(the model is not the problem); it serves {served}",
                       405: f"method {request.method} is not allowed on {request.path}; the "
                            f"proxy serves {served}"}.get(exc.status, exc.reason)
            code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status,
                                                                         str(exc.status))
            return _protocol_of(request).error_response(
                ProxyError(exc.status, message, code=code))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except StoreUnavailable as exc:  # the workspace's database server is down: not a bug
            log.warning("the workspace database is unreachable: %s", exc)
            if request.writer is not None and request.writer.output_size > 0:
                raise ConnectionResetError("the workspace database went away mid-reply") from exc
            return _protocol_of(request).error_response(ProxyError(
                503, f"the workspace database is unreachable, so this request was not served "
                f"(nothing was sent upstream, or its turn could not be recorded); retry when it "
                f"is back: {exc}", type="server_error", code="store_unavailable"),
                {"Retry-After": "5"})
        except Exception as exc:  # a bug: answer in the protocol's shape, keep serving
            log.exception("internal error while serving %s", request.path)
            if request.writer is not None and request.writer.output_size > 0:
                # the reply has begun (a stream): a second response would corrupt it, so the
                # connection is closed instead, which the client sees as a broken reply
                raise ConnectionResetError("the reply had begun when the proxy failed") from exc
            return _protocol_of(request).error_response(ProxyError(
                500, f"internal proxy error: {type(exc).__name__}: {exc}", type="server_error",
                code="internal_error"))

    # -- handlers -------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        generation, skills = self.library.current()
        responder = self._parts.responder
        ready = responder is not None or bool(self.config.upstream_url)
        return web.json_response({
            "status": "ok" if ready else "no_upstream",
            # a database server found down moments ago: requests get 503 meanwhile
            "store": "unreachable" if self.store.unreachable() else "ok",
            "skill_generation": generation,
            "skills": len(skills),
            "upstream": safe_url(self.config.upstream_url),
            "upstream_protocol": self.config.upstream_protocol,
            "model": self.config.model,
            "policy_version": self.policy_version,
            "responder": responder is not None,
            "retrieval": getattr(self.retriever, "kind", type(self.retriever).__name__),
            "auth": bool(self.config.token),
            "caller_auth": self.config.caller_auth,
            "pending_records": len(self._pending),
            "record_commits": self._recorder.commits,
            "record_cpu_s": round(self._recorder.commit_cpu_s, 4),
        })

    async def _models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the upstream's list, or the model this proxy serves, in the
        client's shape."""
        client, models, payload = await self._model_list(request)
        if payload is not None:  # the upstream speaks the client's protocol: its list as it is
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=dumpb(client.models_payload(models)),
                            content_type="application/json")

    async def _model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the SDKs' ``models.retrieve``): one model of the list, or a
        404 naming it."""
        model_id = request.match_info["model_id"]
        client, models, _ = await self._model_list(request)
        for model in models:
            if model["id"] == model_id:
                return web.Response(body=dumpb(client.models_payload([model])["data"][0]),
                                    content_type="application/json")
        raise ProxyError(404, f"the model {model_id!r} does not exist here; list the models "
                              "with GET /v1/models", param="model", code="model_not_found")

    async def _model_list(self, request: web.Request) -> tuple[Any, list[dict[str, Any]],
                                                               bytes | None]:
        """(the client's protocol, the models in the neutral view, the upstream's own list when
        it is in the client's shape already, else None)."""
        caller_key = self._pipeline.authenticate(request)
        responder = self._parts.responder
        name = (getattr(responder, "model", None) or getattr(responder, "model_name", None)
                if responder is not None else None)
        name = name or self.config.model
        upstream = self._parts.upstream
        client = _protocol_of(request)  # an Anthropic SDK reads only Anthropic's list
        if name is None and upstream is not None and hasattr(upstream, "models"):
            try:
                _, payload = await upstream.models(caller_key)
            except Exception as exc:
                raise self._parts.scrubber.error(upstream.map_error(exc), caller_key) from None
            try:
                models = upstream.protocol.models_of(loads(payload))
            except ValueError:
                if upstream.protocol is client:  # relayed as it came, as before
                    return client, [], payload
                raise self._parts.scrubber.error(ProxyError(
                    502, f"the upstream's model list is not JSON: {payload[:200]!r}",
                    type="upstream_error"), caller_key) from None
            return client, models, payload if upstream.protocol is client else None
        return client, [{"id": name, "name": name, "created": 0}] if name else [], None
