"""Where the proxy forwards a turn: an OpenAI-compatible upstream, an Anthropic upstream, or a
local policy (the slow loop's responder).

Each upstream speaks one wire protocol (:attr:`Upstream.protocol`); the pipeline translates the
client's request into it when they differ. Both HTTP upstreams use their official SDK (pooled
connections, retries on non-streaming calls, timeouts, typed errors) through its documented raw
``post``: the body goes out as given and the reply comes back as bytes, without the SDK's typed
transforms on the hot path.

Keys: the upstream key comes from the environment variable ``ProxyConfig.api_key_env``; with
caller-auth, ``key`` is the caller's own key, sent instead (as ``Authorization: Bearer`` to an
OpenAI upstream, ``x-api-key`` to an Anthropic one). Keys never reach logs, errors or the store.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import AsyncExitStack
from typing import Any, AsyncIterator

from metaclaw.protocols import (Event, ProxyError, WireProtocol, dumps, error_json, get_protocol,
                                sse_events)

log = logging.getLogger("metaclaw.proxy")

NO_KEY = "sk-no-key"


def response_type(sdk: str = "openai") -> type:
    """The HTTP response class of an SDK's transport (``httpx2``; ``httpx`` in older SDKs).

    Passed as ``cast_to`` to the SDK's documented ``client.post``/``client.get`` for raw
    responses: the body is relayed as it is, without the SDK's typed request transform (which
    costs milliseconds per request) and with the client's retries, timeouts and error classes.
    """
    import importlib

    base = importlib.import_module(f"{sdk}._base_client")
    http = getattr(base, "httpx2", None) or getattr(base, "httpx")
    return http.Response


def safe_url(url: str | None) -> str | None:
    """``url`` without ``user:password@``, query or fragment (for logs, errors and health output)."""
    from urllib.parse import urlsplit, urlunsplit

    if not url:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], query="", fragment=""))


class Upstream:
    """A model endpoint in one wire protocol. ``complete`` returns ``(payload bytes, reply dict,
    policy columns)``; ``stream`` returns an async iterator of :data:`Event` and registers its
    cleanup on ``stack``."""

    protocol: WireProtocol
    kind = "upstream"

    async def complete(self, body: dict[str, Any], key: str | None, headers: dict[str, str]
                       ) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
        raise NotImplementedError

    async def stream(self, body: dict[str, Any], key: str | None, headers: dict[str, str],
                     stack: AsyncExitStack, captured: dict[str, Any]) -> AsyncIterator[Event]:
        raise NotImplementedError

    def map_error(self, exc: BaseException, midstream: bool = False) -> ProxyError:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class HTTPUpstream(Upstream):
    """Shared by the two SDK-backed upstreams: raw posts, error mapping."""

    path = "/chat/completions"
    sdk_name = "openai"

    def __init__(self, url: str, key_env: str, timeout: float, max_retries: int):
        self.url = url
        self.key_env = key_env
        self.timeout = timeout
        self.max_retries = max_retries
        self._client: Any = None

    def _headers(self, key: str | None, headers: dict[str, str]) -> dict[str, str]:
        return headers

    #: Upstream statuses worth another attempt (the SDKs' own choice).
    retry_statuses = frozenset({408, 409, 429, 500, 502, 503, 504})
    #: A Retry-After longer than this (seconds) is not waited for: the error goes to the client,
    #: Retry-After included, so that it can decide.
    max_retry_wait = 20.0

    async def _post(self, body: dict[str, Any], key: str | None, headers: dict[str, str],
                    stream: bool = False) -> Any:
        """POST with retries, only where safe: each attempt ends before any byte reaches the
        client (a stream is retried only while the upstream has not answered 200). Waits as the
        upstream's ``Retry-After`` / ``retry-after-ms`` says, else backs off exponentially;
        timeouts are not retried (the upstream already had its full time)."""
        import asyncio
        import random

        sdk = __import__(self.sdk_name)
        options = {"headers": self._headers(key, headers)}
        for attempt in range(self.max_retries + 1):
            try:
                # a non-streaming reply must be whole within the timeout (an upstream trickling
                # its body never trips the per-read timeout); a stream's events are timed apart
                async with asyncio.timeout(None if stream else self.timeout):
                    return await self._client.post(self.path, body=body,
                                                   cast_to=response_type(self.sdk_name), stream=stream,
                                                   options=options)
            except sdk.APITimeoutError:
                raise
            except (sdk.APIStatusError, sdk.APIConnectionError) as exc:
                status = getattr(exc, "status_code", None)
                if attempt == self.max_retries or (status is not None
                                                   and status not in self.retry_statuses):
                    raise
                wait = retry_after(exc.response.headers) if status is not None else None
                if wait is None:
                    wait = min(0.25 * 2 ** attempt, 4.0) * (0.75 + random.random() / 2)
                elif wait > self.max_retry_wait:
                    raise
                log.info("upstream %s answered %s; retrying in %.2f s (attempt %d of %d)",
                         safe_url(self.url), status or type(exc).__name__, wait, attempt + 2,
                         self.max_retries + 1)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    async def complete(self, body, key, headers):
        upstream = await self._post(body, key, headers)
        payload = upstream.content
        try:
            data = json.loads(payload)
        except ValueError:
            raise ProxyError(502, f"the upstream {safe_url(self.url)} answered with invalid JSON "
                                  f"({len(payload)} bytes); check that the URL is the model "
                                  "server's API", type="upstream_error",
                             code="bad_upstream_response") from None
        problem = self.protocol.reply_problem(data)
        if problem:
            raise ProxyError(502, f"the upstream {safe_url(self.url)} answered with a reply that "
                                  f"is not a {self.protocol.name} reply: {problem}",
                             type="upstream_error", code="bad_upstream_response")
        return payload, data, {}

    async def stream(self, body, key, headers, stack, captured):
        upstream = await self._post(body, key, headers, stream=True)
        stack.push_async_callback(upstream.aclose)
        return timed_events(sse_events(upstream.aiter_lines()), self.timeout)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def map_error(self, exc: BaseException, midstream: bool = False) -> ProxyError:
        sdk = __import__(self.sdk_name)
        upstream = safe_url(self.url)
        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, sdk.APIStatusError):
            return self._relayed_status_error(exc)
        if isinstance(exc, sdk.APITimeoutError) or "timeout" in type(exc).__name__.lower():
            return ProxyError(504, f"the upstream {upstream} did not answer within "
                                   f"{self.timeout:g} s{' mid-stream' if midstream else ''}; "
                                   "raise the proxy timeout or check the upstream",
                              type="upstream_error", code="upstream_timeout")
        if midstream:
            return ProxyError(502, f"the upstream {upstream} dropped the connection mid-stream "
                                   f"({type(exc).__name__}: {exc}); retry the request",
                              type="upstream_error", code="upstream_disconnected")
        if isinstance(exc, sdk.APIConnectionError):
            cause = exc.__cause__ or exc
            return ProxyError(502, f"cannot reach the upstream {upstream} ({type(cause).__name__}: "
                                   f"{cause}); check that it is running and the URL is right",
                              type="upstream_error", code="upstream_unreachable")
        log.exception("unexpected upstream failure", exc_info=exc)
        return ProxyError(502, f"upstream request failed: {type(exc).__name__}: {exc}",
                          type="upstream_error", code="upstream_error")

    def _relayed_status_error(self, exc: Any) -> ProxyError:
        """The upstream's own error (status, JSON, Retry-After) as the client's error."""
        status = exc.status_code
        try:
            body = exc.response.json()
        except Exception:
            body = None
        headers = {k: v for k, v in exc.response.headers.items()
                   if k.lower() in ("retry-after", "retry-after-ms")}
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            error = body["error"]
            message = str(error.get("message") or f"upstream error {status}")
            payload = error_json(message, error.get("type") or "upstream_error",
                                 error.get("param"), error.get("code"))
            return ProxyError(status, message, type=payload["error"]["type"], payload=payload,
                              headers=headers, upstream=(self.protocol.name, body))
        text = (exc.response.text or "").strip()[:500] if exc.response is not None else ""
        message = f"the upstream answered HTTP {status}" + (f": {text}" if text else "")
        return ProxyError(status, message, type="upstream_error", code=str(status),
                          headers=headers)


class OpenAIUpstream(HTTPUpstream):
    """Any OpenAI-compatible base URL, through the official ``openai`` SDK."""

    protocol = get_protocol("openai")
    kind = "openai"

    async def open(self) -> None:
        from openai import AsyncOpenAI

        key = os.environ.get(self.key_env) or NO_KEY
        self._client = AsyncOpenAI(base_url=self.url, api_key=key, timeout=self.timeout,
                                   max_retries=0)  # retries: HTTPUpstream._post

    def _headers(self, key: str | None, headers: dict[str, str]) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def models(self, key: str | None = None) -> Any:
        return await self._client.get("/models", cast_to=response_type(self.sdk_name),
                                      options={"headers": self._headers(key, {})})


class AnthropicUpstream(HTTPUpstream):
    """An Anthropic Messages endpoint (``base_url`` without ``/v1``, as the ``anthropic`` SDK
    takes it), through the official ``anthropic`` SDK. ``anthropic-version`` and
    ``anthropic-beta`` headers of an Anthropic client are forwarded as they came."""

    protocol = get_protocol("anthropic")
    kind = "anthropic"
    path = "/v1/messages"
    sdk_name = "anthropic"

    async def open(self) -> None:
        try:
            from anthropic import AsyncAnthropic
        except ImportError:
            raise RuntimeError("an Anthropic upstream needs the anthropic SDK: "
                               "pip install 'metaclaw-jupyter[anthropic]'") from None
        key = os.environ.get(self.key_env) or NO_KEY
        url = self.url[:-3] if self.url.rstrip("/").endswith("/v1") else self.url
        self._client = AsyncAnthropic(base_url=url.rstrip("/"), api_key=key,
                                      timeout=self.timeout, max_retries=0)

    def _headers(self, key: str | None, headers: dict[str, str]) -> dict[str, str]:
        out = dict(headers)
        if key:  # both ways Anthropic endpoints take a key, replacing the server key
            out["Authorization"] = f"Bearer {key}"
            out["x-api-key"] = key
        return out

    async def count_tokens(self, body: dict[str, Any], key: str | None,
                           headers: dict[str, str]) -> bytes:
        upstream = await self._client.post("/v1/messages/count_tokens", body=body,
                                           cast_to=response_type(self.sdk_name),
                                           options={"headers": self._headers(key, headers)})
        return upstream.content


class ResponderUpstream(Upstream):
    """A local policy answering in the OpenAI chat shape (see :class:`metaclaw.proxy.Responder`).

    A reply's ``metaclaw`` object (policy version, token ids, logprobs) is moved to the turn's
    record and never reaches the client.
    """

    protocol = get_protocol("openai")
    kind = "responder"

    def __init__(self, responder: Any):
        self.responder = responder

    async def complete(self, body, key, headers):
        data = await self.responder.complete(body)
        policy = policy_columns(data.pop("metaclaw", None) if isinstance(data, dict) else None)
        return dumps(data).encode(), data if isinstance(data, dict) else {}, policy

    async def stream(self, body, key, headers, stack, captured):
        # the first event is taken before answering 200, so that a request the policy refuses
        # gets a proper error status instead of a broken stream
        events = _responder_events(self.responder, body, captured)
        stack.push_async_callback(events.aclose)
        return _prepend(await events.__anext__(), events)

    def map_error(self, exc: BaseException, midstream: bool = False) -> ProxyError:
        if isinstance(exc, ProxyError):
            return exc
        from metaclaw.policy import PolicyRequestError

        if isinstance(exc, PolicyRequestError):  # the local policy cannot serve this request
            return ProxyError(exc.status, str(exc), code="unsupported_by_policy")
        return ProxyError(500, f"the local policy failed: {type(exc).__name__}: {exc}",
                          type="server_error", code="responder_error")


async def _responder_events(responder: Any, body: dict[str, Any],
                            captured: dict[str, Any]) -> AsyncIterator[Event]:
    """SSE events of a responder's chunks; a chunk's ``metaclaw`` object is moved to
    ``captured["metaclaw"]`` and never sent to the client."""
    async for chunk in responder.stream(body):
        if isinstance(chunk, dict) and "metaclaw" in chunk:
            chunk = dict(chunk)
            captured["metaclaw"] = chunk.pop("metaclaw")
        yield f"data: {dumps(chunk)}\n\n".encode(), chunk
    yield b"data: [DONE]\n\n", None


async def _prepend(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event


def policy_columns(info: Any) -> dict[str, Any]:
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


async def timed_events(events: AsyncIterator[Event], timeout: float) -> AsyncIterator[Event]:
    """``events``, each within ``timeout`` seconds of the previous one (``TimeoutError``
    otherwise): an upstream trickling an event byte by byte never trips a per-read timeout."""
    import asyncio

    iterator = events.__aiter__()
    while True:
        try:
            async with asyncio.timeout(timeout):
                event = await iterator.__anext__()
        except StopAsyncIteration:
            return
        yield event


def retry_after(headers: Any) -> float | None:
    """Seconds an upstream asks to wait (``retry-after-ms``, ``Retry-After`` in seconds or as an
    HTTP date); ``None`` when it says nothing usable."""
    import email.utils

    try:
        if headers.get("retry-after-ms"):
            return max(0.0, float(headers["retry-after-ms"]) / 1000.0)
        value = headers.get("retry-after")
        if not value:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


def make_upstream(protocol: str, url: str, key_env: str, timeout: float,
                  max_retries: int) -> HTTPUpstream:
    """The HTTP upstream for ``protocol`` (``"openai"`` or ``"anthropic"``)."""
    kinds = {"openai": OpenAIUpstream, "anthropic": AnthropicUpstream}
    if protocol not in kinds:
        raise ValueError(f"unknown upstream protocol {protocol!r}; choose 'openai' or 'anthropic'")
    return kinds[protocol](url, key_env, timeout, max_retries)
