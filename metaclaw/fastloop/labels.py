"""Human labels: a person's pass / fail verdict on a turn, with a note and a corrected answer.

    from metaclaw.fastloop import labels
    labels.label(store, turn_id, "fail", note="wrong unit", corrected="8.05 km")
    labels.frame(store)                    # the latest label of every labelled turn
    labels.agreement(store)                # judge vs human, per session and overall
    labels.export_jsonl(store, path, turn_ids=..., shape="chat" | "eval")
    labels.export_parquet(store, path, turn_ids=...)

Every label is a new row of ``labels`` (the history stays: who said what, when); the latest
verdict is also written to ``turns.human_label``, where the buffer rules read it
(:func:`metaclaw.buffers.is_failure`): a human label takes precedence over the judge when the
support set is built, so a turn the judge passed but a person failed feeds the evolver, and a
false alarm of the judge does not.

Agreement: a judged turn's judge verdict is ``fail`` below the threshold, ``pass`` above it and
``unclear`` at it (:func:`metaclaw.turns.judge_verdict`); over the turns the judge gave a pass or
a fail, it agrees with the human when both say the same (an unclear turn is counted apart, as
``judge_unclear``: the judge said neither). Cohen's kappa corrects the raw rate for chance.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import time
from pathlib import Path
from typing import Any, Iterable

from metaclaw import buffers
from metaclaw.jsonlib import LONE_SURROGATE as _SURROGATE, jsonl_line
from metaclaw.skills.library import default_author
from metaclaw.store import IN_IDS, Store, id_list
from metaclaw.turns import judge_verdict

log = logging.getLogger(__name__)

VERDICTS = ("pass", "fail")


class LabelError(ValueError):
    """A label that cannot be stored (unknown turn, unknown verdict)."""


def normalise_verdict(verdict: Any) -> str:
    """``"pass"`` / ``"fail"`` from a verdict given as text, a bool or a score (+1 / -1)."""
    if isinstance(verdict, bool):
        return "pass" if verdict else "fail"
    if isinstance(verdict, (int, float)):
        if verdict > 0:
            return "pass"
        if verdict < 0:
            return "fail"
    if isinstance(verdict, str) and verdict.strip().lower() in VERDICTS:
        return verdict.strip().lower()
    if isinstance(verdict, str) and verdict.strip().lower() in ("good", "ok", "+", "+1"):
        return "pass"
    if isinstance(verdict, str) and verdict.strip().lower() in ("bad", "-", "-1"):
        return "fail"
    raise LabelError(f"a label's verdict is 'pass' or 'fail' (or True / False, +1 / -1), "
                     f"got {verdict!r}")


def _turn_id(turn_id: Any) -> int:
    """A turn id given as an int or a string of digits (``True`` or ``1.9`` would silently
    label turn 1)."""
    value = None
    if isinstance(turn_id, str) and turn_id.strip().isdecimal():
        value = int(turn_id)
    elif not isinstance(turn_id, bool):
        try:
            value = operator.index(turn_id)  # int, numpy and other integer types
        except TypeError:
            value = None
    if value is None or not 0 < value < 2 ** 63:
        raise LabelError(f"a turn id is a positive whole number (see %metaclaw turns), "
                         f"got {turn_id!r}")
    return value


def label(store: Store, turn_id: int, verdict: Any, *, note: str = "",
          corrected: str | None = None, author: str | None = None) -> dict[str, Any]:
    """Store a human label for a turn and re-classify the turn in the buffers.

    ``verdict``: pass / fail; ``note``: free text; ``corrected``: the answer the turn should
    have given (used by the exports); ``author``: who labels (default :func:`default_author`).
    Returns the label row, with the turn's place in the buffers (:func:`reach` says what the
    label can still change).
    """
    value = normalise_verdict(verdict)
    if not isinstance(note, str):
        raise LabelError(f"note must be text, got {type(note).__name__}")
    if corrected is not None and not isinstance(corrected, str):
        raise LabelError(f"corrected must be text (the right answer), got "
                         f"{type(corrected).__name__}")
    if author is not None and not isinstance(author, str):
        raise LabelError(f"author must be text (who labels), got {type(author).__name__}")
    for what, text in (("note", note), ("corrected", corrected), ("author", author)):
        # a lone surrogate (half an emoji, from a JSON escape) cannot be stored in SQLite:
        # refused here with its field, not as a UnicodeEncodeError from the store
        if text and _SURROGATE.search(text):
            raise LabelError(f"{what} holds a lone surrogate (half of an emoji?), which is not "
                             "valid Unicode; remove it or write the whole character")
    turn_id = _turn_id(turn_id)
    who = (author or default_author()).strip() or "unknown"
    with store.transaction():
        if store.turn(turn_id) is None:
            raise LabelError(f"turn #{turn_id} is not in the store; label a recorded turn")
        row_id = store._insert("labels", {
            "turn_id": turn_id, "verdict": value, "note": note,
            "corrected": corrected if corrected and corrected.strip() else None,
            "author": who, "created_at": time.time()})
        store.update_turn(turn_id, human_label=value)
        buffers.refresh(store, [turn_id])
    return store.query("SELECT l.*, t.buffer_set, t.buffer_state, t.skill_generation FROM "
                       "labels l JOIN turns t ON t.id = l.turn_id WHERE l.id = ?", (row_id,))[0]


def reach(row: dict[str, Any]) -> str:
    """What a label (a row :func:`label` returned) can still change, where that is less than
    a person would expect: a turn out of the live buffers no longer feeds the evolver (``""``
    where it does, or where the label is a pass)."""
    state, place = row.get("buffer_state"), row.get("buffer_set")
    if row.get("verdict") != "fail" or state == buffers.LIVE:
        return ""
    if place is None:
        return " (a turn outside the buffers: the label is kept for the exports and the " \
               "agreement, and feeds no evolution)"
    why = {buffers.PURGED: f"its generation {row.get('skill_generation')} was replaced",
           buffers.CONSUMED: "an evolution already learned from it"}.get(state, f"it is {state}")
    return (f" ({state}: {why}; the label is kept for the exports and the agreement, and "
            "feeds no evolution)")


def history(store: Store, turn_id: int) -> list[dict[str, Any]]:
    """Every label of one turn, oldest first."""
    return store.query("SELECT * FROM labels WHERE turn_id = ? ORDER BY id", (int(turn_id),))


def latest(store: Store, turn_ids: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
    """The latest label of each labelled turn (of ``turn_ids``, default all): ``{turn_id: row}``."""
    sql = ("SELECT l.* FROM labels l JOIN (SELECT turn_id, MAX(id) AS id FROM labels "
           "GROUP BY turn_id) m ON l.id = m.id")
    rows = store.query(sql + " ORDER BY l.turn_id")
    if turn_ids is None:
        return {int(r["turn_id"]): r for r in rows}
    wanted = {int(i) for i in turn_ids}
    return {int(r["turn_id"]): r for r in rows if int(r["turn_id"]) in wanted}


def frame(store: Store, *, session: str | None = None, threshold: float = 0.0):
    """Labelled turns beside the judge's verdict, as a ``polars.DataFrame``.

    Columns: turn_id, session_id, verdict (human), note, corrected, author, labelled_at,
    reward, judge_verdict (pass / fail / unclear, null when unjudged), agree (null when
    unjudged or unclear: the judge said neither).
    """
    import polars as pl

    where, params = "", []
    if session is not None:
        where, params = "WHERE t.session_id = ?", [session]
    rows = store.query(
        "SELECT l.turn_id, t.session_id, l.verdict, l.note, l.corrected, l.author, "
        "l.created_at AS labelled_at, t.reward FROM labels l "
        "JOIN (SELECT turn_id, MAX(id) AS id FROM labels GROUP BY turn_id) m ON l.id = m.id "
        f"JOIN turns t ON t.id = l.turn_id {where} ORDER BY l.turn_id", params)
    for row in rows:
        row["judge_verdict"] = judge_verdict(row["reward"], threshold)
        row["agree"] = None if row["judge_verdict"] in (None, "unclear") else \
            row["judge_verdict"] == row["verdict"]
    schema = {"turn_id": pl.Int64, "session_id": pl.Utf8, "verdict": pl.Utf8, "note": pl.Utf8,
              "corrected": pl.Utf8, "author": pl.Utf8, "labelled_at": pl.Float64,
              "reward": pl.Float64, "judge_verdict": pl.Utf8, "agree": pl.Boolean}
    return pl.DataFrame({k: [r[k] for r in rows] for k in schema}, schema=schema).with_columns(
        pl.from_epoch((pl.col("labelled_at") * 1000).cast(pl.Int64), time_unit="ms"))


def _kappa(pairs: list[tuple[str, str]]) -> float | None:
    """Cohen's kappa of (judge, human) verdict pairs; None when undefined."""
    n = len(pairs)
    if not n:
        return None
    observed = sum(1 for a, b in pairs if a == b) / n
    expected = sum((sum(1 for a, _ in pairs if a == v) / n) * (sum(1 for _, b in pairs if b == v) / n)
                   for v in VERDICTS)
    if expected >= 1.0:
        return None
    return (observed - expected) / (1.0 - expected)


