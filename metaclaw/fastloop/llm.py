"""The LLM client the fast loop's judge, evolver and gate share: an OpenAI-compatible chat
endpoint called with retries, and the readers of its replies.

:class:`LLMClient` posts each request with one pooled ``aiohttp.ClientSession`` per event loop and
reads the reply as JSON, as the proxy's upstreams do (:mod:`metaclaw.proxy.upstreams`, whose body
reader it shares): through the openai SDK's request building and its httpx layer a call cost
about 2.2 ms of CPU against about 0.75 ms here (1,200 concurrent calls on fresh connections to
a local double), which bounded how many replays and votes a run keeps in flight. What the SDK gave is kept: the
key as ``Authorization: Bearer`` (``user:password@`` in the URL as Basic authentication
instead), TLS verified against the system's certificate authorities (``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` when set, certifi's bundle where the system has none), ``HTTPS_PROXY`` /
``HTTP_PROXY`` / ``ALL_PROXY`` / ``NO_PROXY`` from the environment, a timeout on the whole call.
Redirects are not followed, as in the proxy (the SDK followed them; a POST must not move, and
the error names where it points); an error body is read up to 64 KiB and a reply up to
:data:`MAX_REPLY_BYTES`.

Retries are the callers': :func:`retry_delay` decides, honouring a server's Retry-After as the
proxy does (:func:`metaclaw.proxy.upstreams.retry_after`). A failed call raises an
:class:`LLMError` (:class:`LLMStatusError`, :class:`LLMConnectionError`,
:class:`LLMResponseError`) or ``TimeoutError``; :func:`error_text` says in one line why, and
:meth:`LLMClient.explain` masks the client's secrets in it (:mod:`metaclaw.redact`).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from metaclaw.buffers import message_text
from metaclaw.jsonlib import dumpb, loads
from metaclaw.proxy.upstreams import (MAX_ERROR_BODY, UpstreamBodyError, environment_proxy,
                                      read_body, retry_after, tls_context)
from metaclaw.redact import mask, safe_url, secrets_of, url_secrets

T = TypeVar("T")

#: The largest reply body read (bytes): a chat.completion is far smaller; a larger body is
#: refused (:class:`LLMResponseError`) rather than held in memory.
MAX_REPLY_BYTES = 32 * 2**20
#: Connections one client keeps open at most (per event loop; more calls wait for one). The
#: callers bound their own concurrency (the judge's ``concurrency``, an experiment's replays in
#: flight); this is the safety net, above an experiment's default (512 replays x 3 votes).
MAX_CONNECTIONS = 2048


# -- errors ------------------------------------------------------------------------------------
class LLMError(Exception):
    """A model call that failed. ``retryable``: whether another attempt may succeed."""

    retryable = True


class LLMStatusError(LLMError):
    """The server answered with an error status (``status_code``; 3xx: a redirect, not
    followed). ``headers`` (Retry-After) and the start of the body are kept; ``message`` is the
    server's own (the ``error.message`` of OpenAI's error JSON, or the start of its text)."""

    def __init__(self, status_code: int, headers: Mapping[str, str], body: bytes = b"",
                 message: str | None = None):
        self.status_code = status_code
        self.headers = headers
        self.body = body
        self.message = server_message(body) if message is None else message
        super().__init__(f"HTTP {status_code}" + (f": {self.message}" if self.message else ""))


class LLMConnectionError(LLMError):
    """The server could not be reached, dropped the connection, or cut its reply off (or its
    TLS certificate was refused: not ``retryable``)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class CallFailed(LLMError):
    """Every attempt of :meth:`LLMClient.complete` failed. ``kind``: ``"timeout"``, ``"error"``
    (a status, connection or reply error) or ``"no_reply"`` (status 200 without a reply);
    ``detail``: why the last attempt failed, one line, the client's secrets masked;
    ``attempts``: how many were made; ``retryable``: False when another try would fail alike (a
    client error), so fewer attempts than allowed were made; ``status``: the last attempt's HTTP
    status, where the server answered one."""

    def __init__(self, kind: str, detail: str, attempts: int, retryable: bool,
                 status: int | None = None):
        super().__init__(detail)
        self.kind, self.detail, self.attempts, self.retryable = kind, detail, attempts, retryable
        self.status = status


