"""The verification gate: an automatically written skill change goes live only when it is safe
and measurably better.

The evolver reads raw tool results (web pages, files: text an attacker can write), so a skill it
writes can carry a persistent prompt injection. On the automatic path (:class:`metaclaw.fastloop.
FastLoop`) every candidate passes two checks before it becomes a generation:

1. :func:`safety_check`: no instruction to exfiltrate data (send, upload, post or e-mail data,
   secrets or credentials somewhere), to ignore or deceive the user, or to fetch or run things
   beyond the task (URLs, downloads, shell pipelines, encoded payloads). A finding holds the
   candidate back without spending a judge call.
2. :meth:`Gate.areview`: the failures the candidate was written for and a sample of recent
   successes (judged or labelled pass) are replayed through the agent's upstream twice, with the
   skills the current library would inject and with the candidate's, and each reply is judged.
   Per case: ``fixed`` (the failure's replay with the candidate passes: reward above the
   judge's threshold, where the one with the current library did not) / ``still failing``
   (below it) / ``not fixed (unclear)`` (at it: the judge could not tell) (failures), ``kept`` /
   ``regressed`` (a lower reward: successes), ``unscored`` (a replay or its judging failed).

Decision: **promote** when no success regressed and at least one failure is fixed; otherwise
**hold** (the candidate is stored as a proposal with all its evidence for a person to review,
edit, promote or discard: :mod:`metaclaw.fastloop.proposals`). :attr:`GateReport.judge_calls` counts the
judge votes the decision cost.
"""

from __future__ import annotations

import asyncio
import html
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from metaclaw.buffers import SUCCESS_SQL
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.llm import check_url
from metaclaw.fastloop.replay import Replayer
from metaclaw.skills.library import Skill, SkillOp, apply_in_memory
from metaclaw.skills.block import BUDGET_CHARS, TOP_K
from metaclaw.turns import TASK_TURNS_SQL

# -- safety ---------------------------------------------------------------------------------------
#: (category, pattern): instructions a skill must never carry. Case-insensitive, on the skill's
#: name, description and body.
SAFETY_RULES: tuple[tuple[str, str], ...] = (
    ("exfiltration", r"\b(send|post|upload|e-?mail|forward|transmit|exfiltrate|leak|copy|paste)"
                     r"\b[^.\n]{0,80}\b(secret|credential|password|api[ _-]?key|token|"
                     r"private key|ssh key|\.env\b|env(ironment)? var|cookie|session id|"
                     r"conversation|chat history|user data|personal data|file contents?)"),
    ("exfiltration", r"\b(secret|credential|password|api[ _-]?key|token|private key|"
                     r"conversation|user data)s?\b[^.\n]{0,80}\b(to|into)\b[^.\n]{0,40}"
                     r"(https?://|webhook|server|endpoint|address|e-?mail)"),
    ("ignore the user", r"\b(ignore|disregard|override|forget)\b[^.\n]{0,40}\b(the user|user'?s?|"
                        r"previous|prior|above|all|system|original)\b[^.\n]{0,30}"
                        r"\b(instruction|request|message|prompt|rule|guideline|wish)"),
    ("ignore the user", r"\b(do not|don't|never)\b[^.\n]{0,20}\b(tell|inform|mention to|"
                        r"reveal to|let)\b[^.\n]{0,20}\b(the )?user\b"),
    ("ignore the user", r"\b(without|instead of)\b[^.\n]{0,20}\b(asking|telling|informing)\b"
                        r"[^.\n]{0,10}\b(the )?user\b"),
    ("fetch or run", r"\b(curl|wget|invoke-webrequest|nc|netcat|ncat)\b\s"),
    ("fetch or run", r"https?://(?!(localhost|127\.0\.0\.1)\b)[^\s)>\"']+"),
    ("fetch or run", r"\b(download|fetch|visit|open|load|navigate to)\b[^.\n]{0,40}"
                     r"\b(url|link|site|page|script|payload)\b"),
    ("fetch or run", r"\|\s*(ba|z)?sh\b|\beval\s*\(|\bexec\s*\(|base64\s+(-d|--decode)|"
                     r"\bpowershell\b|\bchmod\s+\+x\b"),
    ("fetch or run", r"\b(run|execute)\b[^.\n]{0,30}\b(this|the following|these)\b[^.\n]{0,20}"
                     r"\b(command|script|code|payload)\b"),
)

