"""The PRM judge: scores a recorded turn in {-1, 0, +1} with an OpenAI-compatible judge model.

What the judge model receives (:func:`build_judge_messages`): a system message with the scoring
rules and one user message with clearly delimited sections (``=== <title> ===`` lines, titles in
:data:`SECTIONS`):

- ``Task (user messages)``          every user message of the turn's conversation, numbered
- ``Tool calls and tool results``   the tool calls and tool results in the turn's messages, and the
                                    tool calls of the reply itself
- ``Reply``                         the assistant reply being judged
- ``Next user message (feedback)``  the session's next user message, when there is one

Long sections are trimmed in the middle with a visible marker ``[... 1234 chars trimmed ...]``
(budgets in :data:`DEFAULT_BUDGETS`). :func:`parse_judge_prompt` reads the sections back.

What the judge model answers: JSON ``{"score": -1|0|1, "rationale": "..."}`` (1 = helpful,
0 = unclear, -1 = unhelpful), requested with a JSON schema (:data:`JUDGE_RESPONSE_FORMAT`) when
``structured=True``, otherwise parsed from free text by :func:`parse_verdict` (a JSON object
anywhere in the text, or a line such as ``Score: -1``; a reasoning model's ``<think>`` block is
skipped; a reply giving two different scores, or 0.8 or 1/5, is unparsable, never rounded).

Voting: the ``votes`` are asked for in one request (``n`` choices: one prompt sent and billed
once), falling back by itself to one request per vote, all in parallel, where the server refuses
``n`` (HTTP 400/422 to a request it answers without ``n``) or answers fewer choices (then the
missing votes are asked for one by one); every later turn then gets a request per vote. Each request has its own timeout and retries; a
request that fails after its retries fails every vote it asked for. The score is the majority
of the valid votes; a tie is 0. Failed votes (transport errors, timeouts, error
statuses, after retries) and unparsable votes are counted in :class:`JudgeResult`, never
counted as 0. When every vote fails the turn stays unjudged and the result carries the error.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from metaclaw import buffers
from metaclaw.buffers import message_text
from metaclaw.fastloop.llm import (CallFailed, LLMClient, chat_params, check_url, reply_text,
                                   run_sync)
from metaclaw.progress import ProgressFn, notify
from metaclaw.redact import safe_url
from metaclaw.store import DB_ERRORS, IN_IDS, Store, id_list
from metaclaw.turns import TASK_TURNS_SQL

log = logging.getLogger(__name__)

SECTION_TASK = "Task (user messages)"
SECTION_TOOLS = "Tool calls and tool results"
SECTION_REPLY = "Reply"
SECTION_FEEDBACK = "Next user message (feedback)"
SECTIONS = (SECTION_TASK, SECTION_TOOLS, SECTION_REPLY, SECTION_FEEDBACK)
SECTION_END = "End"

#: Character budget of each section of the judge prompt.
DEFAULT_BUDGETS = {SECTION_TASK: 4000, SECTION_TOOLS: 6000, SECTION_REPLY: 4000,
                   SECTION_FEEDBACK: 2000}

#: JSON schema of one judge verdict.
JUDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "enum": [-1, 0, 1]},
        "rationale": {"type": "string"},
    },
    "required": ["score", "rationale"],
    "additionalProperties": False,
}

#: ``response_format`` sent when ``structured=True``.
JUDGE_RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "turn_verdict", "strict": True, "schema": JUDGE_SCHEMA},
}

JUDGE_SYSTEM_PROMPT = """\
You are a process reward model. You judge one turn of an AI assistant working for a user: did \
the assistant's reply in this turn help the user make progress on their task?

Score:
  1  = helpful: the reply (and any tool use) correctly advances or completes the task.
  0  = unclear: not enough evidence either way.
  -1 = unhelpful: wrong, unsafe, ignores the request, misuses tools, or the user's next message \
shows it failed.

The next user message, when present, is the strongest evidence: complaints, corrections or \
repeated requests mean the reply failed. Judge what the assistant actually did, including its \
tool calls and the tool results it received.

