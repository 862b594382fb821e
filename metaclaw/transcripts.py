"""Bring your own traces: record the transcripts agents already write as turns of a workspace.

    from metaclaw import transcripts
    result = transcripts.import_files(store, ["~/.claude/projects/p/<session>.jsonl"])
    result.imported, result.skipped, result.turn_ids

Formats (``format="auto"`` tells them apart by the first records of each file):

- ``openclaw``: an OpenClaw session: its records (``{"type": "session"}`` then ``{"type":
  "message", "id", "parentId", "message": {"role": "user" | "assistant" | "toolResult",
  "content": [...]}}``), which earlier versions append to ``sessions/<id>.jsonl`` and 2026.9
  keeps one per row in its agent database; or the ``events.jsonl`` of ``openclaw sessions
  export-trajectory`` (``openclaw-trajectory`` events), whose transcript events carry the same
  messages. An assistant message OpenClaw marks aborted or failed is recorded with status
  ``error``.
- ``claude-code``: a Claude Code session (``~/.claude/projects/<project>/<session>.jsonl``):
  ``user`` / ``assistant`` entries holding Anthropic messages, one entry per content block of a
  reply; the system prompt and tools of the request from its ``api-request-shape`` entries
  where present. Side chains (sub-agents) and synthetic replies (errors Claude Code wrote
  itself) are not replies of the model and are skipped; attachments (the reminders Claude Code
  adds to a request, recorded apart from the messages) are left out.
- ``codex``: a Codex rollout (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``): Responses API
  items (``response_item``) after a ``session_meta`` record holding the instructions.
- ``openai``: OpenAI chat JSON Lines, one ``{"messages": [..., assistant], "tools": [...]}``
  per line: what ``metaclaw export`` and :func:`metaclaw.fastloop.labels.export_jsonl` write, so that
  an export imported again gives the same turns.

How a transcript becomes turns: each reply of the model (an assistant message with its tool
calls; a run of consecutive assistant entries or output items forms one reply) becomes one
turn whose request is the conversation before it, translated to the OpenAI chat shape by the
proxy's own translators (:mod:`metaclaw.protocols`), as a proxied turn of that protocol is
recorded; an ``openai`` line is one turn (its last message is the reply). A turn's session is
the one the agent wrote (its session id); an ``openai`` line's session is named after the
conversation's opening messages, so that the lines of one conversation share one.

What marks an imported turn: ``turns.identified_by`` holds ``{"session":
"imported:<format>:<file name>", "turn_type": "imported", "line": n, "import_key": ...}``.
Imported turns are never trained on: the slow loop trains on the turns the policy served under
the current skill generation (the query set), and an imported reply was served by neither;
nor does a transcript hold the token ids and log-probabilities of its replies that training on
them would need. They enter the buffers as ``support /
live`` of the current skill generation: the judge scores them, people label them, the evolver
reads their failures (:func:`metaclaw.buffers.support_set`), the views list them; the slow
loop trains only ``query`` turns (:func:`metaclaw.slowloop.grpo.select_query_turns`,
:func:`metaclaw.buffers.claim_for_training`), and the buffer rules never move a turn out of the
set it was given.

Idempotent: each turn carries a content key (a hash of its session, request and reply);
importing a file again, or a longer version of it, records only the turns not already there.
All or nothing: the turns of every file of an import are written in one transaction, each
checked as it is read (one file's records and one turn's conversation are held at a time, so a
long session does not need memory for every turn's copy of it). A malformed file (a line that
is not JSON, a record of the wrong shape, binary data, a line longer than
:data:`MAX_LINE_BYTES`, JSON nested deeper than :data:`MAX_DEPTH`) raises
:class:`TranscriptError` naming the file and the line, the transaction is rolled back, and the
store is left as it was.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from metaclaw.jsonlib import LONE_SURROGATE, dumps, loads
from metaclaw.store import Store

FORMATS = ("openclaw", "claude-code", "codex", "openai")
#: The protocol each format's turns are recorded under (``turns.protocol``).
PROTOCOLS = {"openclaw": "openai", "claude-code": "anthropic", "codex": "responses",
             "openai": "openai"}
#: A line longer than this is refused (a transcript line is one message; this is no message).
MAX_LINE_BYTES = 32 * 1024 * 1024
#: A file longer than this is refused before it is read.
MAX_FILE_BYTES = 512 * 1024 * 1024
#: A record nested deeper than this is refused (messages nest a few levels; the readers of
#: the request, and the store's JSON, recurse).
MAX_DEPTH = 100
#: Records read to tell the format of a file.
DETECT_LINES = 50
#: The model recorded for a turn whose transcript names none.
UNKNOWN_MODEL = "unknown"


class TranscriptError(ValueError):
    """A transcript that cannot be imported: ``path`` and ``line`` (1-based; ``None`` for the
    whole file) say where."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, message: str):
        self.path, self.line, self.reason = str(path), line, message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@dataclass
