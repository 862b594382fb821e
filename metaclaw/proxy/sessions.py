"""Which session a request belongs to, and whether it is a main turn, a stage of a task or a side
call, without cooperation from the client.

Many agents send no session header. The session id is taken from the first of these that the
request carries (the precedence, documented and tested):

1. the ``X-Session-Id`` header, then the body field ``session_id`` (MetaClaw's own, compatible
   with upstream MetaClaw), then other frameworks' session headers (:data:`SESSION_HEADERS`);
2. a session id in the body's ``metadata`` (``metadata.session_id``, or the session in
   ``metadata.user_id``: Claude Code sends a JSON string with ``session_id``, older clients
   ``..._session_<id>``), then OpenClaw's ``prompt_cache_key`` (``<sessionId>:<n>``; a key
   without the numbered suffix is a cache key shared by conversations, not a session);
3. a session id the framework embeds in the conversation (:data:`EMBEDDED_SESSION`: OpenClaw
   writes ``sessionId=<uuid>`` into a session's first user message, or into the system
   prompt), searched for only there;
4. a fingerprint of the conversation: a hash of the body's ``user`` field and the first user
   message as sent (frameworks resend the whole history each turn, so every turn of one
   conversation carries the same first message): ``conv-<12 hex>``. Conversations whose
   first messages are the same (a harness running one task several times without a session
   id) are then told apart by the replies they continue (:class:`ReplyThreads`, in the
   proxy): ``conv-<12 hex>.2``, ... Clients that need this to hold across proxy restarts send
   ``X-Session-Id``;
5. ``unidentified`` for a request without any of these (no user message at all), logged.

Nothing is ever lumped into a ``default`` session silently: :attr:`Identity.how` says which
rule decided, and the proxy records it with the turn (``turns.identified_by``).

Turn type: ``X-Turn-Type`` / body ``turn_type`` decide when given. Otherwise
:data:`SIDE_CALL_RULES` recognise the side calls frameworks make beside the user's task (a title
for the conversation, a summary or compaction of it, a quota or health probe, a sub-agent's
call): they get no skills and never reach the support or query set. Everything else is ``main``.

Whom a turn served: the ``X-MetaClaw-User`` (the person) and ``X-MetaClaw-Agent`` (the agent)
headers, each a short identifier (:data:`metaclaw.turns.PRINCIPAL_ID`; anything else is a 400
naming the header); without them the proxy's configured ``user`` / ``agent``
(:func:`principals_of`). Private skills are offered only to their own person or agent.

The turn types and the one test of "main or a stage" are :mod:`metaclaw.turns`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import orjson

from metaclaw.protocols import tool_input
from metaclaw.skills.asks import INSTRUCTION_ROLES, content_text
from metaclaw.store import OutageLog, StoreUnavailable
from metaclaw.turns import (TASK_TURNS_SQL, IdentityError, check_principal, check_session_id,
                            check_turn_type)

log = logging.getLogger(__name__)
#: Warnings of the look-ups an unreachable workspace failed, rate-limited (every opening
#: meets it while it lasts).
_OUTAGES = OutageLog(log)

#: Session headers of other frameworks, after ``X-Session-Id`` (first match wins).
SESSION_HEADERS = ("X-Claude-Code-Session-Id", "X-Conversation-Id", "X-Thread-Id",
                   "Session-Id", "Conversation-Id")
#: A session id embedded in message text (OpenClaw's runtime line: ``sessionId=<uuid>``, or
#: the name given with ``openclaw agent --session-id``, however short).
EMBEDDED_SESSION = re.compile(r"\bsessionId=([A-Za-z0-9][A-Za-z0-9._:-]{0,127})")
_METADATA_SESSION = re.compile(r"session_([A-Za-z0-9-]{6,128})")
_ID_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{5,127}")


def _store_warning(what: str, subject: Any) -> None:
    """A session look-up the workspace could not answer: one line, once a while, where its
    database server cannot be reached (a state the proxy reports on every request meanwhile),
    the traceback where the failure is another."""
    exc = sys.exc_info()[1]
    if isinstance(exc, StoreUnavailable):
        _OUTAGES.warning(what + ": %s", subject, exc)
    else:
        log.warning(what, subject, exc_info=True)


def _metadata_user_session(user_id: str) -> str | None:
    """The session in ``metadata.user_id``: Claude Code sends a JSON string with ``session_id``;
    older clients ``user_<hash>_account_<uuid>_session_<uuid>``."""
    if user_id.lstrip().startswith("{"):
        try:
            value = json.loads(user_id).get("session_id")
        except (ValueError, AttributeError):
            value = None
        return value if isinstance(value, str) and value.strip() else None
    found = _METADATA_SESSION.search(user_id)
    return found.group(1) if found else None


@dataclass(frozen=True)
class Identity:
    """``session_id``, ``turn_type``, ``done`` (the client closed the session) and ``how``:
    which rule decided each (``{"session": ..., "turn_type": ...}``)."""

    session_id: str
    turn_type: str
    done: bool
    how: dict[str, str]
    #: the person and the agent the request names in its headers (``None``: not named)
    person: str | None = None
    agent: str | None = None


@dataclass(frozen=True)
class SideCallRule:
    """A kind of side call: ``matches(body, instructions, last_user_text) -> bool``."""

    name: str
    matches: Callable[[dict[str, Any], str, str], bool]


#: Where a side call's instruction starts: at the start of a line (a system prompt's block, a
#: paragraph), as the request's own purpose. The same words in the middle of a sentence of an
#: agent's standing prompt ("If the user asks, summarize the conversation") are not one.
_LEAD = r"^[^\w\n]*(?:you are |your task is to |please |now )?(?:[*_]*\w+ly[*_]* )?"
#: "this conversation", "the partial conversation", "the lines of conversation", ...
_THE_CONVERSATION = r"(?:this|the)(?: [\w-]+){0,3} (?:conversation|chat)\b|(?:the )?chat history"


def _says(*patterns: str, needles: tuple[str, ...]) -> Callable[[dict[str, Any], str, str], bool]:
    """A rule: one of ``patterns`` (case-insensitive, each starting a line, see :data:`_LEAD`)
    in the instructions or the last user message. ``needles``: lowercase words every match
    contains; a text without any of them is not searched (instructions run to tens of
    kilobytes, and most requests are not side calls)."""
    pattern = re.compile("|".join(_LEAD + p for p in patterns), re.I | re.M)

    def says(body: dict[str, Any], instructions: str, last: str) -> bool:
        return any(pattern.search(text) for text in (instructions, last[:2000])
                   if any(needle in _folded(text) for needle in needles))
    return says


@functools.lru_cache(maxsize=8)  # the rules of one request fold the same texts
def _folded(text: str) -> str:
    return text.casefold()


def _title_schema(body: dict[str, Any], instructions: str, last: str) -> bool:
    """A structured reply whose only field is a title (Claude Code names its sessions so)."""
    formats = [(body.get("output_config") or {}).get("format") if isinstance(
        body.get("output_config"), dict) else None,
        ((body.get("response_format") or {}).get("json_schema") or {}) if isinstance(
        body.get("response_format"), dict) else None]
    for fmt in formats:
        schema = (fmt or {}).get("schema") if isinstance(fmt, dict) else None
        if isinstance(schema, dict) and list((schema.get("properties") or {})) == ["title"]:
            return True
    return False


def _tiny_probe(body: dict[str, Any], instructions: str, last: str) -> bool:
    limit = body.get("max_tokens", body.get("max_completion_tokens"))
    return (isinstance(limit, int) and not isinstance(limit, bool) and limit <= 1
            and not body.get("tools"))


_SUB_AGENT = re.compile(r"\bsession=agent:[^|\s]*:subagent:")


def _sub_agent(body: dict[str, Any], instructions: str, last: str) -> bool:
    return any(_SUB_AGENT.search(text) for text in (instructions, last)
               if "session=agent:" in text)


#: How side calls are recognised (first match wins); extend for a new framework.
SIDE_CALL_RULES: list[SideCallRule] = [
    SideCallRule("title", _says(
        r"(?:generate|write|create|suggest|give|provide|propose)\b[^.\n]{0,40}\btitle\b"
        rf"[^.\n]{{0,60}}\b(?:{_THE_CONVERSATION}|(?:this|the) (?:session|thread)\b)",
        r"naming (?:a|this|the) (?:\w+ )?(?:session|conversation|chat|thread)\b",
        needles=("title", "naming"))),
    SideCallRule("title-schema", _title_schema),
    SideCallRule("summary", _says(
        r"(?:summari[sz]e|create a (?:detailed |new anchored )?summary (?:of|from)|compact)\b"
        rf"[^.\n]{{0,40}}\b(?:{_THE_CONVERSATION}|the prefix\b)",
        r"an? (?:context )?summari[sz]ation assistant\b",
        r"an? context summari[sz]ation agent\b",  # opencode
        r"performing a context checkpoint compaction\b",  # Codex
        needles=("summar", "compact"))),
    SideCallRule("quota-probe", _tiny_probe),
    SideCallRule("sub-agent", _sub_agent),
]


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return value if value else None


def _first_user_text(messages: list[Any]) -> str | None:
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
    return None


def session_of(headers: Mapping[str, str], body: dict[str, Any],
               principals: tuple[str | None, str | None] = (None, None)) -> tuple[str, str]:
    """(session id, which rule found it) by the precedence in the module docstring;
    ``principals``: the person and agent the request names, part of a fingerprint (two people
    opening alike never share a session)."""
    for name in ("X-Session-Id",):
        if (value := _header(headers, name)) is not None:
            return check_session_id(value, f"header {name}"), f"header:{name}"
    if body.get("session_id") is not None:
        return check_session_id(body["session_id"], "body 'session_id'"), "body:session_id"
    for name in SESSION_HEADERS:
        if (value := _header(headers, name)) is not None:
            return check_session_id(value, f"header {name}"), f"header:{name}"
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    if isinstance(metadata.get("session_id"), str) and metadata["session_id"].strip():
        return (check_session_id(metadata["session_id"], "metadata.session_id"),
                "metadata:session_id")
    if isinstance(metadata.get("user_id"), str):
        found = _metadata_user_session(metadata["user_id"])
        if found:
            return check_session_id(found, "metadata.user_id"), "metadata:user_id"
    # OpenClaw (compat.supportsPromptCacheKey) sends "<sessionId>:<n>"; other clients use one
    # cache key for every conversation sharing a prompt prefix, which is not a session
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and ":" in cache_key:
        key, _, number = cache_key.rpartition(":")
        if number.isdigit() and _ID_TOKEN.fullmatch(key):
            return key, "body:prompt_cache_key"
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    # where frameworks write it: the instructions, or the session's first user message (a
    # later message may quote code that happens to say "sessionId=")
    texts = [content_text(body.get("system"))] + [  # Anthropic's system is top-level
        content_text(m.get("content")) for m in messages
        if isinstance(m, dict) and m.get("role") in INSTRUCTION_ROLES]
    first = _first_user_text(messages)
    for text in (*texts, first or ""):
        found = EMBEDDED_SESSION.search(text) if "sessionId=" in text else None
        if found:
            return found.group(1), "message:sessionId"
    if first is not None:
        user = body.get("user") if isinstance(body.get("user"), str) else ""
        key = f"{user}\x00{first}"
        if any(principals):  # (a conversation without them keeps the fingerprint it had)
            key += f"\x00person={principals[0] or ''}\x00agent={principals[1] or ''}"
        digest = hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()
        return f"conv-{digest[:12]}", FINGERPRINT
    log.warning("a request carries no session id and no user message; recorded as "
                "'unidentified' (send X-Session-Id to group its turns)")
    return "unidentified", "none"


def turn_type_of(headers: Mapping[str, str], body: dict[str, Any]) -> tuple[str, str]:
    """(``main`` | ``side`` | ``stage:<name>``, which rule decided)."""
    header = _header(headers, "X-Turn-Type")
    given = header if header is not None else body.get("turn_type")
    if given is not None:
        where = "header X-Turn-Type" if header is not None else "body 'turn_type'"
        how = "header:X-Turn-Type" if header is not None else "body:turn_type"
        return check_turn_type(given, where), how
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    instructions = "\n".join([content_text(body.get("system")), *(
        content_text(m.get("content")) for m in messages
        if isinstance(m, dict) and m.get("role") in INSTRUCTION_ROLES)])
    last = next((content_text(m.get("content")) for m in reversed(messages)
                 if isinstance(m, dict) and m.get("role") == "user"), "")
    for rule in SIDE_CALL_RULES:
        if rule.matches(body, instructions, last):
            return "side", f"rule:{rule.name}"
    return "main", "default"


_TRUE = {"1", "true", "yes", "on"}
#: The headers naming whom a request serves: the person (``user``) and the agent.
PRINCIPAL_HEADERS = {"user": "X-MetaClaw-User", "agent": "X-MetaClaw-Agent"}


def principals_of(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(person, agent) the request names in ``X-MetaClaw-User`` / ``X-MetaClaw-Agent``
    (``None`` where a header is absent or empty); a value that is not a short identifier
    raises :class:`IdentityError` (``param`` ``user`` or ``agent``) naming the header."""
    found: list[str | None] = []
    for param, name in PRINCIPAL_HEADERS.items():
        value = headers.get(name)
        found.append(None if value is None or value == ""
                     else check_principal(value, param, f"header {name}"))
    return found[0], found[1]