class Agreement:
    """Judge–human agreement: :attr:`table` (per session, polars) and :attr:`overall`.

    A row per session: ``session_id``, ``labelled`` (labelled turns the judge passed or
    failed), ``agree``, ``rate``, ``kappa``, ``judge_fail`` / ``human_fail`` (how often each
    said fail), ``judge_unclear`` (labelled turns the judge could not tell, left out of the
    rate).
    """

    def __init__(self, table: Any, overall: dict[str, Any]):
        self.table = table
        self.overall = overall

    def chart(self):
        """An altair bar chart: agreement rate per session, the overall rate as a rule."""
        import altair as alt

        values = self.table.to_dicts()
        bars = alt.Chart(alt.Data(values=values)).mark_bar().encode(
            x=alt.X("session_id:N", title="session", sort=None),
            y=alt.Y("rate:Q", title="judge–human agreement", scale=alt.Scale(domain=[0, 1])),
            tooltip=["session_id:N", "labelled:Q", "agree:Q", alt.Tooltip("rate:Q", format=".2f"),
                     alt.Tooltip("kappa:Q", format=".2f")])
        rate = self.overall.get("rate")
        layers = [bars]
        if rate is not None:
            layers.append(alt.Chart(alt.Data(values=[{"rate": rate}])).mark_rule(
                color="#cf222e", strokeDash=[4, 3]).encode(y="rate:Q"))
        n = self.overall.get("labelled", 0)
        title = (f"Judge–human agreement: {rate:.0%} overall over {n} turns" if rate is not None
                 else "Judge–human agreement: no judged and labelled turn yet")
        return alt.layer(*layers).properties(width=360, height=180, title=title)

    def __repr__(self) -> str:
        o = self.overall
        unclear = o.get("judge_unclear") or 0
        apart = f"; {unclear} the judge could not tell, left out" if unclear else ""
        if not o.get("labelled"):
            return f"Agreement(no judged and labelled turn yet{apart})"
        kappa = "n/a" if o["kappa"] is None else f"{o['kappa']:.2f}"
        sessions = self.table.height
        return (f"Agreement({o['agree']}/{o['labelled']} = {o['rate']:.0%} overall, "
                f"kappa {kappa}, {sessions} session{'' if sessions == 1 else 's'}{apart})")

    def _repr_html_(self) -> str:
        import html

        rate = lambda r: "n/a" if r["rate"] is None else format(r["rate"], ".0%")  # noqa: E731
        rows = "".join(
            f"<tr><td>{html.escape(str(r['session_id']))}</td><td>{r['labelled']}</td>"
            f"<td>{r['agree']}</td><td>{rate(r)}</td>"
            f"<td>{'n/a' if r['kappa'] is None else format(r['kappa'], '.2f')}</td></tr>"
            for r in self.table.to_dicts())
        svg = ""
        try:
            import vl_convert

            svg = vl_convert.vegalite_to_svg(self.chart().to_dict())
        except Exception:  # the table tells the same story
            svg = ""
        return (f"<div><b>{html.escape(repr(self))}</b>{svg}<table><tr><th>session</th>"
                "<th>labelled</th><th>agree</th><th>rate</th><th>kappa</th></tr>"
                f"{rows}</table></div>")


