"""Serve chat completions from the current trained policy, with an atomic hot-swap.

:class:`PolicyResponder` turns an OpenAI chat request into prompt tokens with the backend's chat
template, samples from the currently published policy (a backend :class:`Sampler`) in a thread
executor, parses tool calls, and answers in the OpenAI ``chat.completion`` /
``chat.completion.chunk`` shapes. The proxy uses it in place of an upstream::

    responder = PolicyResponder(backend)
    reply = await responder.complete(body)          # dict, OpenAI chat.completion
    async for chunk in responder.stream(body): ...  # dicts, OpenAI chat.completion.chunk
    responder.policy_version                         # the version new requests get

Hot-swap: ``responder.swap(sampler, version)`` (pass it as ``on_publish`` to
:func:`metaclaw.slowloop.grpo.train_grpo`) replaces the serving sampler in one reference assignment.
Each request reads that reference once when it starts, so in-flight requests finish on the old
weights, new requests get the new ones, nothing is locked, and no request waits for training
(training and sampling use different weight copies; generation runs in the executor).

Tool calls: the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the format :func:`metaclaw.slowloop.backends.normalize_messages` renders earlier calls in); each parsed
block becomes an OpenAI ``tool_calls`` entry and the reply's ``finish_reason`` is
``tool_calls``. An unparsable block stays in the text.

Following the workspace: a serving process is not the only one that publishes policies (``metaclaw
train`` or a notebook's slow loop publishes into the shared store's ``policy_versions``).
:class:`PolicyFollower` watches the store from a background thread, and when a newer version is
published loads its checkpoint there (never on the event loop) and hot-swaps it in with
:meth:`PolicyResponder.swap`; a version it cannot serve is reported once and skipped::

    follower = PolicyFollower(store, responder, served_model.published_sampler).start()

Every reply carries a ``metaclaw`` object (the final chunk, when streaming) with the
``policy_version`` that produced it and the prompt / completion token ids and completion
logprobs, so the proxy can record the turn exactly; strip it before answering a client if wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator

from metaclaw.proxy.upstreams import PolicyRequestError
from metaclaw.slowloop.backends import Sample, locate_checkpoint, render_request

log = logging.getLogger("metaclaw.policy")

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


class PolicyMismatch(ValueError):
    """A published policy version this server cannot serve (another base model or backend)."""


@dataclass(frozen=True)
class _Serving:
    sampler: Any
    version: int


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into (content, OpenAI tool_calls).

    In: the decoded completion. Out: the text without parsed ``<tool_call>`` blocks (``None``
    when nothing but tool calls remains) and a list of
    ``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``.
    """
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return match.group(0)
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
        return ""

    rest = TOOL_CALL_RE.sub(take, text).strip()
    return (rest or None) if calls else rest, calls


def _streamable(text: str) -> str:
    """The part of a growing completion that is safe to stream as content: stripped, before any
    ``<tool_call>``, and without a trailing partial ``<tool_call>`` opener."""
    visible = text.split(TOOL_CALL_OPEN, 1)[0]
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(visible)), 0, -1):
        if visible.endswith(TOOL_CALL_OPEN[:k]):
            visible = visible[:-k]
            break
    return visible.strip()


MAX_STOP = 4  # as in the OpenAI API


