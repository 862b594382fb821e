"""Anthropic Messages (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

Requests, replies and stream events translate to and from the OpenAI chat shape (the pivot, see
:mod:`metaclaw.protocols`). Between an Anthropic client and an Anthropic upstream nothing is
translated: the body (system blocks, ``cache_control``, thinking blocks with their signatures,
tool_use / tool_result, every parameter) goes upstream as sent, with only the skill block added,
and the reply and its stream events come back byte for byte.

Skill injection and prompt caching: the skill block is appended as a *new last* text block of
``system`` (a string system becomes one text block first). The client's own system blocks, and
their ``cache_control`` breakpoints, stay byte-identical in front of it, so the client's cached
prefix (tools, then system up to its breakpoint) is still a prefix of what is sent and still hits
the cache. The skill block itself carries no breakpoint: it changes when the library evolves.

Lossy corners of the translation (only when client and upstream speak different protocols):

Anthropic client -> OpenAI-compatible upstream
  - ``cache_control`` is dropped (OpenAI-compatible servers cache on their own, or not at all);
  - system blocks are joined into one system message (blank line between blocks);
  - thinking / redacted_thinking blocks in the history are dropped (no chat equivalent); thinking
    the upstream streams as ``reasoning_content`` comes back as a thinking block with an empty
    signature, which an Anthropic model would reject if the client sent it back to one;
  - a ``system`` message inside ``messages`` (Claude Code sends them: environment, reminders)
    stays a system message at its place in the conversation;
  - ``top_k``, ``thinking`` (also ``adaptive``), ``service_tier``, ``container``,
    ``mcp_servers``, ``context_management`` (server-side context edits: clearing old thinking,
    which is dropped anyway), ``safeguards``, ``output_config.effort`` (a chat model that does
    not reason would refuse ``reasoning_effort``), the ``anthropic-beta`` header and server tools
    (tools without ``input_schema``) are dropped; ``output_config.format`` (a JSON schema the
    reply must follow) becomes ``response_format``; ``metadata.user_id`` becomes ``user``;
  - ``max_tokens`` is forwarded, cut to the upstream model's output limit where the proxy knows
    it (Claude Code asks for 128,000, which gpt-4o refuses; see
    :func:`metaclaw.proxy.context_budget.output_limit` and ``--max-output-tokens``);
  - base64 PDF documents become OpenAI ``file`` parts; other documents and search-result blocks
    become text; images keep their data (as data URLs or URLs);
  - a tool_result's images are dropped (a chat ``tool`` message holds text only); ``is_error``
    becomes an ``"[error] "`` prefix on the result text;
  - ``stop_reason`` comes from ``finish_reason``: stop -> end_turn (also when a stop sequence
    matched: a chat upstream does not say so, and ``stop_sequence`` is null), length ->
    max_tokens, tool_calls -> tool_use, content_filter -> refusal;
  - usage: ``input_tokens`` / ``output_tokens`` from prompt / completion tokens; in a stream the
    input count is only known at the end, so ``message_start`` says 0 and ``message_delta`` carries
    the real ``input_tokens`` and ``output_tokens``.

OpenAI client -> Anthropic upstream
  - system and developer messages are joined into ``system``; ``max_tokens`` is required by
    Anthropic, so a request without one gets :data:`DEFAULT_MAX_TOKENS`;
  - ``n`` > 1 is refused (400): Anthropic returns one reply per request;
  - ``logprobs``, ``response_format``, ``seed``, ``presence_penalty``,
    ``frequency_penalty`` and ``logit_bias`` have no Anthropic equivalent and are dropped;
  - ``file`` parts holding a base64 data URL become document blocks; parts with nothing to send
    (audio, a ``file_id``, empty text) are left out: Anthropic refuses empty text blocks;
  - thinking in the reply comes back as a non-standard ``reasoning_content`` field (as several
    OpenAI-compatible servers do); signatures are lost;
  - refusal -> content_filter, pause_turn -> stop, max_tokens -> length, tool_use -> tool_calls.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Any

from metaclaw.jsonlib import dumpb, dumps, loads
from metaclaw.protocols import (ARRAY, BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, ProxyError,
                                StreamTranslator, WireProtocol, tool_input)
from metaclaw.protocols.openai_chat import ToChatStream, TranslatedAssembler

#: The Anthropic API version sent to an upstream when the client names none (the anthropic
#: SDK's own default).
ANTHROPIC_VERSION = "2023-06-01"
#: ``max_tokens`` sent to an Anthropic upstream when an OpenAI client gave none.
DEFAULT_MAX_TOKENS = 4096

_STOP_TO_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                   "tool_use": "tool_calls", "refusal": "content_filter", "pause_turn": "stop",
                   "model_context_window_exceeded": "length"}
_FINISH_TO_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                   "function_call": "tool_use", "content_filter": "refusal"}
#: Error types of Anthropic's error shape, by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


#: Roles of the messages in ``messages``: ``system`` is a system message inside the conversation
#: (Claude Code sends them; the API takes them with its mid-conversation-system beta).
ROLES = ("user", "assistant", "system")


def _text(value: Any) -> str:
    """Text of an OpenAI content (string or parts) or an Anthropic block list."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # each part read once: twice would be exponential in depth
        return "\n\n".join(text for text in map(_text, value) if text)
    if isinstance(value, dict):
        if value.get("type") in ("text", None) and isinstance(value.get("text"), str):
            return value["text"]
        if value.get("type") == "document" and isinstance(value.get("source"), dict):
            source = value["source"]
            if source.get("type") == "text":
                return source["data"] if isinstance(source.get("data"), str) else ""
            return _text(source.get("content"))
        if value.get("type") == "search_result":
            return _text(value.get("content"))
    return ""