class LLMResponseError(LLMError, ValueError):
    """The server answered 2xx with a body that is no chat.completion JSON object (not JSON,
    cannot be decoded, too large, not HTTP)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


def server_message(body: bytes) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message"}}`` (or ``{"error": "..."}``,
    ``{"message"}``, ``{"detail"}``), else the start of its text, printable characters only."""
    try:
        data = loads(body)
    except ValueError:
        data = None
    message: Any = None
    if isinstance(data, dict):
        error = data.get("error")
        message = (error.get("message") if isinstance(error, dict) else error) or \
            data.get("message") or data.get("detail")
    text = str(message) if message else body[:2000].decode("utf-8", "replace")
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:300]


# -- client and event-loop plumbing -----------------------------------------------------------
class LLMClient:
    """Chat calls to an OpenAI-compatible endpoint: one pooled ``aiohttp.ClientSession`` per
    event loop (a session is bound to the loop that made it), created on first use. ``timeout``:
    seconds for a whole call (connecting, sending, reading the reply)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, *,
                 max_connections: int = MAX_CONNECTIONS):
        from urllib.parse import unquote, urlsplit

        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self.max_connections = int(max_connections)
        parts = urlsplit(base_url)
        self._url = (safe_url(base_url) or "").rstrip("/") + "/chat/completions"
        # a query in the URL (Azure OpenAI's ``api-version``) goes with every call, as the
        # proxy's upstream client sends it; never shown (it may carry a key)
        self._query = parts.query
        self._parsed: Any = None  # the URL parsed once (yarl), not per call
        self._basic = ((unquote(parts.username or ""), unquote(parts.password or ""))
                       if parts.username or parts.password else None)
        self._sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = (
            weakref.WeakKeyDictionary())
        self._proxies: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, str | None]" = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    def get(self):
        """The session for the running event loop (the environment's proxy and TLS settings
        are read when it is made)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is None:
                headers = {"Content-Type": "application/json", "Accept": "application/json",
                           "Authorization": f"Bearer {self.api_key or 'unused'}"}
                if self._basic is not None:  # credentials in the URL win, as in HTTP clients
                    headers["Authorization"] = aiohttp.BasicAuth(*self._basic).encode()
                tls = tls_context() if self._url.startswith("https:") else True
                session = aiohttp.ClientSession(
                    headers=headers, cookie_jar=aiohttp.DummyCookieJar(),
                    connector=aiohttp.TCPConnector(limit=self.max_connections, ssl=tls),
                    timeout=aiohttp.ClientTimeout(total=self.timeout,
                                                  sock_connect=self.timeout))
                self._sessions[loop] = session
                self._proxies[loop] = environment_proxy(self._url)
            return session

    def explain(self, exc: BaseException) -> str:
        """:func:`error_text` of a failed call, with this client's key and the credentials in
        its URL masked (a server's error may quote the key it was sent)."""
        return self.mask(error_text(exc))

    def mask(self, text: str) -> str:
        """``text`` with this client's key and the credentials in its URL replaced by ``***``."""
        return mask(text, secrets_of(self.api_key, *url_secrets(self.base_url)))

    async def chat(self, params: dict[str, Any]) -> dict[str, Any]:
        """``POST /chat/completions`` with ``params`` (the request body); returns the reply's
        JSON object. Raises :class:`LLMError` or ``TimeoutError`` (see the module's docstring)."""
        import aiohttp

        session = self.get()
        proxy = self._proxies.get(asyncio.get_running_loop())
        if self._parsed is None:
            from yarl import URL

            self._parsed = (URL(f"{self._url}?{self._query}", encoded=True) if self._query
                            else URL(self._url))  # (the query as written: already encoded)
        try:
            response = await session.post(self._parsed, data=dumpb(params), proxy=proxy,
                                          allow_redirects=False)
            if response.status >= 400:
                raise LLMStatusError(response.status, response.headers,
                                     await read_body(response, MAX_ERROR_BODY))
            if response.status >= 300:  # not followed: a POST must not move
                response.release()
                raise LLMStatusError(response.status, response.headers, b"",
                                     self._redirect(response.headers.get("Location")))
            body = await read_body(response, MAX_REPLY_BYTES + 1)
        except (TimeoutError, LLMError):
            raise
        except UpstreamBodyError as exc:
            if exc.truncated:
                raise LLMConnectionError(f"the reply was cut off ({exc.detail})") from exc
            raise LLMResponseError(f"the reply cannot be decoded ({exc.detail})",
                                   retryable=False) from exc
        except aiohttp.ClientConnectorCertificateError as exc:
            raise LLMConnectionError(f"the server's TLS certificate was refused "
                                     f"({exc.certificate_error})", retryable=False) from exc
        except aiohttp.ClientResponseError as exc:  # the answer is not HTTP
            raise LLMResponseError(f"the server at {safe_url(self.base_url)} did not answer "
                                   f"with valid HTTP ({exc.message})", retryable=False) from exc
        except (aiohttp.ClientError, OSError) as exc:
            cause = getattr(exc, "os_error", None) or exc
            raise LLMConnectionError(f"{type(cause).__name__}: {cause}") from exc
        if len(body) > MAX_REPLY_BYTES:
            raise LLMResponseError(f"the reply of the server at {safe_url(self.base_url)} is "
                                   f"larger than {MAX_REPLY_BYTES >> 20} MiB", retryable=False)
        try:
            reply = loads(body)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise LLMResponseError(f"the server at {safe_url(self.base_url)} did not answer "
                                   f"with chat.completion JSON ({len(body)} bytes, "
                                   f"{response.content_type})")
        return reply

    async def complete(self, params: dict[str, Any], *, timeout: float, retries: int,
                       schema: dict[str, Any] | None = None,
                       semaphore: asyncio.Semaphore | None = None) -> tuple[dict[str, Any], bool]:
        """One chat completion of ``params``, tried up to ``retries`` more times after a timeout
        (``timeout`` seconds for each whole call), a retryable error or an answer with status
        200 and no reply, waiting :func:`retry_delay` between tries. With ``schema`` (a
        ``response_format``), the schema is asked for first; a server that refuses it (400 or
        422) is asked once more in plain text, a try not counted. ``semaphore``: held for each
        call. Returns the reply's JSON and whether the schema was used; raises
        :class:`CallFailed` when no attempt gave a reply. The one retry loop of the fast loop's
        callers (the judge's votes, the evolver's requests)."""
        structured, attempt = schema is not None, 0
        self.get()  # the session exists before the first call's time starts
        while True:
            body = {**params, "response_format": schema} if structured else params
            status = None
            try:
                if semaphore is None:
                    response = await asyncio.wait_for(self.chat(body), timeout)
                else:
                    async with semaphore:
                        response = await asyncio.wait_for(self.chat(body), timeout)
            except asyncio.TimeoutError:
                kind, detail = "timeout", f"timed out after {timeout:g} s"
                delay = retry_delay(None, attempt)
            except Exception as exc:  # a status, connection or reply error: maybe retried
                if structured and getattr(exc, "status_code", None) in (400, 422):
                    structured = False  # maybe no JSON-schema support: once more as text
                    continue
                kind, detail, delay = "error", self.explain(exc), retry_delay(exc, attempt)
                status = getattr(exc, "status_code", None)
            else:
                refusal = answer_error(response)
                if refusal is None:
                    return response, structured
                # a gateway's error answered with status 200 is a failed call, retried like
                # one, and reported with its message, not read as an empty reply
                kind, detail = "no_reply", self.mask(" ".join(refusal.split())[:300])
                delay = retry_delay(None, attempt)
            if delay is None or attempt >= retries:
                raise CallFailed(kind, detail, attempt + 1, delay is not None, status)
            attempt += 1
            await asyncio.sleep(delay)

    def _redirect(self, location: str | None) -> str:
        """What a redirect's error says: where it points (the base URL to configure, when it
        keeps the endpoint's path)."""
        from urllib.parse import urljoin

        target = ""
        if location:
            target = safe_url(urljoin(self._url, location)) or ""
            if target.endswith("/chat/completions"):
                target = target[:-len("/chat/completions")]
            target = "".join(c for c in target[:300] if c.isprintable())
        return (f"a redirect{' to ' + target if target else ''}, not followed; set the URL to "
                "where it redirects")

    async def aclose(self) -> None:
        """Close the session of the running loop (if any)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.pop(loop, None)
            self._proxies.pop(loop, None)
        if session is not None:
            await session.close()


def run_sync(factory: Callable[[], Awaitable[T]], *closers: LLMClient) -> T:
    """Run a coroutine to completion from synchronous code (script or notebook, see
    :func:`metaclaw.aio.run_sync`); the clients in ``closers`` are closed on that loop before it
    ends."""
    from metaclaw import aio

    async def main() -> T:
        try:
            return await factory()
        finally:
            for closer in closers:
                await closer.aclose()

    return aio.run_sync(main)


def chat_params(model: str, messages: list[dict[str, Any]], *, temperature: float | None = None,
                max_tokens: int | None = None) -> dict[str, Any]:
    """A chat request's body: ``model`` and ``messages``, and the sampling settings given."""
    params: dict[str, Any] = {"model": model, "messages": messages}
    if temperature is not None:
        params["temperature"] = temperature
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return params


