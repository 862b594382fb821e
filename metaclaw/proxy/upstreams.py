"""Where the proxy forwards a turn: an HTTP upstream speaking any registered wire protocol, or a
local policy (the slow loop's responder).

Each upstream speaks one wire protocol (:attr:`Upstream.protocol`); the pipeline translates the
client's request into it when they differ. There is one HTTP upstream, :class:`HTTPUpstream`, for
every protocol: what differs between them (the path, how the key is sent, headers every request
needs such as ``anthropic-version``, the model list, the token count) is declared by the
protocol's adapter (:mod:`metaclaw.protocols`), so this module names no protocol. It posts the
body with one pooled ``aiohttp.ClientSession`` (the framework the proxy serves with) and takes
the reply as bytes: a proxy relays bytes, so the official SDKs' typed request and response
models would only add work to every turn (through them a turn cost about three times the CPU).
What the SDKs gave is kept: the key in each protocol's header, the protocol's version header,
timeouts, retries of what is safe to retry (honouring Retry-After), the upstream's own error
status and body relayed to the client, ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``ALL_PROXY`` /
``NO_PROXY`` from the environment (:func:`environment_proxy`), and TLS verified against the
system's certificate authorities or certifi's bundle (:func:`tls_context`).

Keys: the upstream key comes from the environment variable ``ProxyConfig.api_key_env``; with
caller-auth, ``key`` is the caller's own key, sent instead (as ``Authorization: Bearer``, and in
the protocol's :attr:`~metaclaw.protocols.WireProtocol.key_header` when it has one, such as
Anthropic's ``x-api-key``). Keys never reach logs, errors or the store.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import re
import time
from contextlib import AsyncExitStack
from typing import Any, AsyncIterator, Mapping

from yarl import URL

from metaclaw.jsonlib import dumpb, loads
from metaclaw.protocols import Event, ProxyError, WireProtocol, error_json
from metaclaw.protocols.registry import PIVOT, get_protocol, upstream_protocols
from metaclaw.redact import safe_url

log = logging.getLogger("metaclaw.proxy")
#: The Anthropic key header, named in its 401 message ("invalid x-api-key"): Claude Code shows
#: any error naming it as "Invalid API key · Fix external API key", its user's own key.
_X_API_KEY = re.compile(r"x-api-key", re.IGNORECASE)

NO_KEY = "sk-no-key"


class PolicyRequestError(ValueError):
    """A chat request a local policy (a responder) cannot serve; ``status`` is the HTTP status to
    answer with. Raised by the responders (:mod:`metaclaw.slowloop.policy`), answered here."""

    status = 400

class Upstream:
    """A model endpoint in one wire protocol. ``complete`` returns ``(payload bytes, reply dict,
    policy columns)``; ``stream`` returns an async iterator of lists of :data:`Event` (the events
    that arrived together) and registers its cleanup on ``stack``."""

    protocol: WireProtocol
    kind = "upstream"

    async def complete(self, body: dict[str, Any], key: str | None, headers: dict[str, str]
                       ) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
        raise NotImplementedError

    async def stream(self, body: dict[str, Any], key: str | None, headers: dict[str, str],
                     stack: AsyncExitStack, captured: dict[str, Any]
                     ) -> AsyncIterator[list[Event]]:
        raise NotImplementedError

    def map_error(self, exc: BaseException, midstream: bool = False) -> ProxyError:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class UpstreamStatusError(Exception):
    """The upstream answered with an HTTP error status; its headers and body are kept so that
    the client gets the upstream's own error."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes):
        super().__init__(f"the upstream answered HTTP {status}")
        self.status = status
        self.headers = headers
        self.body = body


class UpstreamBodyError(Exception):
    """The upstream answered, but its reply body did not arrive whole: ``truncated`` (the
    connection closed before the body's end) or, when not, corrupt (a ``Content-Encoding`` that
    cannot be decoded)."""

    def __init__(self, truncated: bool, detail: str):
        super().__init__(detail)
        self.truncated = truncated
        self.detail = detail


#: The most of an upstream error body that is read (bytes): only its start reaches the client
#: (500 characters of a text body, or the message of an error JSON), so a huge error page is
#: not read whole, once per attempt.
MAX_ERROR_BODY = 64 * 1024


