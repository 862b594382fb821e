"""An offline multi-stage research pipeline (in the style of AutoResearchClaw) run through the
proxy, to measure what stage-specific skills do to retries, refine cycles and robustness.

Stages (:data:`STAGES`): ``plan`` -> ``search`` -> ``experiment`` -> ``analyze`` -> ``write``.
A run of the pipeline is one session (named after the run); each stage is a proxied chat call
of turn type ``stage:<stage>`` (:mod:`metaclaw.proxy.sessions`), so the proxy offers it only general
skills and the skills of its own stage, and the skills learnt from its failures are scoped to
it. The system prompt carries the earlier stages' outputs, the user message the stage's task.
Each call is followed by the stage's own :func:`check` (the ``Key:`` lines of :data:`REQUIRED`
and a content test). The check's verdict is recorded on the turn (reward +1 / -1, the check's
message as the rationale, ``judge_model`` :data:`CHECK`); a failed stage is retried with that
message as feedback, up to ``max_attempts``. After ``write``, a review checks that the
write-up restates the planned metric; when it does not, the write turn is marked failed
(``judge_model`` :data:`REVIEW`) and ``analyze`` and ``write`` run again: a *refine cycle*
(at most ``max_refines``).

Robustness of a stage in a run: ``passed / attempts`` (1: passed first time, 0.5: after one
retry, 0: never). Robustness of a run: mean stage robustness x share of stages completed x
``1 / (1 + refine cycles)``. :func:`stage_table` and :func:`run_table` compute every figure from
the recorded turns (grouped by session and turn type), not from the runner's own bookkeeping.

:class:`SimulatedResearchModel` is a SIMULATED model, not a language model: an honest double
whose output follows only from the request it receives. It writes a default draft for the stage
named in the request; it adds a ``Key: value`` line for every rule of the form ``Include a line
starting with `Key:``` found in its system prompt (where the proxy injects skills) and for every
missing ```Key:``` named in a later user message (a retry's feedback), taking values from the
earlier stages' outputs in the request when they hold that key; and it slips (drops one such
line) with probability ``slip`` decided by a hash of the request, so runs are reproducible. It
knows nothing of the checks. Its ``sim-evolver`` role reads the support turns of the evolver's
prompt and writes one skill per stage (the stage read from each turn's ``turn_type``)
restating the missing lines the checks' messages name as rules. Every figure it produces is
simulated.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from metaclaw.turns import STAGE_TURNS_SQL, stage_of, stage_turn_type

STAGES = ("plan", "search", "experiment", "analyze", "write")
#: The stages a refine cycle runs again.
REFINED = ("analyze", "write")
#: ``judge_model`` of a stage check's verdict, and of the review's (which fails a write turn
#: that passed its check).
CHECK, REVIEW = "stage-check", "stage-review"

#: Per stage: the ``Key:`` lines its output must hold, and what each stage is asked to do.
REQUIRED: dict[str, tuple[str, ...]] = {
    "plan": ("Hypothesis", "Method", "Metric", "Baseline"),
    "search": ("Query", "Sources", "Years"),
    "experiment": ("Config", "Seed", "Metric"),
    "analyze": ("Result", "Interval", "Metric"),
    "write": ("Title", "Abstract", "Limitations"),
}
TASKS = {
    "plan": "Write the research plan for the topic.",
    "search": "Search the literature for the topic and list what you found.",
    "experiment": "Specify the experiment that tests the plan.",
    "analyze": "Analyze the results and their uncertainty.",
    "write": "Write the paper's front matter from the stages so far.",
}

_RULE = re.compile(r"Include a line starting with `([A-Za-z][A-Za-z ]*):`")
_MISSING = re.compile(r"`([A-Za-z][A-Za-z ]*):`")


# -- the pipeline's own checks -------------------------------------------------------------------
def lines_of(text: str) -> dict[str, str]:
    """``{Key: value}`` of the ``Key: value`` lines of a stage output."""
    out = {}
    for line in (text or "").splitlines():
        match = re.match(r"^\s*([A-Za-z][A-Za-z ]*):\s*(.*)$", line)
        if match:
            out.setdefault(match[1].strip(), match[2].strip())
    return out


def check(stage: str, output: str) -> tuple[bool, str]:
    """The stage's check: ``(passed, message)``; the message names what to fix."""
    found = lines_of(output)
    missing = [k for k in REQUIRED[stage] if not found.get(k)]
    if missing:
        keys = ", ".join(f"`{k}:`" for k in missing)
        return False, (f"the {stage} stage output is missing the line(s) {keys}; include a line "
                       f"starting with each")
    if stage == "experiment" and not found["Seed"].isdigit():
        return False, "the experiment's `Seed:` must be an integer so the run can be repeated"
    if stage == "analyze" and not re.search(r"\d", found["Interval"]):
        return False, "the analysis' `Interval:` must give numbers"
    return True, f"the {stage} stage output passed its check"


