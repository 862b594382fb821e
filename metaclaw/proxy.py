"""The OpenAI-compatible proxy: inject skills, forward upstream, record every turn.

An agent points its OpenAI client at the proxy (``base_url=proxy.url``). For each
``POST /v1/chat/completions`` the proxy

1. checks the optional bearer token and the request body (OpenAI error JSON on failure:
   400 malformed, 401 token, 413 too large);
2. on *main* turns retrieves the most relevant skills of the current library generation (in a
   worker thread, never on the event loop) and appends them to the system message;
3. forwards the request to the upstream (any OpenAI-compatible base URL, through the official
   ``openai`` SDK with one pooled connection) or, when a local policy is set with
   :meth:`Proxy.set_responder`, answers from it. Streams are relayed event by event as they
   arrive (content, tool-call deltas and the usage chunk);
4. records the turn in the :class:`~metaclaw.store.Store` (what was sent upstream after
   injection, the reply, tool calls, usage, latency, status, the skill generation and policy
   version that served it) and calls the turn listeners with the new turn id. A responder's
   reply may carry a ``metaclaw`` object (the policy version that produced it, the prompt and
   completion token ids and the completion's sampling logprobs, see :mod:`metaclaw.policy`):
   it is recorded with the turn and removed before the reply reaches the client. A request
   the responder refuses (``PolicyRequestError``) gets a 400 error.

Upstream failures map to OpenAI error JSON with the right status: upstream HTTP errors keep their
status and message, a timeout is 504, an unreachable upstream 502, and a stream the upstream drops
midway ends with an SSE ``data: {"error": ...}`` event. Failed turns are recorded too.

Session headers (compatible with upstream MetaClaw): ``X-Session-Id`` (or body ``session_id``),
``X-Turn-Type`` (``main`` | ``side``), ``X-Session-Done``. Clients that send none of them still
get sessions and side-call detection: see :mod:`metaclaw.sessions` for the precedence. They and the
client's ``Authorization`` header are never forwarded; the upstream key comes from the environment
variable named by ``ProxyConfig.api_key_env`` and is never logged or stored.

Turns are written to the store right after the reply is sent, off the request path; call
:meth:`Proxy.flush` to wait until every turn answered so far is recorded. Each reply carries
``X-MetaClaw-Skill-Generation``, ``X-MetaClaw-Injected-Skills`` and ``X-MetaClaw-Policy-Version``
headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web

from metaclaw import sessions
from metaclaw.store import Store

if TYPE_CHECKING:  # pragma: no cover
    from metaclaw.skills import SkillLibrary

log = logging.getLogger("metaclaw.proxy")

#: Body fields understood by the proxy itself; removed before forwarding.
PROXY_FIELDS = ("session_id", "turn_type", "session_done")
#: Body fields recorded in their own columns rather than in ``request_params``.
_OWN_COLUMNS = ("messages", "model", "stream")
NO_KEY = "sk-no-key"


# ---------------------------------------------------------------------------------------------
# configuration and errors
# ---------------------------------------------------------------------------------------------
@dataclass
class ProxyConfig:
    """How the proxy listens, where it forwards, and how it retrieves skills.

    ``upstream_url``: OpenAI-compatible base URL (e.g. ``http://127.0.0.1:8000/v1``); ``None``
    means no upstream (requests get 503 unless a responder is set). ``model``: when set, replaces
    the model of every request. ``api_key_env``: name of the environment variable holding the
    upstream key (a placeholder key is sent when it is unset). ``token``: when set, clients must
    send ``Authorization: Bearer <token>``. ``retrieval``/``embedding_model``: passed to
    :func:`metaclaw.retrieval.make_retriever`. ``top_k``/``min_score``/``budget_chars``: passed
    to :func:`metaclaw.retrieval.select`. ``timeout``: seconds to wait for the upstream (per read
    while streaming). ``max_body_bytes``: larger request bodies get 413. ``max_retries``: retries
    of non-streaming upstream calls on connection errors, 408/409/429/5xx (streams never retry).
    ``stream_usage``: ask the upstream for the usage chunk on every stream so the turn's token
    counts are recorded (the chunk is relayed only to clients that asked for it).
    """

    upstream_url: str | None = None
    model: str | None = None
    api_key_env: str = "METACLAW_UPSTREAM_API_KEY"
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    retrieval: str = "auto"
    embedding_model: str | None = None
    top_k: int = 3
    min_score: float | None = None
    budget_chars: int = 6000
    timeout: float = 120.0
    max_body_bytes: int = 8 * 2**20
    max_retries: int = 2
    stream_usage: bool = True


def error_json(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ProxyError(Exception):
    """A request the proxy answers with an OpenAI error JSON and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 payload: dict[str, Any] | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.payload = payload or error_json(message, type, param, code)
        self.headers = headers or {}

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(self.payload, status=self.status,
                                 headers={**self.headers, **(extra_headers or {})},
                                 dumps=_dumps)


class Responder(Protocol):
    """A local policy answering instead of the upstream (the slow loop's trained weights).

    ``complete(body)`` returns an OpenAI ``chat.completion`` dict; ``stream(body)`` yields
    ``chat.completion.chunk`` dicts. ``body`` is the request as it would go upstream (skills
    injected, proxy fields removed). ``policy_version`` is recorded with every turn it serves.
    """

    policy_version: int

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def safe_url(url: str | None) -> str | None:
    """``url`` without ``user:password@``, query or fragment (for logs, errors and health output)."""
    if not url:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], query="", fragment=""))