_COMPILED = tuple((category, re.compile(pattern, re.I)) for category, pattern in SAFETY_RULES)


@dataclass
class SafetyFinding:
    """One unsafe instruction found in a candidate skill."""

    skill: str
    category: str
    excerpt: str

    def __str__(self) -> str:
        return f"{self.skill}: {self.category} ({self.excerpt!r})"


def safety_check_skill(skill: Skill) -> list[SafetyFinding]:
    """The unsafe instructions in one skill (empty when it is clean)."""
    text = "\n".join((skill.name, skill.description, skill.body))
    findings = []
    seen: set[tuple[str, str]] = set()
    for category, pattern in _COMPILED:
        for match in pattern.finditer(text):
            key = (category, match.group(0).lower())
            if key in seen:
                continue
            seen.add(key)
            start = max(0, match.start() - 30)
            excerpt = " ".join(text[start:match.end() + 30].split())
            findings.append(SafetyFinding(skill.name, category, excerpt))
    return findings


def safety_check(ops: Iterable[SkillOp]) -> list[SafetyFinding]:
    """The unsafe instructions in the skills that ``ops`` would add or write (removes are safe)."""
    findings: list[SafetyFinding] = []
    for op in ops:
        if op.skill is not None:
            findings += safety_check_skill(op.skill)
    return findings


# -- the gate -------------------------------------------------------------------------------------
FAILURE, SUCCESS = "failure", "success"


@dataclass
class GateCase:
    """One replayed turn: ``before`` / ``after`` are the judge's scores with the current and the
    candidate library (None when unscored)."""

    turn_id: int
    kind: str
    before: float | None
    after: float | None
    before_reply: str = ""
    after_reply: str = ""
    error: str | None = None
    outcome: str = ""


@dataclass
class GateReport:
    """What the gate decided and why: ``decision`` (``promote`` | ``hold``), ``reason`` (one
    sentence), ``cases`` (:class:`GateCase` dicts), ``safety`` (findings), ``judge_calls`` (votes
    spent), ``replays`` (upstream calls), ``base_generation``."""

    decision: str
    reason: str
    base_generation: int
    cases: list[dict[str, Any]] = field(default_factory=list)
    safety: list[dict[str, Any]] = field(default_factory=list)
    judge_calls: int = 0
    replays: int = 0

    @property
    def promoted(self) -> bool:
        return self.decision == "promote"

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.cases if c.get("outcome") == outcome)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GateReport":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in (data or {}).items() if k in keys})

    def __str__(self) -> str:
        tally = ", ".join(f"{self.count(o)} {o}" for o in
                          ("fixed", "still failing", "not fixed (unclear)", "kept",
                           "regressed", "unscored")
                          if self.count(o))
        return (f"gate: {self.decision} — {self.reason} ({tally or 'no replays'}; "
                f"{self.judge_calls} judge votes)")

    def _repr_html_(self) -> str:
        return cases_html(self.to_dict())


def cases_html(report: dict[str, Any]) -> str:
    """Static HTML of a gate report: the decision and the per-case before / after table."""
    esc = html.escape
    rows = "".join(
        f"<tr><td>#{c['turn_id']}</td><td>{esc(c['kind'])}</td>"
        f"<td>{_score(c.get('before'))}</td><td>{_score(c.get('after'))}</td>"
        f"<td><b>{esc(c.get('outcome') or '')}</b></td>"
        f"<td>{esc((c.get('before_reply') or '')[:160])}</td>"
        f"<td>{esc((c.get('after_reply') or '')[:160])}</td></tr>"
        for c in report.get("cases", []))
    safety = "".join(f"<li>{esc(f['skill'])}: {esc(f['category'])} — "
                     f"<code>{esc(f['excerpt'])}</code></li>" for f in report.get("safety", []))
    if report.get("decision") is None and not report.get("cases"):
        return "<div>Not run through the verification gate.</div>" \
            if not report.get("safety") else f"<div><p>Safety findings:</p><ul>{safety}</ul></div>"
    return (f"<div><b>Verification gate: {esc(str(report.get('decision')))}</b> — "
            f"{esc(str(report.get('reason', '')))} · {report.get('judge_calls', 0)} judge votes"
            + (f"<p>Safety findings:</p><ul>{safety}</ul>" if safety else "")
            + ("<table><tr><th>turn</th><th>case</th><th>before</th><th>after</th>"
               "<th>outcome</th><th>reply before</th><th>reply after</th></tr>"
               f"{rows}</table>" if rows else "") + "</div>")


