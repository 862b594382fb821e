"""OpenAI Responses (``POST /v1/responses``): what Codex CLI, the Agents SDK's default model and
the Responses modes of pydantic-ai, langchain-openai and litellm speak.

Requests
--------
``instructions`` and ``input`` (a string, or a list of items) are read; the other fields are
forwarded unchanged to a Responses upstream and translated where the chat shape has a
counterpart. In the chat form (the pivot, and what the store records):

- ``instructions`` -> a system message; message items keep their role (``developer`` becomes
  ``system``: chat servers' templates know no ``developer``; leading instruction messages are
  merged into one, as those templates want a single leading system message); their parts
  ``input_text`` / ``output_text`` -> text, ``input_image`` -> ``image_url``; ``input_file`` and
  ``refusal`` parts are dropped;
- ``function_call`` -> an assistant tool call, ``function_call_output`` -> a ``tool`` message;
  ``custom_tool_call`` (a free-form tool such as Codex's) -> a tool call whose arguments are
  ``{"input": "<text>"}`` and ``custom_tool_call_output`` -> a ``tool`` message;
- ``reasoning`` items (often encrypted) and hosted tools' call items (``web_search_call``...)
  are dropped: a chat upstream cannot read them;
- tools: ``function`` -> a chat function; ``custom`` -> a chat function taking one string
  ``input`` (its grammar, if any, quoted in the description); a ``namespace`` (Codex) -> its
  tools, flattened; an ``additional_tools`` input item (Codex) -> its tools, likewise; hosted
  tools (``web_search``, ``file_search``, ``code_interpreter``, ``computer_use``, ``mcp``...)
  are dropped, since a chat upstream cannot run them (a Responses upstream gets them as sent);
- ``max_output_tokens`` -> ``max_tokens``; ``text.format`` -> ``response_format``;
  ``reasoning.effort`` -> ``reasoning_effort``; ``tool_choice``, ``parallel_tool_calls``,
  ``temperature``, ``top_p``, ``user``, ``stream`` as they are; ``store``, ``include``,
  ``prompt_cache_key``, ``metadata``, ``client_metadata``, ``truncation`` and ``service_tier``
  have no chat counterpart a chat server honours and are not translated.
- ``previous_response_id`` is refused (400 naming it): the proxy keeps no response state to
  continue from; send the conversation in ``input`` (as Codex does, with ``store: false``).

Skills are injected as a ``developer`` message item placed after the client's items, so the
prefix a client's prompt cache holds (instructions, tools, earlier items) is unchanged; in the
chat form they go into the leading system message, as for every chat request.

Replies
-------
A ``response`` object (output items: ``reasoning``, ``message`` with ``output_text``,
``function_call``, ``custom_tool_call``; ``usage`` with input/output tokens) and, streaming,
the typed event sequence: ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ... ``.done``, ``response.function_call_arguments.delta`` ...
``.done``, ``response.custom_tool_call_input.delta`` ... ``.done``,
``response.output_item.done``, then ``response.completed`` (or ``error``), each with its
``sequence_number``.
"""

from __future__ import annotations

import random
import time
from typing import Any

from metaclaw.jsonlib import dumpb, dumps, loads
from metaclaw.protocols import (ARRAY, BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, ProxyError,
                                StreamTranslator, WireProtocol)
from metaclaw.protocols.openai_chat import ToChatStream, TranslatedAssembler
from metaclaw.skills.asks import content_text

#: Message roles a Responses input item may carry.
ROLES = ("user", "assistant", "system", "developer")
#: Finish reasons of a chat completion -> (response status, incomplete reason).
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{random.getrandbits(96):024x}"


def _bad(param: str, message: str) -> ProxyError:
    return ProxyError(400, message, param=param)