# ---------------------------------------------------------------------------------------------
# running an aiohttp application on its own event loop
# ---------------------------------------------------------------------------------------------
class BackgroundServer:
    """Serve an aiohttp application on its own event loop, in a thread or in the foreground.

    ``make_app()`` builds the application (called once per start, inside the server's loop).
    :meth:`start` returns once the socket listens; :attr:`port` is the bound port.
    """

    def __init__(self, make_app: Callable[[], web.Application], host: str = "127.0.0.1",
                 port: int = 0, name: str = "metaclaw-server", shutdown_timeout: float = 2.0):
        self.make_app = make_app
        self.host = host
        self.port = port
        self.name = name
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.loop is not None and self.loop.is_running()

    async def _open(self) -> None:
        self._runner = web.AppRunner(self.make_app(), access_log=None,
                                     shutdown_timeout=self.shutdown_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(exc.errno, f"cannot listen on {self.host}:{self.port}: {exc.strerror}; "
                                     "choose another port (port=0 picks a free one)") from exc
        self.port = int(self._runner.addresses[0][1])

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> "BackgroundServer":
        """Serve in a daemon thread; returns when listening (raises if the port is taken)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} is already running on port {self.port}")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:  # reported to the caller of start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            self.loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._close())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread to finish (no-op when not running)."""
        thread, loop = self._thread, self.loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None
        self.loop = None

    def call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        """Run a coroutine on the server's loop from another thread and return its result."""
        if self.loop is None:
            raise RuntimeError(f"{self.name} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling thread until Ctrl-C or SIGTERM, then shut down cleanly."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGTERM, loop.stop)  # main thread, POSIX only
        try:
            loop.run_until_complete(self._open())
            self.loop = loop
            if on_ready is not None:
                on_ready()
            loop.run_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.loop = None
            loop.run_until_complete(self._close())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def _base_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


# ---------------------------------------------------------------------------------------------
# assembling what a turn produced
# ---------------------------------------------------------------------------------------------
class StreamAssembler:
    """Accumulates ``chat.completion.chunk`` dicts into the turn's reply (choice 0).

    After the stream: ``content`` (str or None), ``tool_calls`` (list of OpenAI tool-call dicts,
    by index, or None), ``finish_reason``, ``usage`` (dict or None), ``error`` (the error dict
    of an SSE error event, or None), ``logprobs`` (list of floats or None), ``chunks`` (count).
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}
        self._logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.chunks = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        if chunk.get("error"):
            error = chunk["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._parts.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                slot = self._tools.setdefault(call.get("index", 0), {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                if call.get("id"):
                    slot["id"] = call["id"]
                if call.get("type"):
                    slot["type"] = call["type"]
                function = call.get("function") or {}
                if function.get("name"):
                    slot["function"]["name"] += function["name"]
                if function.get("arguments"):
                    slot["function"]["arguments"] += function["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            logprobs = choice.get("logprobs") or {}
            for item in logprobs.get("content") or ():
                self._logprobs.append(item.get("logprob"))

    @property
    def content(self) -> str | None:
        return "".join(self._parts) if self._parts else None

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return [self._tools[i] for i in sorted(self._tools)] or None

    @property
    def logprobs(self) -> list[float] | None:
        return self._logprobs or None


def summarize_completion(data: dict[str, Any]) -> dict[str, Any]:
    """Turn columns (response, tool_calls, finish_reason, usage, tokens) of a chat.completion."""
    choices = data.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    usage = data.get("usage") or None
    logprobs = [item.get("logprob") for item in ((choice.get("logprobs") or {}).get("content") or ())]
    return {
        "response": message.get("content"),
        "tool_calls": message.get("tool_calls") or None,
        "finish_reason": choice.get("finish_reason"),
        **_usage_columns(usage),
        **({"completion_logprobs": logprobs} if logprobs else {}),
    }


def _usage_columns(usage: dict[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {"usage": None}
    return {"usage": usage, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens")}


# ---------------------------------------------------------------------------------------------
# the proxy
# ---------------------------------------------------------------------------------------------
@dataclass
class _Turn:
    """One parsed request: who sent it and what goes upstream."""

    session_id: str
    turn_type: str
    done: bool
    stream: bool
    client_usage: bool          # the client asked for the usage chunk itself
    body: dict[str, Any]        # what is forwarded (model set, proxy fields removed)
    identified_by: dict[str, str]  # which rule found the session and the turn type


class ServedApp:
    """Lifecycle shared by the servers built on :class:`BackgroundServer` (the proxy, the
    doubles): start in the background, stop, use as a context manager, port and base URL."""

    _server: BackgroundServer

    def start(self):
        """Serve in a background thread with its own event loop; returns when listening."""
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def running(self) -> bool:
        return self._server.running

    @property
    def url(self) -> str:
        """Base URL for OpenAI clients, e.g. ``http://127.0.0.1:PORT/v1``."""
        return _base_url(self._server.host, self._server.port) + "/v1"


class Proxy(ServedApp):
    """The OpenAI-compatible proxy in front of an upstream, with skills and recording.

    ``config``: :class:`ProxyConfig`. ``store``: where turns are recorded. ``library``: the
    :class:`~metaclaw.skills.SkillLibrary` whose current generation is injected. ``retriever``:
    any :class:`~metaclaw.retrieval.Retriever`; built from ``config.retrieval`` when omitted.
    """

    def __init__(self, config: ProxyConfig, store: Store, library: "SkillLibrary",
                 retriever: Any = None):
        from metaclaw import retrieval

        self.config = config
        self.store = store
        self.library = library
        self.retriever = retriever if retriever is not None else retrieval.make_retriever(
            config.retrieval, config.embedding_model)
        self._responder: Any = None
        self._listeners: list[Callable[[int], None]] = []
        self._pending: set[asyncio.Task[Any]] = set()
        self._client: Any = None          # openai.AsyncOpenAI, created on the server's loop
        self._stream_client: Any = None   # same connection pool, no retries
        self._retrieval_pool: ThreadPoolExecutor | None = None
        self._record_pool: ThreadPoolExecutor | None = None
        self._listener_pool: ThreadPoolExecutor | None = None
        self._server = BackgroundServer(self._make_app, config.host, config.port, "metaclaw-proxy")

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

    # -- seams for the loops --------------------------------------------------------------
    def add_turn_listener(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(turn_id)`` in a worker thread after each turn is recorded (errors are logged)."""
        self._listeners.append(fn)

    def remove_turn_listener(self, fn: Callable[[int], None]) -> None:
        with contextlib.suppress(ValueError):
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
        self._responder = responder

    @property
    def responder(self) -> Any:
        return self._responder

    @property
    def policy_version(self) -> int:
        responder = self._responder
        return int(getattr(responder, "policy_version", 0)) if responder is not None else 0

    # -- application ----------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_middleware])
        for prefix in ("/v1", ""):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_get(prefix + "/models", self._models)
        app.router.add_get("/healthz", self._health)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._retrieval_pool = ThreadPoolExecutor(8, thread_name_prefix="metaclaw-retrieval")  # embedding queries batch
        self._record_pool = ThreadPoolExecutor(1, thread_name_prefix="metaclaw-record")
        self._listener_pool = ThreadPoolExecutor(1, thread_name_prefix="metaclaw-listeners")
        if self.config.upstream_url:
            from openai import AsyncOpenAI

            key = os.environ.get(self.config.api_key_env) or NO_KEY
            self._client = AsyncOpenAI(base_url=self.config.upstream_url, api_key=key,
                                       timeout=self.config.timeout,
                                       max_retries=self.config.max_retries)
            self._stream_client = self._client.with_options(max_retries=0)
        if callable(getattr(self.retriever, "warm", None)):  # load models before the first turn
            asyncio.get_running_loop().run_in_executor(self._retrieval_pool, self._warm)

    def _warm(self) -> None:
        try:
            self.retriever.warm(self.library.skills())
        except Exception:
            log.exception("could not prepare the skill retriever; retrieval will retry per turn")

    def _scrub(self, text: str | None) -> str | None:
        """``text`` with the upstream key and the proxy token masked (for errors and records)."""
        if not text:
            return text
        for secret in (os.environ.get(self.config.api_key_env), self.config.token):
            if secret and len(secret) >= 4 and secret in text:
                text = text.replace(secret, "***")
        return text

    async def _on_cleanup(self, app: web.Application) -> None:
        await self._drain()
        if self._client is not None:
            await self._client.close()
            self._client = self._stream_client = None
        if self._record_pool is not None:
            self._record_pool.shutdown(wait=True)  # every answered turn reaches the store
        for pool in (self._retrieval_pool, self._listener_pool):
            if pool is not None:  # a model still loading or a slow listener never blocks stop()
                pool.shutdown(wait=False)

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as exc:
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large().response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {404: f"no route {request.path}; the proxy serves POST /v1/chat/completions, "
                            "GET /v1/models and GET /healthz",
                       405: f"method {request.method} is not allowed on {request.path}"}.get(
                exc.status, exc.reason)
            return ProxyError(exc.status, message, code=str(exc.status)).response()
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: answer in the OpenAI shape, keep serving
            log.exception("internal error while serving %s", request.path)
            return ProxyError(500, f"internal proxy error: {type(exc).__name__}: {exc}",
                              type="server_error", code="internal_error").response()

    # -- request checks -------------------------------------------------------------------
    def _check_auth(self, request: web.Request) -> None:
        token = self.config.token
        if not token:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ProxyError(401, "missing bearer token: this proxy requires the header "
                                  "'Authorization: Bearer <token>' (the OpenAI client's api_key)",
                             type="authentication_error", code="missing_token")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise ProxyError(401, "invalid bearer token: set the client's api_key to the proxy's "
                                  "token", type="authentication_error", code="invalid_token")

    def _too_large(self) -> ProxyError:
        limit = self.config.max_body_bytes
        return ProxyError(413, f"request body is larger than the proxy's limit of {limit} bytes; "
                               "send a smaller request or raise max_body_bytes",
                          code="request_too_large")

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise self._too_large()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProxyError(400, f"request body is not valid JSON ({exc}); send a JSON object "
                                  "with 'model' and 'messages'") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object with 'model' and 'messages', "
                                  f"not {type(body).__name__}")
        return body

    def _parse_turn(self, request: web.Request, body: dict[str, Any]) -> _Turn:
        def bad(param: str, message: str) -> ProxyError:
            return ProxyError(400, message, param=param)

        messages = body.get("messages")
        if messages is None:
            raise bad("messages", "'messages' is required: a non-empty list of "
                                  "{'role': ..., 'content': ...} objects")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "'messages' must be a non-empty list of "
                                  "{'role': ..., 'content': ...} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string "
                                            "'role'")
        model = self.config.model or body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", "'model' is required (a string), or start the proxy with a model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "'stream' must be true or false")
        for name, kind in (("tools", list), ("stream_options", dict)):
            if body.get(name) is not None and not isinstance(body[name], kind):
                raise bad(name, f"'{name}' must be a JSON {'array' if kind is list else 'object'}")
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise bad(name, f"'{name}' must be a number")

        try:
            identity = sessions.identify(request.headers, body)
        except sessions.IdentityError as exc:
            raise bad(exc.param, str(exc)) from None

        forward = {k: v for k, v in body.items() if k not in PROXY_FIELDS}
        forward["model"] = model
        client_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if stream and self.config.stream_usage and not client_usage:
            forward["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return _Turn(identity.session_id, identity.turn_type, identity.done, stream, client_usage,
                     forward, identity.how)

    # -- retrieval (runs in a worker thread) ----------------------------------------------
    def _retrieve(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Retrieve and inject: the record fields (``skill_generation``, ``injected_skills``,
        ``retrieval_query``, ``retrieval_scores``, ``error``) plus ``messages`` with the skill
        block. Runs in a worker thread."""
        from metaclaw import retrieval

        generation, skills = self.library.current()
        query = retrieval.query_text(messages)
        found = {"skill_generation": generation, "messages": messages, "injected_skills": [],
                 "retrieval_query": query, "retrieval_scores": [], "error": None}
        if not skills or not query:
            return found
        try:
            selected = retrieval.select(self.retriever, query, skills, top_k=self.config.top_k,
                                        min_score=self.config.min_score,
                                        budget_chars=self.config.budget_chars)
        except Exception as exc:  # serve the turn without skills rather than fail the agent
            log.exception("skill retrieval failed; serving this turn without skills")
            return {**found, "error": f"skill retrieval failed (served without skills): {exc}"}
        return {**found, "messages": retrieval.inject(messages, retrieval.render_block(selected)),
                "injected_skills": [s.skill.name for s in selected],
                "retrieval_scores": [{"name": s.skill.name, "score": round(float(s.score), 4)}
                                     for s in selected]}

    # -- handlers -------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        generation, skills = self.library.current()
        responder = self._responder
        ready = responder is not None or bool(self.config.upstream_url)
        return web.json_response({
            "status": "ok" if ready else "no_upstream",
            "skill_generation": generation,
            "skills": len(skills),
            "upstream": safe_url(self.config.upstream_url),
            "model": self.config.model,
            "policy_version": self.policy_version,
            "responder": responder is not None,
            "retrieval": getattr(self.retriever, "kind", type(self.retriever).__name__),
            "auth": bool(self.config.token),
            "pending_records": len(self._pending),
        })

    async def _models(self, request: web.Request) -> web.Response:
        self._check_auth(request)
        responder = self._responder
        name = (getattr(responder, "model", None) or getattr(responder, "model_name", None)
                if responder is not None else None)
        name = name or self.config.model
        if name is None and self._client is not None:
            try:
                upstream = await self._client.get("/models", cast_to=_response_type())
            except Exception as exc:
                raise self._upstream_error(exc) from None
            return web.Response(body=upstream.content, status=upstream.status_code,
                                content_type="application/json")
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "metaclaw"}] if name else []
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        self._check_auth(request)
        body = await self._read_body(request)
        turn = self._parse_turn(request, body)
        if turn.turn_type == "main":
            retrieved = await asyncio.get_running_loop().run_in_executor(
                self._retrieval_pool, self._retrieve, turn.body["messages"])
        else:  # side calls (titles, summaries) get no skills
            retrieved = {"skill_generation": self.library.current()[0], "injected_skills": [],
                         "messages": turn.body["messages"], "error": None}
        messages = turn.body["messages"] = retrieved.pop("messages")
        responder = self._responder
        record: dict[str, Any] = {
            "session_id": turn.session_id,
            "turn_type": turn.turn_type,
            "identified_by": turn.identified_by,
            "model": turn.body["model"],
            "stream": int(turn.stream),
            "request_messages": messages,
            "request_params": {k: v for k, v in body.items()
                               if k not in _OWN_COLUMNS and k not in PROXY_FIELDS},
            "policy_version": int(getattr(responder, "policy_version", 0)) if responder else 0,
            **retrieved,
        }
        injected = record["injected_skills"]
        headers = {"X-MetaClaw-Skill-Generation": str(record["skill_generation"]),
                   "X-MetaClaw-Injected-Skills": ",".join(injected),
                   "X-MetaClaw-Policy-Version": str(record["policy_version"])}
        if turn.stream:
            return await self._relay_stream(request, turn, record, headers, responder, started)
        return await self._complete(turn, record, headers, responder, started)

    async def _complete(self, turn: _Turn, record: dict[str, Any], headers: dict[str, str],
                        responder: Any, started: float) -> web.Response:
        policy: dict[str, Any] = {}
        try:
            if responder is not None:
                data = await responder.complete(turn.body)
                policy = _policy_columns(data.pop("metaclaw", None) if isinstance(data, dict)
                                         else None)
                if "policy_version" in policy:
                    headers["X-MetaClaw-Policy-Version"] = str(policy["policy_version"])
                payload = _dumps(data).encode()
            elif self._client is not None:
                upstream = await self._client.post("/chat/completions", body=turn.body,
                                                   cast_to=_response_type())
                payload = upstream.content
                try:
                    data = json.loads(payload)
                except ValueError:
                    raise ProxyError(502, "the upstream answered with invalid JSON",
                                     type="upstream_error", code="bad_upstream_response") from None
            else:
                raise self._no_upstream()
        except Exception as exc:
            return self._fail(exc, record, turn, started, headers, responder)
        self._finish(record, turn, started, status="ok", http_status=200,
                     **{**summarize_completion(data if isinstance(data, dict) else {}), **policy})
        return web.Response(body=payload, status=200, content_type="application/json",
                            headers=headers)

    async def _relay_stream(self, request: web.Request, turn: _Turn, record: dict[str, Any],
                            headers: dict[str, str], responder: Any,
                            started: float) -> web.StreamResponse:
        assembler = StreamAssembler()
        captured: dict[str, Any] = {}  # the responder's ``metaclaw`` object, kept from the client
        async with contextlib.AsyncExitStack() as stack:
            try:
                if responder is not None:
                    # the first event is taken before answering 200, so that a request the
                    # policy refuses gets a proper error status instead of a broken stream
                    events = _responder_events(responder, turn.body, captured)
                    stack.push_async_callback(events.aclose)
                    events = _prepend(await events.__anext__(), events)
                elif self._stream_client is not None:
                    upstream = await self._stream_client.post(
                        "/chat/completions", body=turn.body, cast_to=_response_type(), stream=True)
                    stack.push_async_callback(upstream.aclose)
                    events = _sse_events(upstream.aiter_lines())
                else:
                    raise self._no_upstream()
            except Exception as exc:
                return self._fail(exc, record, turn, started, headers, responder)

            response = web.StreamResponse(status=200, headers={
                **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"})
            await response.prepare(request)
            failure: str | None = None
            done_marker = b""  # "[DONE]" goes out after the turn's record is scheduled, so a
            try:               # client that read the whole stream can flush() and find it
                async for raw, chunk in events:
                    if chunk is None and raw.startswith(b"data: [DONE]"):
                        done_marker = raw
                        continue
                    if chunk is not None:
                        assembler.add(chunk)
                        if (not turn.client_usage and chunk.get("usage")
                                and not chunk.get("choices") and "error" not in chunk):
                            continue  # usage chunk the proxy asked for on its own behalf
                    await response.write(raw)
            except (ConnectionResetError, asyncio.CancelledError) as exc:
                self._finish(record, turn, started, status="error", http_status=200,
                             error="the client disconnected mid-stream", **_assembled(assembler),
                             **_policy_columns(captured.get("metaclaw")))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return response
            except Exception as exc:
                error = self._upstream_error(exc, responder, midstream=True)
                failure = error.message
                with contextlib.suppress(ConnectionResetError):
                    await response.write(f"data: {_dumps(error.payload)}\n\n".encode())
            if failure is None and assembler.error is not None:
                failure = f"upstream stream error: {assembler.error.get('message', assembler.error)}"
            self._finish(record, turn, started, status="error" if failure else "ok",
                         http_status=200, error=failure or record.get("error"),
                         **_assembled(assembler), **_policy_columns(captured.get("metaclaw")))
            with contextlib.suppress(ConnectionResetError):
                if done_marker:
                    await response.write(done_marker)
                await response.write_eof()
            return response

    # -- failures -------------------------------------------------------------------------
    def _fail(self, exc: BaseException, record: dict[str, Any], turn: _Turn, started: float,
              headers: dict[str, str], responder: Any) -> web.Response:
        """Record the turn as failed and answer with the OpenAI error for ``exc``."""
        error = exc if isinstance(exc, ProxyError) else self._upstream_error(exc, responder)
        self._finish(record, turn, started, status="error", http_status=error.status,
                     error=error.message)
        return error.response(headers)

    def _no_upstream(self) -> ProxyError:
        return ProxyError(503, "no upstream is configured: start the proxy with an upstream URL "
                               "(ProxyConfig.upstream_url or metaclaw serve --upstream URL) or set a "
                               "responder", type="server_error", code="no_upstream")

    def _upstream_error(self, exc: BaseException, responder: Any = None, *,
                        midstream: bool = False) -> ProxyError:
        """Map an upstream (or responder) failure to the error the client gets (secrets masked)."""
        error = self._map_failure(exc, responder, midstream)
        error.message = self._scrub(error.message)
        inner = error.payload.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            inner["message"] = self._scrub(inner["message"])
        return error

    def _map_failure(self, exc: BaseException, responder: Any, midstream: bool) -> ProxyError:
        import openai

        upstream = safe_url(self.config.upstream_url)
        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, openai.APIStatusError):
            return _relayed_status_error(exc)
        if responder is not None:
            from metaclaw.policy import PolicyRequestError

            if isinstance(exc, PolicyRequestError):  # the local policy cannot serve this request
                return ProxyError(exc.status, str(exc), code="unsupported_by_policy")
            return ProxyError(500, f"the local policy failed: {type(exc).__name__}: {exc}",
                              type="server_error", code="responder_error")
        if isinstance(exc, openai.APITimeoutError) or "timeout" in type(exc).__name__.lower():
            return ProxyError(504, f"the upstream {upstream} did not answer within "
                                   f"{self.config.timeout:g} s{' mid-stream' if midstream else ''}; "
                                   "raise the proxy timeout or check the upstream",
                              type="upstream_error", code="upstream_timeout")
        if midstream:
            return ProxyError(502, f"the upstream {upstream} dropped the connection mid-stream "
                                   f"({type(exc).__name__}: {exc}); retry the request",
                              type="upstream_error", code="upstream_disconnected")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            return ProxyError(502, f"cannot reach the upstream {upstream} ({type(cause).__name__}: "
                                   f"{cause}); check that it is running and the URL is right",
                              type="upstream_error", code="upstream_unreachable")
        log.exception("unexpected upstream failure", exc_info=exc)
        return ProxyError(502, f"upstream request failed: {type(exc).__name__}: {exc}",
                          type="upstream_error", code="upstream_error")

    # -- recording ------------------------------------------------------------------------
    def _finish(self, record: dict[str, Any], turn: _Turn, started: float, **fields: Any) -> None:
        """Schedule the turn's store write (off the event loop) and its listeners."""
        row = {**record, **fields, "latency_ms": (time.perf_counter() - started) * 1000.0}
        task = asyncio.get_running_loop().create_task(self._record(row, turn.done))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _record(self, row: dict[str, Any], done: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            turn_id = await loop.run_in_executor(self._record_pool, self._write, row, done)
        except Exception:
            log.exception("could not record a turn of session %r", row.get("session_id"))
            return
        if self._listeners:
            loop.run_in_executor(self._listener_pool, self._notify, turn_id)

    def _write(self, row: dict[str, Any], done: bool) -> int:
        turn_id = self.store.record_turn(**row)
        if done:
            self.store.mark_session_done(row["session_id"])
        return turn_id

    def _notify(self, turn_id: int) -> None:
        for fn in list(self._listeners):
            try:
                fn(turn_id)
            except Exception:
                log.exception("turn listener %r failed for turn %d", fn, turn_id)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _response_type() -> type:
    """The HTTP response class of the openai SDK's transport (``httpx2``; ``httpx`` before).

    Passed as ``cast_to`` to the SDK's documented ``client.post``/``client.get`` for raw
    responses: the body is relayed as it is, without the SDK's typed request transform (which
    costs milliseconds per request) and with the client's retries, timeouts and error classes.
    """
    try:
        import httpx2 as http
    except ImportError:  # pragma: no cover - openai < 3
        import httpx as http
    return http.Response


def _assembled(assembler: StreamAssembler) -> dict[str, Any]:
    columns = {"response": assembler.content, "tool_calls": assembler.tool_calls,
               "finish_reason": assembler.finish_reason, **_usage_columns(assembler.usage)}
    if assembler.logprobs:
        columns["completion_logprobs"] = assembler.logprobs
    return columns


def _relayed_status_error(exc: Any) -> ProxyError:
    """The upstream's own error (status, JSON, Retry-After) as the client's error."""
    status = exc.status_code
    try:
        body = exc.response.json()
    except Exception:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        message = str(error.get("message") or f"upstream error {status}")
        payload = error_json(message, error.get("type") or "upstream_error", error.get("param"),
                             error.get("code"))
    else:
        text = (exc.response.text or "").strip()[:500] if exc.response is not None else ""
        message = f"the upstream answered HTTP {status}" + (f": {text}" if text else "")
        payload = error_json(message, "upstream_error", None, str(status))
    headers = {k: v for k, v in exc.response.headers.items()
               if k.lower() in ("retry-after", "retry-after-ms")}
    return ProxyError(status, message, payload=payload, headers=headers)


Event = tuple[bytes, "dict[str, Any] | None"]


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    """Group SSE lines into events: yields (the event's bytes to relay, its JSON data or None)."""
    buffer: list[str] = []
    async for line in lines:
        if line:
            buffer.append(line)
            continue
        if buffer:
            yield _event(buffer)
            buffer = []
    if buffer:
        yield _event(buffer)


def _event(lines: list[str]) -> Event:
    data = "\n".join(line[5:].lstrip(" ") for line in lines if line.startswith("data:"))
    chunk = None
    if data and data != "[DONE]":
        try:
            parsed = json.loads(data)
            chunk = parsed if isinstance(parsed, dict) else None
        except ValueError:
            chunk = None
    return ("\n".join(lines) + "\n\n").encode(), chunk


async def _responder_events(responder: Any, body: dict[str, Any],
                            captured: dict[str, Any]) -> AsyncIterator[Event]:
    """SSE events of a responder's chunks; a chunk's ``metaclaw`` object is moved to
    ``captured["metaclaw"]`` and never sent to the client."""
    async for chunk in responder.stream(body):
        if isinstance(chunk, dict) and "metaclaw" in chunk:
            chunk = dict(chunk)
            captured["metaclaw"] = chunk.pop("metaclaw")
        yield f"data: {_dumps(chunk)}\n\n".encode(), chunk
    yield b"data: [DONE]\n\n", None


async def _prepend(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event


def _policy_columns(info: Any) -> dict[str, Any]:
    """Turn columns from a responder reply's ``metaclaw`` object: the policy version that
    produced it, the prompt / completion token ids and the completion's sampling logprobs."""
    if not isinstance(info, dict):
        return {}
    columns: dict[str, Any] = {}
    if isinstance(info.get("policy_version"), int):
        columns["policy_version"] = info["policy_version"]
    for key, column in (("prompt_token_ids", "prompt_tokens_ids"),
                        ("completion_token_ids", "completion_tokens_ids"),
                        ("completion_logprobs", "completion_logprobs")):
        if isinstance(info.get(key), list):
            columns[column] = info[key]
    return columns