class Entry:
    """One JSON record of a transcript and the line it was on."""

    line: int
    data: dict[str, Any]


@dataclass
class ImportedTurn:
    """One reply of a transcript, ready to record: ``messages`` (the request, chat shape),
    ``reply`` (the assistant message, chat shape), ``params`` (``request_params``)."""

    session_id: str
    line: int
    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    model: str = UNKNOWN_MODEL
    created_at: float | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    #: ``error`` for a reply the transcript says failed (cut off by a timeout, an API error)
    status: str = "ok"
    error: str | None = None

    @property
    def key(self) -> str:
        """The content key: the same session, request and reply give the same key."""
        text = dumps([self.session_id, self.messages, _reply_text(self.reply),
                      self.reply.get("tool_calls") or None])
        return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


@dataclass
class Transcript:
    """One file, read: its format and its replies (an iterator until read whole)."""

    path: Path
    format: str
    turns: Iterable[ImportedTurn]


@dataclass
class ImportResult:
    """What :func:`import_files` did: ``turn_ids`` of the turns it recorded, ``skipped`` the
    turns already in the store, per file the format found."""

    turn_ids: list[int] = field(default_factory=list)
    skipped: int = 0
    formats: dict[str, str] = field(default_factory=dict)
    sessions: list[str] = field(default_factory=list)

    @property
    def imported(self) -> int:
        return len(self.turn_ids)


# -- reading lines ----------------------------------------------------------------------------
def read_entries(path: str | os.PathLike[str]) -> Iterator[Entry]:
    """The JSON objects of a JSON Lines file, one per non-blank line, with their line numbers.
    Raises :class:`TranscriptError` for a file that cannot be read, a line that is not UTF-8
    text, not JSON, not an object, or longer than :data:`MAX_LINE_BYTES`."""
    path = Path(path)
    try:
        if path.is_dir():
            raise TranscriptError(path, None, "is a folder, not a transcript file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise TranscriptError(path, None, f"is larger than {_size(MAX_FILE_BYTES)}")
        handle = open(path, "rb")
    except OSError as exc:
        raise TranscriptError(path, None, f"cannot be read ({exc.strerror or exc})") from None
    with handle:
        number = 0
        while True:
            try:
                raw = handle.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise TranscriptError(path, number + 1, f"cannot be read ({exc})") from None
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TranscriptError(path, number, f"the line is longer than "
                                      f"{_size(MAX_LINE_BYTES)}; no transcript record is")
            if raw.strip():
                yield Entry(number, _parse_line(path, number, raw, raw.endswith(b"\n")))


def _parse_line(path: Path, number: int, raw: bytes, complete: bool) -> dict[str, Any]:
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a byte order mark
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TranscriptError(path, number, f"not UTF-8 text (byte {exc.start + 1} of the "
                              "line): a binary file, or a damaged one") from None
    if "\x00" in text:
        raise TranscriptError(path, number, "holds NUL bytes: a binary file, or a damaged one")
    try:
        value = loads(text)
    except (ValueError, RecursionError) as exc:
        cut = "" if complete else " (the file ends in the middle of this line: cut short?)"
        raise TranscriptError(path, number, f"not valid JSON{cut}: {_short(str(exc))}") from None
    if not isinstance(value, dict):
        raise TranscriptError(path, number, f"a JSON {_json_type(value)}, not an object: a "
                              "transcript line is one JSON object")
    if _depth(value) > MAX_DEPTH:
        raise TranscriptError(path, number, f"JSON nested deeper than {MAX_DEPTH} levels; no "
                              "transcript record is")
    return _clean(value)


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (without recursion: any depth is read)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                      else item))
    return deepest