#: The fields of a content block that the proxy reads, by block type: (name, JSON types it may
#: have, whether the block needs it). Anthropic refuses the same shapes; checking them here makes
#: a malformed block a 400 naming it rather than a failure of the translation.
_BLOCK_FIELDS: dict[str, tuple[tuple[str, tuple[type, ...], bool], ...]] = {
    "text": (("text", (str,), True),),
    "image": (("source", (dict,), True),),
    "document": (("source", (dict,), True),),
    "tool_use": (("input", (dict,), False),),
    "server_tool_use": (("input", (dict,), False),),
    "tool_result": (("content", (str, list), False),),
    "search_result": (("content", (list,), False),),
}
_JSON_NAMES = {str: "a string", dict: "an object", list: "a list"}


def _block_problem(block: dict[str, Any]) -> str | None:
    """What is wrong with a content block's fields the proxy reads, or None."""
    for name, types, required in _BLOCK_FIELDS.get(block["type"], ()):
        value = block.get(name)
        if value is None and not required:
            continue
        if not isinstance(value, types):
            return f"'{name}' must be {' or '.join(_JSON_NAMES[t] for t in types)}"
    if block["type"] == "document" and block["source"].get("type") == "text" and not isinstance(
            block["source"].get("data"), str):
        return "a text 'source' needs its 'data' as a string"
    return None


def _image_to_chat(block: dict[str, Any]) -> dict[str, Any] | None:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = source.get("url", "")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _image_from_chat(part: dict[str, Any]) -> dict[str, Any]:
    url = (part.get("image_url") or {}).get("url", "")
    if url.startswith("data:") and ";base64," in url:
        media, data = url[5:].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _document_to_chat(block: dict[str, Any]) -> dict[str, Any] | None:
    """A base64 PDF document block as an OpenAI ``file`` part (the chat API's way to send a PDF),
    or None for other documents (their text, if any, is sent as text)."""
    source = block["source"]
    if source.get("type") != "base64" or not isinstance(source.get("data"), str):
        return None
    media = source.get("media_type") or "application/pdf"
    title = block.get("title")
    return {"type": "file", "file": {
        "filename": title if isinstance(title, str) and title else "document.pdf",
        "file_data": f"data:{media};base64,{source['data']}"}}


def _file_from_chat(part: dict[str, Any]) -> dict[str, Any] | None:
    """An OpenAI ``file`` part holding its data (a base64 data URL) as a document block, or None
    (a ``file_id`` names a file in OpenAI's own storage: nothing to send)."""
    file = part.get("file")
    data = file.get("file_data") if isinstance(file, dict) else None
    if not isinstance(data, str) or not data.startswith("data:") or ";base64," not in data:
        return None
    media, payload = data[5:].split(";base64,", 1)
    block: dict[str, Any] = {"type": "document", "source": {
        "type": "base64", "media_type": media or "application/pdf", "data": payload}}
    if isinstance(file.get("filename"), str) and file["filename"]:
        block["title"] = file["filename"]
    return block