def answer_error(response: Any) -> str | None:
    """Why a chat.completion JSON answered with status 200 holds no reply (an ``error`` body,
    no ``choices``), or ``None`` when it holds one. Some servers and gateways report a failure
    this way; read as a reply it would be an empty answer, and judged as one a replay that never
    ran would count as a failure (so a candidate "fixing" it would be promoted)."""
    if not isinstance(response, dict):
        return "the answer is not a JSON object"
    error = response.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        return f"error: {str(message or error)[:300]}"
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
            or not isinstance(choices[0].get("message"), dict):
        return "no choices with a message"
    return None


def reply_message(response: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a chat.completion JSON (``{}`` when it has none)."""
    try:
        message = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return {}
    return message if isinstance(message, dict) else {}


def reply_text(response: dict[str, Any]) -> str:
    """The assistant text of a chat.completion JSON ("" when there is none)."""
    content = reply_message(response).get("content")
    return message_text(content) if content is not None else ""


def check_url(name: str, url: Any) -> str:
    """``url`` if it is an http(s) base URL, else a ``ValueError`` naming the parameter."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{name} must be an OpenAI-compatible base URL such as "
                         f"'http://127.0.0.1:8000/v1', got {url!r}")
    return url


def replay_params(turn: dict[str, Any], messages: list[dict[str, Any]],
                  model: str | None) -> dict[str, Any]:
    """The request that replays a recorded turn with other ``messages`` (other skills): the
    turn's model unless ``model`` is given, and the sampling and tool settings it was sent with."""
    params: dict[str, Any] = {"model": model or turn.get("model") or "default",
                              "messages": messages}
    recorded = turn.get("request_params") or {}
    for key in ("tools", "tool_choice", "temperature", "max_tokens"):
        if recorded.get(key) is not None:
            params[key] = recorded[key]
    return params