Answer with JSON only: {"score": -1 | 0 | 1, "rationale": "<one or two sentences>"}"""

JUDGE_INSTRUCTION = "Judge the assistant's reply in the turn below."

TRIM_MARKER = "[... {n} chars trimmed ...]"


# -- prompt -----------------------------------------------------------------------------------
def trim(text: str, budget: int) -> str:
    """``text`` cut in the middle to at most about ``budget`` characters, with a visible marker."""
    if budget <= 0 or len(text) <= budget:
        return text
    head = (budget * 2) // 3
    tail = budget - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n{TRIM_MARKER.format(n=cut)}\n{text[len(text) - tail:] if tail else ''}"


def _call_line(call: dict[str, Any], prefix: str) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    ident = f" [id {call.get('id')}]" if call.get("id") else ""
    return f"{prefix}{fn.get('name', '?')}({args}){ident}"


def render_sections(turn: dict[str, Any], next_user: str | None = None, *,
                    tool_entry_chars: int | None = None) -> dict[str, str]:
    """The (untrimmed) text of each judge prompt section for a turn row.

    ``turn`` needs ``request_messages`` and ``response``; ``tool_calls`` (the reply's own tool
    calls) is optional. The feedback section is present only when ``next_user`` is given.
    ``tool_entry_chars``: each tool call and result cut in its middle to about that many
    characters (its tool's name and the start of its arguments kept), for a tools section whose
    budget is smaller than one long call: cut as one text, a long call lost its name.
    """
    messages = turn.get("request_messages") or []
    users = [message_text(m.get("content")) for m in messages
             if isinstance(m, dict) and m.get("role") == "user"]
    task = "\n\n".join(f"[{i}] {text}" for i, text in enumerate(users, 1)) or "(no user message)"

    tool_lines: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                tool_lines.append(_call_line(call, "call "))
        elif m.get("role") == "tool":
            ident = f" [id {m.get('tool_call_id')}]" if m.get("tool_call_id") else ""
            tool_lines.append(f"result{ident}: {message_text(m.get('content'))}")
        elif m.get("role") == "function":  # legacy function-calling results
            tool_lines.append(f"result [{m.get('name')}]: {message_text(m.get('content'))}")
    for call in turn.get("tool_calls") or []:
        tool_lines.append(_call_line(call, "call in this reply: "))
    if tool_entry_chars is not None:
        tool_lines = [trim(line, tool_entry_chars) for line in tool_lines]
    tools = "\n".join(tool_lines) or "(no tool calls)"

    reply = turn.get("response") or ""
    if not reply.strip():
        reply = ("(no text; the reply consists of the tool calls above)"
                 if turn.get("tool_calls") else "(empty reply)")
    sections = {SECTION_TASK: task, SECTION_TOOLS: tools, SECTION_REPLY: reply}
    if next_user is not None and next_user.strip():
        sections[SECTION_FEEDBACK] = next_user
    return sections


def build_judge_messages(turn: dict[str, Any], next_user: str | None = None, *,
                         budgets: dict[str, int] | None = None) -> list[dict[str, str]]:
    """The chat messages sent to the judge model for one turn (system + one user message)."""
    limits = {**DEFAULT_BUDGETS, **(budgets or {})}
    parts = [JUDGE_INSTRUCTION, ""]
    for title, text in render_sections(turn, next_user).items():
        parts += [f"=== {title} ===", trim(text, limits.get(title, 4000)), ""]
    parts.append(f"=== {SECTION_END} ===")
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT},
            {"role": "user", "content": "\n".join(parts)}]


_SECTION_RE = re.compile(r"^=== (.+?) ===$", re.M)


def parse_judge_prompt(text: str) -> dict[str, str]:
    """Sections of a judge prompt (the user message built by :func:`build_judge_messages`).

    Returns ``{title: text}`` for the sections present (see :data:`SECTIONS`).
    """
    out: dict[str, str] = {}
    matches = [m for m in _SECTION_RE.finditer(text)
               if m.group(1) in SECTIONS or m.group(1) == SECTION_END]
    for match, following in zip(matches, matches[1:] + [None]):
        if match.group(1) == SECTION_END:
            break
        end = following.start() if following else len(text)
        out[match.group(1)] = text[match.end():end].strip("\n").rstrip()
    return out


def next_user_message(turn: dict[str, Any], later_turns: Iterable[dict[str, Any]]) -> str | None:
    """The first user message the session sent after ``turn`` (the feedback on its reply).

    ``later_turns``: the later turns of its thread (its session's turns of the same turn type:
    a stage's retry follows that stage), in order. A later turn's conversation holds
    the new user message after this turn's ones; when the client trimmed or compacted its
    history, the last user message of the later turn is used if it is new. A later turn that
    sends one user message alone (a conversation's first turn: a notebook's chat after a kernel
    restart, another notebook under the same session name) is no reaction to this turn, unless
    it still holds this turn's reply. ``None`` when there is none yet.
    """
    mine = [message_text(m.get("content")) for m in turn.get("request_messages") or []
            if isinstance(m, dict) and m.get("role") == "user"]
    reply = " ".join((turn.get("response") or "").split())
    for later in later_turns:
        messages = later.get("request_messages") or []
        theirs = [message_text(m.get("content")) for m in messages
                  if isinstance(m, dict) and m.get("role") == "user"]
        if len(theirs) > len(mine) and theirs[:len(mine)] == mine:
            return theirs[len(mine)]
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "user":
            last = message_text(messages[-1].get("content"))
            follows = len(theirs) > 1 or bool(reply) and any(
                isinstance(m, dict) and m.get("role") == "assistant"
                and " ".join(message_text(m.get("content")).split()) == reply for m in messages)
            if last not in mine and follows:
                return last
    return None


# -- reply parsing ----------------------------------------------------------------------------
def _as_score(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"score must be -1, 0 or 1, got {value!r}")
    shown = repr(value)[:40]  # a 400-digit number is not worth quoting whole
    if isinstance(value, str):
        value = value.strip()
        if not re.fullmatch(r"[+-]?\d+(\.0+)?", value):
            raise ValueError(f"score must be -1, 0 or 1, got {shown}")
    try:
        number = float(value) if isinstance(value, (int, float, str)) else None
    except OverflowError:  # an integer too large for a float
        number = None
    if number in (-1.0, 0.0, 1.0):
        return int(number)
    raise ValueError(f"score must be -1, 0 or 1, got {shown}")


#: Failed attempts at reading a JSON object (a ``{"`` that starts none) after which
#: :func:`json_objects` stops looking: each attempt may read to the end of the text, so a huge
#: degenerate reply (``{"a": {"a": ...`` repeated, never closed) would otherwise cost seconds of
#: CPU per vote; an answer has a handful of such false starts at most.
MAX_JSON_FALSE_STARTS = 100

_OBJECT_START = re.compile(r"\{\s*[\"}]")


def json_objects(text: str):
    """Every JSON object embedded in ``text`` (fenced, alone or among prose), in order: each
    object found, then the objects nested in it."""
    for value in _top_level_objects(text):
        yield from _nested_dicts(value)


def _top_level_objects(text: str):
    """The JSON objects written in ``text`` that are not inside another one, in order."""
    decoder = json.JSONDecoder()
    position, false_starts = 0, 0
    while false_starts < MAX_JSON_FALSE_STARTS:
        match = _OBJECT_START.search(text, position)
        if match is None:
            return
        try:
            value, end = decoder.raw_decode(text, match.start())
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
            false_starts += 1
            position = match.start() + 1
            continue
        # the nested objects are read from the decoded value: decoding each again from its own
        # brace would cost the square of the nesting depth
        yield value
        position = end


def _nested_dicts(value: Any, stop_at: str | None = None):
    """``value`` if it is a dict, then every dict nested in it, in the order they were written;
    with ``stop_at``, not the dicts nested in one that has that key."""
    stack = [value]
    while stack:  # a loop, not recursion: the decoder accepts nesting deeper than our stack
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            if stop_at is None or stop_at not in item:
                stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))


#: Tags around a reasoning model's thinking when a server leaves it in the reply's text.
_REASONING_OPEN = re.compile(r"<(?:think|thinking|reasoning)>", re.I)
_REASONING_CLOSE = re.compile(r"</(?:think|thinking|reasoning)>", re.I)

#: Longest rationale kept from one vote (characters; trimmed in the middle beyond).
MAX_RATIONALE_CHARS = 2000


def strip_reasoning(text: str) -> str:
    """``text`` without a reasoning model's thinking block: a draft verdict in the thinking is
    not the verdict.

    The answer is what follows the last closing tag (``</think>``; the opening tag may have been
    in the prompt, as DeepSeek-R1's chat template puts it), cut where a thinking block that
    never closed begins (the model ran out of tokens while thinking)."""
    last_close = None
    for last_close in _REASONING_CLOSE.finditer(text):
        pass
    if last_close is not None:
        text = text[last_close.end():]
    unclosed = _REASONING_OPEN.search(text)
    return text[:unclosed.start()] if unclosed else text


_SCORE_LINE = re.compile(r"^[\s>*_#-]*score[\s*_]*[:=][\s*_]*"
                         # the whole number as written, so that 0.8, 1.5, 1e-05, 1/5 or
                         # "1 out of 10" is refused rather than read as its first digit
                         r"([+-]?\d[\d.,]*(?:e[+-]?\d+)?(?:\s*(?:/|out\s+of)\s*\d+)?)(?!\w)",
                         re.I | re.M)
_RATIONALE_LINE = re.compile(r"^[\s>*_#-]*(?:rationale|reason)[\s*_]*[:=][\s*_]*(.+)$", re.I | re.M)


def _one_score(found: list[tuple[Any, str]],
               where: str) -> tuple[tuple[int, str] | None, str | None]:
    """``(verdict, problem)`` from the scores ``found`` (each as written, with its rationale):
    the verdict when they all are the same valid score; ``None`` and why when none is valid.
    Raises ``ValueError`` when they differ: a reply giving two scores has no verdict."""
    valid, problem, shown = [], None, []
    for value, rationale in found:
        try:
            valid.append((_as_score(value), rationale))
            shown.append(f"{valid[-1][0]:+d}")
        except ValueError as exc:
            problem = str(exc)
            shown.append(repr(value)[:40])
    if valid and (problem is not None or len({score for score, _ in valid}) > 1):
        raise ValueError(f"the reply gives different scores in {where} "
                         f"({', '.join(dict.fromkeys(shown))}); expected one verdict")
    return (valid[0] if valid else None), problem


def parse_verdict(text: str) -> tuple[int, str]:
    """``(score, rationale)`` from a judge reply; raises ``ValueError`` saying why it cannot.

    Accepts the JSON object (alone, fenced, or anywhere in the text) or a ``Score: N`` line
    (with an optional ``Rationale: ...`` line). A reasoning model's thinking block
    (``<think>...</think>``) is not read. A reply giving several different scores, or a score
    other than -1, 0 or 1 (0.8, 1/5), has no verdict.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the judge returned an empty reply")
    text = strip_reasoning(text)
    if not text.strip():
        raise ValueError("the judge's reply holds only its reasoning (a <think> block) and no "
                         "verdict after it; it may have run out of tokens: raise max_tokens")
    found = []
    for obj in (found_obj for value in _top_level_objects(text)
                for found_obj in _nested_dicts(value, stop_at="score")):
        if "score" in obj:  # a verdict's own nested details are not another verdict
            rationale = obj.get("rationale", obj.get("reason", ""))
            found.append((obj["score"], rationale if isinstance(rationale, str)
                          else json.dumps(rationale)))
    verdict, problem = _one_score(found, "its JSON")
    if verdict is not None:
        return verdict
    lines = [(match.group(1).rstrip(".,"), "") for match in _SCORE_LINE.finditer(text)]
    if lines:
        verdict, line_problem = _one_score(lines, "its 'Score:' lines")
        if verdict is None:
            raise ValueError(line_problem)
        rat = _RATIONALE_LINE.search(text)
        rationale = rat.group(1).strip() if rat else _SCORE_LINE.sub("", text).strip()
        return verdict[0], rationale
    raise ValueError(problem or "no score found (expected JSON {\"score\": -1|0|1, ...} "
                                "or a line 'Score: N')")


# -- results ----------------------------------------------------------------------------------
@dataclass
class JudgeResult:
    """The verdict on one turn.

    ``score``: majority of the valid votes (-1, 0, 1; tie -> 0), ``None`` when every vote failed.
    ``votes``: one ``{"score", "rationale", "error"}`` per vote (``score`` None for a failed or
    unparsable vote; ``error`` says why, starting with ``"unparsable:"`` for unparsable ones).
    ``failed`` / ``unparsable``: counts of such votes. ``error``: why there is no score.
    """

    score: int | None
    votes: list[dict[str, Any]]
    failed: int
    unparsable: int
    rationale: str
    model: str
    turn_id: int | None = None
    error: str | None = None
    #: Not judged by this call: ``"judged"`` (the turn has a verdict: see the store), or
    #: ``"leased"`` (another process is judging it); empty when this call judged it.
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return self.score is not None

    @property
    def failed_call(self) -> bool:
        """The judge was called and gave no usable verdict (a skipped turn is not a failure)."""
        return self.score is None and not self.skipped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        head = f"turn {self.turn_id}: " if self.turn_id is not None else ""
        if self.skipped:
            return f"{head}skipped ({self.error})"
        if self.score is None:
            return f"{head}unjudged ({self.error})"
        scores = ", ".join("x" if v["score"] is None else f"{v['score']:+d}" for v in self.votes)
        return (f"{head}score {self.score:+d} (votes {scores}; failed {self.failed}, "
                f"unparsable {self.unparsable}) — {self.rationale}")

    def _repr_html_(self) -> str:
        rows = []
        for i, vote in enumerate(self.votes, 1):
            shown = "" if vote.get("score") is None else f"{vote['score']:+d}"
            rows.append(f"<tr><td>{i}</td><td>{shown}</td>"
                        f"<td>{html.escape(vote.get('rationale') or '')}</td>"
                        f"<td>{html.escape(vote.get('error') or '')}</td></tr>")
        score = "unjudged" if self.score is None else f"{self.score:+d}"
        turn = "" if self.turn_id is None else f"turn {self.turn_id} · "
        error = f"<p><b>error:</b> {html.escape(self.error)}</p>" if self.error else ""
        return (f"<div><b>{turn}score {score}</b> · judge {html.escape(self.model)} · "
                f"failed {self.failed} · unparsable {self.unparsable}{error}"
                f"<p>{html.escape(self.rationale or '')}</p>"
                f"<table><tr><th>vote</th><th>score</th><th>rationale</th><th>error</th></tr>"
                f"{''.join(rows)}</table></div>")


def aggregate(votes: list[dict[str, Any]]) -> tuple[int | None, str, int, int, str | None]:
    """Majority of votes: ``(score, rationale, failed, unparsable, error)``.

    A tie between the most frequent scores gives 0. ``score`` is None when no vote is valid.
    """
    valid = [v for v in votes if v.get("score") is not None]
    unparsable = sum(1 for v in votes if v.get("score") is None
                     and str(v.get("error") or "").startswith("unparsable"))
    failed = len(votes) - len(valid) - unparsable
    if not valid:
        reasons = sorted({str(v.get("error")) for v in votes})
        return None, "", failed, unparsable, (
            f"all {len(votes)} judge votes failed: {'; '.join(reasons)}")
    counts = Counter(v["score"] for v in valid)
    top = max(counts.values())
    winners = sorted(s for s, c in counts.items() if c == top)
    if len(winners) == 1:
        score = winners[0]
        rationale = next(v["rationale"] for v in valid if v["score"] == score)
    else:
        score = 0
        rationale = "votes tied (" + ", ".join(f"{s:+d}" for s in winners) + "): " + " | ".join(
            v["rationale"] for v in valid if v["score"] in winners)
    return score, rationale, failed, unparsable, None


# -- the judge --------------------------------------------------------------------------------
def turns_to_score(store: Store, *, session: str | None = None, last: int | None = None,
                   rescore: bool = False) -> list[int]:
    """Ids of the successful task turns (main and stage turns) to judge, oldest first: the
    unjudged ones (all with ``rescore``), of one ``session`` if given, only the ``last`` N if
    given."""
    where, params = f"status = 'ok' AND {TASK_TURNS_SQL}", []
    if not rescore:
        where += " AND reward IS NULL"
    if session:
        where += " AND session_id = ?"
        params.append(session)
    ids = [row["id"] for row in store.query(f"SELECT id FROM turns WHERE {where} ORDER BY id",
                                            params)]
    return ids if last is None else ids[-last:] if last > 0 else []  # --last 0: none


#: Seconds a judge's lease on the turns it is scoring lasts (renewed every quarter of it while
#: the judge works, released when it finishes): how long the turns of a process that was
#: killed, or a notebook kernel restarted mid-score, wait before another judge takes them. A
#: renewal that waited out the store's busy timeout (30 s) and failed leaves the next one in
#: time.
JUDGE_LEASE_S = 90.0


def lease_turns(store: Store, turn_ids: Iterable[int], seconds: float = JUDGE_LEASE_S) -> set[int]:
    """Lease the unjudged turns among ``turn_ids`` to this caller for ``seconds``, in one
    transaction: those without a verdict and without another judge's live lease. Returns the
    leased ids; the others are left to whoever judged or is judging them."""
    return _lease_turns(store, turn_ids, seconds)[0]


def _lease_turns(store: Store, turn_ids: Iterable[int], seconds: float) -> tuple[set[int], float]:
    """:func:`lease_turns`, and the end it gave the leases: the caller's mark on them (see
    :func:`renew_leases`)."""
    now = time.time()
    until = now + seconds
    with store.transaction(fsync=False):
        leased = {row["id"] for row in store.query(
            f"SELECT id FROM turns WHERE id {IN_IDS} AND reward IS NULL "
            "AND (judge_lease_until IS NULL OR judge_lease_until < ?)", (id_list(turn_ids), now))}
        store.execute(f"UPDATE turns SET judge_lease_until = ? WHERE id {IN_IDS}",
                      (until, id_list(leased)))
    return leased, until


def renew_leases(store: Store, turn_ids: Iterable[int], held: float,
                 seconds: float = JUDGE_LEASE_S) -> float:
    """Extend the caller's leases among ``turn_ids`` (still unjudged) to ``seconds`` from now, so
    that a batch judged for longer than one lease is not taken up by a second judge midway.

    ``held``: the end the caller last gave its leases (from the lease, then from the previous
    renewal). A lease carries no owner, so its end is the owner's mark: a lease another process
    took once the caller's had run out (a suspended laptop, a store busy past several renewals)
    ends at another time, and is neither extended nor cut short here. A lease of the caller's
    that ran out without anyone taking it is still the caller's, and is renewed. Returns the new
    end, to pass as ``held`` next time."""
    until = time.time() + seconds
    with store.transaction(fsync=False):
        store.execute(f"UPDATE turns SET judge_lease_until = ? WHERE id {IN_IDS} "
                      "AND reward IS NULL AND judge_lease_until = ?",
                      (until, id_list(turn_ids), held))
    return until


def release_turns(store: Store, turn_ids: Iterable[int], held: float | None = None) -> None:
    """End the leases of :func:`lease_turns` on ``turn_ids``; with ``held`` (see
    :func:`renew_leases`) only those that still end then: a lease another process took meanwhile
    is left to it."""
    mine = "" if held is None else " AND judge_lease_until = ?"
    with store.transaction(fsync=False):
        store.execute(f"UPDATE turns SET judge_lease_until = NULL WHERE id {IN_IDS}{mine}",
                      (id_list(turn_ids), *(() if held is None else (held,))))


class Judge:
    """Scores turns with an OpenAI-compatible judge model by majority of ``votes`` parallel votes.

    ``base_url``: the judge endpoint (e.g. ``http://127.0.0.1:8000/v1``); ``model``: its model
    name; ``api_key``: the key (default: the environment variable named by ``api_key_env``;
    never stored or logged). ``timeout``: seconds per vote attempt; ``retries``: extra attempts
    of a failed vote (errors and timeouts; an unparsable reply is not retried). ``threshold``:
    rewards below it are failures (support set). ``structured``: request the JSON schema; when
    the server rejects it (HTTP 400/422) the judge falls back to text parsing by itself.
    ``one_request``: ask for all votes of a turn in one request (``n``; see the module's
    docstring); False sends one request per vote from the start.
    """

    #: Seconds :meth:`ajudge_turns` leases the turns it scores for (:func:`lease_turns`).
    lease_s = JUDGE_LEASE_S

    def __init__(self, base_url: str, model: str, api_key: str | None = None, votes: int = 3,
                 timeout: float = 30.0, retries: int = 1, threshold: float = 0.0,
                 structured: bool = True, *, temperature: float | None = 0.7,
                 max_tokens: int | None = 400, budgets: dict[str, int] | None = None,
                 api_key_env: str = "METACLAW_JUDGE_API_KEY", one_request: bool = True):
        check_url("base_url", base_url)
        if not isinstance(model, str) or not model.strip():
            raise ValueError("model must be the judge model's name, e.g. model='gpt-4o-mini'")
        if not isinstance(votes, int) or votes < 1:
            raise ValueError(f"votes must be an integer of at least 1, got {votes!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        self.base_url = base_url
        self.model = model
        self.votes = int(votes)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.threshold = float(threshold)
        self.structured = bool(structured)
        self.one_request = bool(one_request)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.budgets = dict(budgets or {})
        self._client = LLMClient(base_url, api_key or os.environ.get(api_key_env), self.timeout)

    def __repr__(self) -> str:
        return (f"Judge(base_url={safe_url(self.base_url)!r}, model={self.model!r}, votes={self.votes}, "
                f"timeout={self.timeout:g}, retries={self.retries}, threshold={self.threshold:g}, "
                f"structured={self.structured})")

    # votes ------------------------------------------------------------------------------
    async def _ask(self, messages: list[dict[str, str]], semaphore: asyncio.Semaphore | None,
                   choices: int = 1) -> dict[str, Any] | CallFailed:
        """One request for ``choices`` votes: the chat.completion JSON, or why it failed."""
        params = chat_params(self.model, messages, temperature=self.temperature,
                             max_tokens=self.max_tokens)
        if choices > 1:
            params["n"] = choices
        try:
            response, structured = await self._client.complete(
                params, timeout=self.timeout, retries=self.retries,
                schema=JUDGE_RESPONSE_FORMAT if self.structured else None, semaphore=semaphore)
        except CallFailed as failed:
            return failed
        if self.structured and not structured:
            self.structured = False  # text worked where the schema was refused
        return response

    @staticmethod
    def _failed(failed: CallFailed) -> dict[str, Any]:
        error = (f"HTTP 200 without a reply: {failed.detail}" if failed.kind == "no_reply"
                 else failed.detail)
        return {"score": None, "rationale": "", "error": error}

    async def _votes(self, messages: list[dict[str, str]],
                     semaphore: asyncio.Semaphore | None) -> list[dict[str, Any]]:
        """Every vote of one turn: in one request where the server gives ``n`` choices, else
        (and for the votes a server left out) one request each, in parallel."""
        votes: list[dict[str, Any]] = []
        refused = False
        if self.votes > 1 and self.one_request:
            answer = await self._ask(messages, semaphore, self.votes)
            if isinstance(answer, CallFailed):
                if answer.status not in (400, 422):
                    return [self._failed(answer) for _ in range(self.votes)]
                refused = True  # maybe ``n``: asked again without it
            else:
                choices = [c for c in answer["choices"][:self.votes] if isinstance(c, dict)]
                votes = [self._verdict({**answer, "choices": [c]}) for c in choices]
                if len(votes) < self.votes:
                    self.one_request = False  # ``n`` ignored: a request per vote from now on
        answers = await asyncio.gather(*(self._ask(messages, semaphore)
                                         for _ in range(self.votes - len(votes))))
        if refused and any(not isinstance(a, CallFailed) for a in answers):
            self.one_request = False  # answered without ``n``: a request per vote from now on
        return votes + [self._failed(a) if isinstance(a, CallFailed) else self._verdict(a)
                        for a in answers]

    def _verdict(self, response: dict[str, Any]) -> dict[str, Any]:
        """One vote from a chat.completion JSON. What the judge wrote is kept with any key of
        this judge masked (a gateway may answer "invalid key sk-..." as a reply) and trimmed."""
        text = reply_text(response)
        try:
            score, rationale = parse_verdict(text)
        except ValueError as exc:
            why = str(exc)
            finish = (response.get("choices") or [{}])[0].get("finish_reason")
            if finish == "length":  # e.g. a reasoning model that spent its tokens thinking
                why += (f" (the reply was cut at max_tokens={self.max_tokens}: raise "
                        "max_tokens)")
            return {"score": None, "rationale": self._client.mask(text[:500]),
                    "error": f"unparsable: {why}"}
        return {"score": score,
                "rationale": trim(self._client.mask(rationale), MAX_RATIONALE_CHARS),
                "error": None}

    # one turn ---------------------------------------------------------------------------
    async def ajudge(self, turn: dict[str, Any], *, next_user: str | None = None,
                     semaphore: asyncio.Semaphore | None = None) -> JudgeResult:
        """Judge one turn row (``request_messages``, ``response``, ``tool_calls``) with all votes
        in parallel. ``next_user``: the session's next user message, if known."""
        turn_id = turn.get("id")
        if turn.get("response") is None and not turn.get("tool_calls"):
            reason = (f"turn {turn_id} has no reply to judge (status {turn.get('status')!r})"
                      if turn_id is not None else "the turn has no reply to judge")
            return JudgeResult(None, [], 0, 0, "", self.model, turn_id, reason)
        unreadable = [c for c in turn.get("malformed_columns", ())
                      if c in ("request_messages", "tool_calls")]
        if unreadable:  # a verdict without the request or the calls would judge something else
            return JudgeResult(None, [], 0, 0, "", self.model, turn_id,
                               f"turn {turn_id} cannot be judged: its stored "
                               f"{' and '.join(unreadable)} are not valid JSON")
        messages = build_judge_messages(turn, next_user, budgets=self.budgets)
        votes = await self._votes(messages, semaphore)
        score, rationale, failed, unparsable, error = aggregate(votes)
        return JudgeResult(score, list(votes), failed, unparsable, rationale, self.model,
                           turn_id, error)

    def judge(self, turn: dict[str, Any], *, next_user: str | None = None) -> JudgeResult:
        """Synchronous :meth:`ajudge`."""
        return run_sync(lambda: self.ajudge(turn, next_user=next_user), self._client)

    # many turns -------------------------------------------------------------------------
    async def ajudge_turns(self, store: Store, turn_ids: Iterable[int] | None = None, *,
                           where: str | None = None, params: Iterable[Any] = (),
                           concurrency: int = 64, update_buffers: bool = True,
                           feedback: bool = True, rescore: bool = False,
                           on_progress: ProgressFn | None = None) -> list[JudgeResult]:
        """Judge many stored turns concurrently and store the verdicts on them.

        Select turns by ``turn_ids`` or an SQL condition ``where`` on ``turns`` (with
        ``params``); with neither, every unjudged successful task turn. All votes of all turns
        run concurrently, at most ``concurrency`` requests at a time. Judged turns get
        ``reward``, ``judge_model``, ``judge_votes``, ``judge_rationale`` and ``judged_at``; a turn
        whose votes all failed is left unjudged (its result carries the error). Unless
        ``rescore``, a turn is judged once however many processes ask: the turns are leased
        first (:func:`lease_turns`), and one that has a verdict already or that another
        process is judging is skipped (``JudgeResult.skipped``) without calling the judge.
        With ``update_buffers`` the support / query buffers are refreshed for the judged turns.
        ``on_progress`` (:mod:`metaclaw.progress`) hears of each turn as its verdict arrives.
        Returns one :class:`JudgeResult` per selected turn, in id order.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if turn_ids is not None:
            ids = {int(i) for i in turn_ids}
            rows = store.turns(f"id {IN_IDS}", (id_list(ids),))
            missing = ids - {r["id"] for r in rows}
            if missing:
                raise ValueError(f"no turn with id {', '.join(map(str, sorted(missing)))} in "
                                 f"{store.location}; list turns with Store.turns()")
        elif where is not None:
            rows = store.turns(where, params)
        else:
            rows = store.turns(f"{TASK_TURNS_SQL} AND status = 'ok' AND reward IS NULL")
        skipped: dict[int, JudgeResult] = {}
        held = [0.0]  # the end of this batch's leases as last written: its mark on them
        if not rescore:  # turns judged meanwhile, or being judged elsewhere, are left alone
            leased, held[0] = _lease_turns(store, [r["id"] for r in rows], self.lease_s)
            others = sorted(r["id"] for r in rows if r["id"] not in leased)
            judged = {row["id"] for row in store.query(  # read again: judged since the rows
                f"SELECT id FROM turns WHERE reward IS NOT NULL AND id {IN_IDS}",
                (id_list(others),))}
            skipped = {i: self._skipped(i, i in judged) for i in others}
            rows = [r for r in rows if r["id"] in leased]
        next_users: dict[int, str | None] = {}
        if feedback:  # the feedback on a turn is in the later turns of its thread
            for thread in sorted({(r["session_id"], r["turn_type"]) for r in rows}):
                thread_turns = store.turns("session_id = ? AND turn_type = ?", thread,
                                           order="turn_index")
                for row in rows:
                    if (row["session_id"], row["turn_type"]) != thread:
                        continue
                    later = [t for t in thread_turns if t["turn_index"] > row["turn_index"]]
                    next_users[row["id"]] = next_user_message(row, later)
        semaphore = asyncio.Semaphore(concurrency)
        ids = [r["id"] for r in rows]
        renewing = None if rescore or not rows else asyncio.ensure_future(
            self._renew_leases(store, ids, held))
        finished = [0]

        async def judge_one(row: dict[str, Any]) -> JudgeResult:
            result = await self.ajudge(row, next_user=next_users.get(row["id"]),
                                       semaphore=semaphore)
            finished[0] += 1
            verdict = "not judged" if result.score is None else f"reward {result.score:+g}"
            notify(on_progress, "judging turns", finished[0], len(rows),
                   f"turn #{row['id']}: {verdict}")
            return result

        notify(on_progress, "judging turns", 0, len(rows))
        try:
            results = await asyncio.gather(*(judge_one(row) for row in rows))
            self.store_results(store, results, update_buffers=update_buffers, rescore=rescore)
        finally:  # a turn left unjudged is free for the next judge at once
            if renewing is not None:
                # its only pause is its sleep: once cancelled it renews nothing more
                renewing.cancel()
            if not rescore:
                release_turns(store, ids, held[0])
            if renewing is not None:
                # asyncio.wait, not await: a cancellation of this batch arriving now must not
                # be taken for the renewal's own, and swallowed
                await asyncio.wait([renewing])
        return sorted([*results, *skipped.values()], key=lambda r: r.turn_id)

    async def _renew_leases(self, store: Store, turn_ids: list[int], held: list[float]) -> None:
        """Renew this batch's leases every quarter of a lease until cancelled: a batch may take
        longer than one lease (a slow judge, thousands of turns). ``held[0]``: the end the
        leases were last given, updated here."""
        while True:
            await asyncio.sleep(self.lease_s / 4)
            try:
                held[0] = renew_leases(store, turn_ids, held[0], self.lease_s)
            except DB_ERRORS as exc:  # busy past the store's timeout: the next round retries
                log.warning("could not renew the judge's leases: %s", exc)

    def _skipped(self, turn_id: int, judged: bool) -> JudgeResult:
        why = ("judged meanwhile (pass rescore=True to judge it again)" if judged else
               "another process is judging it (its lease ends within "
               f"{self.lease_s:g} s if that process stopped; rescore judges it now)")
        return JudgeResult(score=None, votes=[], failed=0, unparsable=0, rationale="",
                           model=self.model, turn_id=turn_id, error=why,
                           skipped="judged" if judged else "leased")

    def judge_turns(self, store: Store, turn_ids: Iterable[int] | None = None, *,
                    where: str | None = None, params: Iterable[Any] = (), concurrency: int = 64,
                    update_buffers: bool = True, feedback: bool = True,
                    rescore: bool = False,
                    on_progress: ProgressFn | None = None) -> list[JudgeResult]:
        """Synchronous :meth:`ajudge_turns` (usable in a notebook cell)."""
        ids = None if turn_ids is None else list(turn_ids)
        return run_sync(lambda: self.ajudge_turns(
            store, ids, where=where, params=tuple(params), concurrency=concurrency,
            update_buffers=update_buffers, feedback=feedback, rescore=rescore,
            on_progress=on_progress), self._client)

    def store_results(self, store: Store, results: Iterable[JudgeResult], *,
                      update_buffers: bool = True, rescore: bool = False) -> int:
        """Write the successful verdicts onto their turns in one commit; returns how many. A
        turn that has a verdict already (another process judged it meanwhile) keeps it unless
        ``rescore``: a turn counts once however many processes judge."""
        now = time.time()
        with store.transaction():
            ids = id_list(r.turn_id for r in results if r.ok and r.turn_id is not None)
            unjudged = None if rescore else {row["id"] for row in store.query(
                f"SELECT id FROM turns WHERE reward IS NULL AND id {IN_IDS}", (ids,))}
            judged = [r for r in results if r.ok and r.turn_id is not None
                      and (unjudged is None or r.turn_id in unjudged)]
            for result in judged:
                store.update_turn(result.turn_id, reward=float(result.score),
                                  judge_model=result.model, judge_votes=result.votes,
                                  judge_rationale=result.rationale, judged_at=now)
        if update_buffers and judged:
            buffers.refresh(store, [r.turn_id for r in judged])
        return len(judged)

    async def aclose(self) -> None:
        """Close the HTTP client bound to the running event loop."""
        await self._client.aclose()