def _clean(value: Any) -> Any:
    """``value`` with lone surrogates (from escapes such as ``"\\ud800"``) replaced: the
    store's UTF-8 cannot hold them."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value) if LONE_SURROGATE.search(value) else value
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    return value


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


# -- telling the format -----------------------------------------------------------------------
def detect_format(entries: list[Entry]) -> str | None:
    """The format of a transcript from its first records, or None when none fits."""
    for entry in entries[:DETECT_LINES]:
        data = entry.data
        kind = data.get("type")
        if kind == "session_meta" or (kind in ("response_item", "turn_context", "event_msg")
                                      and "payload" in data):
            return "codex"
        if isinstance(data.get("sessionId"), str) and kind in (
                "user", "assistant", "summary", "system", "attachment", "queue-operation",
                "api-request-shape", "api-request", "api-request-blob", "last-prompt"):
            return "claude-code"
        if data.get("traceSchema") == "openclaw-trajectory":
            return "openclaw"
        if kind == "session" and "version" in data or kind == "message" and isinstance(
                data.get("message"), dict) and "parentId" in data:
            return "openclaw"
        if isinstance(data.get("messages"), list) and "type" not in data:
            return "openai"
    return None


# -- shared helpers ---------------------------------------------------------------------------
def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch from an ISO 8601 text or a number of seconds or milliseconds."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        seconds = float(value) / 1000.0 if value > 1e11 else float(value)
        return seconds if 0 < seconds < 1e11 else None
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        return parsed.timestamp()
    return None


def _reply_text(reply: dict[str, Any]) -> str | None:
    from metaclaw.buffers import message_text

    return message_text(reply.get("content")) or None


def _session_id(path: Path, line: int, value: Any, what: str) -> str:
    from metaclaw.turns import IdentityError, check_session_id

    try:
        return check_session_id(value, what)
    except IdentityError as exc:
        raise TranscriptError(path, line, str(exc)) from None


def _check(path: Path, line: int, validate: Callable[[], Any], what: str) -> None:
    """Run a protocol's request check; its complaint becomes a :class:`TranscriptError`."""
    from metaclaw.protocols import ProxyError

    try:
        validate()
    except ProxyError as exc:
        raise TranscriptError(path, line, f"{what}: {exc}") from None


def _translate(path: Path, line: int, translate: Callable[[], Any]) -> Any:
    """Run a translation of checked records. The checks should leave nothing it cannot read;
    should one slip through, the file is refused with its line rather than half read."""
    try:
        return translate()
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        raise TranscriptError(path, line, "a record of a shape that cannot be read as a "
                              f"conversation ({type(exc).__name__}: {_short(str(exc))})") from None


def _model(value: Any, fallback: str = UNKNOWN_MODEL) -> str:
    return value if isinstance(value, str) and value.strip() else fallback


def _usage(chat_usage: Any) -> dict[str, Any] | None:
    return chat_usage if isinstance(chat_usage, dict) and chat_usage else None


# -- openai chat JSON Lines -------------------------------------------------------------------
def parse_openai(path: Path, entries: list[Entry]) -> Iterator[ImportedTurn]:
    """One turn per line: the last message is the reply, the ones before it the request."""
    from metaclaw.protocols.openai_chat import OPENAI

    for entry in entries:
        data = entry.data
        messages, tools = data.get("messages"), data.get("tools")
        if not isinstance(messages, list) or len(messages) < 2:
            raise TranscriptError(path, entry.line, "an OpenAI chat line needs 'messages': a "
                                  "list of the request's messages and the assistant's reply")
        body = {"model": "imported", "messages": messages, "tools": tools}
        _check(path, entry.line, lambda: OPENAI.parse_request(body, None), "not a chat request")
        reply = messages[-1]
        if reply.get("role") != "assistant":
            raise TranscriptError(path, entry.line, "the last message must be the assistant's "
                                  f"reply, not a {_short(str(reply.get('role')), 40)!r} message")
        calls = reply.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise TranscriptError(path, entry.line, "the reply's 'tool_calls' must be a list of "
                                  "calls, each with a 'function' object naming it")
        yield ImportedTurn(
            session_id=_conversation_id(messages[:-1]), line=entry.line,
            messages=messages[:-1], reply=reply,
            params={"tools": tools} if tools else {}, model=_model(data.get("model")),
            finish_reason="tool_calls" if reply.get("tool_calls") else "stop")