def _score(value: Any) -> str:
    return "—" if value is None else f"{float(value):+.0f}"


def _outcome(kind: str, before: float | None, after: float | None, threshold: float,
             broken: bool = False) -> str:
    """``broken``: the upstream failed the replay with the candidate, where it answered the one
    with the current library (a skill that makes requests fail, e.g. past the context length)."""
    if broken:
        return "regressed" if kind == SUCCESS else "still failing"
    if before is None or after is None:
        return "unscored"
    if kind == FAILURE:  # fixed: it passes now (a rise from -1 to "unclear" 0 is judge noise
        # as often as not: counted, a candidate that changed nothing went live one time in five)
        return ("fixed" if after > threshold >= before else
                "not fixed (unclear)" if after == threshold else "still failing")
    return "regressed" if after < before else "kept"


class Gate:
    """Replays candidates through the agent's upstream and the judge; decides promote / hold.

    ``judge``: scores the replays (its ``threshold`` separates pass from fail); ``upstream_url``
    / ``model``: where the agent's requests go (``model`` default: each turn's recorded model);
    ``successes``: how many recent successes to replay as regression checks; ``max_failures``:
    at most this many of the candidate's failures are replayed. ``retriever`` / ``top_k`` /
    ``min_score`` / ``budget_chars``: how the replays pick their skills (as the proxy does).
    """

    def __init__(self, judge: Judge, upstream_url: str, model: str | None = None, *,
                 api_key: str | None = None, api_key_env: str = "METACLAW_UPSTREAM_API_KEY",
                 successes: int = 4, max_failures: int = 4, retriever: Any = None,
                 top_k: int = TOP_K, min_score: float | None = None,
                 budget_chars: int = BUDGET_CHARS, timeout: float = 120.0, seed: int = 0):
        if not isinstance(judge, Judge):
            raise TypeError("Gate needs a metaclaw.fastloop.judge.Judge to score the replays")
        check_url("upstream_url", upstream_url)
        self.judge = judge
        self.upstream_url = upstream_url
        self.model = model
        self.successes = int(successes)
        self.max_failures = int(max_failures)
        self.retriever = retriever
        self.top_k, self.min_score, self.budget_chars = top_k, min_score, budget_chars
        self.timeout = float(timeout)
        self.seed = seed
        self.replayer = Replayer(judge, upstream_url, model, api_key=api_key,
                                 api_key_env=api_key_env, retriever=retriever, top_k=top_k,
                                 min_score=min_score, budget_chars=budget_chars,
                                 timeout=self.timeout)

    def __repr__(self) -> str:
        return (f"Gate(upstream_url={self.upstream_url!r}, successes={self.successes}, "
                f"max_failures={self.max_failures}, judge votes={self.judge.votes})")

    async def _replay(self, turn: dict[str, Any], skills: list[Skill]) -> dict[str, Any]:
        """One replay, judged (:mod:`metaclaw.fastloop.replay`): ``{"score", "reply", "error",
        "votes", "upstream_failed"}``."""
        replay = await self.replayer.areplay(turn, skills)
        return {"score": replay.score, "reply": replay.reply, "error": replay.error,
                "votes": replay.votes, "upstream_failed": replay.upstream_failed}

    def recent_successes(self, store: Any, exclude: Iterable[int] = ()) -> list[dict[str, Any]]:
        """The most recent successful task turns (labelled pass, or judged above the threshold
        without a fail label: :data:`metaclaw.buffers.SUCCESS_SQL`; a turn the judge could not
        tell guards nothing), newest first, at most ``successes``."""
        skip = {int(i) for i in exclude}
        rows = store.query(
            f"SELECT id FROM turns WHERE {TASK_TURNS_SQL} AND status = 'ok' AND {SUCCESS_SQL} "
            "ORDER BY id DESC LIMIT ?", (self.judge.threshold, self.successes + len(skip)))
        ids = [int(r["id"]) for r in rows if int(r["id"]) not in skip][:self.successes]
        return [t for t in (store.turn(i) for i in ids) if t is not None]

    async def areview(self, ops: list[SkillOp], library: Any, store: Any,
                      support_ids: Iterable[int], base_generation: int | None = None) -> GateReport:
        """Check ``ops`` (a candidate change of ``library``) and decide promote / hold.

        ``support_ids``: the failures the candidate was written for.
        """
        base = library.generation if base_generation is None else int(base_generation)
        findings = safety_check(ops)
        if findings:
            cats = sorted({f.category for f in findings})
            return GateReport("hold", f"unsafe instructions ({', '.join(cats)}): "
                              + "; ".join(str(f) for f in findings[:3]), base,
                              safety=[asdict(f) for f in findings])
        old = library.snapshot(base)
        new = apply_in_memory(old, ops)
        old_skills = [old[n] for n in sorted(old)]
        new_skills = [new[n] for n in sorted(new)]
        support = sorted({int(i) for i in support_ids})
        failures = [t for t in (store.turn(i) for i in support) if t is not None]
        if len(failures) > self.max_failures:
            failures = sorted(random.Random(self.seed).sample(failures, self.max_failures),
                              key=lambda t: t["id"])
        successes = self.recent_successes(store, exclude=support)
        cases = [(t, FAILURE) for t in failures] + [(t, SUCCESS) for t in successes]
        runs = await asyncio.gather(*(self._replay(t, skills) for t, _ in cases
                                      for skills in (old_skills, new_skills)))
        threshold = self.judge.threshold
        out: list[GateCase] = []
        for i, (turn, kind) in enumerate(cases):
            before, after = runs[2 * i], runs[2 * i + 1]
            errors = [e for e in (before["error"], after["error"]) if e and (
                before["score"] is None or after["score"] is None)]
            broken = after.get("upstream_failed", False) and not before.get("upstream_failed")
            out.append(GateCase(
                int(turn["id"]), kind, before["score"], after["score"],
                before["reply"][:600], after["reply"][:600], "; ".join(errors) or None,
                _outcome(kind, before["score"], after["score"], threshold, broken)))
        judge_calls = sum(r["votes"] for r in runs)
        report = GateReport("hold", "", base, [asdict(c) for c in out], [], judge_calls, len(runs))
        fixed, regressed = report.count("fixed"), report.count("regressed")
        scored_failures = sum(1 for c in out if c.kind == FAILURE and c.outcome != "unscored")
        if regressed:
            report.reason = (f"the candidate regresses {regressed} recent success"
                             f"{'es' if regressed > 1 else ''}")
        elif not scored_failures:
            report.reason = "no failure could be replayed and judged with both libraries"
        elif not fixed and all(c.before == threshold and c.after == threshold for c in out
                               if c.outcome != "unscored"):
            report.reason = ("the judge could not tell the replies apart: it found every "
                             f"replay unclear ({threshold:g}), with the candidate and without "
                             "(a judge that reads the user's reaction, as the offline simulated "
                             "one does, finds none in a replay); review it by hand")
        elif not fixed:
            report.reason = f"the candidate fixes none of its {scored_failures} failures"
        else:
            report.decision = "promote"
            report.reason = (f"fixes {fixed} of {scored_failures} failures, no regression on "
                             f"{report.count('kept')} recent successes")
        return report

    async def aclose(self) -> None:
        await self.replayer.aclose()