def review(outputs: dict[str, str]) -> tuple[bool, str]:
    """The final review: the write-up restates the metric the plan chose."""
    planned = lines_of(outputs.get("plan", "")).get("Metric")
    stated = lines_of(outputs.get("write", "")).get("Metric")
    if planned and stated and stated == planned:
        return True, "the write-up restates the planned metric"
    return False, (f"the write stage output must restate the planned metric ({planned!r}): "
                   "include a line starting with `Metric:`")


# -- the simulated model ---------------------------------------------------------------------------
def _unit(*parts: str) -> float:
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


_VALUES = {
    "Hypothesis": "skills cut retries on {topic}", "Method": "ablation with and without skills",
    "Metric": ["accuracy", "f1", "exact-match", "pass@1"], "Baseline": "the unmodified agent",
    "Query": "\"{topic}\" survey", "Sources": "3 papers and 1 benchmark", "Years": "2021-2025",
    "Config": "batch 8, lr 1e-4, 3 epochs", "Seed": "1234", "Result": "0.71 vs 0.64",
    "Interval": "95% CI [0.66, 0.76]", "Title": "Skills for {topic}",
    "Abstract": "We study {topic}.", "Limitations": "one simulated model, small sample",
}
_DEFAULT_KEYS = {
    "plan": ("Hypothesis", "Method"), "search": ("Query", "Sources"),
    "experiment": ("Config", "Metric"), "analyze": ("Result",), "write": ("Title", "Abstract"),
}
#: What the model writes without being told (plausible but unchecked).
_SLOPPY = {"Seed": "random", "Interval": "narrow"}