def _conversation_id(messages: list[dict[str, Any]]) -> str:
    """A session id for an OpenAI chat line: its messages up to the first user message (a
    conversation's later lines open the same way)."""
    opening = []
    for message in messages:
        opening.append(message)
        if message.get("role") == "user":
            break
    return "chat-" + hashlib.sha256(dumps(opening).encode("utf-8", "replace")).hexdigest()[:20]


# -- Claude Code ------------------------------------------------------------------------------
def parse_claude_code(path: Path, entries: list[Entry]) -> Iterator[ImportedTurn]:
    """Each assistant reply (consecutive ``assistant`` entries of one message id) is a turn."""
    from metaclaw.protocols.anthropic_messages import ANTHROPIC

    conversation: list[dict[str, Any]] = []  # Anthropic messages so far
    shape: dict[str, Any] = {}  # the system prompt and tools of the latest request
    pending: list[Entry] = []  # the entries of the reply being read
    for entry in entries:
        data = entry.data
        kind = data.get("type")
        if kind == "api-request-shape" and isinstance(data.get("shape"), dict):
            shape = _claude_shape(path, entry, data["shape"])
            continue
        if kind not in ("user", "assistant") or data.get("isSidechain") is True:
            continue
        message = data.get("message")
        if not isinstance(message, dict):
            raise TranscriptError(path, entry.line, f"a {kind} entry needs a 'message' object")
        _check(path, entry.line, lambda: ANTHROPIC.parse_request(
            {"model": "imported", "messages": [message]}, None, count_only=True),
            f"not a Claude Code {kind} entry")
        if message.get("role") != kind:
            raise TranscriptError(path, entry.line, f"a {kind} entry holds a message of role "
                                  f"{_short(str(message.get('role')), 40)!r}")
        if kind == "assistant":
            if message.get("model") == "<synthetic>" or data.get("isApiErrorMessage"):
                # written by Claude Code itself (an error, an interruption)
                yield from _claude_flush(path, pending, conversation, shape)
                continue
            if pending and pending[-1].data["message"].get("id") != message.get("id"):
                yield from _claude_flush(path, pending, conversation, shape)
            pending.append(entry)
            continue
        yield from _claude_flush(path, pending, conversation, shape)
        conversation.append({"role": "user", "content": message["content"]})
    yield from _claude_flush(path, pending, conversation, shape)


def _claude_flush(path: Path, pending: list[Entry], conversation: list[dict[str, Any]],
                  shape: dict[str, Any]) -> Iterator[ImportedTurn]:
    """The reply read so far as a turn, and into the conversation."""
    if pending:
        turn = _claude_turn(path, pending, conversation, shape)
        conversation.append({"role": "assistant", "content": _blocks(pending)})
        pending.clear()
        yield turn


def _claude_shape(path: Path, entry: Entry, shape: dict[str, Any]) -> dict[str, Any]:
    system, tools = shape.get("system"), shape.get("tools")
    if system is not None and not (isinstance(system, str) or isinstance(system, list) and all(
            isinstance(b, dict) and isinstance(b.get("text"), str) for b in system)):
        raise TranscriptError(path, entry.line, "'shape.system' must be a text or a list of "
                              "text blocks")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools)):
        raise TranscriptError(path, entry.line, "'shape.tools' must be a list of tools with "
                              "a string 'name'")
    return {"system": system, "tools": tools}