@functools.lru_cache(maxsize=8)
def _tls_context(cafile: str | None, capath: str | None) -> Any:
    import ssl

    if cafile or capath:
        return ssl.create_default_context(cafile=cafile, capath=capath)
    context = ssl.create_default_context()  # the system's certificate authorities
    paths = ssl.get_default_verify_paths()
    if os.name != "nt" and not (paths.cafile or paths.capath):
        # the system has none (python.org builds on macOS, slim containers): certifi's bundle
        try:
            import certifi

            context.load_verify_locations(certifi.where())
        except ImportError:
            pass
    return context


def tls_context() -> Any:
    """The ``ssl.SSLContext`` HTTPS calls verify servers with (one per process and setting):
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set, else the system's certificate authorities,
    else certifi's bundle. The proxy's upstreams and the fast loop's LLM client use it."""
    return _tls_context(os.environ.get("SSL_CERT_FILE") or None,
                        os.environ.get("SSL_CERT_DIR") or None)


def environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY`` / ``HTTP_PROXY`` by its
    scheme, else ``ALL_PROXY``; none for a host in ``NO_PROXY``, and none where it is not an
    HTTP proxy, such as ``socks5://``, which the HTTP client cannot use). The one lookup of the
    proxy's upstreams and the fast loop's LLM client."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(url)
    proxies = getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or proxy_bypass(parts.hostname or ""):
        return None
    proxy = proxy if "://" in proxy else f"http://{proxy}"
    return proxy if proxy.startswith(("http://", "https://")) else None


async def read_body(response: Any, limit: int | None = None) -> bytes:
    """The reply's body (its first ``limit`` bytes when given), the response released after;
    a body that breaks off or cannot be decoded raises :class:`UpstreamBodyError`."""
    from aiohttp import ClientPayloadError
    from aiohttp.http_exceptions import ContentEncodingError

    try:
        if limit is None:
            return await response.read()
        body = bytearray()
        while len(body) < limit:
            piece = await response.content.read(limit - len(body))
            if not piece:
                break
            body += piece
        return bytes(body)
    except ClientPayloadError as exc:
        cause = exc.__cause__
        detail = getattr(cause, "message", None) or str(exc)
        raise UpstreamBodyError(not isinstance(cause, ContentEncodingError), detail) from exc
    finally:
        if response.content.is_eof():
            response.release()  # the connection goes back to the pool
        else:  # the rest of the body is not wanted: closing is cheaper than reading it
            response.close()


