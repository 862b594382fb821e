"""An offline multi-stage research pipeline (in the style of AutoResearchClaw) run through the
proxy, to measure what stage-specific skills do to retries, refine cycles and robustness.

Stages (:data:`STAGES`): ``plan`` -> ``search`` -> ``experiment`` -> ``analyze`` -> ``write``.
Each stage is one proxied chat call (session ``<run>/<stage>``, so every stage's turns are
tracked apart; the system prompt carries the earlier stages' outputs, the user message the
stage's task) followed by the stage's own
check (:data:`CHECKS`: required ``Key:`` lines and a content test). A failed check is recorded
on the turn as its verdict (reward -1, the check's message as the rationale) and the stage is
retried with that message as feedback, up to ``max_attempts``. After ``write``, a review checks
that the write-up restates the planned metric; when it does not, ``analyze`` and ``write`` run
again: a *refine cycle* (at most ``max_refines``).

Robustness of a stage in a run: ``passed / attempts`` (1: passed first time, 0.5: after one
retry, 0: never). Robustness of a run: mean stage robustness x share of stages completed x
``1 / (1 + refine cycles)``.

:class:`SimulatedResearchModel` is a SIMULATED model, not a language model: an honest double
whose output follows only from the request it receives. It writes a default draft for the stage
named in the request; it adds a ``Key: value`` line for every rule of the form ``Include a line
starting with `Key:``` found in its system prompt (where the proxy injects skills) and for every
missing ```Key:``` named in a later user message (a retry's feedback), taking values from the
earlier stages' outputs in the request when they hold that key; and it slips (drops one such line) with probability ``slip``
decided by a hash of the request, so runs are reproducible. It knows nothing of the checks. Its
``sim-evolver`` role turns the support turns' rationales (the checks' messages) into one skill
per stage restating the missing lines as rules. Every figure it produces is simulated.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

STAGES = ("plan", "search", "experiment", "analyze", "write")

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
        from metaclaw.double import Reply

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
        """The ``sim-evolver`` role: one skill per stage from the support turns' rationales."""
        from metaclaw.evolver import parse_evolver_prompt

        parsed = parse_evolver_prompt(prompt)
        existing = {s["name"]: s for s in parsed["library"]}
        by_stage: dict[str, dict[str, Any]] = {}
        for item in parsed["support"]:
            stage_match = re.search(r"Stage: (\w+)", item.get("task") or "")
            if not stage_match:
                continue
            entry = by_stage.setdefault(stage_match[1], {"keys": [], "ids": []})
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


def run_pipeline(chat: Callable[[str, list[dict[str, str]]], tuple[str, int | None]],
                 record_verdict: Callable[[int, bool, str], None], run: str, topic: str, *,
                 max_attempts: int = 3, max_refines: int = 2) -> RunRecord:
    """One run of the pipeline on ``topic``.

    ``chat(session, messages) -> (reply, turn_id)``: one proxied call; ``record_verdict(turn_id,
    passed, message)``: store the check's verdict on the turn.
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
            reply, turn_id = chat(f"{run}/{stage}", messages)
            ok, message = check(stage, reply)
            if turn_id is not None:
                record.turn_ids.append(turn_id)
                record_verdict(turn_id, ok, message)
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
            record_verdict(last.turn_ids[-1], False, message)
        if refines >= max_refines:
            return RunRecord(run, topic, stages, refines, False)
        refines += 1
        for stage in ("analyze", "write"):
            if not do(stage, message if stage == "write" else None):
                return RunRecord(run, topic, stages, refines, False)


def stage_table(runs: list[RunRecord], label: str):
    """Per stage: runs, mean retries, first-attempt pass rate, robustness (polars), tagged
    ``label`` (e.g. "baseline" / "with skills")."""
    import polars as pl

    rows = []
    for stage in STAGES:
        records = [s for r in runs for s in r.stages if s.stage == stage]
        if not records:
            continue
        rows.append({"condition": label, "stage": stage, "calls": sum(s.attempts for s in records),
                     "retries": sum(s.attempts - 1 for s in records) / len(runs),
                     "first_try": sum(1 for s in records if s.attempts == 1 and s.passed)
                     / len(records),
                     "robustness": sum(s.robustness for s in records) / len(records)})
    return pl.DataFrame(rows)


def run_table(runs: list[RunRecord], label: str):
    """Per run: refine cycles, completed, robustness (polars), tagged ``label``."""
    import polars as pl

    return pl.DataFrame([{"condition": label, "run": r.run, "topic": r.topic,
                          "refine_cycles": r.refine_cycles, "completed": r.completed,
                          "retries": sum(s.attempts - 1 for s in r.stages),
                          "robustness": r.robustness} for r in runs])


def as_dicts(runs: list[RunRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in runs]


def runtime_hooks(runtime: Any, model: str = "sim-research"):
    """``(chat, record_verdict)`` for :func:`run_pipeline` through a running
    :class:`metaclaw.runtime.Runtime`: each call goes through its proxy (skills injected,
    turn recorded); a verdict is stored on the turn (reward +1 / -1, the check's message as the
    rationale, ``judge_model = "stage-check"``) and the turn re-classified in the buffers."""
    from metaclaw import buffers

    client = runtime.client(max_retries=0)

    def chat(session: str, messages: list[dict[str, str]]) -> tuple[str, int | None]:
        reply = client.chat.completions.create(model=model, messages=messages,
                                               extra_headers={"X-Session-Id": session})
        runtime.proxy.flush()
        rows = runtime.store.query("SELECT MAX(id) AS id FROM turns WHERE session_id = ?",
                                   (session,))
        return reply.choices[0].message.content or "", rows[0]["id"]

    def record_verdict(turn_id: int, passed: bool, message: str) -> None:
        import time

        runtime.store.update_turn(turn_id, reward=1.0 if passed else -1.0,
                                  judge_rationale=message, judge_model="stage-check",
                                  judged_at=time.time())
        buffers.refresh(runtime.store, [turn_id])

    return chat, record_verdict