#: Longest wait before a retry (seconds), whatever a server's Retry-After asks.
MAX_RETRY_WAIT_S = 20.0


def retry_delay(exc: BaseException | None, attempt: int) -> float | None:
    """Seconds to wait before retrying a failed model call (``exc``; None: it timed out), or
    None when retrying cannot help: a client error other than 408, 409 or 429, a redirect, or
    a reply that would come back alike (:attr:`LLMError.retryable`). A server's
    ``Retry-After`` (or ``retry-after-ms``) is honoured up to :data:`MAX_RETRY_WAIT_S`;
    otherwise the wait doubles from 0.5 s, with jitter."""
    import random

    status = getattr(exc, "status_code", None)
    if status is not None and status < 500 and status not in (408, 409, 429):
        return None
    if getattr(exc, "retryable", True) is False:
        return None
    headers = getattr(exc, "headers", None)
    if headers is None:
        headers = getattr(getattr(exc, "response", None), "headers", None)
    wait = retry_after(headers or {})
    if wait is not None:
        return min(wait, MAX_RETRY_WAIT_S)
    return min(0.5 * 2 ** attempt, MAX_RETRY_WAIT_S) * random.uniform(0.75, 1.25)


def error_text(exc: BaseException) -> str:
    """One line saying why a model request failed (status and server message, timeout, ...)."""
    if isinstance(exc, LLMStatusError):
        text = f"HTTP {exc.status_code}" + (f": {exc.message}" if exc.message else "")
    elif isinstance(exc, TimeoutError):
        text = "timed out"
    elif isinstance(exc, LLMConnectionError):
        text = f"connection error: {exc}"
    elif isinstance(exc, LLMResponseError):
        text = f"invalid reply: {exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


def record_call_failure(store: Any, kind: str, client: Any, error: str, *, source: str,
                        session_id: str | None = None, turn_id: int | None = None,
                        generation: int | None = None) -> str:
    """A failed judge or evolver call in the store's ``events`` table (``kind``:
    ``judge_failed``, ``evolve_failed`` or ``keys_failed``), where ``%metaclaw status``,
    ``%metaclaw events``, ``metaclaw events`` and the notebook views count it, whoever made the
    call: the fast loop, the CLI or a magic. Returns the event's message (the endpoint with its
    secrets masked, the model, the error)."""
    role = "judge" if kind == "judge_failed" else "evolver"
    endpoint, model = safe_url(getattr(client, "base_url", None)), getattr(client, "model", None)
    where = " ".join(x for x in (f"session {session_id}" if session_id else "",
                                 f"turn {turn_id}" if turn_id is not None else "") if x)
    message = (f"{role} call failed{' for ' + where if where else ''}: model {model!r} at "
               f"{endpoint}: {error}")
    store.record_event(source=source, kind=kind, level="error", message=message,
                       endpoint=endpoint, model=model, error=error, session_id=session_id,
                       turn_id=turn_id, generation=generation)
    return message