class HTTPUpstream(Upstream):
    """An upstream at an HTTP base URL speaking ``protocol`` (a registered protocol that declares
    an ``upstream_path``): one pooled session, raw posts, retries, error mapping.

    ``url``: the base URL (``user:password@`` in it becomes Basic authentication, as HTTP
    clients read it); ``key_env``: the environment variable with the server's key; ``timeout``:
    seconds for a whole non-streaming reply, for connecting, and between a stream's events;
    ``max_retries``: further attempts after a 408/409/429/5xx or a connection error (a
    connection that could not be opened is tried once more even at 0).

    :meth:`models` and :meth:`count_tokens` exist (``hasattr``) only when the protocol declares
    the upstream's model list or token count.
    """

    def __init__(self, protocol: WireProtocol, url: str, key_env: str, timeout: float,
                 max_retries: int):
        from urllib.parse import unquote, urlsplit, urlunsplit

        if not protocol.upstream_path:
            raise ValueError(f"the wire protocol {protocol.name!r} declares no upstream_path: "
                             "the proxy cannot forward in it")
        self.protocol = protocol
        self.kind = protocol.name
        self.path = protocol.upstream_path
        self.url = url
        self.key_env = key_env
        self.timeout = timeout
        self.max_retries = max_retries
        parts = urlsplit(url)
        self._base = safe_url(protocol.upstream_base_url(
            urlunsplit(parts._replace(query="", fragment="")))) or ""
        # a query in the URL (Azure OpenAI's ``api-version``) goes with every request; like
        # credentials in the URL it is never shown (it may carry a key)
        self._query = f"?{parts.query}" if parts.query else ""
        self._basic = ((unquote(parts.username or ""), unquote(parts.password or ""))
                       if parts.username or parts.password else None)
        self._session: Any = None
        self._proxy: str | None = None
        self._urls: dict[str, Any] = {}
        self._keyless = False
        #: set by the proxy when callers' own keys are forwarded (``--caller-auth``)
        self.caller_auth = False

    def _headers(self, key: str | None, headers: dict[str, str]) -> dict[str, str]:
        """Per-request headers: ``headers`` and, under caller-auth, the caller's ``key``."""
        return self.protocol.upstream_request_headers(key, headers)

    async def open(self) -> None:
        """Create the pooled session (on the loop that will use it)."""
        import aiohttp

        key = os.environ.get(self.key_env) or NO_KEY
        # a 401 / 403 then says why (unless each caller's own key is forwarded instead)
        self._keyless = key == NO_KEY and self._basic is None and not self.caller_auth
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   **self.protocol.upstream_server_headers(key)}
        if self._basic is not None:  # credentials in the URL win, as in other HTTP clients
            headers["Authorization"] = aiohttp.BasicAuth(*self._basic).encode()
        # the environment's proxy, looked up once (aiohttp's trust_env would look per request)
        self._proxy = environment_proxy(self._base)
        # a whole reply is timed by the caller (asyncio.timeout); a stream's reads are timed
        # here, its events by the protocol's event reader (sse_events)
        self._whole_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                                     sock_read=self.timeout)
        self._session = aiohttp.ClientSession(
            headers=headers, cookie_jar=aiohttp.DummyCookieJar(),  # no state between callers
            connector=aiohttp.TCPConnector(
                limit=1000, ssl=tls_context() if self._base.startswith("https:") else True),
            timeout=self._stream_timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    #: Upstream statuses worth another attempt (the SDKs' own choice).
    retry_statuses = frozenset({408, 409, 429, 500, 502, 503, 504})
    #: A Retry-After longer than this (seconds) is not waited for: the error goes to the client,
    #: Retry-After included, so that it can decide.
    max_retry_wait = 20.0

    async def _request(self, method: str, path: str, data: bytes | None, headers: dict[str, str],
                       stream: bool = False) -> Any:
        """One request, without retries: the reply's bytes, or the open response of a stream.
        An error status raises :class:`UpstreamStatusError`."""
        url = self._urls.get(path)
        if url is None:  # parsed once per path, not per request
            url = self._urls[path] = URL(self._base + path + self._query)
        response = await self._session.request(
            method, url, data=data, headers=headers, proxy=self._proxy, allow_redirects=False,
            timeout=self._stream_timeout if stream else self._whole_timeout)
        if response.status >= 400:
            raise UpstreamStatusError(response.status, response.headers,
                                      await read_body(response, MAX_ERROR_BODY))
        if 300 <= response.status < 400:  # redirects are not followed (a POST must not move)
            response.release()
            raise self._redirect_error(response.status, url, response.headers.get("Location"))
        if stream:
            return response
        return await read_body(response)

    def _redirect_error(self, status: int, url: URL, location: str | None) -> ProxyError:
        """A 502 naming where the upstream redirects (an ``http://`` URL of an ``https://``
        server, a moved endpoint): its body is no reply, and read as one it would be reported as
        invalid JSON or, mid-stream, as a broken stream to retry."""
        where = ""
        try:
            target = str(url.join(URL(location))) if location else ""
            # the base URL to configure, when the redirect keeps the endpoint's path
            target = safe_url(target.split("?", 1)[0].split("#", 1)[0]) or ""
            path = url.path.removeprefix(URL(self._base).path)
            if path and target.endswith(path) and len(target) > len(path):
                target = target[:-len(path)]
        except ValueError:  # a Location that is no URL: not quoted
            target = ""
        if target:  # the upstream's text, shown as printable characters only
            where = " to " + "".join(c for c in target[:300] if c.isprintable())
        return ProxyError(502, f"the upstream {safe_url(self.url)} answered HTTP {status}, a "
                               f"redirect{where}; set the upstream URL to where it redirects",
                          type="upstream_error", code="upstream_redirect",
                          headers={"x-should-retry": "false"})  # a setting, not a passing fault

    async def _post(self, body: dict[str, Any], key: str | None, headers: dict[str, str],
                    stream: bool = False) -> Any:
        """POST with retries, only where safe: each attempt ends before any byte reaches the
        client (a stream is retried only while the upstream has not answered 200). Waits as the
        upstream's ``Retry-After`` / ``retry-after-ms`` says, else backs off exponentially;
        timeouts are not retried (the upstream already had its full time)."""
        import aiohttp

        data, request_headers = dumpb(body), self._headers(key, headers)
        for attempt in range(max(self.max_retries, 1) + 1):
            try:
                # a non-streaming reply must be whole within the timeout (an upstream trickling
                # its body never trips the per-read timeout); a stream's events are timed apart
                async with asyncio.timeout(None if stream else self.timeout):
                    return await self._request("POST", self.path, data, request_headers, stream)
            except TimeoutError:
                raise
            except (UpstreamStatusError, UpstreamBodyError, aiohttp.ClientError,
                    OSError) as exc:
                exc.proxy_attempts = attempt + 1  # read by map_error when this one is raised
                status = getattr(exc, "status", None) if isinstance(
                    exc, UpstreamStatusError) else None
                # a connection that could not be opened reached no upstream: tried once more
                # even at max_retries 0 (one dropped later may have been received, and charged)
                unsent = isinstance(exc, aiohttp.ClientConnectorError)
                allowed = max(self.max_retries, 1) if unsent else self.max_retries
                if attempt >= allowed or (status is not None
                                          and status not in self.retry_statuses):
                    raise
                # a body cut off in transit may arrive whole next time (the SDKs retry it too);
                # a body that cannot be decoded is how the upstream (or a gateway before it)
                # encodes this reply, so another attempt would cost a turn for the same garbage
                if isinstance(exc, UpstreamBodyError) and not exc.truncated:
                    raise
                wait = retry_after(exc.headers) if status is not None else None
                if wait is None:
                    wait = min(0.25 * 2 ** attempt, 4.0) * (0.75 + random.random() / 2)
                elif wait > self.max_retry_wait:
                    raise
                log.info("upstream %s answered %s; retrying in %.2f s (attempt %d of %d)",
                         safe_url(self.url), status or type(exc).__name__, wait, attempt + 2,
                         allowed + 1)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    async def complete(self, body, key, headers):
        payload = await self._post(body, key, headers)
        try:
            data = loads(payload)
        except ValueError:
            raise ProxyError(502, f"the upstream {safe_url(self.url)} answered with invalid JSON "
                                  f"({len(payload)} bytes); check that the URL is the model "
                                  "server's API", type="upstream_error",
                             code="bad_upstream_response") from None
        problem = self.protocol.reply_problem(data)
        if problem:
            self._raise_error_object(data, payload)
            raise ProxyError(502, f"the upstream {safe_url(self.url)} answered with a reply that "
                                  f"is not a {self.protocol.name} reply: {problem}",
                             type="upstream_error", code="bad_upstream_response")
        return payload, data, {}

    async def stream(self, body, key, headers, stack, captured):
        response = await self._post(body, key, headers, stream=True)
        stack.callback(response.release)  # reused only when read to the end
        if response.content_type == "application/json":
            # one JSON body instead of events: an error answered with HTTP 200 (as some
            # gateways do) or a server that does not stream; either is an error status for the
            # client, before any byte of a stream that could only break off
            async with asyncio.timeout(self.timeout):
                payload = await read_body(response)
            try:
                data = loads(payload)
            except ValueError:  # events under the wrong Content-Type: read as events
                return self.protocol.upstream_events(_once(payload), self.timeout)
            self._raise_error_object(data, payload)
            raise ProxyError(502, f"the upstream {safe_url(self.url)} answered a streaming "
                                  "request with one JSON body, not server-sent events: it does "
                                  "not stream; send the request without stream, or use an "
                                  "upstream that streams", type="upstream_error",
                             code="upstream_not_streaming")
        return self.protocol.upstream_events(response.content.iter_any(), self.timeout)

    def _raise_error_object(self, data: Any, payload: bytes) -> None:
        """Raise the upstream's own error when ``data`` (a body answered with HTTP 200) is an
        error object (``{"error": {...}}``, the shape the protocols share), so that the client
        reads the upstream's message."""
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            raise self._relayed_status_error(UpstreamStatusError(502, {}, payload))

    def map_error(self, exc: BaseException, midstream: bool = False) -> ProxyError:
        import aiohttp

        upstream = safe_url(self.url)
        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, UpstreamStatusError):
            return self._relayed_status_error(exc)
        if isinstance(exc, UpstreamBodyError):  # it was reached: its reply broke
            if exc.truncated:
                what, code = ("was truncated: the connection closed before the whole body "
                              "arrived", "upstream_truncated_reply")
            else:
                what, code = "is corrupt: its body cannot be decoded", "upstream_corrupt_reply"
            return ProxyError(502, f"the reply of the upstream {upstream} {what} ({exc.detail})",
                              type="upstream_error", code=code)
        if isinstance(exc, TimeoutError):
            return ProxyError(504, f"the upstream {upstream} did not answer within "
                                   f"{self.timeout:g} s{' mid-stream' if midstream else ''}; "
                                   "raise the proxy timeout or check the upstream",
                              type="upstream_error", code="upstream_timeout")
        if midstream:
            return ProxyError(502, f"the upstream {upstream} dropped the connection mid-stream "
                                   f"({type(exc).__name__}: {exc}); retry the request",
                              type="upstream_error", code="upstream_disconnected")
        if isinstance(exc, (aiohttp.ClientError, OSError)):
            cause = getattr(exc, "os_error", None) or exc.__cause__ or exc
            # where the proxy tried again itself (a request, not a model list or a token
            # count), a client retrying at once would only repeat the wait, and Claude Code would
            # say nothing for minutes; the SDKs (openai, anthropic, Claude Code's) read this header
            retried = getattr(exc, "proxy_attempts", 1) > 1
            return ProxyError(502, f"cannot reach the upstream {upstream} ({type(cause).__name__}: "
                                   f"{cause}); check that it is running and the URL is right",
                              type="upstream_error", code="upstream_unreachable",
                              headers={"x-should-retry": "false"} if retried else None)
        log.exception("unexpected upstream failure", exc_info=exc)
        return ProxyError(502, f"upstream request failed: {type(exc).__name__}: {exc}",
                          type="upstream_error", code="upstream_error")

    def _relayed_status_error(self, exc: UpstreamStatusError) -> ProxyError:
        """The upstream's own error (status, JSON, Retry-After) as the client's error."""
        status = exc.status
        try:
            body = loads(exc.body)
        except ValueError:
            body = None
        headers = {k: v for k, v in exc.headers.items()
                   if k.lower() in ("retry-after", "retry-after-ms")}
        hint = ""
        if status in (401, 403) and self._keyless:
            hint = (f" [the proxy sent no key: ${self.key_env} is unset where `metaclaw serve` "
                    "runs]")
        elif status in (401, 403) and not self.caller_auth:  # the agent's own key is not used
            sent = ("the credentials in its URL" if self._basic is not None else
                    f"the key the proxy sends (${self.key_env} where `metaclaw serve` runs)")
            hint = f" [the upstream {safe_url(self.url)} refused {sent}, not the agent's]"
        refused = bool(hint) and status == 401
        if refused:
            # not the agent's key: a 401 (or an authentication_error) tells an agent to ask its
            # user for a new one (Claude Code retries it ten times, then says "Invalid API key
            # · Fix external API key"); a 403 permission_error is shown with this message at
            # once. The proxy's own 401 stays the one for a wrong proxy token.
            status = 403
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            error = body["error"]
            message = str(error.get("message") or f"upstream error {exc.status}")
            if hint:  # Claude Code reads any message naming the header as its own key wrong
                message = _X_API_KEY.sub("API key", message)
            message += hint
            payload = error_json(message, "permission_error" if refused else
                                 error.get("type") or "upstream_error",
                                 error.get("param"), error.get("code"))
            return ProxyError(status, message, type=payload["error"]["type"], payload=payload,
                              headers=headers,
                              upstream=None if hint else (self.protocol.name, body))
        text = exc.body.decode("utf-8", "replace").strip()[:500]
        if hint:
            text = _X_API_KEY.sub("API key", text)
        message = f"the upstream answered HTTP {exc.status}" + (f": {text}" if text else "") + hint
        return ProxyError(status, message, type="permission_error" if refused else
                          "upstream_error", code=str(exc.status), headers=headers)


    # -- what the protocol may declare of its upstreams ----------------------------------------
    @property
    def models(self):
        """``async models(key=None) -> (status, body)``: the upstream's model list (the
        protocol's ``upstream_models_path``); absent when the protocol declares none."""
        if not self.protocol.upstream_models_path:
            raise AttributeError(f"a {self.protocol.name} upstream has no model list")
        return self._models

    async def _models(self, key: str | None = None) -> tuple[int, bytes]:
        async with asyncio.timeout(self.timeout):
            return 200, await self._request("GET", self.protocol.upstream_models_path, None,
                                            self._headers(key, {}))

    @property
    def count_tokens(self):
        """``async count_tokens(body, key, headers) -> bytes``: the upstream's count of a
        request's tokens (the protocol's ``upstream_count_tokens_path``); absent when the
        protocol declares none."""
        if not self.protocol.upstream_count_tokens_path:
            raise AttributeError(f"a {self.protocol.name} upstream does not count tokens")
        return self._count_tokens

    async def _count_tokens(self, body: dict[str, Any], key: str | None,
                            headers: dict[str, str]) -> bytes:
        async with asyncio.timeout(self.timeout):
            return await self._request("POST", self.protocol.upstream_count_tokens_path,
                                       dumpb(body), self._headers(key, headers))


