"""OpenAI chat completions (``POST /v1/chat/completions``): the first protocol, and the pivot.

Its chat shape is the pivot every other protocol translates to and from, and the neutral form the
store records, so ``to_chat`` / ``from_chat`` and the reply translations are identities here.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from metaclaw.jsonlib import dumpb
from metaclaw.protocols import (ARRAY, BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, Event,
                                ProxyError, StreamTranslator, WireProtocol, sse_events,
                                summarize_completion, usage_columns)
from metaclaw.skills.asks import content_text


class StreamAssembler:
    """Accumulates ``chat.completion.chunk`` dicts into the turn's reply (choice 0).

    After the stream: ``content`` (str or None; a refusal's text where the model refused),
    ``refusal`` (whether it did), ``tool_calls`` (list of OpenAI tool-call dicts,
    by index, or None), ``finish_reason``, ``usage`` (dict or None), ``error`` (the error dict
    of an SSE error event, or None), ``logprobs`` (list of floats or None), ``chunks`` (count).
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._refusal: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}
        self._logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.chunks = 0

    def add(self, chunk: dict[str, Any] | None) -> None:
        if chunk is None:
            return
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
            if delta.get("content"):  # a list of parts from some servers (Mistral's Magistral)
                self._parts.append(content_text(delta["content"]))
            if isinstance(delta.get("refusal"), str):
                self._refusal.append(delta["refusal"])
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
        if self._parts:
            return "".join(self._parts)
        return "".join(self._refusal) if self._refusal else None

    @property
    def refusal(self) -> bool:
        return bool(self._refusal)

    @property
    def finished(self) -> bool:
        """Whether the reply's end was said (its finish reason)."""
        return self.finish_reason is not None

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return [self._tools[i] for i in sorted(self._tools)] or None

    @property
    def logprobs(self) -> list[float] | None:
        return self._logprobs or None

    def columns(self) -> dict[str, Any]:
        """The recorded reply columns of what was assembled."""
        columns = {"response": self.content, "tool_calls": self.tool_calls,
                   "finish_reason": self.finish_reason, **usage_columns(self.usage)}
        if self.logprobs:
            columns["completion_logprobs"] = self.logprobs
        return columns


class ToChatStream(StreamTranslator):
    """Base of the translators of another protocol's stream into ``chat.completion.chunk``
    dicts: the chunk template (``base``), one chunk per delta (:meth:`_chunk`), and the end: a
    usage chunk when the usage is known (:meth:`chat_usage`), then ``None`` (``[DONE]``)."""

    def __init__(self) -> None:
        self.base: dict[str, Any] = {"id": "chatcmpl-" + uuid.uuid4().hex[:24],
                                     "object": "chat.completion.chunk",
                                     "created": int(time.time()), "model": ""}
        self.done = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}

    def chat_usage(self) -> dict[str, Any] | None:
        """The stream's usage in the chat shape (``None``: not known)."""
        return None

    def close(self) -> list[dict[str, Any] | None]:
        if self.done:
            return []
        self.done = True
        usage = self.chat_usage()
        return [*([{**self.base, "choices": [], "usage": usage}] if usage else []), None]


class TranslatedAssembler:
    """Accumulates another protocol's stream events into the recorded reply columns: each event
    is translated to ``chat.completion.chunk`` dicts by ``to_chat`` (the protocol's
    ``stream_to_chat()``) and those are assembled as a chat stream (:class:`StreamAssembler`)."""

    def __init__(self, to_chat: StreamTranslator) -> None:
        self._chat = to_chat
        self._inner = StreamAssembler()
        self.error: dict[str, Any] | None = None

    def add(self, event: dict[str, Any] | None) -> None:
        for chunk in self._chat.feed(event):
            self._inner.add(chunk)
        self.error = self._inner.error

    def columns(self) -> dict[str, Any]:
        for chunk in self._chat.close():
            self._inner.add(chunk)
        return self._inner.columns()