class SimulatedResearchModel:
    """SIMULATED research-pipeline model (see the module docstring); a ``DoubleServer`` reply
    function: ``body -> Reply``. ``slip``: chance of dropping one rule-following line."""

    def __init__(self, slip: float = 0.15):
        self.slip = float(slip)

    def __call__(self, body: dict[str, Any]):
        from metaclaw.offline.double import Reply

        model = body.get("model") or ""
        messages = body.get("messages") or []
        if model.endswith("evolver"):
            return Reply(content=json.dumps(self.evolve(messages[-1]["content"])))
        return Reply(content=self.answer(messages))

    def answer(self, messages: list[dict[str, Any]]) -> str:
        from metaclaw.buffers import message_text

        system = "\n".join(message_text(m.get("content")) for m in messages
                           if m.get("role") == "system")
        users = [message_text(m.get("content")) for m in messages if m.get("role") == "user"]
        request = users[0] if users else ""
        stage_match = re.search(r"^Stage: (\w+)", request, re.M)
        stage = stage_match[1] if stage_match else "plan"
        topic_match = re.search(r"^Topic: (.+)$", request, re.M)
        topic = topic_match[1].strip() if topic_match else "the topic"
        prompt = system.split("## Skills", 1)[0]  # the caller's prompt, before injected skills
        context = lines_of(prompt.split("Earlier stages:", 1)[1]) \
            if "Earlier stages:" in prompt else {}
        ruled = [k for k in _RULE.findall(system)]
        for feedback in users[1:]:  # retries: do what every piece of feedback named
            ruled += _MISSING.findall(feedback)
        keys = list(dict.fromkeys([*_DEFAULT_KEYS.get(stage, ()), *ruled]))
        told = set(ruled)
        if told and _unit("slip", json.dumps(messages)) < self.slip:
            dropped = sorted(told)[int(_unit("which", json.dumps(messages)) * len(told))]
            keys = [k for k in keys if k != dropped]
        lines = [f"{stage.capitalize()} for {topic}:"]
        for key in keys:
            lines.append(f"{key}: {self._value(key, topic, context, told)}")
        return "\n".join(lines)

    @staticmethod
    def _value(key: str, topic: str, context: dict[str, str], told: set[str]) -> str:
        if key in context:
            return context[key]  # keep what an earlier stage decided
        if key not in told and key in _SLOPPY:
            return _SLOPPY[key]
        value = _VALUES.get(key, "see above")
        if isinstance(value, list):
            value = value[int(_unit("value", key, topic) * len(value))]
        return value.format(topic=topic)

    @staticmethod
    def evolve(prompt: str) -> dict[str, Any]:
        """The ``sim-evolver`` role: one skill per stage (the support turns' ``turn_type``) from
        their rationales."""
        from metaclaw.fastloop.evolver import parse_evolver_prompt

        parsed = parse_evolver_prompt(prompt)
        existing = {s["name"]: s for s in parsed["library"]}
        by_stage: dict[str, dict[str, Any]] = {}
        for item in parsed["support"]:
            stage = stage_of(item.get("turn_type"))
            if stage is None:
                continue
            entry = by_stage.setdefault(stage, {"keys": [], "ids": []})
            for key in _MISSING.findall(item.get("rationale") or ""):
                if key not in entry["keys"]:
                    entry["keys"].append(key)
            entry["ids"].append(item["id"])
        ops = []
        for stage, entry in sorted(by_stage.items()):
            if not entry["keys"]:
                continue
            name = f"{stage}-stage-conventions"
            old_keys = _RULE.findall(existing.get(name, {}).get("body", ""))
            keys = list(dict.fromkeys([*old_keys, *entry["keys"]]))
            if keys == old_keys:
                continue
            body = "\n".join([f"Conventions for the {stage} stage of a research pipeline:"]
                             + [f"- Include a line starting with `{k}:` in the {stage} stage "
                                "output." for k in keys])
            ops.append({"op": "edit" if name in existing else "add", "name": name,
                        "description": f"What the {stage} stage output must contain "
                                       f"(research pipeline, {stage} stage)",
                        "category": "pipeline", "body": body,
                        "reason": f"{stage} stage checks failed: missing "
                                  + ", ".join(entry["keys"]),
                        "evidence": entry["ids"]})
        return {"operations": ops}


# -- running the pipeline ----------------------------------------------------------------------------
@dataclass
class StageRecord:
    run: str
    stage: str
    attempts: int
    passed: bool
    turn_ids: list[int] = field(default_factory=list)

    @property
    def robustness(self) -> float:
        return (1.0 / self.attempts) if self.passed else 0.0


@dataclass
class RunRecord:
    run: str
    topic: str
    stages: list[StageRecord]
    refine_cycles: int
    completed: bool

    @property
    def robustness(self) -> float:
        scores = [s.robustness for s in self.stages] or [0.0]
        done = len({s.stage for s in self.stages if s.passed}) / len(STAGES)
        return (sum(scores) / len(scores)) * done / (1 + self.refine_cycles)


def _messages(stage: str, topic: str, outputs: dict[str, str]) -> list[dict[str, str]]:
    """A stage's request: the earlier stages' outputs in the system prompt, the stage's task as
    the user message (what skill retrieval reads)."""
    earlier = "\n".join(outputs[s] for s in STAGES if s in outputs and s != stage)
    system = "You are a research assistant." + (f"\nEarlier stages:\n{earlier}" if earlier else "")
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Stage: {stage}\nTopic: {topic}\n{TASKS[stage]}"}]