def identify(headers: Mapping[str, str], body: dict[str, Any],
             configured: tuple[str | None, str | None] = (None, None)) -> Identity:
    """The session, turn type and done flag of a request (raises :class:`IdentityError` for a
    session id or turn type the client gave that cannot be accepted). ``configured``: the
    person and agent the proxy serves where the headers name none (they take part in a
    fingerprint as the headers' would)."""
    person, agent = principals_of(headers)
    session_id, session_how = session_of(
        headers, body, (person or configured[0] or None, agent or configured[1] or None))
    turn_type, type_how = turn_type_of(headers, body)
    done_value = headers.get("X-Session-Done", body.get("session_done", False))
    done = done_value is True or str(done_value).strip().lower() in _TRUE
    return Identity(session_id, turn_type, done, {"session": session_how, "turn_type": type_how},
                    person, agent)


# -- threading by replies ----------------------------------------------------------------------
#: ``Identity.how["session"]`` of a turn found through the fingerprint, by what decided it.
FINGERPRINT = "fingerprint:first-user-message"
REPEATED_OPENING = "fingerprint:repeated-opening"
REPLY_THREAD = "fingerprint:reply-thread"


@dataclass(frozen=True)
class Thread:
    """Where a fingerprinted task turn sits (:meth:`ReplyThreads.resolve`), for
    :meth:`ReplyThreads.settle` once its reply is known. ``history``: a running digest of the
    messages the client sent; ``after``: the key of the recorded reply it continues (``None``
    if none); ``opening``: the conversation's first turn."""

    fingerprint: str
    session_id: str
    history: Any
    after: tuple[str, str] | None = None
    opening: bool = False
    #: a digest of the last user message the client sent (its reply is remembered after it)
    ask: Any = None