class CallNumbering:
    """Fills in what some OpenAI-compatible servers leave out of a streamed reply's tool calls,
    so that every reader of the stream (the recorded turn, each translation, a chat client)
    sees the same calls: a fragment without ``index`` belongs to the call whose ``id`` it
    repeats, starts a new call when it brings a new ``id``, else continues the last call; a
    call whose first fragment has no ``id`` gets one (``call_...``). Only the chunks it changes
    are re-encoded."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.started: set[int] = set()
        self.last: int | None = None
        self.arguments: dict[int, list[str]] = {}  # each call's argument fragments so far
        self.names: dict[int, str] = {}  # each call's name so far

    def fix(self, event: Event) -> Event:
        raw, chunk = event
        if chunk is None or b'"tool_calls"' not in raw:
            return event
        changed = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            if choice.get("index", 0) != 0 or not isinstance(calls, list):
                continue
            for call in calls:
                if isinstance(call, dict):
                    changed = self._fix_call(call) or changed
        return (b"data: " + dumpb(chunk) + b"\n\n", chunk) if changed else event

    def _fix_call(self, call: dict[str, Any]) -> bool:
        changed = False
        index, given = call.get("index"), call.get("id")
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        if not isinstance(index, int) or isinstance(index, bool):
            if isinstance(given, str) and given in self.ids:
                index = self.ids[given]
            elif given or self.last is None or (function.get("name")
                                                and self._whole(self.last)):
                # a new id, or a name once the last call's arguments are whole: another call
                index = max(self.started, default=-1) + 1
            else:  # (a server may repeat the name on every fragment of one call)
                index = self.last
            call["index"], changed = index, True
        name = function.get("name")
        if isinstance(name, str) and name:
            if self.names.get(index) == name and index in self.arguments:
                # the name repeated on a later fragment (some servers): said once, or every
                # reader would join it to itself
                del function["name"]
                changed = True
            elif len(self.names) < 64:
                self.names[index] = self.names.get(index, "") + name
        if isinstance(function.get("arguments"), str) and len(self.arguments) < 64:
            self.arguments.setdefault(index, []).append(function["arguments"])
        if index not in self.started:
            self.started.add(index)
            if not given:
                call["id"] = given = "call_" + uuid.uuid4().hex[:24]
                changed = True
        if isinstance(given, str) and given:
            self.ids[given] = index
        self.last = index
        return changed

    def _whole(self, index: int) -> bool:
        """Whether call ``index``'s arguments so far are a whole JSON value."""
        text = "".join(self.arguments.get(index, ())).strip()
        if not text:
            return False
        try:
            json.loads(text)
        except ValueError:
            return False
        return True


async def _numbered(batches: Any) -> Any:
    numbering = CallNumbering()
    async for batch in batches:
        yield [numbering.fix(event) for event in batch]


def fill_call_ids(completion: dict[str, Any]) -> bool:
    """Give each tool call of a ``chat.completion`` that has no ``id`` one (``call_...``), as
    :class:`CallNumbering` does in a stream; whether any was missing."""
    changed = False
    for choice in completion.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict) and not call.get("id"):
                call["id"], changed = "call_" + uuid.uuid4().hex[:24], True
    return changed