def agreement(store: Store, *, threshold: float = 0.0) -> Agreement:
    """Judge–human agreement over the turns that are both judged and labelled."""
    import polars as pl

    judged = frame(store, threshold=threshold).filter(pl.col("judge_verdict").is_not_null())
    unclear = pl.col("judge_verdict") == "unclear"
    rows = []
    for (session,), group in judged.group_by(["session_id"], maintain_order=True):
        said = group.filter(~unclear)
        pairs = list(zip(said["judge_verdict"].to_list(), said["verdict"].to_list()))
        agree = sum(1 for a, b in pairs if a == b)
        rows.append({"session_id": session, "labelled": len(pairs), "agree": agree,
                     "rate": agree / len(pairs) if pairs else None, "kappa": _kappa(pairs),
                     "judge_fail": sum(1 for a, _ in pairs if a == "fail"),
                     "human_fail": sum(1 for _, b in pairs if b == "fail"),
                     "judge_unclear": len(group) - len(said)})
    schema = {"session_id": pl.Utf8, "labelled": pl.Int64, "agree": pl.Int64,
              "rate": pl.Float64, "kappa": pl.Float64, "judge_fail": pl.Int64,
              "human_fail": pl.Int64, "judge_unclear": pl.Int64}
    table = pl.DataFrame({k: [r[k] for r in rows] for k in schema}, schema=schema)
    said = judged.filter(~unclear)
    pairs = list(zip(said["judge_verdict"].to_list(), said["verdict"].to_list()))
    agree = sum(1 for a, b in pairs if a == b)
    overall = {"labelled": len(pairs), "agree": agree,
               "rate": agree / len(pairs) if pairs else None, "kappa": _kappa(pairs),
               "judge_unclear": len(judged) - len(said)}
    return Agreement(table, overall)