class ResponderUpstream(Upstream):
    """A local policy answering in the OpenAI chat shape (see :class:`metaclaw.proxy.app.Responder`).

    A reply's ``metaclaw`` object (policy version, token ids, logprobs) is moved to the turn's
    record and never reaches the client.
    """

    protocol = PIVOT
    kind = "responder"

    def __init__(self, responder: Any):
        self.responder = responder

    async def complete(self, body, key, headers):
        data = await self.responder.complete(body)
        policy = policy_columns(data.pop("metaclaw", None) if isinstance(data, dict) else None)
        return dumpb(data), data if isinstance(data, dict) else {}, policy

    async def stream(self, body, key, headers, stack, captured):
        # the first event is taken before answering 200, so that a request the policy refuses
        # gets a proper error status instead of a broken stream
        events = _responder_events(self.responder, body, captured)
        stack.push_async_callback(events.aclose)
        return _prepend(await events.__anext__(), events)

    def map_error(self, exc: BaseException, midstream: bool = False) -> ProxyError:
        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, PolicyRequestError):  # the local policy cannot serve this request
            return ProxyError(exc.status, str(exc), code="unsupported_by_policy")
        return ProxyError(500, f"the local policy failed: {type(exc).__name__}: {exc}",
                          type="server_error", code="responder_error")