def _blocks(entries: list[Entry]) -> list[dict[str, Any]]:
    """The content blocks of a reply written over several entries, thinking left out."""
    blocks = []
    for entry in entries:
        content = entry.data["message"]["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        blocks += [b for b in content if b.get("type") not in ("thinking", "redacted_thinking")]
    return blocks


def _claude_turn(path: Path, pending: list[Entry], conversation: list[dict[str, Any]],
                 shape: dict[str, Any]) -> ImportedTurn:
    from metaclaw.protocols.anthropic_messages import ANTHROPIC

    first, last = pending[0], pending[-1]
    message = last.data["message"]
    if not conversation:
        raise TranscriptError(path, first.line, "an assistant reply before any user message")
    tools = [{"name": t["name"], "description": t.get("description", ""),
              "input_schema": t.get("input_schema") or {"type": "object"}}
             for t in shape.get("tools") or ()]
    body = {"model": _model(message.get("model")), "messages": list(conversation),
            "system": shape.get("system"), "tools": tools}
    chat = _translate(path, first.line, lambda: ANTHROPIC.to_chat(body))
    reply = _translate(path, first.line, lambda: ANTHROPIC.reply_to_chat(
        {"content": _blocks(pending), "stop_reason": message.get("stop_reason"),
         "usage": message.get("usage") if isinstance(message.get("usage"), dict) else None}))
    choice = reply["choices"][0]
    params = {k: v for k, v in chat.items() if k not in ("model", "messages")}
    session = _session_id(path, last.line, last.data.get("sessionId"), "the entry's 'sessionId'")
    return ImportedTurn(session_id=session, line=first.line, messages=chat["messages"],
                        reply=choice["message"], params=params, model=body["model"],
                        created_at=_timestamp(last.data.get("timestamp")),
                        usage=_usage(reply.get("usage")), finish_reason=choice["finish_reason"])


# -- Codex ------------------------------------------------------------------------------------
#: Responses items the model writes (a reply is a run of them); the others are its input.
CODEX_OUTPUT = ("function_call", "custom_tool_call", "local_shell_call", "reasoning",
                "web_search_call")


def parse_codex(path: Path, entries: list[Entry]) -> Iterator[ImportedTurn]:
    """Each run of output items (assistant messages, tool calls) is a turn; the items before
    it, with the session's instructions, are its request."""
    from metaclaw.protocols.openai_responses import RESPONSES

    items: list[dict[str, Any]] = []
    pending: list[Entry] = []
    meta: dict[str, Any] = {}
    model = UNKNOWN_MODEL
    for entry in entries:
        kind, payload = entry.data.get("type"), entry.data.get("payload")
        if kind not in ("session_meta", "turn_context", "response_item"):
            continue
        if not isinstance(payload, dict):
            raise TranscriptError(path, entry.line, f"a {kind} record needs a 'payload' object")
        if kind == "session_meta":
            meta = payload
        elif kind == "turn_context":
            model = _model(payload.get("model"), model)
        else:
            _check(path, entry.line, lambda: RESPONSES.parse_request(
                {"model": "imported", "input": [payload]}, None), "not a Codex response item")
            output = payload.get("type") in CODEX_OUTPUT or (
                payload.get("type", "message") == "message" and payload.get("role") == "assistant")
            if output:
                pending.append(entry)
            else:
                yield from _codex_flush(path, pending, items, meta, model)
                items.append(payload)
    yield from _codex_flush(path, pending, items, meta, model)


def _codex_flush(path: Path, pending: list[Entry], items: list[dict[str, Any]],
                 meta: dict[str, Any], model: str) -> Iterator[ImportedTurn]:
    """The run of output items read so far as a turn, and into the conversation."""
    if pending:
        turn = _codex_turn(path, pending, items, meta, model)
        items.extend(p.data["payload"] for p in pending)
        pending.clear()
        yield turn


def _codex_turn(path: Path, pending: list[Entry], items: list[dict[str, Any]],
                meta: dict[str, Any], model: str) -> ImportedTurn:
    from metaclaw.protocols.openai_responses import RESPONSES

    first, last = pending[0], pending[-1]
    if not items:
        raise TranscriptError(path, first.line, "a reply of the model before any input")
    instructions = meta.get("base_instructions")
    if isinstance(instructions, dict):
        instructions = instructions.get("text")
    body = {"model": model, "input": list(items),
            "instructions": instructions if isinstance(instructions, str) else None}
    _check(path, first.line, lambda: RESPONSES.parse_request(body, None), "not a Codex request")
    chat = _translate(path, first.line, lambda: RESPONSES.to_chat(body))
    outputs = [p.data["payload"] for p in pending]
    reply = _translate(path, first.line, lambda: RESPONSES.reply_to_chat({"output": outputs}))
    choice = reply["choices"][0]
    message = {k: v for k, v in choice["message"].items() if k != "reasoning_content"}
    params = {k: v for k, v in chat.items() if k not in ("model", "messages")}
    session = _session_id(path, first.line, meta.get("id") or meta.get("session_id"),
                          "the session_meta record's 'id' (before the first reply)")
    return ImportedTurn(session_id=session, line=first.line, messages=chat["messages"],
                        reply=message, params=params, model=model,
                        created_at=_timestamp(last.data.get("timestamp")),
                        finish_reason=choice["finish_reason"])


# -- OpenClaw ---------------------------------------------------------------------------------
def parse_openclaw(path: Path, entries: list[Entry]) -> Iterator[ImportedTurn]:
    """Each assistant message is a turn; its request is the messages on its path from the
    session's root (entries form a tree by ``parentId``: a rewound session branches)."""
    from metaclaw.protocols.openai_chat import OPENAI

    by_id: dict[str, Entry] = {}
    path_ids: list[str] = []  # the ids from the root to the previous entry
    session, model = None, UNKNOWN_MODEL
    if any(e.data.get("traceSchema") == TRAJECTORY for e in entries[:DETECT_LINES]):
        entries = _from_trajectory(path, entries)
    for entry in entries:
        data = entry.data
        kind = data.get("type")
        if kind == "session":
            session = data.get("id")
            continue
        if kind == "model_change":
            model = _model(data.get("modelId"), model)
        entry_id, parent = data.get("id"), data.get("parentId")
        if isinstance(entry_id, str):
            by_id[entry_id] = entry
            path_ids = _openclaw_path(path_ids, by_id, entry_id, parent)
        if kind != "message":
            continue
        message = _openclaw_message(path, entry)
        if message["role"] != "assistant":
            continue
        request = [_openclaw_message(path, by_id[i]) for i in path_ids[:-1]
                   if by_id[i].data.get("type") == "message"] if isinstance(entry_id, str) \
            else _openclaw_linear(path, entries, entry)
        if not request:
            raise TranscriptError(path, entry.line, "an assistant message before any user "
                                  "message")
        body = {"model": "imported", "messages": [*request, message]}
        _check(path, entry.line, lambda: OPENAI.parse_request(body, None),
               "not an OpenClaw conversation")
        raw = data["message"]
        usage = raw.get("usage") if isinstance(raw.get("usage"), dict) else {}
        tokens = {"prompt_tokens": usage.get("input"), "completion_tokens": usage.get("output")}
        failed = raw.get("stopReason") in ("aborted", "error")
        yield ImportedTurn(
            status="error" if failed else "ok",
            error=_short(str(raw.get("errorMessage") or f"the reply was {raw['stopReason']}"),
                         500) if failed else None,
            session_id=_session_id(path, entry.line, session, "the session record's 'id' "
                                   "(before the first message)"),
            line=entry.line, messages=request, reply=message,
            model=_model(raw.get("model"), model),
            created_at=_timestamp(data.get("timestamp")),
            usage={k: v for k, v in tokens.items() if isinstance(v, int)} or None,
            finish_reason="tool_calls" if message.get("tool_calls") else "stop")


#: The schema of OpenClaw's trajectory export (``openclaw sessions export-trajectory``).
TRAJECTORY = "openclaw-trajectory"


def _from_trajectory(path: Path, entries: list[Entry]) -> list[Entry]:
    """The session records inside a trajectory export's ``events.jsonl``: its events from the
    transcript that carry a message (user, assistant, tool result), as the session records
    they were, and the session and model they name."""
    out: list[Entry] = []
    ids: set[Any] = set()
    for entry in entries:
        data = entry.data
        if data.get("traceSchema") != TRAJECTORY:
            raise TranscriptError(path, entry.line, f"not an event of the {TRAJECTORY} schema "
                                  "(its other lines are)")
        event = data.get("data") if isinstance(data.get("data"), dict) else {}
        if not out and isinstance(data.get("sessionId"), str):
            out.append(Entry(entry.line, {"type": "session", "id": data["sessionId"]}))
        if data.get("source") != "transcript":
            continue
        record = {"id": data.get("entryId"), "parentId": data.get("parentEntryId")}
        if record["id"] in ids:  # a tool call's event repeats its assistant message's entry
            continue
        ids.add(record["id"])
        if data.get("type") == "session.model_change":
            record.update(type="model_change", modelId=event.get("modelId"))
        elif "message" in event and data.get("type") in (
                "user.message", "assistant.message", "tool.result"):
            record.update(type="message", timestamp=data.get("ts"), message=event["message"])
        else:  # kept for the chain of parents
            record["type"] = str(data.get("type"))
        out.append(Entry(entry.line, record))
    return out


def _openclaw_path(path_ids: list[str], by_id: dict[str, Entry], entry_id: str,
                   parent: Any) -> list[str]:
    """The ids from the root to ``entry_id``: the previous path extended (a linear session,
    the common case, costs nothing more), or, after a branch, walked back by ``parentId``."""
    if parent is None or (path_ids and path_ids[-1] == parent):
        return [*path_ids, entry_id] if parent is not None else [entry_id]
    chain, seen, node = [entry_id], {entry_id}, parent
    while isinstance(node, str) and node in by_id and node not in seen:
        chain.append(node)
        seen.add(node)
        node = by_id[node].data.get("parentId")
    return chain[::-1]


def _openclaw_linear(path: Path, entries: list[Entry], upto: Entry) -> list[dict[str, Any]]:
    """The messages before ``upto`` in file order (records without ids)."""
    return [_openclaw_message(path, e) for e in entries
            if e.line < upto.line and e.data.get("type") == "message"]


def _openclaw_message(path: Path, entry: Entry) -> dict[str, Any]:
    """An OpenClaw message record in the chat shape (checked: a wrong type is an error)."""
    message = entry.data.get("message")
    if not isinstance(message, dict):
        raise TranscriptError(path, entry.line, "a message record needs a 'message' object")
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant", "toolResult", "system"):
        raise TranscriptError(path, entry.line, "'message.role' must be user, assistant, "
                              f"toolResult or system, not {_short(repr(role), 40)}")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(
            isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        raise TranscriptError(path, entry.line, "'message.content' must be a text or a list "
                              "of parts with a string 'type'")
    texts, calls = [], []
    for part in content:
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise TranscriptError(path, entry.line, "a text part needs a string 'text'")
            texts.append(part["text"])
        elif kind == "toolCall":
            if not isinstance(part.get("id"), str) or not isinstance(part.get("name"), str):
                raise TranscriptError(path, entry.line, "a toolCall part needs a string 'id' "
                                      "and 'name'")
            arguments = part.get("arguments")
            calls.append({"id": part["id"], "type": "function", "function": {
                "name": part["name"], "arguments": arguments if isinstance(arguments, str)
                else dumps(arguments if arguments is not None else {})}})
        elif kind == "image":
            texts.append("[image]")
    text = "\n".join(texts)
    if role == "toolResult":
        call_id = message.get("toolCallId")
        if not isinstance(call_id, str):
            raise TranscriptError(path, entry.line, "a toolResult needs a string 'toolCallId'")
        return {"role": "tool", "tool_call_id": call_id, "content": text}
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            out["tool_calls"] = calls
        return out
    return {"role": role, "content": text}


PARSERS: dict[str, Callable[[Path, list[Entry]], Iterator[ImportedTurn]]] = {
    "openclaw": parse_openclaw, "claude-code": parse_claude_code, "codex": parse_codex,
    "openai": parse_openai}


# -- reading a file ---------------------------------------------------------------------------
def open_transcript(path: str | os.PathLike[str], format: str = "auto") -> Transcript:
    """Read one transcript file's records and tell its format; its ``turns`` are produced as
    they are iterated (each checked on the way: an error names its line). ``format``: one of
    :data:`FORMATS`, or ``"auto"`` to tell it from the file."""
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"format must be 'auto' or one of {', '.join(FORMATS)}, not {format!r}")
    path = Path(path).expanduser()
    entries = list(read_entries(path))
    if not entries:
        raise TranscriptError(path, None, "is empty: no transcript records")
    found = format if format != "auto" else detect_format(entries)
    if found is None:
        raise TranscriptError(path, None, "is JSON Lines, but not a transcript of a known format "
                              f"({', '.join(FORMATS)}); give --format to say which it is")
    return Transcript(path, found, PARSERS[found](path, entries))


def read_transcript(path: str | os.PathLike[str], format: str = "auto") -> Transcript:
    """Read and check one whole transcript file, its turns in a list (nothing is written)."""
    transcript = open_transcript(path, format)
    transcript.turns = list(transcript.turns)
    return transcript


# -- recording --------------------------------------------------------------------------------
def import_files(store: Store, paths: Iterable[str | os.PathLike[str]],
                 format: str = "auto") -> ImportResult:
    """Record the replies of every file as turns, in one transaction: a file refused on any
    line leaves the store as it was, the other files' turns included. One file's records are
    held at a time, and one turn's conversation. Turns already in the store (by content key)
    are skipped."""
    from metaclaw import buffers

    paths = [Path(p).expanduser() for p in paths]
    result = ImportResult()
    known: dict[str, set[str]] = {}  # per session, the content keys in the store
    with store.transaction():
        generation = buffers.current_generation(store)
        for path in paths:
            transcript = open_transcript(path, format)
            result.formats[str(path)] = transcript.format
            for turn in transcript.turns:
                keys = known.get(turn.session_id)
                if keys is None:
                    keys = known[turn.session_id] = _known_keys(store, turn.session_id)
                key = turn.key
                if key in keys:
                    result.skipped += 1
                    continue
                keys.add(key)
                result.turn_ids.append(store.record_turn(**_row(transcript, turn, key,
                                                                generation)))
    result.sessions = sorted(known)
    return result


def _known_keys(store: Store, session: str) -> set[str]:
    """The content keys of the imported turns of ``session`` already in the store."""
    key = store.json_text("identified_by", "import_key")
    rows = store.query(f"SELECT {key} AS k FROM turns WHERE session_id = ? AND {key} IS NOT NULL",
                       (session,))
    return {row["k"] for row in rows}


def source(transcript: Transcript) -> str:
    """What ``identified_by`` says of a turn from ``transcript``: imported, its format, file."""
    return f"imported:{transcript.format}:{transcript.path.name}"


def _row(transcript: Transcript, turn: ImportedTurn, key: str,
         generation: int) -> dict[str, Any]:
    from metaclaw.skills.retrieval import query_text

    usage = turn.usage or {}
    marked = source(transcript)
    return {
        "session_id": turn.session_id, "request_messages": turn.messages,
        "status": turn.status, "error": turn.error,
        "turn_type": "main", "model": turn.model, "stream": 0, "request_params": turn.params,
        "response": _reply_text(turn.reply), "tool_calls": turn.reply.get("tool_calls") or None,
        "finish_reason": turn.finish_reason, "usage": turn.usage,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "protocol": PROTOCOLS[transcript.format], "skill_generation": generation,
        "retrieval_query": query_text(turn.messages) or None,
        "identified_by": {"session": marked, "turn_type": "imported", "line": turn.line,
                          "import_key": key},
        # never trained on (no token ids or log-probabilities): support, never query; a
        # failed reply enters no buffer, as a failed proxied turn does not
        "buffer_set": "support" if turn.status == "ok" else None,
        "buffer_state": "live" if turn.status == "ok" else None,
        **({"created_at": turn.created_at} if turn.created_at is not None else {}),
    }


def is_imported(turn: dict[str, Any]) -> bool:
    """Whether a ``turns`` row was recorded by an import rather than served by the proxy."""
    how = turn.get("identified_by")
    return isinstance(how, dict) and "import_key" in how
