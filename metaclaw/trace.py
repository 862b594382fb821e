"""The trace of one session: every turn as the upstream saw it, for debugging failures.

    trace = Trace(store, "session-7")
    trace.index()            # one small row per turn (polars), cheap even for long sessions
    trace.turn(1234)         # one turn in full: messages with the injected skill block split out,
                             # retrieval query and scores, tool calls and results, the reply,
                             # judge votes with reasons, human labels, the generation written
                             # for it and the turns served after that generation
    trace.votes_frame()      # every judge vote of the session (polars)
    trace.failures()         # ids of the failed turns

Lazy by design: :meth:`Trace.index` reads only scalar columns plus short previews computed inside
SQLite (``json_extract`` / ``substr``), never the recorded conversations, whose total size grows
with the square of a session's length; :meth:`Trace.turn` decodes one turn when it is looked at.

A turn *failed* when a person labelled it ``fail``, or, without a label, when the judge scored it
below the threshold, or when the request itself did not succeed (``status != 'ok'``).

Retrieval columns: ``retrieval_query`` (text) and ``retrieval_scores`` (JSON list of ``{"name",
"score"}``, the injected skills', then the nearest miss, marked ``"injected": false`` with the
floor it was ``"below"``) are read when the store has them; otherwise the scores fall back to
the injected skill names without scores.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from metaclaw import buffers
from metaclaw.buffers import message_text
from metaclaw.skills.asks import INSTRUCTION_ROLES
from metaclaw.store import Store
from metaclaw.turns import judge_verdict

#: Length of the previews in :meth:`Trace.index`.
PREVIEW_CHARS = 160


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def split_skill_block(text: str) -> tuple[str, str | None]:
    """``(prompt, skill_block)``: a system prompt cut where the injected skill block begins."""
    from metaclaw.skills.block import BLOCK_HEADER

    if not isinstance(text, str) or BLOCK_HEADER not in text:
        return text, None
    at = text.index(BLOCK_HEADER)
    return text[:at].rstrip(), text[at:]


def sessions(store: Store, limit: int = 500, threshold: float = 0.0) -> list[dict[str, Any]]:
    """The most recent sessions with a turn: ``[{id, turns, failures, updated_at}]``, newest
    first; a failure as :class:`Trace` counts one (a reward below the judge's ``threshold``, a
    human label ``fail``, a request that did not succeed)."""
    return store.query(
        "SELECT s.id, s.updated_at, COUNT(t.id) AS turns, "
        "COALESCE(SUM(CASE WHEN t.human_label = 'fail' OR (COALESCE(t.human_label, '') NOT IN "
        "('pass', 'fail') AND t.reward < ?) OR t.status != 'ok' THEN 1 ELSE 0 END), 0) "
        # the latest sessions are picked first and only their turns are read: counting every
        # session's turns read every turn of the workspace (the verdict columns lie past the
        # conversation) at each open and refresh of a trace
        # (a session with no turn yet, claimed by a conversation's first turn still in flight,
        # is not listed)
        "AS failures FROM (SELECT id, updated_at FROM sessions WHERE EXISTS (SELECT 1 FROM "
        "turns WHERE turns.session_id = sessions.id) ORDER BY updated_at DESC "
        "LIMIT ?) s LEFT JOIN turns t ON t.session_id = s.id GROUP BY s.id, s.updated_at "
        "ORDER BY s.updated_at DESC", (float(threshold), int(limit)))


def _index_sql(store: Store, guarded: bool = False) -> str:
    """The query of :meth:`Trace.rows`; ``guarded``: JSON is looked into only where it is valid
    (anything else shows as NULL), at the cost of validating every value first."""
    role = store.json_text("request_messages", -1, "role", guarded=guarded)
    text = (f"substr({store.json_text('request_messages', -1, 'content', guarded=guarded)}, "
            f"1, {PREVIEW_CHARS})")
    return ("SELECT id, turn_index, turn_type, status, created_at, model, skill_generation, "
            "policy_version, reward, human_label, latency_ms, finish_reason, "
            f"{store.json_length('request_messages', guarded=guarded)} AS messages, "
            f"COALESCE({store.json_length('tool_calls', guarded=guarded)}, 0) AS tool_calls, "
            f"{role} AS last_role, {text} AS last_text, "
            f"substr(response, 1, {PREVIEW_CHARS}) AS reply "
            "FROM turns WHERE session_id = ? ORDER BY turn_index")


class Trace:
    """One session's turns, loaded lazily. ``session_id`` default: the most recent session.
    ``threshold``: the judge's failure threshold."""

    def __init__(self, store: Store, session_id: str | None = None, *, threshold: float = 0.0):
        self.store = store
        self.threshold = float(threshold)
        if session_id is None:
            recent = sessions(store, 1)
            if not recent:
                raise LookupError("no session recorded yet; send a turn through the proxy first")
            session_id = recent[0]["id"]
        if store.session(session_id) is None:
            raise LookupError(f"no session {session_id!r} in the store; list them with "
                              "metaclaw.trace.sessions(store)")
        self.session_id = session_id
        columns = set(store.declared_types("turns"))
        self._has_retrieval = {"retrieval_query", "retrieval_scores"} <= columns
        self._index: list[dict[str, Any]] | None = None

    # -- the index -----------------------------------------------------------------------
    def rows(self, refresh: bool = False) -> list[dict[str, Any]]:
        """One small dict per turn, oldest first (cached; ``refresh`` re-reads)."""
        if self._index is None or refresh:
            try:
                rows = self.store.query(_index_sql(self.store), (self.session_id,))
            except sqlite3.OperationalError as exc:
                if "malformed JSON" not in str(exc):
                    raise
                # one corrupt or foreign-written row makes SQLite's JSON functions fail the
                # whole query: read again looking only into valid JSON (slower: every value is
                # validated first), so that such a row shows NULL instead
                rows = self.store.query(_index_sql(self.store, guarded=True), (self.session_id,))
            for row in rows:
                row["failed"] = self.is_failure(row)
                row["judge"] = self._judge_verdict(row.get("reward"))
            self._index = rows
        return self._index

    def _judge_verdict(self, reward: Any) -> str | None:
        return judge_verdict(reward, self.threshold)

    def is_failure(self, row: dict[str, Any]) -> bool:
        if row.get("status") != "ok":
            return True
        return buffers.is_failure(row, self.threshold)

    def index(self):
        """The turns as a ``polars.DataFrame`` (one row per turn, previews only)."""
        import polars as pl

        schema = {"id": pl.Int64, "turn_index": pl.Int64, "turn_type": pl.Utf8,
                  "status": pl.Utf8, "created_at": pl.Float64, "model": pl.Utf8,
                  "skill_generation": pl.Int64, "policy_version": pl.Int64,
                  "reward": pl.Float64, "judge": pl.Utf8, "human_label": pl.Utf8,
                  "failed": pl.Boolean, "messages": pl.Int64, "tool_calls": pl.Int64,
                  "latency_ms": pl.Float64, "finish_reason": pl.Utf8, "last_role": pl.Utf8,
                  "last_text": pl.Utf8, "reply": pl.Utf8}
        rows = self.rows()
        return pl.DataFrame({k: [r.get(k) for r in rows] for k in schema}, schema=schema)

    frame = index

    def ids(self) -> list[int]:
        return [int(r["id"]) for r in self.rows()]

    def failures(self) -> list[int]:
        return [int(r["id"]) for r in self.rows() if r["failed"]]

    def __len__(self) -> int:
        return len(self.rows())

    # -- one turn in full -------------------------------------------------------------------
    def turn(self, turn_id: int) -> dict[str, Any]:
        """One turn of this session in full (see the module docstring); raises ``LookupError``
        for a turn of another session or none."""
        turn = self.store.turn(int(turn_id))
        if turn is None or turn["session_id"] != self.session_id:
            raise LookupError(f"turn #{turn_id} is not in session {self.session_id!r}")
        from metaclaw.fastloop import labels

        messages = []
        results: dict[str, str] = {}
        for message in turn.get("request_messages") or []:
            if not isinstance(message, dict):
                continue
            text = message_text(message.get("content"))
            entry: dict[str, Any] = {"role": message.get("role"), "text": text}
            if message.get("role") in INSTRUCTION_ROLES:
                entry["text"], entry["skill_block"] = split_skill_block(text)
            if message.get("tool_calls"):
                entry["tool_calls"] = [_call(c) for c in message["tool_calls"]]
            if message.get("role") == "tool":
                entry["tool_call_id"] = message.get("tool_call_id")
                results[str(message.get("tool_call_id"))] = text
            if message.get("name"):
                entry["name"] = message["name"]
            messages.append(entry)
        for entry in messages:  # each call beside its result, when the result came back
            for call in entry.get("tool_calls", []):
                call["result"] = results.get(str(call.get("id")))
        votes = [{**vote, "rationale": vote["rationale"] or ""}
                 for vote in _votes(turn.get("judge_votes"))]
        injected = list(turn.get("injected_skills") or [])
        scores = _maybe_json(turn.get("retrieval_scores")) if self._has_retrieval else None
        if not isinstance(scores, list):
            scores = [{"name": name, "score": None} for name in injected]
        written = self.written_for(int(turn["id"]))
        return {
            "id": turn["id"], "session_id": turn["session_id"],
            "turn_index": turn["turn_index"], "turn_type": turn.get("turn_type"),
            "status": turn.get("status"), "error": turn.get("error"),
            "http_status": turn.get("http_status"), "created_at": turn.get("created_at"),
            "model": turn.get("model"), "latency_ms": turn.get("latency_ms"),
            "skill_generation": turn.get("skill_generation"),
            "policy_version": turn.get("policy_version"),
            "messages": messages, "response": turn.get("response") or "",
            "tool_calls": [_call(c) for c in (turn.get("tool_calls") or [])],
            "finish_reason": turn.get("finish_reason"), "usage": turn.get("usage"),
            "injected_skills": injected,
            "retrieval": {"query": turn.get("retrieval_query") if self._has_retrieval else None,
                          "scores": scores},
            "reward": turn.get("reward"), "judge": self._judge_verdict(turn.get("reward")),
            "judge_model": turn.get("judge_model"), "judge_votes": votes,
            "judge_rationale": turn.get("judge_rationale") or "",
            "human_label": turn.get("human_label"),
            "labels": labels.history(self.store, int(turn["id"])),
            "failed": self.is_failure(turn),
            "buffer": [turn.get("buffer_set"), turn.get("buffer_state")],
            "written_for": written,
            "after": self.after(written[0]["generation"]) if written else [],
            # columns whose stored JSON could not be read (shown empty above)
            "malformed_columns": turn.get("malformed_columns", []),
        }

    def written_for(self, turn_id: int) -> list[dict[str, Any]]:
        """The skill generations whose changes cite this turn as evidence, with the skill each
        wrote (``[{generation, kind, reason, op, skill_name, skill_markdown}]``), plus held
        proposals citing it (``generation`` None, ``proposal_id`` set)."""
        rows = self.store.query(
            "SELECT e.generation, e.op, e.skill_name, e.reason, g.kind, g.snapshot "
            "FROM skill_events e JOIN skill_generations g ON g.generation = e.generation, "
            f"{self.store.json_values('e.evidence', 'j', 'int')} WHERE j.value = ? "
            "ORDER BY e.generation, e.id",
            (int(turn_id),))
        out = []
        for row in rows:
            skill = (row.get("snapshot") or {}).get(row["skill_name"])
            markdown = ""
            if skill:
                from metaclaw.skills.library import Skill

                markdown = Skill.from_dict(skill).to_markdown()
            out.append({"generation": row["generation"], "kind": row["kind"], "op": row["op"],
                        "skill_name": row["skill_name"], "reason": row["reason"],
                        "skill_markdown": markdown, "proposal_id": None})
        for row in self.store.query(
                "SELECT p.id, p.status, p.reason FROM proposals p, "
                f"{self.store.json_values('p.support_ids', 'j', 'int')} "
                "WHERE j.value = ? AND p.status != 'promoted' ORDER BY p.id", (int(turn_id),)):
            out.append({"generation": None, "kind": f"proposal ({row['status']})", "op": "",
                        "skill_name": "", "reason": row["reason"], "skill_markdown": "",
                        "proposal_id": row["id"]})
        return [o for o in out if o["generation"] is not None] + \
            [o for o in out if o["generation"] is None]

    def after(self, generation: int | None, limit: int = 50) -> list[dict[str, Any]]:
        """The first turns of this session served with ``generation`` or later
        (``[{id, turn_index, skill_generation, failed}]``)."""
        if generation is None:
            return []
        return [{"id": r["id"], "turn_index": r["turn_index"],
                 "skill_generation": r["skill_generation"], "failed": r["failed"]}
                for r in self.rows() if (r.get("skill_generation") or 0) >= generation][:limit]

    # -- frames -----------------------------------------------------------------------------
    def votes_frame(self):
        """Every judge vote of the session: turn_id, vote, score, rationale, error (polars)."""
        import polars as pl

        rows = self.store.query("SELECT id, judge_votes FROM turns WHERE session_id = ? AND "
                                "judge_votes IS NOT NULL ORDER BY turn_index", (self.session_id,))
        data: dict[str, list[Any]] = {"turn_id": [], "vote": [], "score": [], "rationale": [],
                                      "error": []}
        for row in rows:
            for i, vote in enumerate(_votes(row["judge_votes"])):
                data["turn_id"].append(row["id"])
                data["vote"].append(i)
                for key in ("score", "rationale", "error"):
                    data[key].append(vote[key])
        return pl.DataFrame(data, schema={"turn_id": pl.Int64, "vote": pl.Int64,
                                          "score": pl.Int64, "rationale": pl.Utf8,
                                          "error": pl.Utf8})

    def messages_frame(self, turn_id: int):
        """One turn's messages as the upstream saw them: index, role, text, skill_block."""
        import polars as pl

        detail = self.turn(turn_id)
        return pl.DataFrame(
            [{"index": i, "role": m["role"], "text": m["text"],
              "skill_block": m.get("skill_block")} for i, m in enumerate(detail["messages"])],
            schema={"index": pl.Int64, "role": pl.Utf8, "text": pl.Utf8,
                    "skill_block": pl.Utf8})

    def __repr__(self) -> str:
        rows = self.rows()
        return (f"Trace(session {self.session_id!r}: {len(rows)} turns, "
                f"{sum(1 for r in rows if r['failed'])} failed)")


def _votes(stored: Any) -> list[dict[str, Any]]:
    """A turn's stored judge votes as ``{"score", "rationale", "error"}`` dicts; a vote written by
    another program (not an object, a score that is not -1, 0 or 1, a rationale that is not text)
    shows its unreadable parts as None, where one such vote would otherwise stop the session's
    vote table from opening."""
    votes = []
    for vote in stored if isinstance(stored, list) else []:
        if not isinstance(vote, dict):
            continue
        score = vote.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, float)) \
                or score not in (-1, 0, 1):
            score = None
        votes.append({
            "score": None if score is None else int(score),
            **{key: vote.get(key) if isinstance(vote.get(key), str) else None
               for key in ("rationale", "error")}})
    return votes


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        return {"id": None, "name": "?", "arguments": str(call)}
    function = call.get("function") or {}
    return {"id": call.get("id"), "name": function.get("name") or "?",
            "arguments": function.get("arguments") or ""}