# -- export -----------------------------------------------------------------------------------
def _selected(store: Store, turn_ids: Iterable[int] | None, session: str | None,
              labelled_only: bool) -> list[dict[str, Any]]:
    if turn_ids is not None:
        rows = store.turns(f"id {IN_IDS}", (id_list(turn_ids),))
    elif session is not None:
        rows = store.turns("session_id = ?", (session,))
    else:
        rows = store.turns("human_label IS NOT NULL" if labelled_only else "1=1")
    if labelled_only:
        rows = [r for r in rows if r.get("human_label")]
    return rows


def _final_message(turn: dict[str, Any], corrected: str | None) -> dict[str, Any]:
    if corrected:
        return {"role": "assistant", "content": corrected}
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("response") or ""}
    if turn.get("tool_calls"):
        message["tool_calls"] = turn["tool_calls"]
    return message


#: Columns a record cannot be built without (the prompt, the calls, the offered tools).
_UNREADABLE = {"request_messages", "tool_calls", "request_params"}


def export_records(store: Store, *, turn_ids: Iterable[int] | None = None,
                   session: str | None = None, shape: str = "chat", labelled_only: bool = False,
                   keep_skills: bool = False, threshold: float = 0.0) -> list[dict[str, Any]]:
    """The selected turns as JSON-ready records.

    ``shape="chat"``: the OpenAI fine-tuning format, ``{"messages": [..., assistant]}`` (plus
    ``"tools"`` when the turn offered tools); only turns fit to learn from are kept: labelled
    pass, or with a corrected answer (which replaces the reply). ``shape="eval"``: an OpenAI
    evals sample per turn, ``{"input": messages, "ideal": ..., "metadata": {turn_id,
    session_id, reply, tool_calls, human verdict, note, author, judge reward and verdict, skill
    generation, policy version}}``: ``ideal``, the reference answer graders compare with, is the
    corrected answer, else the reply where it passed (a person's pass, else the judge's without a
    person's fail; a reply of tool calls is the calls as JSON text), else empty (a failed or
    unclear reply is no reference; it stays in ``metadata.reply``). ``keep_skills``: keep the
    injected skill block in the system prompt (default: stripped, the prompt as the agent wrote
    it).
    """
    from metaclaw.skills.block import strip_skill_block

    if shape not in ("chat", "eval"):
        raise ValueError(f"shape must be 'chat' (fine-tuning) or 'eval', got {shape!r}")
    rows = _selected(store, turn_ids, session, labelled_only)
    marks = latest(store, [r["id"] for r in rows])
    out = []
    for turn in rows:
        mark = marks.get(int(turn["id"]))
        unreadable = _UNREADABLE & set(turn.get("malformed_columns", ()))
        if unreadable:  # a record without its prompt would teach the reply to no question
            log.warning("turn %s is not exported: its stored %s are not valid JSON", turn["id"],
                        " and ".join(sorted(unreadable)))
            continue
        messages = turn.get("request_messages") or []
        if not all(isinstance(m, dict) for m in messages):
            # written by another program: a fine-tuning file holding them is refused whole
            log.warning("turn %s is not exported: its stored request_messages hold entries "
                        "that are not messages", turn["id"])
            continue
        if not keep_skills:
            messages = strip_skill_block(messages)
        corrected = mark.get("corrected") if mark else None
        if shape == "chat":
            if not (corrected or (mark and mark["verdict"] == "pass")):
                continue
            record: dict[str, Any] = {"messages": [*messages, _final_message(turn, corrected)]}
            tools = (turn.get("request_params") or {}).get("tools")
            if tools:
                record["tools"] = tools
        else:
            judged = judge_verdict(turn.get("reward"), threshold)
            passed = mark["verdict"] == "pass" if mark else judged == "pass"
            calls = turn.get("tool_calls") or []
            # a reply of tool calls is those calls (as JSON text: an evals sample's answer is text)
            reply = turn.get("response") or (json.dumps(calls, ensure_ascii=False)
                                             if calls else "")
            record = {"input": messages,
                      "ideal": corrected if corrected else reply if passed else "",
                      "metadata": {
                          "turn_id": turn["id"], "session_id": turn["session_id"],
                          "reply": reply, "tool_calls": calls,
                          "human_verdict": mark["verdict"] if mark else None,
                          "note": mark["note"] if mark else None,
                          "author": mark["author"] if mark else None,
                          "judge_reward": turn.get("reward"),
                          "judge_verdict": judged,
                          "skill_generation": turn.get("skill_generation"),
                          "policy_version": turn.get("policy_version")}}
        out.append(record)
    return out