def _parts_text(content: Any) -> str:
    """The text of a Responses content value (a string, or ``input_text`` / ``output_text`` /
    ``text`` parts)."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "\n".join(texts)


def _item_problem(item: Any) -> tuple[str, str] | None:
    """(where, what) is wrong with one ``input`` item, or None."""
    if not isinstance(item, dict):
        return "", "must be an object"
    kind = item.get("type", "message" if "role" in item else None)
    if kind is None:
        return "", "needs a 'type' (or a 'role' for a message)"
    if not isinstance(kind, str):
        return ".type", "must be a string"
    if kind == "message":
        if item.get("role") not in ROLES:
            return ".role", f"must be one of {', '.join(ROLES)}"
        content = item.get("content")
        if not isinstance(content, (str, list)):
            return ".content", "must be a string or a list of content parts"
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                return f".content[{j}]", "must be an object with a string 'type'"
            if part["type"] in ("input_text", "output_text") and not isinstance(
                    part.get("text"), str):
                return f".content[{j}].text", "must be a string"
            if part["type"] == "input_image" and not (isinstance(part.get("image_url"), str)
                                                      or isinstance(part.get("file_id"), str)):
                return f".content[{j}]", "an input_image needs a string 'image_url' or 'file_id'"
    elif kind in ("function_call", "custom_tool_call"):
        if not isinstance(item.get("call_id"), str) or not item["call_id"]:
            return ".call_id", "must be a non-empty string"
        if not isinstance(item.get("name"), str) or not item["name"]:
            return ".name", "must be a non-empty string"
        field = "arguments" if kind == "function_call" else "input"
        if not isinstance(item.get(field, ""), str):
            return f".{field}", "must be a string"
    elif kind == "additional_tools":
        problem = _tools_problem(item.get("tools"))
        if problem:
            return f".tools{problem[0]}", problem[1]
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str) or not item["call_id"]:
            return ".call_id", "must be a non-empty string"
        if not isinstance(item.get("output"), (str, list)):
            return ".output", "must be a string or a list of content parts"
    return None


def _tools_problem(tools: Any) -> tuple[str, str] | None:
    """(where, what) is wrong with a list of tool definitions (namespaces' own lists too)."""
    if not isinstance(tools, list):
        return "", "must be a list of tool definitions"
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            return f"[{k}]", "must be an object with a string 'type'"
        if tool["type"] in ("function", "custom") and not isinstance(tool.get("name"), str):
            return f"[{k}].name", "must be a string"
        if tool["type"] == "namespace":
            inner = _tools_problem(tool.get("tools"))
            if inner:
                return f"[{k}].tools{inner[0]}", inner[1]
    return None


def _image_part(part: dict[str, Any]) -> dict[str, Any] | None:
    url = part.get("image_url")
    if not isinstance(url, str):
        return None  # a file id: no chat counterpart
    image: dict[str, Any] = {"url": url}
    if part.get("detail") in ("low", "high", "auto"):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _content_to_chat(content: Any) -> Any:
    """A message's content in the chat shape: a string when it is text alone."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") and part.get("text"):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and (image := _image_part(part)) is not None:
            parts.append(image)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _output_text(output: Any) -> str:
    """A function call's output (a string, or parts) as the text of a chat tool message."""
    return output if isinstance(output, str) else _parts_text(output)


def _tool_to_chat(tool: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses tool as chat function tools (a namespace gives several; a hosted tool none)."""
    kind = tool.get("type")
    if kind == "namespace":
        return [t for inner in tool.get("tools") or () if isinstance(inner, dict)
                for t in _tool_to_chat(inner)]
    if not isinstance(tool.get("name"), str):
        return []
    if kind == "function":
        function: dict[str, Any] = {"name": tool["name"],
                                    "description": tool.get("description") or "",
                                    "parameters": tool.get("parameters")
                                    or {"type": "object", "properties": {}}}
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        return [{"type": "function", "function": function}]
    if kind == "custom":
        description = tool.get("description") or ""
        form = tool.get("format") if isinstance(tool.get("format"), dict) else {}
        if form.get("type") == "grammar" and isinstance(form.get("definition"), str):
            description += (f"\n\nThe input follows this {form.get('syntax', '')} grammar:\n"
                            f"{form['definition']}")
        return [{"type": "function", "function": {
            "name": tool["name"], "description": description.strip(),
            "parameters": {"type": "object", "properties": {"input": {
                "type": "string", "description": "the tool's free-form input"}},
                "required": ["input"], "additionalProperties": False}}}]
    return []  # hosted tools (web_search, file_search, mcp, ...): a chat upstream cannot run them


def custom_tools(body: dict[str, Any]) -> frozenset[str]:
    """The names of a request's free-form (``custom``) tools, wherever they are declared."""
    names: set[str] = set()

    def walk(tools: Any) -> None:
        for tool in tools if isinstance(tools, list) else ():
            if isinstance(tool, dict):
                if tool.get("type") == "custom" and isinstance(tool.get("name"), str):
                    names.add(tool["name"])
                elif tool.get("type") == "namespace":
                    walk(tool.get("tools"))

    walk(body.get("tools"))
    for item in body.get("input") if isinstance(body.get("input"), list) else ():
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            walk(item.get("tools"))
    return frozenset(names)


def _usage_from_chat(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.get("total_tokens") or prompt + completion}


def _usage_to_chat(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt, completion = usage.get("input_tokens") or 0, usage.get("output_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": usage.get("total_tokens") or prompt + completion}


def _call_item(call: dict[str, Any], custom: frozenset[str],
               status: str = "completed") -> dict[str, Any]:
    """A chat tool call as a ``function_call`` (or, for a free-form tool, ``custom_tool_call``)
    output item."""
    function = call.get("function") or {}
    name, arguments = function.get("name") or "", function.get("arguments") or ""
    call_id = call.get("id") or _new_id("call")
    if name in custom:
        return {"type": "custom_tool_call", "id": _new_id("ctc"), "call_id": call_id,
                "name": name, "input": _custom_input(arguments), "status": status}
    if not isinstance(arguments, str):
        arguments = dumps(arguments)
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _custom_input(arguments: Any) -> str:
    """The free-form input a chat model gave a custom tool (``{"input": ...}``; a model that
    wrote the text itself instead of JSON is taken at its word)."""
    if isinstance(arguments, dict):
        value = arguments.get("input")
        return value if isinstance(value, str) else dumps(arguments)
    try:
        parsed = loads(arguments) if arguments else {}
    except ValueError:
        return str(arguments)
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return str(arguments)


def _part(kind: str, text: str) -> dict[str, Any]:
    """A message's content part: its text, or (``kind`` "refusal") the model's refusal."""
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(text: str, status: str = "completed", kind: str = "message") -> dict[str, Any]:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [_part(kind, text)]}


def _response(request: dict[str, Any] | None, model: str, output: list[dict[str, Any]],
              status: str, usage: dict[str, Any] | None, *, response_id: str | None = None,
              created: int | None = None, finish: str | None = None) -> dict[str, Any]:
    """A ``response`` object, echoing the request's settings as the API does."""
    request = request or {}
    incomplete = _INCOMPLETE.get(finish or "")
    return {
        "id": response_id or _new_id("resp"), "object": "response",
        "created_at": created or int(time.time()),
        "status": "incomplete" if incomplete and status == "completed" else status,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": request.get("instructions"), "model": model or request.get("model") or "",
        "output": output, "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": None, "reasoning": request.get("reasoning"),
        "store": request.get("store", False), "text": request.get("text") or {
            "format": {"type": "text"}},
        "truncation": request.get("truncation", "disabled"),
        "metadata": request.get("metadata") or {}, "user": request.get("user"),
        "usage": usage,
    }


class ChatToResponsesStream(StreamTranslator):
    """``chat.completion.chunk`` dicts (``None`` for ``[DONE]``) -> Responses stream events.

    Text streams live as one ``message`` item. Tool calls stream live one at a time: a chat
    stream may interleave its calls' argument fragments, but an item takes no delta after its
    ``output_item.done``, so calls after the first are gathered and sent whole, in order, when
    the stream ends (as the Anthropic translation does). A free-form tool's input is sent whole
    at its end: the chat model writes it as JSON (``{"input": ...}``), which is only readable
    once complete. Reasoning text is sent as a ``reasoning`` item with a summary, a refusal as a
    message whose part is a ``refusal``."""

    def __init__(self, request: dict[str, Any] | None = None):
        self.request = request or {}
        self._custom: frozenset[str] | None = None  # found when the first call comes
        self.seq = 0
        self.started = False
        self.closed = False
        self.response_id = _new_id("resp")
        self.created = int(time.time())
        self.model = ""
        self.output: list[dict[str, Any]] = []  # finished items, in order
        self.open: _Open | None = None  # the item streaming now
        self.calls: dict[int, dict[str, Any]] = {}  # chat index -> gathered call
        self.live: int | None = None  # the chat index of the call streaming live
        self.late = ""  # text that came once the calls had begun
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    @property
    def custom(self) -> frozenset[str]:
        """The request's free-form tools (read only for a stream that calls tools)."""
        if self._custom is None:
            self._custom = custom_tools(self.request)
        return self._custom

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return _response(self.request, self.model, list(self.output), status, usage,
                         response_id=self.response_id, created=self.created,
                         finish=self.finish if status == "completed" else None)

    def _start(self) -> list[dict[str, Any]]:
        self.started = True
        snapshot = self._snapshot("in_progress")  # the same in both (each encoded as it goes)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _open_item(self, item: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        out = self._close_item()
        index = len(self.output)
        self.open = _Open(kind, item, index)
        out.append(self._event("response.output_item.added", output_index=index,
                               item={**item, "status": "in_progress"}))
        if kind in ("message", "refusal"):
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=index, content_index=0, part=_part(kind, "")))
        elif kind == "reasoning":
            out.append(self._event("response.reasoning_summary_part.added", item_id=item["id"],
                                   output_index=index, summary_index=0,
                                   part={"type": "summary_text", "text": ""}))
        return out

    def _close_item(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, item, index, text = (self.open.kind, self.open.item, self.open.index,
                                   "".join(self.open.parts))
        self.open = None
        out: list[dict[str, Any]] = []
        if kind in ("message", "refusal"):
            part = _part(kind, text)
            item = {**item, "content": [part]}
            out += [self._event("response.refusal.done", item_id=item["id"], output_index=index,
                                content_index=0, refusal=text) if kind == "refusal" else
                    self._event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=text),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=part)]
        elif kind == "reasoning":
            part = {"type": "summary_text", "text": text}
            item = {**item, "summary": [part]}
            out += [self._event("response.reasoning_summary_text.done", item_id=item["id"],
                                output_index=index, summary_index=0, text=text),
                    self._event("response.reasoning_summary_part.done", item_id=item["id"],
                                output_index=index, summary_index=0, part=part)]
        elif kind == "function_call":
            item = {**item, "arguments": text}
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=text))
        item = {**item, "status": "incomplete" if self.finish in _INCOMPLETE else "completed"}
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _text(self, kind: str, text: str, out: list[dict[str, Any]]) -> None:
        """Append to ``out`` a delta of ``text`` for the item of ``kind`` streaming now (opened
        first when another item streams)."""
        if self.open is None or self.open.kind != kind:
            item = (_message_item("", "in_progress", kind) if kind in ("message", "refusal")
                    else {"type": "reasoning", "id": _new_id("rs"), "summary": []})
            out += self._open_item(item, kind)
        opened = self.open
        opened.parts.append(text)
        if kind in ("message", "refusal"):
            out.append({"type": f"response.{'refusal' if kind == 'refusal' else 'output_text'}"
                                ".delta", "sequence_number": self.seq,
                        "item_id": opened.item["id"], "output_index": opened.index,
                        "content_index": 0, "delta": text})
        else:
            out.append({"type": "response.reasoning_summary_text.delta",
                        "sequence_number": self.seq, "item_id": opened.item["id"],
                        "output_index": opened.index, "summary_index": 0, "delta": text})
        self.seq += 1

    def _whole_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """One gathered call sent whole: added, its input or arguments, done."""
        out = self._close_item()
        item = _call_item({"id": call["id"], "function": {"name": call["name"],
                                                           "arguments": call["arguments"]}},
                          self.custom)
        index = len(self.output)
        empty = {**item, "status": "in_progress",
                 **({"input": ""} if item["type"] == "custom_tool_call" else {"arguments": ""})}
        out.append(self._event("response.output_item.added", output_index=index, item=empty))
        if item["type"] == "custom_tool_call":
            out += [self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                output_index=index, delta=item["input"]),
                    self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                output_index=index, input=item["input"])]
        else:
            out += [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, arguments=item["arguments"])]
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _tool_calls(self, calls: list[Any]) -> list[dict[str, Any]]:
        """A chunk's tool-call fragments: the first call streams live, the others gather."""
        out: list[dict[str, Any]] = []
        for call in calls:
            key = call.get("index", 0)
            function = call.get("function") or {}
            gathered = self.calls.setdefault(key, {"id": None, "name": "", "arguments": ""})
            gathered["id"] = call.get("id") or gathered["id"]
            gathered["name"] += function.get("name") or ""
            gathered["arguments"] += function.get("arguments") or ""
            if self.live is None and gathered["name"] not in self.custom:
                self.live = key
                item = {"type": "function_call", "id": _new_id("fc"),
                        "call_id": gathered["id"] or _new_id("call"),
                        "name": gathered["name"], "arguments": ""}
                gathered["id"] = item["call_id"]
                out += self._open_item(item, "function_call")
                gathered["streamed"] = True
            opened = self.open
            if key != self.live or opened is None or opened.kind != "function_call":
                continue
            if function.get("name"):  # a name sent in pieces: the item's is whole
                opened.item["name"] = gathered["name"]
            if function.get("arguments"):
                opened.parts.append(function["arguments"])
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=opened.item["id"], output_index=opened.index,
                                       delta=function["arguments"]))
        return out

    def feed(self, chunk: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        if chunk is None:
            return []
        if chunk.get("error"):  # an error, then the terminal event clients wait for
            error = chunk["error"] if isinstance(chunk["error"], dict) else {
                "message": str(chunk["error"])}
            code = error.get("code") or "upstream_error"
            message = str(error.get("message", error))
            out = [] if self.started else self._start()
            failed = {**self._snapshot("failed"), "error": {"code": code, "message": message}}
            return [*out, self._event("error", code=code, message=message, param=None),
                    self._event("response.failed", response=failed)]
        out: list[dict[str, Any]] = [] if self.started else self._start()
        if not self.model:
            self.model = chunk.get("model") or ""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if len(delta) == 1 and not self.calls and type(delta.get("content")) is str:
                # the usual chunk: a piece of text alone (its item opens with the first)
                if delta["content"]:
                    self._text("message", delta["content"], out)
            else:
                self._delta(delta, out)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _delta(self, delta: dict[str, Any], out: list[dict[str, Any]]) -> None:
        content = delta.get("content")
        text = content_text(content) if content else ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        refusal = delta.get("refusal") if isinstance(delta.get("refusal"), str) else ""
        if self.live is not None or self.calls:
            # once the calls began, an item may not open between their fragments: text is
            # gathered and sent after them; reasoning this late is left out
            self.late += text
            reasoning = text = ""
        if reasoning and isinstance(reasoning, str):
            self._text("reasoning", reasoning, out)
        if text:
            self._text("message", text, out)
        if refusal:
            self._text("refusal", refusal, out)
        if delta.get("tool_calls"):
            out += self._tool_calls(delta["tool_calls"])

    def close(self) -> list[dict[str, Any] | None]:
        if self.closed:
            return []
        self.closed = True
        out: list[dict[str, Any] | None] = [] if self.started else self._start()
        out += self._close_item()
        for key in sorted(self.calls):
            call = self.calls[key]
            if not call.get("streamed"):
                out += self._whole_call(call)
        if self.late:
            self._text("message", self.late, out)
            out += self._close_item()
        usage = _usage_from_chat(self.usage)
        if self.finish in _INCOMPLETE:  # cut off (max_output_tokens, a content filter)
            out.append(self._event("response.incomplete",
                                   response=self._snapshot("completed", usage)))
        else:
            out.append(self._event("response.completed",
                                   response=self._snapshot("completed", usage)))
        return out


class _Open:
    """The output item streaming now: its kind, the item, its index, its text so far."""

    __slots__ = ("kind", "item", "index", "parts")

    def __init__(self, kind: str, item: dict[str, Any], index: int):
        self.kind, self.item, self.index = kind, item, index
        self.parts: list[str] = []


class ResponsesToChatStream(ToChatStream):
    """Responses stream events -> ``chat.completion.chunk`` dicts (``None`` is ``[DONE]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}  # item id -> chat tool index
        self.usage: dict[str, Any] | None = None  # in the chat shape
        self.finish = "stop"

    def chat_usage(self) -> dict[str, Any] | None:
        return self.usage

    def feed(self, event: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        if event is None:
            return []
        kind = event.get("type")
        if kind == "response.created":
            response = event.get("response") or {}
            self.base["model"] = response.get("model") or ""
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "response.output_text.delta":
            return [self._chunk({"content": event.get("delta") or ""})]
        if kind == "response.refusal.delta":
            return [self._chunk({"refusal": event.get("delta") or ""})]
        if kind == "response.reasoning_summary_text.delta":
            return [self._chunk({"reasoning_content": event.get("delta") or ""})]
        if kind == "response.output_item.added":
            item = event.get("item") or {}
            if item.get("type") in ("function_call", "custom_tool_call"):
                index = self.calls.setdefault(item.get("id") or str(len(self.calls)),
                                              len(self.calls))
                self.finish = "tool_calls"
                return [self._chunk({"tool_calls": [{
                    "index": index, "id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name") or "", "arguments": ""}}]})]
            return []
        if kind == "response.function_call_arguments.delta":
            index = self.calls.get(event.get("item_id") or "")
            if index is None or not event.get("delta"):
                return []
            return [self._chunk({"tool_calls": [{"index": index,
                                                 "function": {"arguments": event["delta"]}}]})]
        if kind == "response.custom_tool_call_input.done":
            index = self.calls.get(event.get("item_id") or "")
            if index is None:
                return []
            arguments = dumps({"input": event.get("input") or ""})
            return [self._chunk({"tool_calls": [{"index": index,
                                                 "function": {"arguments": arguments}}]})]
        if kind == "response.failed":
            response = event.get("response") or {}
            error = response.get("error") if isinstance(response.get("error"), dict) else {}
            return [{"error": {"message": error.get("message") or "the upstream's response "
                               "failed", "code": error.get("code") or "response_failed"}}]
        if kind in ("response.completed", "response.incomplete"):
            response = event.get("response") or {}
            self.usage = _usage_to_chat(response.get("usage"))
            reason = (response.get("incomplete_details") or {}).get("reason")
            finish = "length" if reason == "max_output_tokens" else self.finish
            return [self._chunk({}, finish), *self.close()]
        if kind == "error":
            return [{"error": {"message": event.get("message") or "upstream stream error",
                               "code": event.get("code")}}]
        return []



class OpenAIResponses(WireProtocol):
    name = "responses"
    routes = ("/responses",)
    key_header = None
    upstream_path = "/responses"  # OpenAI's own, or any server that speaks it
    upstream_models_path = "/models"
    field_types = {
        "model": STRING, "input": STRING + ARRAY, "instructions": STRING, "stream": BOOLEAN,
        "tools": ARRAY, "tool_choice": STRING + OBJECT, "parallel_tool_calls": BOOLEAN,
        "max_output_tokens": INTEGER, "max_tool_calls": INTEGER, "temperature": NUMBER,
        "top_p": NUMBER, "top_logprobs": INTEGER, "text": OBJECT, "reasoning": OBJECT,
        "include": ARRAY, "store": BOOLEAN, "prompt_cache_key": STRING, "metadata": OBJECT,
        "previous_response_id": STRING, "truncation": STRING, "user": STRING,
        "service_tier": STRING, "background": BOOLEAN, "safety_identifier": STRING,
        "client_metadata": OBJECT, "stream_options": OBJECT, "conversation": STRING + OBJECT,
        "prompt": OBJECT,
    }

    # -- requests -------------------------------------------------------------------------
    def parse_request(self, body: dict[str, Any], model: str | None) -> tuple[str, bool]:
        if body.get("previous_response_id") is not None:
            raise _bad("previous_response_id",
                       "'previous_response_id' is not supported: this proxy keeps no response "
                       "state to continue from; send the whole conversation in 'input' (and "
                       "'store': false, as Codex does)")
        given = body.get("input")
        if given is None or given == "" or given == []:
            raise _bad("input", "'input' is required: a string, or a non-empty list of input "
                                "items such as {'role': 'user', 'content': '...'}")
        if not isinstance(given, (str, list)):
            raise _bad("input", "'input' must be a string or a list of input items")
        for i, item in enumerate(given if isinstance(given, list) else ()):
            problem = _item_problem(item)
            if problem:
                where, what = problem
                raise _bad(f"input[{i}]{where}", f"input[{i}]{where} {what}")
        if body.get("instructions") is not None and not isinstance(body["instructions"], str):
            raise _bad("instructions", "'instructions' must be a string")
        model = model or body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model", "'model' is required (a string), or start the proxy with a model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream", "'stream' must be true or false")
        if body.get("tools") is not None:
            problem = _tools_problem(body["tools"])
            if problem:
                where, what = problem
                raise _bad(f"tools{where}", f"'tools{where}' {what}")
        choice = body.get("tool_choice")
        if choice is not None and not isinstance(choice, (str, dict)):
            raise _bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or an "
                                      "object such as {'type': 'function', 'name': 'f'}")
        limit = body.get("max_output_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise _bad("max_output_tokens", "'max_output_tokens' must be a positive integer")
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise _bad(name, f"'{name}' must be a number")
        for name in ("text", "reasoning"):
            if body.get(name) is not None and not isinstance(body[name], dict):
                raise _bad(name, f"'{name}' must be an object")
        return model, stream

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request in the OpenAI chat shape (the rules in the module docstring)."""
        from metaclaw.skills.block import BLOCK_HEADER, inject

        messages: list[dict[str, Any]] = []
        tools: list[dict[str, Any]] = [t for tool in body.get("tools") or ()
                                       if isinstance(tool, dict) for t in _tool_to_chat(tool)]
        block = ""
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            messages.append({"role": "system", "content": body["instructions"]})
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given or []
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                role = "system" if item.get("role") == "developer" else item.get("role")
                content = _content_to_chat(item.get("content"))
                text = content if isinstance(content, str) else None
                if role == "system" and text and text.startswith(BLOCK_HEADER):
                    block = text  # the skill block: goes to the leading system message below
                    continue
                if role == "system" and text is not None and messages \
                        and messages[-1]["role"] == "system" \
                        and all(m["role"] == "system" for m in messages):
                    if text:  # leading instructions: one system message
                        messages[-1] = {"role": "system",
                                        "content": f"{messages[-1]['content']}\n\n{text}"}
                    continue
                if role == "assistant" and not content:
                    continue
                last = messages[-1] if messages else None
                if role == "assistant" and last is not None and last["role"] == "assistant" \
                        and last.get("tool_calls") and not last.get("content"):
                    # text the model wrote after its calls, in the same turn: one assistant
                    # message (a tool message must follow the calls it answers)
                    last["content"] = content
                    continue
                messages.append({"role": role, "content": content})
            elif kind in ("function_call", "custom_tool_call"):
                arguments = (item.get("arguments") or "" if kind == "function_call"
                             else dumps({"input": item.get("input") or ""}))
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # the same turn's calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind in ("function_call_output", "custom_tool_call_output"):
                messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": _output_text(item.get("output"))})
            elif kind == "additional_tools":  # Codex declares its tools in an input item
                tools += [t for tool in item.get("tools") or () if isinstance(tool, dict)
                          for t in _tool_to_chat(tool)]
            # reasoning items and hosted tools' calls: a chat upstream cannot read them
        chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
        if block:
            chat["messages"] = inject(messages, block)
        if tools:
            chat["tools"] = tools
        choice = body.get("tool_choice")
        if choice in ("auto", "none", "required"):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") in ("function", "custom") \
                and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        if isinstance(body.get("parallel_tool_calls"), bool) and tools:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
        for key in ("temperature", "top_p", "stream", "user"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        form = (body.get("text") or {}).get("format") if isinstance(body.get("text"),
                                                                    dict) else None
        if isinstance(form, dict) and form.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}
        elif isinstance(form, dict) and form.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        effort = (body.get("reasoning") or {}).get("effort") if isinstance(
            body.get("reasoning"), dict) else None
        if isinstance(effort, str):
            chat["reasoning_effort"] = effort
        return chat

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI chat request as a Responses request."""
        items: list[dict[str, Any]] = []
        instructions: list[str] = []
        for message in chat.get("messages") or ():
            role, content = message.get("role"), message.get("content")
            if role in ("system", "developer") and not items:
                instructions.append(content_text(content))
            elif role == "tool":
                items.append({"type": "function_call_output",
                              "call_id": message.get("tool_call_id") or "",
                              "output": content_text(content)})
            elif role == "assistant":
                if content:
                    items.append({"type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": content_text(content)}]})
                for call in message.get("tool_calls") or ():
                    function = call.get("function") or {}
                    arguments = function.get("arguments") or ""
                    items.append({"type": "function_call", "call_id": call.get("id") or "",
                                  "name": function.get("name") or "",
                                  "arguments": arguments if isinstance(arguments, str)
                                  else dumps(arguments)})
            else:
                parts: list[dict[str, Any]] = []
                if isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and part.get("type") == "text":
                            parts.append({"type": "input_text", "text": part.get("text", "")})
                        elif isinstance(part, dict) and part.get("type") == "image_url":
                            image = part.get("image_url") or {}
                            if isinstance(image.get("url"), str):
                                parts.append({"type": "input_image", "image_url": image["url"],
                                              "detail": image.get("detail") or "auto"})
                else:
                    parts.append({"type": "input_text", "text": content_text(content)})
                items.append({"type": "message",
                              "role": "developer" if role in ("system", "developer") else "user",
                              "content": parts})
        body: dict[str, Any] = {"model": chat.get("model"), "input": items}
        if instructions:
            body["instructions"] = "\n\n".join(t for t in instructions if t)
        # a chat tool is strict only when it says so; a Responses tool without 'strict' is
        # strict (its optional parameters become required): said explicitly
        tools = [{"type": "function", "name": (t.get("function") or {}).get("name"),
                  "description": (t.get("function") or {}).get("description", ""),
                  "parameters": (t.get("function") or {}).get("parameters")
                  or {"type": "object", "properties": {}},
                  "strict": (t.get("function") or {}).get("strict") is True}
                 for t in chat.get("tools") or () if isinstance(t, dict)]
        if tools:
            body["tools"] = tools
        choice = chat.get("tool_choice")
        if choice in ("auto", "none", "required"):
            body["tool_choice"] = choice
        elif isinstance(choice, dict) and (choice.get("function") or {}).get("name"):
            body["tool_choice"] = {"type": "function", "name": choice["function"]["name"]}
        for key in ("temperature", "top_p", "stream", "user", "parallel_tool_calls"):
            if chat.get(key) is not None:
                body[key] = chat[key]
        limit = chat.get("max_completion_tokens") or chat.get("max_tokens")
        if limit:
            body["max_output_tokens"] = limit
        form = chat.get("response_format")
        if isinstance(form, dict) and form.get("type") == "json_schema":
            body["text"] = {"format": {"type": "json_schema",
                                       **(form.get("json_schema") or {})}}
        elif isinstance(form, dict) and form.get("type") == "json_object":
            body["text"] = {"format": {"type": "json_object"}}
        if chat.get("reasoning_effort"):
            body["reasoning"] = {"effort": chat["reasoning_effort"]}
        body["store"] = False  # the proxy relays; it asks no one to keep state for it
        return body

    def inject(self, body: dict[str, Any], block: str) -> dict[str, Any]:
        """``body`` with the skill block as a ``developer`` message item after the client's
        items (the prefix its prompt cache holds stays as it was), in place of any block item
        an earlier turn left there. Unchanged when there is nothing to do."""
        from metaclaw.skills.block import BLOCK_HEADER

        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(
            given or [])
        kept = [item for item in items if not (
            isinstance(item, dict) and item.get("role") in ("developer", "system")
            and _parts_text(item.get("content")).startswith(BLOCK_HEADER))]
        if not block and len(kept) == len(items):
            return body
        if block:
            kept.append({"type": "message", "role": "developer",
                         "content": [{"type": "input_text", "text": block}]})
        return {**body, "input": kept}

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_output_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # -- replies --------------------------------------------------------------------------
    def reply_to_chat(self, data: dict[str, Any]) -> dict[str, Any]:
        texts, reasoning, calls, refusals = [], [], [], []
        for item in data.get("output") or ():
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "message":
                texts.append(_parts_text(item.get("content")))
                refusals += [part["refusal"] for part in item.get("content") or ()
                             if isinstance(part, dict) and part.get("type") == "refusal"
                             and isinstance(part.get("refusal"), str)]
            elif kind == "reasoning":
                reasoning.append(_parts_text(item.get("summary")))
            elif kind == "function_call":
                calls.append({"id": item.get("call_id"), "type": "function", "function": {
                    "name": item.get("name"), "arguments": item.get("arguments") or ""}})
            elif kind == "custom_tool_call":
                calls.append({"id": item.get("call_id"), "type": "function", "function": {
                    "name": item.get("name"),
                    "arguments": dumps({"input": item.get("input") or ""})}})
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        if any(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if any(refusals):
            message["refusal"] = "".join(refusals)
        reason = (data.get("incomplete_details") or {}).get("reason")
        finish = ("length" if reason == "max_output_tokens" else "content_filter"
                  if reason == "content_filter" else "tool_calls" if calls else "stop")
        return {"id": data.get("id"), "object": "chat.completion",
                "created": data.get("created_at") or int(time.time()),
                "model": data.get("model"),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish}],
                "usage": _usage_to_chat(data.get("usage"))}

    def reply_problem(self, data: Any) -> str | None:
        if not isinstance(data, dict):
            return f"a JSON {type(data).__name__}, not an object"
        if not isinstance(data.get("output"), list):
            return "no 'output' list of items"
        return None

    def reply_from_chat(self, completion: dict[str, Any],
                        request: dict[str, Any] | None = None) -> dict[str, Any]:
        choices = completion.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            output.append({"type": "reasoning", "id": _new_id("rs"),
                           "summary": [{"type": "summary_text", "text": reasoning}]})
        if message.get("content"):
            output.append(_message_item(content_text(message["content"])))
        if isinstance(message.get("refusal"), str) and message["refusal"]:
            output.append(_message_item(message["refusal"], kind="refusal"))
        calls = [call for call in message.get("tool_calls") or () if isinstance(call, dict)]
        if calls:
            custom = custom_tools(request or {})
            output += [_call_item(call, custom) for call in calls]
        return _response(request, completion.get("model") or "", output, "completed",
                         _usage_from_chat(completion.get("usage")),
                         finish=choice.get("finish_reason"))

    def stream_to_chat(self) -> StreamTranslator:
        return ResponsesToChatStream()

    def stream_from_chat(self, request: dict[str, Any] | None = None) -> StreamTranslator:
        return ChatToResponsesStream(request)

    def assembler(self) -> TranslatedAssembler:
        return TranslatedAssembler(ResponsesToChatStream())

    # -- wire encoding --------------------------------------------------------------------
    def encode_event(self, event: dict[str, Any] | None) -> bytes:
        if event is None:
            return b""
        return b"event: %s\ndata: %s\n\n" % (str(event.get("type")).encode(), dumpb(event))

    def is_terminal(self, raw: bytes, event: dict[str, Any] | None) -> bool:
        return event is not None and event.get("type") in (
            "response.completed", "response.incomplete", "response.failed")

    def ends_failed(self, event: dict[str, Any] | None) -> bool:
        return isinstance(event, dict) and event.get("type") == "response.failed"

    def error_payload(self, error: ProxyError) -> dict[str, Any]:
        return error.payload  # the Responses API answers errors in the chat API's shape

    def stream_error_event(self, error: ProxyError, first: dict[str, Any] | None = None,
                           last: dict[str, Any] | None = None) -> bytes:
        """An ``error`` event, then ``response.failed`` with the error: the terminal event
        clients wait for (Codex shows its ``response.error.message``; it reads a bare
        ``error`` event as a dropped stream and retries). Numbered after ``last``, for the
        response ``first`` opened."""
        detail = error.payload.get("error") if isinstance(error.payload, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        code = detail.get("code") or error.code or error.type
        message = detail.get("message") or error.message
        seq = last.get("sequence_number") if isinstance(last, dict) else None
        seq = seq + 1 if isinstance(seq, int) and not isinstance(seq, bool) else 0
        started = first.get("response") if isinstance(first, dict) else None
        response = started if isinstance(started, dict) and started.get("id") else \
            _response(None, "", [], "failed", None)
        failed = {"type": "response.failed", "sequence_number": seq + 1, "response": {
            **response, "status": "failed", "error": {"code": code, "message": message}}}
        event = {"type": "error", "code": code, "message": message,
                 "param": detail.get("param", error.param), "sequence_number": seq}
        return (b"event: error\ndata: " + dumpb(event) + b"\n\n"
                + b"event: response.failed\ndata: " + dumpb(failed) + b"\n\n")

    def models_payload(self, models: list[dict[str, Any]]) -> dict[str, Any]:
        from metaclaw.protocols.openai_chat import OPENAI

        return OPENAI.models_payload(models)

    def models_of(self, payload: Any) -> list[dict[str, Any]]:
        from metaclaw.protocols.openai_chat import OPENAI

        return OPENAI.models_of(payload)


RESPONSES = OpenAIResponses()