def _part_from_chat(part: dict[str, Any]) -> dict[str, Any] | None:
    """One OpenAI user content part as an Anthropic block, or None when it has nothing to send:
    Anthropic refuses an empty text block, so a part without text (audio, a file id) is left out
    rather than sent as one."""
    kind = part.get("type")
    if kind == "image_url":
        return _image_from_chat(part)
    if kind == "file":
        return _file_from_chat(part)
    text = _text(part)
    return {"type": "text", "text": text} if text else None


def _tool_result_text(block: dict[str, Any]) -> str:
    text = _text(block.get("content"))
    return f"[error] {text}" if block.get("is_error") else text


def _chat_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI usage of an Anthropic usage; Anthropic's own fields are kept alongside."""
    if not usage:
        return None
    prompt = sum(int(usage.get(k) or 0) for k in (
        "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
    completion = int(usage.get("output_tokens") or 0)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion}
    for key in ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                "cache_read_input_tokens"):
        if usage.get(key) is not None:
            out[key] = usage[key]
    return out


def _anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    if "input_tokens" in usage or "output_tokens" in usage:
        return {k: usage[k] for k in ("input_tokens", "output_tokens",
                                      "cache_creation_input_tokens", "cache_read_input_tokens")
                if k in usage}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    cached = min(cached, prompt) if isinstance(cached, int) and cached > 0 else 0
    # Anthropic counts the tokens read from the cache apart from the input tokens
    return {"input_tokens": prompt - cached, "output_tokens":
            int(usage.get("completion_tokens") or 0),
            **({"cache_read_input_tokens": cached} if cached else {})}


def _stop_reason(finish: str | None, calls: bool, refused: bool) -> str:
    """Anthropic's stop reason of a chat reply: a chat upstream does not say which stop
    sequence matched ("stop" is end_turn); a reply that calls tools stops for them, and one the
    model refused is a refusal, whatever finish reason the server gave (some say "stop")."""
    stop = _FINISH_TO_STOP.get(finish or "stop", "end_turn")
    if stop == "end_turn" and calls:
        return "tool_use"
    return "refusal" if stop == "end_turn" and refused else stop