def export_jsonl(store: Store, path: str | os.PathLike[str], **selection: Any) -> int:
    """Write :func:`export_records` (same keyword arguments) as JSON Lines; returns the count."""
    records = export_records(store, **selection)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(jsonl_line(record))
    return len(records)


def export_frame(store: Store, *, turn_ids: Iterable[int] | None = None,
                 session: str | None = None, labelled_only: bool = False,
                 threshold: float = 0.0):
    """The selected turns with their latest label as a ``polars.DataFrame`` (JSON columns as
    text): id, session_id, turn_index, skill_generation, policy_version, request_messages,
    response, tool_calls, reward, judge_verdict, human_verdict, note, corrected, author."""
    import polars as pl

    rows = _selected(store, turn_ids, session, labelled_only)
    marks = latest(store, [r["id"] for r in rows])
    schema = {"id": pl.Int64, "session_id": pl.Utf8, "turn_index": pl.Int64,
              "skill_generation": pl.Int64, "policy_version": pl.Int64,
              "request_messages": pl.Utf8, "response": pl.Utf8, "tool_calls": pl.Utf8,
              "reward": pl.Float64, "judge_verdict": pl.Utf8, "human_verdict": pl.Utf8,
              "note": pl.Utf8, "corrected": pl.Utf8, "author": pl.Utf8}
    data: dict[str, list[Any]] = {k: [] for k in schema}
    for turn in rows:
        mark = marks.get(int(turn["id"])) or {}
        for key in ("id", "session_id", "turn_index", "skill_generation", "policy_version",
                    "response", "reward"):
            data[key].append(turn.get(key))
        for key in ("request_messages", "tool_calls"):  # None: absent, or malformed in the row
            data[key].append(None if turn.get(key) is None
                             else json.dumps(turn[key], ensure_ascii=False))
        data["judge_verdict"].append(judge_verdict(turn.get("reward"), threshold))
        data["human_verdict"].append(mark.get("verdict"))
        for key in ("note", "corrected", "author"):
            data[key].append(mark.get(key))
    return pl.DataFrame(data, schema=schema)


#: The files turns are exported to, by ending: JSON Lines (a shape), or Parquet (a table).
EXPORT_SUFFIXES = (".jsonl", ".parquet")


def export_file(store: Store, path: str | os.PathLike[str], *, shape: str = "chat",
                **selection: Any) -> int:
    """Write the selected turns to ``path`` as its ending says: ``.jsonl`` (:func:`export_jsonl`
    in ``shape``) or ``.parquet`` (:func:`export_parquet`, a table whatever the shape);
    another ending is a :class:`ValueError`. Returns the count."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        return export_parquet(store, path, **selection)
    if suffix == ".jsonl":
        return export_jsonl(store, path, shape=shape, **selection)
    raise ValueError(f"export to a file ending in {' or '.join(EXPORT_SUFFIXES)}, not "
                     f"{Path(path).name!r}")


def export_summary(count: int, path: str | os.PathLike[str], *, shape: str = "chat",
                   labelled_only: bool = False) -> str:
    """One line saying what :func:`export_file` wrote to ``path``: the count and which turns it
    keeps; where a chat-shape file kept none, what to do (it keeps only turns fit to learn
    from: labelled pass, or with a corrected answer)."""
    if Path(path).suffix.lower() == ".parquet":
        which = "a table of " + ("labelled turns" if labelled_only else "turns")
    else:
        which = f"{shape} shape: " + ("turns labelled pass or with a corrected answer"
                                      if shape == "chat" else
                                      "labelled turns" if labelled_only else "turns")
    line = f"wrote {count} record{'' if count == 1 else 's'} to {path} ({which})"
    if count == 0 and shape == "chat" and Path(path).suffix.lower() == ".jsonl":
        line += ("; label turns pass or give a corrected answer (metaclaw label, %metaclaw "
                 "label, the trace view), or export the eval shape, which keeps every selected "
                 "turn")
    return line


def export_parquet(store: Store, path: str | os.PathLike[str], **selection: Any) -> int:
    """Write :func:`export_frame` (same keyword arguments) as Parquet; returns the row count."""
    table = export_frame(store, **selection)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    table.write_parquet(target)
    return table.height