class _Identity(StreamTranslator):
    def feed(self, event: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        return [event]


def _message_problem(message: dict[str, Any]) -> tuple[str, str] | None:
    """(where, what) is wrong with the parts of a message the proxy reads (image parts, tool
    calls), or None. The OpenAI API refuses the same shapes; checking them here makes them a 400
    naming the field whatever the upstream, rather than a failure of a translation."""
    content = message.get("content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        # a text part without its text: the OpenAI API refuses it, and servers that join the
        # parts' texts fail on it with a 500 the client cannot act on
        if isinstance(part, dict) and part.get("type") == "text" and not isinstance(
                part.get("text"), str):
            return f".content[{j}].text", "must be a string"
        if isinstance(part, dict) and part.get("type") == "image_url" and not (
                isinstance(part.get("image_url"), dict)
                and isinstance(part["image_url"].get("url"), str)):
            return f".content[{j}].image_url", "must be an object with a string 'url'"
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        return ".tool_calls", "must be a list of tool calls"
    for k, call in enumerate(calls):
        if not isinstance(call, dict):
            return f".tool_calls[{k}]", "must be an object"
        if call.get("type", "function") != "function":  # a custom tool's call: forwarded as is
            continue
        function = call.get("function")
        if not isinstance(function, dict):
            return f".tool_calls[{k}]", "must be an object with a 'function' object"
        if not isinstance(function.get("arguments", ""), (str, dict)):
            return f".tool_calls[{k}].function.arguments", "must be a string of JSON"
    return None


class OpenAIChat(WireProtocol):
    name = "openai"
    routes = ("/chat/completions",)
    key_header = None
    pivot = True
    upstream_path = "/chat/completions"  # after any OpenAI-compatible base URL (``.../v1``)
    upstream_models_path = "/models"
    field_types = {
        "model": STRING, "messages": ARRAY, "stream": BOOLEAN, "stream_options": OBJECT,
        "tools": ARRAY, "tool_choice": STRING + OBJECT, "temperature": NUMBER, "top_p": NUMBER,
        "n": INTEGER, "max_tokens": INTEGER, "max_completion_tokens": INTEGER,
        "stop": STRING + ARRAY, "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
        "logprobs": BOOLEAN, "top_logprobs": INTEGER, "user": STRING, "seed": INTEGER,
        "response_format": OBJECT, "parallel_tool_calls": BOOLEAN, "logit_bias": OBJECT,
        "metadata": OBJECT, "store": BOOLEAN, "modalities": ARRAY, "reasoning_effort": STRING,
        "functions": ARRAY, "function_call": STRING + OBJECT, "prediction": OBJECT,
        "audio": OBJECT, "service_tier": STRING,
    }
    message_field_types = {"role": STRING, "content": STRING + ARRAY, "name": STRING,
                           "tool_calls": ARRAY, "tool_call_id": STRING}

    def parse_request(self, body: dict[str, Any], model: str | None) -> tuple[str, bool]:
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
            problem = _message_problem(message)
            if problem:
                param, what = problem
                raise bad(f"messages[{i}]{param}", f"messages[{i}]{param} {what}")
        model = model or body.get("model")
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
        for k, tool in enumerate(body.get("tools") or ()):
            if not isinstance(tool, dict) or not isinstance(tool.get("function", {}), dict):
                raise bad(f"tools[{k}]", f"tools[{k}] must be an object whose 'function' is an "
                                         "object")
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and not isinstance(choice.get("function", {}), dict):
            raise bad("tool_choice", "'tool_choice.function' must be an object such as "
                                     "{'name': 'get_weather'}")
        return model, stream

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        return chat

    def inject(self, body: dict[str, Any], block: str) -> dict[str, Any]:
        from metaclaw.skills.block import inject

        messages = inject(body["messages"], block)
        return body if messages == body["messages"] else {**body, "messages": messages}

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_completion_tokens") or body.get("max_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def prepare_forward(self, body: dict[str, Any],
                        stream_usage: bool) -> tuple[dict[str, Any], bool]:
        client_usage = self.asks_for_usage(body)
        if body.get("stream") and stream_usage and not client_usage:
            body = {**body, "stream_options": {**(body.get("stream_options") or {}),
                                               "include_usage": True}}
        return body, client_usage

    def asks_for_usage(self, body: dict[str, Any]) -> bool:
        return bool((body.get("stream_options") or {}).get("include_usage"))

    def reply_to_chat(self, data: dict[str, Any]) -> dict[str, Any]:
        return data

    def complete_reply(self, data: dict[str, Any]) -> bool:
        return fill_call_ids(data)

    def upstream_events(self, chunks: Any, timeout: float | None) -> Any:
        return _numbered(sse_events(chunks, timeout))

    def complete_without_terminal(self, assembler: Any) -> bool:
        # some OpenAI-compatible servers close a finished stream without "data: [DONE]"
        return assembler.finished

    def reply_problem(self, data: Any) -> str | None:
        if not isinstance(data, dict):
            return f"a JSON {type(data).__name__}, not an object"
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not all(
                isinstance(c, dict) and isinstance(c.get("message"), dict) for c in choices):
            return "no 'choices' list of objects with a 'message'"
        return None

    def reply_from_chat(self, completion: dict[str, Any],
                        request: dict[str, Any] | None = None) -> dict[str, Any]:
        return completion

    def reply_columns(self, data: dict[str, Any]) -> dict[str, Any]:
        return summarize_completion(data)

    def stream_to_chat(self) -> StreamTranslator:
        return _Identity()

    def stream_from_chat(self, request: dict[str, Any] | None = None) -> StreamTranslator:
        return _Identity()

    def assembler(self) -> StreamAssembler:
        return StreamAssembler()

    def encode_event(self, event: dict[str, Any] | None) -> bytes:
        return b"data: [DONE]\n\n" if event is None else b"data: " + dumpb(event) + b"\n\n"

    def is_terminal(self, raw: bytes, event: dict[str, Any] | None) -> bool:
        return event is None and raw.startswith(b"data: [DONE]")

    def is_private(self, event: dict[str, Any] | None, client_asked: bool) -> bool:
        # the usage chunk the proxy asked for on its own behalf (to record token counts)
        return (not client_asked and event is not None and bool(event.get("usage"))
                and not event.get("choices") and "error" not in event)

    def error_payload(self, error: ProxyError) -> dict[str, Any]:
        return error.payload  # an upstream's own error is already in this shape

    def stream_error_event(self, error: ProxyError, first: dict[str, Any] | None = None,
                           last: dict[str, Any] | None = None) -> bytes:
        return b"data: " + dumpb(self.error_payload(error)) + b"\n\n"

    def models_payload(self, models: list[dict[str, Any]]) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m["id"], "object": "model", "created": int(m.get("created") or 0),
             "owned_by": m.get("owned_by") or "metaclaw"} for m in models]}

    def models_of(self, payload: Any) -> list[dict[str, Any]]:
        data = payload.get("data") if isinstance(payload, dict) else None
        return [{"id": m["id"], "name": m["id"],
                 "created": m["created"] if isinstance(m.get("created"), int) else 0,
                 "owned_by": m.get("owned_by") if isinstance(m.get("owned_by"), str) else None}
                for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
                ] if isinstance(data, list) else []


OPENAI = OpenAIChat()