def _stop_strings(stop: Any) -> list[str]:
    """The request's ``stop`` as a list: absent or null is none, a string is one; else a list
    of 1 to 4 non-empty strings (OpenAI's limits), or a :class:`PolicyRequestError`."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)):
        raise PolicyRequestError(f"'stop' must be a non-empty string or a list of up to "
                                 f"{MAX_STOP} non-empty strings")
    return stops


def _cut_at_stop(text: str, stops: list[str]) -> int | None:
    """Where ``text`` must end: the start of the first stop string in it, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` may be the start of a stop string (held back
    when streaming until the next tokens tell)."""
    for k in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


class PolicyResponder:
    """OpenAI-compatible chat answers from a backend's published policy (see module docstring).

    In: a backend (for its tokenizer: ``render_chat`` / ``decode``), optionally the sampler and
    version to start from (default: ``backend.sampler()``), the model name to report, default
    ``max_tokens`` / ``temperature``, and the size of the generation thread pool.
    """

    def __init__(self, backend, sampler=None, policy_version: int | None = None, *,
                 model_name: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.7, max_workers: int = 8):
        self.backend = backend
        sampler = backend.sampler() if sampler is None else sampler
        version = (getattr(sampler, "policy_version", 0) if policy_version is None
                   else policy_version)
        self._serving = _Serving(sampler, int(version))
        self.model_name = model_name or f"metaclaw-policy:{backend.base_model}"
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._executor = ThreadPoolExecutor(max_workers=max_workers,
                                            thread_name_prefix="metaclaw-policy")
        self.swaps = 0

    # -- hot-swap -------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The policy version new requests are served with."""
        return self._serving.version

    def swap(self, new_sampler, policy_version: int | None = None) -> int:
        """Serve new requests from ``new_sampler`` (atomic; in-flight requests are unaffected).
        Returns the new policy version. Usable directly as ``on_publish`` of ``train_grpo``."""
        version = (getattr(new_sampler, "policy_version", self.policy_version + 1)
                   if policy_version is None else int(policy_version))
        self._serving = _Serving(new_sampler, int(version))  # one reference assignment
        self.swaps += 1
        return version

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- requests -------------------------------------------------------------------------
    def _prepare(self, body: dict[str, Any]
                 ) -> tuple[list[int], int, float, int | None, list[str]]:
        if not isinstance(body, dict):
            raise PolicyRequestError("the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PolicyRequestError("'messages' must be a non-empty list of chat messages")
        if body.get("n") not in (None, 1):  # null is the API's default, 1
            raise PolicyRequestError("only n=1 is supported when serving from the trained policy")
        max_tokens = body.get("max_completion_tokens")
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        temperature = body.get("temperature")
        temperature = self.temperature if temperature is None else temperature
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise PolicyRequestError("'max_tokens' must be a positive integer")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise PolicyRequestError("'temperature' must be a number >= 0")
        try:
            prompt = render_request(self.backend, body)  # the rendering training uses too
        except ValueError as exc:
            raise PolicyRequestError(f"cannot render these messages: {exc}") from None
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not -2**63 <= seed < 2**63):
            raise PolicyRequestError("'seed' must be an integer from -2**63 to 2**63 - 1")
        return prompt, max_tokens, float(temperature), seed, _stop_strings(body.get("stop"))

    def _envelope(self, kind: str, rid: str, created: int, body: dict[str, Any]) -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": created,
                "model": body.get("model") or self.model_name}

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a non-streaming chat request with an OpenAI ``chat.completion`` dict.

        With ``stop`` (a string or up to 4), generation ends at the first token that completes
        a stop string; the reply's text ends before it (the stop string is not included) and
        its ``finish_reason`` is ``stop``. The recorded token ids are those generated."""
        serving = self._serving  # read once: this request stays on these weights
        prompt, max_tokens, temperature, seed, stops = self._prepare(body)
        if stops or hasattr(serving.sampler, "stream"):
            # token by token: to end as soon as a stop string appears, and so that a client who
            # hangs up (its handler cancelled) stops the generation at the next token, where a
            # whole sample in the executor would go on generating for nobody
            sample = Sample([], [], "length")
            text = ""
            # aclosing: leaving the loop stops the generation thread now, not at garbage
            # collection
            async with contextlib.aclosing(self._tokens(serving.sampler, prompt, max_tokens,
                                                        temperature, seed)) as pairs:
                async for token, logprob in pairs:
                    sample.tokens.append(token)
                    sample.logprobs.append(logprob)
                    if token == self.backend.eos_token_id:
                        sample.stop_reason = "stop"
                    if not stops:
                        continue
                    text = self.backend.decode(sample.tokens)
                    cut = _cut_at_stop(text, stops)
                    if cut is not None:
                        text, sample.stop_reason = text[:cut], "stop"
                        break
            if not stops:
                text = self.backend.decode(sample.tokens)
        else:
            loop = asyncio.get_running_loop()
            samples = await loop.run_in_executor(self._executor, serving.sampler.sample,
                                                 prompt, 1, max_tokens, temperature, seed)
            sample = samples[0]
            text = self.backend.decode(sample.tokens)
        content, calls = parse_tool_calls(text)
        finish = "tool_calls" if calls else ("stop" if sample.stop_reason == "stop" else "length")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        reply = self._envelope("chat.completion", f"chatcmpl-{uuid.uuid4().hex[:24]}",
                               int(time.time()), body)
        reply.update({
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sample.tokens),
                      "total_tokens": len(prompt) + len(sample.tokens)},
            "metaclaw": {"policy_version": serving.version, "prompt_token_ids": prompt,
                         "completion_token_ids": list(sample.tokens),
                         "completion_logprobs": list(sample.logprobs)},
        })
        return reply

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Answer a streaming chat request with OpenAI ``chat.completion.chunk`` dicts.

        With a sampler that generates incrementally (the local backend) each token is sent as
        it is produced; otherwise (Tinker) the completion is sampled first and then sent token
        by token. Text from ``<tool_call>`` on is held back and sent as ``tool_calls`` deltas.
        With ``stop``, text that may be the start of a stop string is held back until the next
        tokens tell, so no part of a stop string is ever sent (as in :meth:`complete`).
        A usage chunk follows when ``stream_options.include_usage`` is true.
        """
        serving = self._serving
        prompt, max_tokens, temperature, seed, stops = self._prepare(body)
        base = self._envelope("chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex[:24]}",
                              int(time.time()), body)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                         "logprobs": None}]}

        yield chunk({"role": "assistant", "content": ""})
        tokens: list[int] = []
        logprobs: list[float] = []
        sent = ""  # the part of the text already sent as content
        stop_reason = "length"
        cut = None  # where a stop string starts in the text, once one appeared
        async with contextlib.aclosing(self._tokens(serving.sampler, prompt, max_tokens,
                                                    temperature, seed)) as pairs:
            async for token, logprob in pairs:
                tokens.append(token)
                logprobs.append(logprob)
                if token == self.backend.eos_token_id:
                    stop_reason = "stop"
                text = self.backend.decode(tokens)
                cut = _cut_at_stop(text, stops)
                if cut is not None:
                    text, stop_reason = text[:cut], "stop"
                elif stops:  # what may begin a stop string is sent only once it cannot
                    text = text[:len(text) - _stop_prefix(text, stops)]
                visible = _streamable(text)
                if len(visible) > len(sent) and visible.startswith(sent):
                    yield chunk({"content": visible[len(sent):]})
                    sent = visible
                if cut is not None:
                    break
        text = self.backend.decode(tokens)
        content, calls = parse_tool_calls(text if cut is None else text[:cut])
        tail = (content or "")[len(sent):] if (content or "").startswith(sent) else ""
        if tail:
            yield chunk({"content": tail})
        for i, call in enumerate(calls):
            yield chunk({"tool_calls": [{"index": i, **call}]})
        finish = "tool_calls" if calls else stop_reason
        last = chunk({}, finish)
        last["metaclaw"] = {"policy_version": serving.version, "prompt_token_ids": prompt,
                            "completion_token_ids": tokens, "completion_logprobs": logprobs}
        yield last
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens)}}

    async def _tokens(self, sampler, prompt: list[int], max_tokens: int, temperature: float,
                      seed: int | None) -> AsyncIterator[tuple[int, float]]:
        """(token, logprob) pairs as the executor produces them."""
        loop = asyncio.get_running_loop()
        if not hasattr(sampler, "stream"):
            samples = await loop.run_in_executor(self._executor, sampler.sample, prompt, 1,
                                                 max_tokens, temperature, seed)
            for pair in zip(samples[0].tokens, samples[0].logprobs):
                yield pair
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        cancelled = threading.Event()

        def produce() -> None:
            try:
                for pair in sampler.stream(prompt, max_tokens, temperature, seed):
                    if cancelled.is_set():
                        break
                    loop.call_soon_threadsafe(queue.put_nowait, pair)
            except BaseException as exc:  # delivered to the consumer below
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        future = loop.run_in_executor(self._executor, produce)
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            await asyncio.shield(future)


class PolicyFollower:
    """Keeps a responder serving the workspace's latest published policy version.

    In: the workspace ``store``, the ``responder`` to hot-swap, ``load(version, backend,
    base_model, checkpoint) -> sampler`` (raises :class:`PolicyMismatch` for a version this
    server cannot serve, any other exception for a checkpoint it cannot load), optionally the
    ``proxy`` (nothing is adopted while another responder answers its requests, e.g. a slow loop
    training in this process, which swaps its own) and ``poll_s``.

    :meth:`check` looks once: the store's watcher says whether anything was committed (SQLite:
    ``PRAGMA data_version`` on a private connection, microseconds; PostgreSQL: always), and only
    then one primary-key range query
    for versions newer than the one served. The newest version that loads is swapped in; the
    others newer than it are reported once each in the store's events (``policy_not_adopted``:
    another base model or backend, warning; ``policy_load_failed``: a missing or broken
    checkpoint, error) and the server keeps serving what it served. ``policy_adopted`` (info)
    records each swap. A version published without its checkpoint yet is looked at again on
    the next commit (its trainer records the checkpoint right after publishing).
    :meth:`start` checks every ``poll_s`` seconds in a daemon thread; :meth:`stop` ends it.
    """

    def __init__(self, store, responder: PolicyResponder, load, *, proxy=None,
                 poll_s: float = 0.5, state_dir: Any = None):
        from metaclaw.store import local_dir

        self.store, self.responder, self.load = store, responder, load
        self.proxy, self.poll_s = proxy, poll_s
        # where a checkpoint recorded before the workspace's folder moved is found now (the
        # training state folder ``metaclaw train`` uses by default)
        self.state_dir = state_dir if state_dir is not None else local_dir(store.target) / "train"
        try:
            self._probe = store.watcher()
        except ValueError:
            raise ValueError("following published policies needs a workspace store on disk "
                             "or a database server") from None
        self._settled: set[int] = set()   # versions reported as not servable: never retried
        self._lock = threading.Lock()     # one check at a time (thread and direct callers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> int | None:
        """Adopt the newest servable version newer than the served one, if one was published
        since the last look. Returns the adopted version, or None."""
        with self._lock:
            if self.proxy is not None and self.proxy.responder is not self.responder:
                return None
            if not self._probe.changed():
                return None
            rows = self._probe.query(
                "SELECT version, backend, base_model, checkpoint FROM policy_versions "
                "WHERE version > ? ORDER BY version DESC",
                (self.responder.policy_version,))
            mismatched: list[tuple[int, str]] = []  # said in one line (a workspace may hold many)
            try:
                return self._adopt(rows, mismatched)
            finally:
                if mismatched:
                    versions = ", ".join(str(v) for v, _ in sorted(mismatched))
                    log.warning("%s", f"policy version{'s' if len(mismatched) > 1 else ''} "
                                f"{versions} not adopted (newest: {mismatched[0][1]}); still "
                                f"serving policy version {self.responder.policy_version}")

    def _adopt(self, rows: list[tuple[Any, ...]], mismatched: list[tuple[int, str]]
               ) -> int | None:
        """Swap in the first version of ``rows`` (newest first) that loads; those trained for
        another base model or backend are added to ``mismatched``."""
        for version, backend, base_model, checkpoint in rows:
            if version in self._settled or checkpoint is None:
                continue
            checkpoint = locate_checkpoint(checkpoint, self.state_dir, version)
            try:
                sampler = self.load(version, backend, base_model, checkpoint)
            except PolicyMismatch as exc:
                self._report(version, "policy_not_adopted", "warning", str(exc), said=False)
                mismatched.append((version, str(exc)))
                continue
            except Exception as exc:
                self._report(version, "policy_load_failed", "error",
                             f"cannot load policy version {version}: {exc}")
                continue
            previous = self.responder.policy_version
            self.responder.swap(sampler, version)
            log.info("serving policy version %d (was %d), loaded from %s", version,
                     previous, checkpoint)
            self.store.record_event(source="policy", kind="policy_adopted",
                                    message=f"now serving policy version {version} "
                                            f"(was {previous})",
                                    version=version, previous=previous,
                                    checkpoint=checkpoint)
            return version
        return None

    def _report(self, version: int, kind: str, level: str, reason: str, *,
                said: bool = True) -> None:
        """Record (and, ``said``, log) that ``version`` is not served, for good."""
        self._settled.add(version)
        message = f"{reason}; still serving policy version {self.responder.policy_version}"
        if said:
            getattr(log, level)("%s", message)
        self.store.record_event(source="policy", kind=kind, level=level, message=message,
                                version=version, serving=self.responder.policy_version)

    def start(self) -> "PolicyFollower":
        """Check every ``poll_s`` seconds in a background thread (returns self)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="metaclaw-policy-follower",
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # a locked or vanished database: try again at the next poll
                log.exception("checking for published policy versions failed")

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30)
        with self._lock:
            self._probe.close()

    close = stop