def _new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class ChatToAnthropicStream(StreamTranslator):
    """``chat.completion.chunk`` dicts (``None`` for ``[DONE]``) -> Anthropic stream events.

    Parallel tool calls: a chat stream may interleave the argument deltas of its calls (both
    calls start in one chunk, then fragments of each), but an Anthropic block takes no delta
    after its ``content_block_stop``. So the first call streams live and the others are
    gathered by index and sent whole, one block each, when the stream ends. For the same reason
    text or reasoning that arrives once the calls have begun (some servers send it between two
    fragments of a call) is gathered and sent after the calls: opening a block for it would
    split the call in two. The live call's block opens with its first arguments (or at the end):
    a name sent in pieces is whole by then. A refusal is sent as text, stopping for
    ``refusal``."""

    def __init__(self) -> None:
        self.started = False
        self.block: tuple[str, int] | None = None  # (kind, OpenAI tool index) of the open block
        self.index = -1
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.closed = False
        self.live: int | None = None  # the OpenAI index of the call streamed live
        self.held: dict[int, dict[str, Any]] = {}  # the other calls, by OpenAI index
        self.after_calls = {"thinking": "", "text": ""}  # what came once the calls began
        self.pending: dict[str, Any] | None = None  # the live call before its block opens
        self.refused = False

    def _start(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        self.started = True
        message = {"id": _new_id(), "type": "message", "role": "assistant", "content": [],
                   "model": chunk.get("model") or "", "stop_reason": None,
                   "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _open(self, kind: str, key: int, start: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close_block()
        self.index += 1
        self.block = (kind, key)
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": start}]

    def _close_block(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        out: list[dict[str, Any]] = []
        if self.block[0] == "thinking":  # no signature from a chat upstream
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        self.block = None
        return [*out, {"type": "content_block_stop", "index": self.index}]

    def feed(self, chunk: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        if chunk is None:
            return []
        if chunk.get("error"):
            error = chunk["error"]
            error = error if isinstance(error, dict) else {"message": str(error)}
            return [{"type": "error", "error": {"type": "api_error",
                                                "message": str(error.get("message", error))}}]
        out: list[dict[str, Any]] = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            text = _text(delta.get("content"))  # a string, or parts (Mistral's Magistral)
            if isinstance(delta.get("refusal"), str) and delta["refusal"]:
                text += delta["refusal"]
                self.refused = True
            if self.live is not None:
                self.after_calls["thinking"] += reasoning or ""
                self.after_calls["text"] += text
                reasoning = text = ""
            if reasoning:
                if self.block is None or self.block[0] != "thinking":
                    out += self._open("thinking", -1, {"type": "thinking", "thinking": "",
                                                       "signature": ""})
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "thinking_delta", "thinking": reasoning}})
            if text:
                if self.block is None or self.block[0] != "text":
                    out += self._open("text", -1, {"type": "text", "text": ""})
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "text_delta", "text": text}})
            for call in delta.get("tool_calls") or ():
                key = call.get("index", 0)
                function = call.get("function") or {}
                if self.live is None:
                    self.live = key
                    self.pending = {"id": None, "name": "", "arguments": ""}
                if key == self.live and self.pending is not None:
                    pending = self.pending
                    pending["id"] = call.get("id") or pending["id"]
                    pending["name"] += function.get("name") or ""
                    pending["arguments"] += function.get("arguments") or ""
                    if pending["arguments"]:
                        out += self._open_live()
                    continue
                if key != self.live or self.block != ("tool", key):
                    held = self.held.setdefault(key, {"id": None, "name": "", "arguments": ""})
                    held["id"] = call.get("id") or held["id"]
                    held["name"] += function.get("name") or ""
                    held["arguments"] += function.get("arguments") or ""
                elif function.get("arguments"):
                    out.append({"type": "content_block_delta", "index": self.index,
                                "delta": {"type": "input_json_delta",
                                          "partial_json": function["arguments"]}})
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _whole_call(self, key: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A call's block, opened with what was gathered of it (``id``, ``name``,
        ``arguments``)."""
        out = self._open("tool", key, {
            "type": "tool_use", "id": call["id"] or f"toolu_{uuid.uuid4().hex[:20]}",
            "name": call["name"], "input": {}})
        if call["arguments"]:
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": call["arguments"]}})
        return out

    def _open_live(self) -> list[dict[str, Any]]:
        """The live call's block, opened with what it gathered so far."""
        call, self.pending = self.pending, None
        return self._whole_call(self.live, call)

    def close(self) -> list[dict[str, Any] | None]:
        if self.closed:
            return []
        self.closed = True
        out: list[dict[str, Any] | None] = [] if self.started else self._start({})
        if self.pending is not None:  # the live call never sent arguments
            out += self._open_live()
        for key in sorted(self.held):  # the calls after the live one, each whole
            out += self._whole_call(key, self.held[key])
        for kind, start, delta in (("thinking", {"type": "thinking", "thinking": "",
                                                 "signature": ""}, "thinking_delta"),
                                   ("text", {"type": "text", "text": ""}, "text_delta")):
            if self.after_calls[kind]:
                out += self._open(kind, -1, start)
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": delta, kind: self.after_calls[kind]}})
        out += self._close_block()
        stop = _stop_reason(self.finish, self.live is not None, self.refused)
        out.append({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": _anthropic_usage(self.usage)})
        out.append({"type": "message_stop"})
        return out


class AnthropicToChatStream(ToChatStream):
    """Anthropic stream events -> ``chat.completion.chunk`` dicts (``None`` is ``[DONE]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tools: dict[int, int] = {}  # Anthropic block index -> OpenAI tool index
        self.usage: dict[str, Any] = {}

    def chat_usage(self) -> dict[str, Any] | None:
        return _chat_usage(self.usage) if self.usage else None

    def feed(self, event: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        if event is None:
            return []
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.base["id"] = message.get("id") or self.base["id"]
            self.base["model"] = message.get("model") or ""
            self.usage.update(message.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self.tools.setdefault(event.get("index", 0), len(self.tools))
                # Anthropic starts with input {} and streams it; a server that sends the whole
                # input here instead (no deltas) must not lose it
                given = block.get("input")
                arguments = dumps(given) if isinstance(given, dict) and given else ""
                return [self._chunk({"tool_calls": [{
                    "index": index, "id": block.get("id"), "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": arguments}}]})]
            if block.get("type") == "text" and block.get("text"):
                return [self._chunk({"content": block["text"]})]
            return []
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": delta.get("text", "")})]
            if delta.get("type") == "input_json_delta":
                index = self.tools.get(event.get("index", 0))
                if index is None or not delta.get("partial_json"):
                    return []
                return [self._chunk({"tool_calls": [{
                    "index": index, "function": {"arguments": delta["partial_json"]}}]})]
            if delta.get("type") == "thinking_delta":
                return [self._chunk({"reasoning_content": delta.get("thinking", "")})]
            return []
        if kind == "message_delta":
            usage = event.get("usage") or {}
            self.usage.update({k: v for k, v in usage.items() if v is not None})
            stop = (event.get("delta") or {}).get("stop_reason")
            return [self._chunk({}, _STOP_TO_FINISH.get(stop or "end_turn", "stop"))]
        if kind == "message_stop":
            return self.close()
        if kind == "error":
            return [{"error": event.get("error") or {"message": "upstream stream error"}}]
        return []  # ping, content_block_stop



class AnthropicMessages(WireProtocol):
    name = "anthropic"
    routes = ("/messages",)
    key_header = "x-api-key"
    field_types = {
        "model": STRING, "messages": ARRAY, "max_tokens": INTEGER, "system": STRING + ARRAY,
        "stream": BOOLEAN, "stop_sequences": ARRAY, "temperature": NUMBER, "top_p": NUMBER,
        "top_k": INTEGER, "metadata": OBJECT, "tools": ARRAY, "tool_choice": OBJECT,
        "thinking": OBJECT, "service_tier": STRING,
    }
    client_headers = ("anthropic-version",)
    forward_headers = ("anthropic-version", "anthropic-beta")
    count_tokens_route = "/messages/count_tokens"
    # an upstream: its base URL with or without ``/v1``; an Anthropic client's
    # ``anthropic-version`` and ``anthropic-beta`` go to it as they came (forward_headers)
    upstream_path = "/v1/messages"
    upstream_models_path = "/v1/models?limit=1000"  # the longest page: the proxy answers one list
    upstream_count_tokens_path = "/v1/messages/count_tokens"

    def upstream_base_url(self, url: str) -> str:
        url = url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    def upstream_server_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}

    # -- requests -------------------------------------------------------------------------
    def parse_request(self, body: dict[str, Any], model: str | None,
                      *, count_only: bool = False) -> tuple[str, bool]:
        def bad(param: str, message: str) -> ProxyError:
            return ProxyError(400, message, param=param)

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "'messages' is required: a non-empty list of "
                                  "{'role': 'user' | 'assistant', 'content': ...} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise bad(f"messages.{i}", f"messages.{i}: each message needs 'role' 'user', "
                                           "'assistant' or 'system' (a system message inside "
                                           "the conversation, as Claude Code sends them; the "
                                           "opening system prompt goes in the top-level "
                                           "'system' field)")
            content = message.get("content")
            if not isinstance(content, (str, list)):
                raise bad(f"messages.{i}.content", f"messages.{i}.content must be a string or "
                                                   "a list of content blocks")
            if isinstance(content, list):
                for j, block in enumerate(content):
                    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                        raise bad(f"messages.{i}.content.{j}", f"messages.{i}.content.{j} must be "
                                                               "an object with a string 'type'")
                    problem = _block_problem(block)
                    if problem:
                        where = f"messages.{i}.content.{j}"
                        raise bad(where, f"{where} ({block['type'][:40]!r} block): {problem}")
        if all(message.get("role") == "system" for message in messages):
            raise bad("messages", "'messages' needs at least one 'user' or 'assistant' "
                                  "message: system messages alone leave nothing to answer")
        system = body.get("system")
        if system is not None and not isinstance(system, (str, list)):
            raise bad("system", "'system' must be a string or a list of text blocks")
        if isinstance(system, list) and not all(
                isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                for b in system):
            raise bad("system", "'system' blocks must be objects with type 'text' and a string "
                                "'text'")
        model = model or body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", "'model' is required (a string), or start the proxy with a model")
        if not count_only:
            max_tokens = body.get("max_tokens")
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise bad("max_tokens", "'max_tokens' is required: a positive integer")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "'stream' must be true or false")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            raise bad("tools", "'tools' must be a list of tool definitions")
        if body.get("tool_choice") is not None and not isinstance(body["tool_choice"], dict):
            raise bad("tool_choice", "'tool_choice' must be an object such as {'type': 'auto'}")
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise bad(name, f"'{name}' must be a number")
        return model, stream

    def inject(self, body: dict[str, Any], block: str) -> dict[str, Any]:
        """``body`` with the skill block as a new last system text block (the client's own blocks,
        and their cache_control breakpoints, unchanged in front of it), in place of any block
        an earlier turn left in the system prompt the client resends (a breakpoint the client
        set on that one moves to its replacement). Unchanged when there is nothing to do."""
        from metaclaw.skills.block import BLOCK_HEADER, strip_skill_block

        system = body.get("system")
        resent = BLOCK_HEADER in _text(system)
        if not block and not resent:
            return body
        part = {"type": "text", "text": block} if block else None
        if resent:
            if part is not None and isinstance(system, list):
                part.update(next(({"cache_control": p["cache_control"]} for p in system
                                  if isinstance(p, dict) and "cache_control" in p
                                  and BLOCK_HEADER in str(p.get("text"))), {}))
            kept = strip_skill_block([{"role": "system", "content": system}])
            system = kept[0]["content"] if kept else None
        if isinstance(system, str) and system:
            system = [{"type": "text", "text": system}]
        blocks = [*(system if isinstance(system, list) else []), *([part] if part else [])]
        if not blocks:
            return {k: v for k, v in body.items() if k != "system"}
        return {**body, "system": blocks}

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request in the OpenAI chat shape (lossy corners in the module docstring)."""
        messages: list[dict[str, Any]] = []
        system = _text(body.get("system"))
        if system:
            messages.append({"role": "system", "content": system})
        for message in body.get("messages") or ():
            messages.extend(self._message_to_chat(message))
        chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
        for key in ("max_tokens", "temperature", "top_p", "stream"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("stop_sequences"):
            chat["stop"] = body["stop_sequences"]
        user = (body.get("metadata") or {}).get("user_id")
        if user:
            chat["user"] = user
        form = (body.get("output_config") or {}).get("format") if isinstance(
            body.get("output_config"), dict) else None
        if isinstance(form, dict) and form.get("type") == "json_schema" \
                and isinstance(form.get("schema"), dict):
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": form.get("name") or "output", "schema": form["schema"],
                **({"strict": form["strict"]} if isinstance(form.get("strict"), bool) else {})}}
        tools = [{"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}}
            for tool in body.get("tools") or ()
            if isinstance(tool, dict) and "input_schema" in tool]
        if tools:
            chat["tools"] = tools
        choice = body.get("tool_choice") or {}
        if choice.get("type") in ("auto", "any", "none"):
            chat["tool_choice"] = {"auto": "auto", "any": "required",
                                   "none": "none"}[choice["type"]]
        elif choice.get("type") == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use") and tools:
            chat["parallel_tool_calls"] = False
        return chat

    @staticmethod
    def _message_to_chat(message: dict[str, Any]) -> list[dict[str, Any]]:
        role, content = message.get("role"), message.get("content")
        if isinstance(content, str):
            return [{"role": role, "content": content}]
        if role == "system":  # a system message in the conversation stays one, where it was
            text = _text(content)
            return [{"role": "system", "content": text}] if text else []
        if role == "assistant":
            texts = [b.get("text", "") for b in content if b.get("type") == "text"]
            calls = [{"id": b.get("id"), "type": "function",
                      "function": {"name": b.get("name"), "arguments": dumps(b.get("input") or {})}}
                     for b in content if b.get("type") in ("tool_use", "server_tool_use")]
            out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                out["tool_calls"] = calls
            return [out]
        results = [{"role": "tool", "tool_call_id": b.get("tool_use_id"),
                    "content": _tool_result_text(b)}
                   for b in content if b.get("type") == "tool_result"]
        parts: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type")
            if kind == "image":
                image = _image_to_chat(block)
                if image:
                    parts.append(image)
            elif kind == "document" and (document := _document_to_chat(block)) is not None:
                parts.append(document)  # a PDF (its text is empty: it would be dropped unseen)
            elif kind != "tool_result":
                text = _text(block)
                if text:
                    parts.append({"type": "text", "text": text})
        if not parts:
            return results
        if all(p["type"] == "text" for p in parts) and len(parts) == 1:
            return [*results, {"role": "user", "content": parts[0]["text"]}]
        return [*results, {"role": "user", "content": parts}]

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI chat request as an Anthropic Messages request (lossy corners above)."""
        n = chat.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            # Anthropic returns one reply per request: answering n > 1 with one choice would
            # leave the client reading choices that are not there
            raise ProxyError(400, f"'n' is {n}, but the upstream speaks Anthropic Messages, "
                                  "which returns one reply per request; send n=1 (or leave it "
                                  "out) and make one request per reply", param="n",
                             code="unsupported_parameter")
        system: list[str] = []
        messages: list[dict[str, Any]] = []

        def add(role: str, blocks: list[dict[str, Any]]) -> None:
            if not blocks:
                return
            if messages and messages[-1]["role"] == role:  # tool results then user text: one turn
                messages[-1]["content"].extend(blocks)
            else:
                messages.append({"role": role, "content": blocks})

        for message in chat.get("messages") or ():
            role, content = message.get("role"), message.get("content")
            if role in ("system", "developer"):
                if _text(content):
                    system.append(_text(content))
            elif role == "tool":
                add("user", [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                              "content": _text(content)}])
            elif role == "assistant":
                blocks = [{"type": "text", "text": _text(content)}] if _text(content) else []
                for call in message.get("tool_calls") or ():
                    function = call.get("function") or {}
                    blocks.append({"type": "tool_use", "id": call.get("id"),
                                   "name": function.get("name"),
                                   "input": tool_input(function.get("arguments"))})
                add("assistant", blocks)
            else:
                if isinstance(content, list):
                    blocks = [b for p in content if isinstance(p, dict)
                              for b in [_part_from_chat(p)] if b is not None]
                else:  # an empty text block is refused by Anthropic: an empty message is left out
                    blocks = [{"type": "text", "text": _text(content)}] if _text(content) else []
                add("user", blocks)
        body: dict[str, Any] = {"model": chat.get("model"), "messages": messages,
                                "max_tokens": chat.get("max_completion_tokens")
                                or chat.get("max_tokens") or DEFAULT_MAX_TOKENS}
        if system:
            body["system"] = "\n\n".join(system)
        for key in ("temperature", "top_p", "stream"):
            if chat.get(key) is not None:
                body[key] = chat[key]
        stop = chat.get("stop")
        if stop:
            body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
        if chat.get("user"):
            body["metadata"] = {"user_id": chat["user"]}
        tools = [{"name": (t.get("function") or {}).get("name"),
                  "description": (t.get("function") or {}).get("description", ""),
                  "input_schema": (t.get("function") or {}).get("parameters")
                  or {"type": "object", "properties": {}}}
                 for t in chat.get("tools") or () if isinstance(t, dict)]
        if tools:
            body["tools"] = tools
        choice = chat.get("tool_choice")
        mapped: dict[str, Any] | None = None
        if choice in ("auto", "none"):
            mapped = {"type": choice}
        elif choice == "required":
            mapped = {"type": "any"}
        elif isinstance(choice, dict) and (choice.get("function") or {}).get("name"):
            mapped = {"type": "tool", "name": choice["function"]["name"]}
        if chat.get("parallel_tool_calls") is False and tools:
            mapped = {**(mapped or {"type": "auto"}), "disable_parallel_tool_use": True}
        if mapped and tools:
            body["tool_choice"] = mapped
        return body

    # -- replies --------------------------------------------------------------------------
    def reply_to_chat(self, data: dict[str, Any]) -> dict[str, Any]:
        content = data.get("content") or []
        texts = [b.get("text", "") for b in content if b.get("type") == "text"]
        thinking = [b.get("thinking", "") for b in content if b.get("type") == "thinking"]
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": dumps(b.get("input") or {})}}
                 for b in content if b.get("type") == "tool_use"]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        return {"id": data.get("id"), "object": "chat.completion", "created": int(time.time()),
                "model": data.get("model"),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": _STOP_TO_FINISH.get(data.get("stop_reason") or
                                                                  "end_turn", "stop")}],
                "usage": _chat_usage(data.get("usage"))}

    def reply_problem(self, data: Any) -> str | None:
        if not isinstance(data, dict):
            return f"a JSON {type(data).__name__}, not an object"
        if not isinstance(data.get("content"), list) or not all(
                isinstance(b, dict) for b in data["content"]):
            return "no 'content' list of blocks"
        return None

    def reply_from_chat(self, completion: dict[str, Any],
                        request: dict[str, Any] | None = None) -> dict[str, Any]:
        choices = completion.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        refused = not message.get("content") and isinstance(message.get("refusal"), str) \
            and bool(message["refusal"])
        if message.get("content") or refused:
            content.append({"type": "text", "text": _text(message.get("content")
                                                          or message["refusal"])})
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id"),
                            "name": function.get("name"),
                            "input": tool_input(function.get("arguments"))})
        return {"id": _new_id(), "type": "message", "role": "assistant",
                "model": completion.get("model") or "", "content": content,
                "stop_reason": _stop_reason(choice.get("finish_reason"),
                                            bool(message.get("tool_calls")), refused),
                "stop_sequence": None, "usage": _anthropic_usage(completion.get("usage"))}

    def stream_to_chat(self) -> StreamTranslator:
        return AnthropicToChatStream()

    def stream_from_chat(self, request: dict[str, Any] | None = None) -> StreamTranslator:
        return ChatToAnthropicStream()

    def assembler(self) -> TranslatedAssembler:
        return TranslatedAssembler(AnthropicToChatStream())

    # -- wire encoding --------------------------------------------------------------------
    def encode_event(self, event: dict[str, Any] | None) -> bytes:
        if event is None:
            return b""
        return f"event: {event.get('type')}\ndata: ".encode() + dumpb(event) + b"\n\n"

    def is_terminal(self, raw: bytes, event: dict[str, Any] | None) -> bool:
        return event is not None and event.get("type") == "message_stop"

    def error_payload(self, error: ProxyError) -> dict[str, Any]:
        if error.upstream is not None and error.upstream[0] == self.name:
            return error.upstream[1]
        kind = _ERROR_TYPES.get(error.status)
        if kind is None:
            kind = ("invalid_request_error" if 400 <= error.status < 500
                    and error.type == "invalid_request_error" else "api_error")
        if error.type == "authentication_error":
            kind = "authentication_error"
        return {"type": "error", "error": {"type": kind, "message": error.message}}

    def stream_error_event(self, error: ProxyError, first: dict[str, Any] | None = None,
                           last: dict[str, Any] | None = None) -> bytes:
        payload = self.error_payload(error)
        return b"event: error\ndata: " + dumpb(payload) + b"\n\n"

    def models_payload(self, models: list[dict[str, Any]]) -> dict[str, Any]:
        data = [{"type": "model", "id": m["id"], "display_name": m.get("name") or m["id"],
                 "created_at": _rfc3339(m.get("created"))} for m in models]
        return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    def models_of(self, payload: Any) -> list[dict[str, Any]]:
        data = payload.get("data") if isinstance(payload, dict) else None
        return [{"id": m["id"], "name": m.get("display_name") if isinstance(
                    m.get("display_name"), str) else m["id"],
                 "created": _unix_seconds(m.get("created_at"))}
                for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
                ] if isinstance(data, list) else []


def _rfc3339(seconds: Any) -> str:
    """Unix seconds as Anthropic writes a model's ``created_at`` (the epoch when unknown)."""
    try:
        moment = datetime.fromtimestamp(float(seconds or 0), timezone.utc)
    except (ValueError, OverflowError, OSError):
        moment = datetime.fromtimestamp(0, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _unix_seconds(text: Any) -> int:
    """A model's ``created_at`` (RFC 3339) as Unix seconds; 0 when it is not one."""
    try:
        return int(datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp())
    except (ValueError, OverflowError):
        return 0


ANTHROPIC = AnthropicMessages()
