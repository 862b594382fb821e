"""The LLM client the fast loop's judge, evolver and gate share: an OpenAI-compatible chat
endpoint called with retries, and the readers of its replies.

:class:`LLMClient` keeps one ``openai.AsyncOpenAI`` client per event loop (the SDK's own retries
off: :func:`retry_delay` decides, honouring a server's Retry-After as the proxy does,
:func:`metaclaw.proxy.upstreams.retry_after`); :func:`error_text` says in one line why a call
failed, and :meth:`LLMClient.explain` masks the client's secrets in it (:mod:`metaclaw.redact`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any, Awaitable, Callable, TypeVar

from metaclaw.buffers import message_text
from metaclaw.proxy.upstreams import retry_after
from metaclaw.redact import mask, safe_url, secrets_of, url_credentials

T = TypeVar("T")


# -- client and event-loop plumbing -----------------------------------------------------------
def _http_client() -> Any:
    """The SDK's aiohttp transport when available (``openai.DefaultAioHttpClient``): hundreds of
    concurrent votes cost about a third of the CPU of the default transport. ``None`` (the
    SDK's default transport) otherwise."""
    import openai

    factory = getattr(openai, "DefaultAioHttpClient", None)
    if factory is None:
        return None
    try:
        return factory()
    except Exception:  # the aiohttp extra is missing: use the default transport
        if not getattr(_http_client, "warned", False):  # once per process
            _http_client.warned = True  # type: ignore[attr-defined]
            logging.getLogger(__name__).warning(
                "openai's aiohttp transport is unavailable (pip install 'openai[aiohttp]'): the "
                "judge and the evolver use the SDK's slower default transport")
        return None


class LLMClient:
    """An ``openai.AsyncOpenAI`` client per event loop (a client's connection pool is bound to
    the loop that first used it), created lazily with the SDK's own retries disabled."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self._clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    def get(self):
        """The client for the running event loop."""
        import openai

        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                client = openai.AsyncOpenAI(
                    base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0,
                    timeout=self.timeout, http_client=_http_client())
                self._clients[loop] = client
            return client

    def explain(self, exc: BaseException) -> str:
        """:func:`error_text` of a failed call, with this client's key and the credentials in
        its URL masked (a server's error may quote the key it was sent)."""
        return self.mask(error_text(exc))

    def mask(self, text: str) -> str:
        """``text`` with this client's key and the credentials in its URL replaced by ``***``."""
        return mask(text, secrets_of(self.api_key, *url_credentials(self.base_url)))

    async def chat(self, params: dict[str, Any]) -> dict[str, Any]:
        """``POST /chat/completions`` with ``params`` (the request body); returns the reply JSON.

        Uses the SDK's documented low-level ``client.post`` with ``cast_to=object``: the same
        transport, authentication and error types (``openai.APIStatusError`` ...) as
        ``chat.completions.create`` without its per-request body transformation and response
        model construction, which dominate the CPU cost of many concurrent votes.
        """
        reply = await self.get().post("/chat/completions", body=params, cast_to=object)
        if not isinstance(reply, dict):
            raise ValueError(f"the server at {safe_url(self.base_url)} did not answer with "
                             "chat.completion JSON")
        return reply

    async def aclose(self) -> None:
        """Close the client of the running loop (if any)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.pop(loop, None)
        if client is not None:
            await client.close()


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
    None when retrying cannot help (a client error other than 408, 409 or 429). A server's
    ``Retry-After`` (or ``retry-after-ms``) is honoured up to :data:`MAX_RETRY_WAIT_S`;
    otherwise the wait doubles from 0.5 s, with jitter."""
    import random

    status = getattr(exc, "status_code", None)
    if status is not None and 400 <= status < 500 and status not in (408, 409, 429):
        return None
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    wait = retry_after(headers)
    if wait is not None:
        return min(wait, MAX_RETRY_WAIT_S)
    return min(0.5 * 2 ** attempt, MAX_RETRY_WAIT_S) * random.uniform(0.75, 1.25)


def error_text(exc: BaseException) -> str:
    """One line saying why a model request failed (status and server message, timeout, ...)."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        message = ""
        try:
            body = exc.response.json()
            message = (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""
        except Exception:
            message = ""
        return f"HTTP {exc.status_code}: {(message or str(exc))[:300]}"
    cause = exc.__cause__
    if isinstance(exc, openai.APITimeoutError):
        # the aiohttp transport reports a refused connection as a connect timeout
        if cause is not None and "connect" in str(cause).lower():
            return f"connection error: {cause}"[:300]
        return "timed out"
    if isinstance(exc, openai.APIConnectionError):
        return f"connection error: {cause or exc}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]