async def _responder_events(responder: Any, body: dict[str, Any],
                            captured: dict[str, Any]) -> AsyncIterator[list[Event]]:
    """SSE events of a responder's chunks, one at a time as they are produced; a chunk's
    ``metaclaw`` object is moved to ``captured["metaclaw"]`` and never sent to the client."""
    async for chunk in responder.stream(body):
        if isinstance(chunk, dict) and "metaclaw" in chunk:
            chunk = dict(chunk)
            captured["metaclaw"] = chunk.pop("metaclaw")
        yield [(b"data: " + dumpb(chunk) + b"\n\n", chunk)]
    yield [(b"data: [DONE]\n\n", None)]


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _prepend(first: list[Event],
                   rest: AsyncIterator[list[Event]]) -> AsyncIterator[list[Event]]:
    yield first
    async for batch in rest:
        yield batch


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


def retry_after(headers: Any) -> float | None:
    """Seconds a server asks to wait before a retry (``retry-after-ms``, else ``Retry-After`` in
    seconds or as an HTTP date); ``None`` when it says nothing usable. The one reader of these
    headers: the upstream clients here and the fast loop's LLM client use it."""
    import email.utils

    try:
        value = headers.get("retry-after")
        given = ((headers.get("retry-after-ms"), 0.001), (value, 1.0))
    except AttributeError:
        return None
    for raw, scale in given:
        try:
            if raw:
                return max(0.0, float(raw) * scale)
        except (TypeError, ValueError, OverflowError):
            continue
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time()) \
            if value else None
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def make_upstream(protocol: str, url: str, key_env: str, timeout: float,
                  max_retries: int) -> HTTPUpstream:
    """The HTTP upstream at ``url`` speaking the registered protocol called ``protocol`` (one of
    :func:`~metaclaw.protocols.registry.upstream_protocols`)."""
    names = upstream_protocols()
    if protocol not in names:
        raise ValueError(f"unknown upstream protocol {protocol!r}; choose one of "
                         f"{', '.join(repr(name) for name in names)}")
    return HTTPUpstream(get_protocol(protocol), url, key_env, timeout, max_retries)