def run_pipeline(chat: Callable[[str, str, list[dict[str, str]]], tuple[str, int | None]],
                 record_verdict: Callable[[int, bool, str, str], None], run: str, topic: str, *,
                 max_attempts: int = 3, max_refines: int = 2) -> RunRecord:
    """One run of the pipeline on ``topic``, as session ``run``.

    ``chat(session, turn_type, messages) -> (reply, turn_id)``: one proxied call (turn type
    ``stage:<stage>``); ``record_verdict(turn_id, passed, message, by)``: store a verdict on the
    turn (``by``: :data:`CHECK` or :data:`REVIEW`).
    """
    outputs: dict[str, str] = {}
    stages: list[StageRecord] = []
    refines = 0

    def do(stage: str, feedback: str | None = None) -> bool:
        messages = _messages(stage, topic, outputs)
        if feedback:
            messages.append({"role": "user", "content": f"Reviewer feedback: {feedback}."})
        record = StageRecord(run, stage, 0, False)
        stages.append(record)
        for _ in range(max_attempts):
            record.attempts += 1
            reply, turn_id = chat(run, stage_turn_type(stage), messages)
            ok, message = check(stage, reply)
            if turn_id is not None:
                record.turn_ids.append(turn_id)
                record_verdict(turn_id, ok, message, CHECK)
            if ok:
                record.passed = True
                outputs[stage] = reply
                return True
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": f"The check failed: {message}. Fix it."}]
        return False

    for stage in STAGES:
        if not do(stage):
            return RunRecord(run, topic, stages, refines, False)
    while True:
        ok, message = review(outputs)
        if ok:
            return RunRecord(run, topic, stages, refines, True)
        last = stages[-1]
        if last.turn_ids:  # the write-up failed the review: its turn is a failure
            record_verdict(last.turn_ids[-1], False, message, REVIEW)
        if refines >= max_refines:
            return RunRecord(run, topic, stages, refines, False)
        refines += 1
        for stage in REFINED:
            if not do(stage, message if stage == "write" else None):
                return RunRecord(run, topic, stages, refines, False)


def stage_executions(store: Any, runs: Iterable[RunRecord | str]) -> list[dict[str, Any]]:
    """Every execution of a stage in ``runs`` (run records or session names), read from the
    recorded turns: ``{"run", "stage", "attempts", "passed", "turn_ids"}``.

    A run's turns of type ``stage:<stage>``, in order, are split into executions after each turn
    that passed its check (reward > 0, or a write turn the review failed after its check
    passed); attempts left open at the end are an execution that never passed."""
    sessions = [r.run if isinstance(r, RunRecord) else str(r) for r in runs]
    if not sessions:
        return []
    rows = store.query(
        "SELECT id, session_id, turn_type, reward, judge_model FROM turns WHERE session_id IN "
        f"({', '.join('?' * len(sessions))}) AND {STAGE_TURNS_SQL} ORDER BY id", sessions)
    done: list[dict[str, Any]] = []
    open_: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["session_id"], stage_of(row["turn_type"]))
        execution = open_.setdefault(key, {"run": key[0], "stage": key[1], "attempts": 0,
                                           "passed": False, "turn_ids": []})
        execution["attempts"] += 1
        execution["turn_ids"].append(row["id"])
        if (row["reward"] or 0) > 0 or row["judge_model"] == REVIEW:
            execution["passed"] = True
            done.append(open_.pop(key))
    return sorted(done + list(open_.values()), key=lambda e: e["turn_ids"][0])


def _unique(runs: Iterable[RunRecord | str]) -> list[RunRecord | str]:
    """``runs`` once each, in order: the tables average per run, so a run listed twice (e.g.
    ``runs + more_runs`` overlapping) would otherwise halve its retries and repeat its row."""
    seen: set[str] = set()
    out = []
    for run in runs:
        name = run.run if isinstance(run, RunRecord) else str(run)
        if name not in seen:
            seen.add(name)
            out.append(run)
    return out