def _arguments(value: Any) -> str:
    """A tool call's arguments in one spelling, read as an Anthropic client gets and resends
    them (:func:`~metaclaw.protocols.tool_input`) and written with sorted keys: clients
    re-serialise the JSON they got."""
    try:
        return orjson.dumps(tool_input(value), option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # nested deeper than orjson writes, a lone surrogate: kept as it came
        return value if isinstance(value, str) else f"<{type(value).__name__}>"


def add_message(history: Any, role: Any, content: Any, tool_calls: Any = None) -> None:
    """Add a message to the running digest ``history`` as the proxy recorded it or as a client
    resends it: its role, its text without surrounding whitespace, each call's name and
    arguments. Call ids, reasoning, images and cache markers are left out: clients rewrite,
    drop or move them. Each field is prefixed with its length, so no two histories read alike."""
    fields = [str(role), content_text(content).strip()]
    for call in tool_calls if isinstance(tool_calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            fields += [str(function.get("name")), _arguments(function.get("arguments"))]
    history.update("".join(f"{len(text)}:{text}" for text in fields).encode("utf-8", "replace")
                   + b"\n")


class ReplyThreads:
    """Tells apart the conversations that share a fingerprint (the same first user message, as
    when a harness runs one task several times at once without a session id), by the replies
    they continue.

    An opening (a task turn with no assistant message yet) takes the fingerprint's session when
    it is new to this process, and a numbered one (``conv-<hex>.2``, ...) when another
    conversation opened with the same message; an opening whose turn failed leaves its session
    to the next opening (a client's retry lands in the same session). A later turn resends the
    history it continues, ending with a reply: it joins the session that recorded that reply
    after that same history, and a reply continued again (a retry while the first attempt is
    in flight, a regenerated answer) joins the session that continued it. Two conversations
    identical so far may trade sessions, which changes nothing; two that differ never share
    one.

    Kept in memory, per proxy process; at most :attr:`MAX_ENTRIES` fingerprints and replies are
    remembered (the least recently used are forgotten). With the workspace ``store``, what this
    process does not remember is read from what was recorded (after a restart, from another
    proxy, or forgotten): an opening's number follows the fingerprint's recorded sessions
    (read whole the first time; after that the number is claimed there before the reply,
    :meth:`Store.claim_session`, and the ids recorded since are read only when it is taken),
    so a new run never joins
    an earlier run's session, or one opening at the same moment, this process's or another
    proxy's; a client's fixed preamble is known from the fingerprint's recorded opening; and a
    continuation of a reply found as the latest turn of a recorded session (of those with
    turns since the last look, :attr:`PAGES` pages of :attr:`RECORDED_SESSIONS`) joins it. A
    continuation of a reply found nowhere (the client edited the history, or continues an
    earlier reply than its session's latest) falls back to the fingerprint.

    Clients that rebuild their context each turn (aider moves its files message after the chat
    history, and ends with a fixed exchange) are followed by the reply *after the ask it
    answered*: the latest reply in the request that this proxy gave right after the same user
    message joins the session that gave it. A request none of whose assistant messages is a
    reply this proxy gave, opening with a fixed preamble (aider's example exchange, few-shot
    prompts: the first reply of a fingerprint new here, then the same one again) is a
    conversation's first turn here, numbered like any opening, so separate runs of such a
    client stay separate sessions; one whose replies the client edited (a reasoning block taken
    out) stays in its conversation. Used on the event loop; the lock makes it safe from threads
    too.
    """

    MAX_ENTRIES = 50_000
    #: Recorded sessions of one fingerprint whose latest reply a continuation is looked up in.
    RECORDED_SESSIONS = 64
    #: Most pages of :attr:`RECORDED_SESSIONS` one look for recorded replies reads: the next
    #: page only where the last one's sessions all had a turn among the :attr:`RECENT_IDS`
    #: latest turn ids (so many at once; a first look after a restart does not read them all).
    PAGES = 16
    RECENT_IDS = 4096

    def __init__(self, store: Any = None) -> None:
        self.store = store
        self._reader: Any = None  # the store through the connection the event loop writes on
        self._openings: OrderedDict[str, list[Any]] = OrderedDict()  # fp -> [count, free ids]
        self._replies: OrderedDict[tuple[str, str], list[str]] = OrderedDict()  # -> sessions
        self._continued: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # -> session
        # a reply after the user message it answered (whatever else the client moved around
        # them) -> the session that gave it: for clients that rebuild their context each turn
        self._answered: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        # the first reply of clients' fixed preambles (after its history) -> True; and first
        # replies found not to be one of the recorded openings' (looked up once)
        # the newest turn read of each fingerprint's sessions: a later look reads only newer ones
        self._looked_up: OrderedDict[str, int] = OrderedDict()
        self._preambles: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._not_preambles: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def reads_network(self) -> bool:
        """Whether a look-up in the workspace may wait on the network (a database server): then
        :meth:`resolve` is called off the event loop."""
        return self.store is not None and getattr(self.store, "engine", "sqlite") != "sqlite"

    def resolve(self, fingerprint: str, messages: list[Any]) -> tuple[str, str, Thread]:
        """(session id, how it was decided, the thread to :meth:`settle`) of a task turn whose
        session is the fingerprint ``fingerprint``; ``messages``: as the client sent them."""
        from metaclaw.skills.block import strip_skill_block

        history, keys, answered = hashlib.blake2b(digest_size=16), [], []
        ask = hashlib.blake2b(digest_size=16)
        # a client that resends an earlier turn's skill block still continues the history the
        # proxy remembered without it (replies are keyed on the client's own messages)
        for message in strip_skill_block(messages):
            message = message if isinstance(message, dict) else {}
            role = message.get("role")
            add_message(history, role, message.get("content"), message.get("tool_calls"))
            if role == "user":
                ask = hashlib.blake2b(digest_size=16)
                add_message(ask, role, message.get("content"))
            elif role == "assistant":  # a reply, after its history, and after its ask
                keys.append((fingerprint, history.hexdigest()))
                reply = ask.copy()
                add_message(reply, role, message.get("content"), message.get("tool_calls"))
                answered.append((fingerprint, reply.hexdigest()))
        key = keys[-1] if keys else None
        with self._lock:
            if key is None:
                return self._open(fingerprint, history, ask)
            waiting = self._replies.get(key)
            if not waiting and key not in self._continued:
                # replies this process gave are kept here; one it does not know may be another
                # process's (two proxies of one workspace), recorded since it last looked
                self._read_recorded_replies(fingerprint)
                waiting = self._replies.get(key)
            if not waiting:
                # a reply continued before: a client's retry while its first attempt is still
                # in flight (a client-side timeout), or another answer to the same history
                session_id = self._continued.get(key)
                if session_id is not None:
                    return session_id, REPLY_THREAD, Thread(fingerprint, session_id, history,
                                                            ask=ask)
                # the latest reply it holds that this proxy gave after the same ask, the rest of
                # the context rearranged (aider puts the chat history before its files message,
                # which followed the ask the first time, and ends with a fixed exchange)
                for answer in reversed(answered):
                    if answer not in self._answered:
                        continue
                    session_id = self._answered[answer]
                    if session_id is None:  # two alike conversations gave it: it names neither
                        break
                    self._answered.move_to_end(answer)
                    return session_id, REPLY_THREAD, Thread(fingerprint, session_id, history,
                                                            ask=ask)
                if not any(k in self._replies or k in self._continued for k in keys) \
                        and not any(k in self._answered for k in answered) \
                        and self._preamble(fingerprint, keys[0]):
                    # none of its assistant messages is a reply this proxy gave, and it opens
                    # with a client's fixed preamble (aider's example exchange, few-shot
                    # prompts): a conversation's first turn here, numbered like any opening
                    return self._open(fingerprint, history, ask)
                # an edited history: it continues its conversation from an earlier reply
                return fingerprint, FINGERPRINT, Thread(fingerprint, fingerprint, history,
                                                        ask=ask)
            session_id = waiting.pop(0)
            if not waiting:
                del self._replies[key]
            # a reply two alike conversations continued names neither: a retry could be either's
            self._continued[key] = (session_id if self._continued.get(key, session_id)
                                    == session_id else None)
            self._continued.move_to_end(key)
            _bound(self._continued, self.MAX_ENTRIES)
            return session_id, REPLY_THREAD, Thread(fingerprint, session_id, history, key,
                                                    ask=ask)

    def _preamble(self, fingerprint: str, first: tuple[str, str]) -> bool:
        """Whether a request none of whose assistant messages this proxy gave opens a new
        conversation: its first assistant message, after the same history, is a preamble seen
        before (the next run of the client), or the fingerprint is new here (its first run;
        the preamble is remembered). Otherwise it continues a conversation whose replies the
        client edited (a reasoning block taken out), or one this process does not remember.
        Holds the lock."""
        if first in self._preambles:
            return True
        if fingerprint in self._openings:
            return False
        if self._recorded(fingerprint) and not self._recorded_preamble(fingerprint, first):
            return False
        self._preambles[first] = True
        _bound(self._preambles, self.MAX_ENTRIES)
        return True

    def _recorded_preamble(self, fingerprint: str, first: tuple[str, str]) -> bool:
        """Whether the recorded opening of ``fingerprint`` (its first session's first turn,
        recorded by another proxy or before a restart) began with the same first assistant
        message after the same history: a client's fixed preamble, so a request beginning so is
        another run's first turn, not the continuation of a conversation this process does not
        remember. Looked up once per preamble (holds the lock)."""
        if first in self._not_preambles:
            return False
        from metaclaw.skills.block import strip_skill_block

        found = False
        try:
            rows = self._read("SELECT request_messages FROM turns WHERE session_id = ? "
                              "ORDER BY turn_index LIMIT 1", (fingerprint,))
        except Exception:  # noqa: BLE001 - a store that cannot answer: not known there
            _store_warning("could not read the recorded opening of %s", fingerprint)
            rows = []
        if not rows and self._recorded(fingerprint):
            # claimed by an opening whose first reply is still on its way (another proxy's):
            # nothing can continue it yet, so this is another run's first turn
            return True
        messages = rows[0]["request_messages"] if rows else None
        if isinstance(messages, list):
            history = hashlib.blake2b(digest_size=16)
            for message in strip_skill_block(messages):
                message = message if isinstance(message, dict) else {}
                add_message(history, message.get("role"), message.get("content"),
                            message.get("tool_calls"))
                if message.get("role") == "assistant":
                    found = (fingerprint, history.hexdigest()) == first
                    break
        if not found:
            self._not_preambles[first] = True
            _bound(self._not_preambles, self.MAX_ENTRIES)
        return found

    def _open(self, fingerprint: str, history: Any, ask: Any) -> tuple[str, str, Thread]:
        """A conversation's first turn: the fingerprint for the first opening, ``.N`` after it
        for the N-th (an opening a failed turn left free is taken again). Holds the lock."""
        opened = self._openings.get(fingerprint)
        new = opened is None
        if new:
            opened = self._openings[fingerprint] = [0, []]
            _bound(self._openings, self.MAX_ENTRIES)
        self._openings.move_to_end(fingerprint)
        session_id = opened[1].pop(0) if opened[1] else self._take(fingerprint, opened, new)
        how = FINGERPRINT if session_id == fingerprint else REPEATED_OPENING
        return session_id, how, Thread(fingerprint, session_id, history, opening=True, ask=ask)

    def _take(self, fingerprint: str, opened: list[Any], new: bool) -> str:
        """The next opening's session id, numbered after the openings recorded by every proxy
        of the workspace (all of a fingerprint new here read once) and claimed there before its
        first reply (:meth:`Store.claim_session`), so that another proxy numbering the same
        opening meanwhile takes the next. For a fingerprint this process knows, the claim is
        the look-up: the ids recorded since are read (one key at a time) only when the next one
        is taken. A claim not written (no store, the write lock held at that instant) leaves
        the opening numbered after what was recorded. Over the network, a fingerprint no process
        recorded takes its bare id in one round trip (a claim written only where its family has
        no id). Holds the lock (a round trip over the network lets go of it meanwhile)."""
        if new and self.reads_network:
            # the first opening anywhere, in one round trip: claimed unless any is recorded
            # (a file's read costs microseconds: there, what was recorded is read first)
            if self._claim(fingerprint, first_of=self._family(fingerprint)):
                opened[0] = max(opened[0], 1)  # another thread may have numbered meanwhile
                return fingerprint
        if new:  # (read before opened[0] is: the read lets go of the lock meanwhile)
            recorded = self._recorded_count(fingerprint)
            opened[0] = max(opened[0], recorded)
        for _ in range(self.CLAIMS):
            opened[0] += 1  # this process's before the claim: another thread takes the next
            number = opened[0]
            session_id = fingerprint if number == 1 else f"{fingerprint}.{number}"
            claimed = self._claim(session_id)
            if claimed:
                break
            if claimed is None:
                if not new:  # not claimed: after the ones recorded since this process looked
                    recorded = self._recorded_count(fingerprint, number - 1)
                    if recorded >= number:
                        opened[0] = max(opened[0], recorded + 1)
                        number = opened[0]
                        session_id = f"{fingerprint}.{number}"
                break
            # taken elsewhere: past the ones recorded since this process looked
            recorded = self._recorded_count(fingerprint, number)
            opened[0] = max(opened[0], recorded)
        return session_id

    # -- what the workspace recorded ----------------------------------------------------------
    def _family(self, fingerprint: str) -> tuple[str, str]:
        """The bounds of the session ids an opening with ``fingerprint`` may have taken
        (``conv-<hex>``, ``conv-<hex>.N``): ``"."`` sorts just before ``"/"``."""
        return fingerprint, fingerprint + "/"

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        return self._on_store(lambda store: store.query(sql, params))

    def _claim(self, session_id: str, first_of: tuple[str, str] | None = None) -> bool | None:
        """:meth:`Store.claim_session` (None without a store, or when it cannot be written)."""
        if self.store is None:
            return None
        try:
            return self._on_store(lambda store: store.claim_session(session_id, first_of))
        except Exception:  # noqa: BLE001 - a store that cannot answer: numbered as recorded
            _store_warning("could not claim the session %s", session_id)
            return None

    def _on_store(self, call: Callable[[Any], Any]) -> Any:
        # On the connection the proxy's loop records turns with: a read or a claim on the loop
        # never waits behind a transaction of the writer thread (the main connection's lock).
        if self._reader is None:
            self._reader = self.store.loop_writer() or self.store
        if not self.reads_network:
            return call(self._reader)
        # called with the lock held: a round trip over the network (made off the loop) lets go
        # of it meanwhile, so that settle() on the loop never waits for the database
        self._lock.release()
        try:
            return call(self._reader)
        finally:
            self._lock.acquire()

    #: Turn ids a look for recorded replies reads back over (see _read_recorded_replies).
    LOOK_BACK = 256
    #: Most session ids looked up one at a time past the number known, before all are read.
    PROBES = 32
    #: Most numbers an opening tries when the workspace has each taken (claimed elsewhere).
    CLAIMS = 64

    def _recorded(self, session_id: str) -> bool:
        """Whether the workspace recorded the session ``session_id`` (False when it cannot say)."""
        if self.store is None:
            return False
        try:
            return bool(self._read("SELECT 1 AS found FROM sessions WHERE id = ?", (session_id,)))
        except Exception:  # noqa: BLE001 - a store that cannot answer: not known there
            _store_warning("could not read the recorded session %s", session_id)
            return False

    def _recorded_count(self, fingerprint: str, known: int | None = None) -> int:
        """How many openings of ``fingerprint`` the workspace recorded (the highest number among
        its sessions), so this process numbers the next one after them. ``known``: the number
        this process already knows of: the next ids are looked up one key at a time (a
        fingerprint with thousands of sessions is not read whole at each opening)."""
        if self.store is None:
            return 0
        if known is not None:
            for number in range(known + 1, known + 1 + self.PROBES):
                if not self._recorded(fingerprint if number == 1 else f"{fingerprint}.{number}"):
                    return number - 1
        try:
            rows = self._read("SELECT id FROM sessions WHERE id >= ? AND id < ?",
                              self._family(fingerprint))
        except Exception:  # noqa: BLE001 - a store that cannot answer: number from scratch
            _store_warning("could not read the recorded sessions of %s", fingerprint)
            return 0
        openings = (_opening(row["id"]) for row in rows)
        return max((number for found, number in filter(None, openings)
                    if found == fingerprint), default=0)

    def _read_recorded_replies(self, fingerprint: str) -> None:
        """Remember the latest recorded reply of each of ``fingerprint``'s latest sessions as
        awaiting its continuation (called with the lock held, where a turn continues a reply
        this process does not know of): the sessions with turns recorded since the last look
        (another process's, of the same workspace), so that a look that finds nothing new costs
        one read of turn ids."""
        if self.store is None:
            return
        # ids are taken before their turns commit (two proxies' turns may commit out of order):
        # a look reads back over the last few ids it has already passed
        since = max(0, self._looked_up.get(fingerprint, 0) - self.LOOK_BACK)
        rows: list[dict[str, Any]] = []
        newest = 0
        try:  # the sessions with turns since, newest first, a page at a time: where more than
            # a page's ran at once (a batch of alike tasks), the others' replies are read too
            for page in range(self.PAGES):
                found = self._read(
                    "SELECT id, session_id, request_messages, response, tool_calls FROM turns "
                    "WHERE id IN (SELECT MAX(id) FROM turns WHERE session_id >= ? AND "
                    f"session_id < ? AND status = 'ok' AND {TASK_TURNS_SQL} AND id > ? "
                    "GROUP BY session_id ORDER BY MAX(id) DESC "
                    "LIMIT ? OFFSET ?) ORDER BY id",
                    (*self._family(fingerprint), since, self.RECORDED_SESSIONS,
                     page * self.RECORDED_SESSIONS))
                rows = found + rows
                newest = max(newest, *(int(row["id"]) for row in found)) if found else newest
                if len(found) < self.RECORDED_SESSIONS or min(
                        int(row["id"]) for row in found) < newest - self.RECENT_IDS:
                    break  # all read, or the rest went quiet long ago (not a batch at once)
        except Exception:  # noqa: BLE001 - a store that cannot answer: the fingerprint it is
            _store_warning("could not read the recorded replies of %s", fingerprint)
            return
        from metaclaw.skills.block import strip_skill_block  # the request as the client sent it

        self._looked_up[fingerprint] = max([self._looked_up.get(fingerprint, 0),
                                            *(int(row["id"]) for row in rows)])
        self._looked_up.move_to_end(fingerprint)
        _bound(self._looked_up, self.MAX_ENTRIES)
        for row in rows:
            if (_opening(row["session_id"]) or ("",))[0] != fingerprint \
                    or not isinstance(row["request_messages"], list):
                continue
            history = hashlib.blake2b(digest_size=16)
            ask = None
            for message in strip_skill_block(row["request_messages"]):
                message = message if isinstance(message, dict) else {}
                add_message(history, message.get("role"), message.get("content"),
                            message.get("tool_calls"))
                if message.get("role") == "user":
                    ask = hashlib.blake2b(digest_size=16)
                    add_message(ask, "user", message.get("content"))
            add_message(history, "assistant", row["response"], row["tool_calls"])
            key = (fingerprint, history.hexdigest())
            if key in self._continued:  # continued here already (its turn still in flight)
                continue
            if row["session_id"] not in self._replies.get(key, ()):
                self._replies.setdefault(key, []).append(row["session_id"])
            if ask is not None:
                add_message(ask, "assistant", row["response"], row["tool_calls"])
                self._answer((fingerprint, ask.hexdigest()), row["session_id"])
        _bound(self._replies, self.MAX_ENTRIES)

    def _answer(self, key: tuple[str, str], session_id: str) -> None:
        """Remember that ``session_id`` gave a reply after an ask (``key``); one that two
        sessions gave is remembered as naming neither (``None``). Holds the lock."""
        self._answered[key] = (session_id if self._answered.get(key, session_id) == session_id
                               else None)
        self._answered.move_to_end(key)
        _bound(self._answered, self.MAX_ENTRIES)

    def settle(self, thread: Thread, replied: bool, text: Any = None,
               tool_calls: Any = None) -> None:
        """The turn of ``thread`` ended: ``replied`` (the client got the reply ``text`` /
        ``tool_calls``), or not (an error, a disconnect), when whatever it continued stays
        open for a retry."""
        with self._lock:
            if replied:
                history = thread.history.copy()
                add_message(history, "assistant", text, tool_calls)
                key = (thread.fingerprint, history.hexdigest())
                self._replies.setdefault(key, []).append(thread.session_id)
                self._replies.move_to_end(key)
                _bound(self._replies, self.MAX_ENTRIES)
                if thread.ask is not None:
                    reply = thread.ask.copy()
                    add_message(reply, "assistant", text, tool_calls)
                    self._answer((thread.fingerprint, reply.hexdigest()), thread.session_id)
            elif thread.after is not None:
                self._replies.setdefault(thread.after, []).insert(0, thread.session_id)
                _bound(self._replies, self.MAX_ENTRIES)
            elif thread.opening:
                opened = self._openings.get(thread.fingerprint)
                if opened is not None:
                    opened[1].append(thread.session_id)


#: A session id an opening took: the fingerprint (``conv-`` and 12 hex digits of a digest of the
#: first user message), and the opening's number after it.
_FINGERPRINT_ID = re.compile(r"(conv-[0-9a-f]{12})(?:\.([0-9]+))?")


def _opening(session_id: str) -> tuple[str, int] | None:
    """``(fingerprint, number)`` of the opening that took ``session_id`` (1 for the fingerprint
    itself, N for ``<fingerprint>.N``); None for an id no opening takes."""
    match = _FINGERPRINT_ID.fullmatch(session_id)
    return None if match is None else (match[1], int(match[2] or 1))


def _bound(entries: OrderedDict[Any, Any], most: int) -> bool:
    """Forget the least recently used of ``entries`` beyond ``most``; whether any was."""
    forgot = len(entries) > most
    while len(entries) > most:
        entries.popitem(last=False)
    return forgot