def stage_table(store: Any, runs: Iterable[RunRecord | str], label: str):
    """Per stage (turn type ``stage:<stage>``), from the recorded turns of ``runs``: calls,
    retries per run, first-attempt pass rate, robustness (polars), tagged ``label`` (e.g.
    "baseline" / "with skills")."""
    import polars as pl

    runs = _unique(runs)
    executions = stage_executions(store, runs)
    rows = []
    for stage in STAGES:
        records = [e for e in executions if e["stage"] == stage]
        if not records:
            continue
        rows.append({"condition": label, "stage": stage, "turn_type": f"stage:{stage}",
                     "calls": sum(e["attempts"] for e in records),
                     "retries": sum(e["attempts"] - 1 for e in records) / len(runs),
                     "first_try": sum(1 for e in records if e["attempts"] == 1 and e["passed"])
                     / len(records),
                     "robustness": sum(_robustness(e) for e in records) / len(records)})
    # the schema keeps the columns when no run recorded a stage turn (an empty selection)
    return pl.DataFrame(rows, schema={
        "condition": pl.Utf8, "stage": pl.Utf8, "turn_type": pl.Utf8, "calls": pl.Int64,
        "retries": pl.Float64, "first_try": pl.Float64, "robustness": pl.Float64})


def run_table(store: Any, runs: Iterable[RunRecord | str], label: str):
    """Per run (session), from its recorded turns: retries, refine cycles (executions of
    ``analyze`` after the first), completed (the last turn passed), robustness (polars), tagged
    ``label``."""
    import polars as pl

    runs = _unique(runs)
    executions = stage_executions(store, runs)
    rows = []
    for run in runs:
        name = run.run if isinstance(run, RunRecord) else str(run)
        mine = [e for e in executions if e["run"] == name]
        refines = max(0, sum(1 for e in mine if e["stage"] == REFINED[0]) - 1)
        last = store.query(f"SELECT reward FROM turns WHERE session_id = ? AND {STAGE_TURNS_SQL} "
                           "ORDER BY id DESC LIMIT 1", (name,))
        scores = [_robustness(e) for e in mine] or [0.0]
        done = len({e["stage"] for e in mine if e["passed"]}) / len(STAGES)
        rows.append({"condition": label, "run": name,
                     "topic": run.topic if isinstance(run, RunRecord) else None,
                     "refine_cycles": refines,
                     "completed": bool(last and (last[0]["reward"] or 0) > 0),
                     "retries": sum(e["attempts"] - 1 for e in mine),
                     "robustness": (sum(scores) / len(scores)) * done / (1 + refines)})
    return pl.DataFrame(rows, schema={
        "condition": pl.Utf8, "run": pl.Utf8, "topic": pl.Utf8, "refine_cycles": pl.Int64,
        "completed": pl.Boolean, "retries": pl.Int64, "robustness": pl.Float64})


def _robustness(execution: dict[str, Any]) -> float:
    return (1.0 / execution["attempts"]) if execution["passed"] else 0.0


def runtime_hooks(runtime: Any, model: str = "sim-research"):
    """``(chat, record_verdict)`` for :func:`run_pipeline` through a running
    :class:`metaclaw.runtime.Runtime`: each call goes through its proxy with its session and
    turn type (skills of its stage injected, turn recorded); a verdict is stored on the turn
    (reward +1 / -1, the check's message as the rationale, ``judge_model`` :data:`CHECK` or
    :data:`REVIEW`) and the turn re-classified in the buffers."""
    from metaclaw import buffers

    client = runtime.client(max_retries=0)

    def chat(session: str, turn_type: str,
             messages: list[dict[str, str]]) -> tuple[str, int | None]:
        reply = client.chat.completions.create(
            model=model, messages=messages,
            extra_headers={"X-Session-Id": session, "X-Turn-Type": turn_type})
        runtime.proxy.flush()
        rows = runtime.store.query("SELECT MAX(id) AS id FROM turns WHERE session_id = ? AND "
                                   "turn_type = ?", (session, turn_type))
        return reply.choices[0].message.content or "", rows[0]["id"]

    def record_verdict(turn_id: int, passed: bool, message: str, by: str = CHECK) -> None:
        import time

        runtime.store.update_turn(turn_id, reward=1.0 if passed else -1.0,
                                  judge_rationale=message, judge_model=by,
                                  judged_at=time.time())
        buffers.refresh(runtime.store, [turn_id])

    return chat, record_verdict
