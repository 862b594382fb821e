"""The simulated model is honest: it knows nothing of MetaClaw-Bench, and what it learns carries over.

1. No benchmark-specific string appears in the core library outside ``metaclaw/bench/`` (the
   benchmark's own graders and loaders may know it; the agent, judge and evolver doubles may not).
   The forbidden strings are derived at test time from the public small subset -- its graders,
   conventions, people, file names and field names -- so this file lists none of them.
2. The fast loop's effect holds on a task family of this file's own, with conventions the
   benchmark does not have (another offset and date style, a date-suffix kebab-case naming
   pattern, another backup suffix, another log file and line): baseline vs skills written by the
   simulated evolver from the failures' feedback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import metaclaw
from metaclaw import simmodel as sm
from metaclaw.bench.data import small_bench_dir

PACKAGE = Path(metaclaw.__file__).parent
DOUBLES = ("simmodel.py", "simrules.py", "double.py", "demo.py")


def _bench_texts(root: Path) -> dict[str, list[str]]:
    """Questions, feedback, grader commands and context files of the public small subset."""
    out: dict[str, list[str]] = {"questions": [], "feedback": [], "commands": [], "context": []}
    for qfile in sorted((root / "eval").glob("*/questions.json")):
        for r in json.loads(qfile.read_text())["rounds"]:
            out["questions"].append(r["question"])
            out["feedback"] += [json.dumps(r.get("feedback", {}), ensure_ascii=False)]
            out["commands"].append(r.get("eval", {}).get("command", ""))
    out["context"] = [p.read_text() for p in sorted((root / "workspaces" / "shared").glob("*.md"))]
    out["context"] += [(root / "CHECKERS.md").read_text()]
    return out


def forbidden_strings() -> tuple[set[str], set[str], list[str]]:
    """(strings no core module may contain, identifiers no double may contain, regexes)."""
    root = small_bench_dir()
    t = _bench_texts(root)
    feedback = "\n".join(t["feedback"]).replace("\\n", "\n")
    strings: set[str] = set()
    strings |= set(re.findall(r"check_\w+", "\n".join(t["commands"])))                   # graders
    strings |= set(re.findall(r"[+-]\d{2}:\d{2}", feedback))                              # offsets
    strings |= set(re.findall(r"\b[\w-]+\.log\b", feedback))                              # log names
    strings |= set(re.findall(r"\[[A-Z]{2,}\]", feedback))                                # line tags
    strings |= set(re.findall(r"\b[YMD]{6,}\b", feedback))                                # name patterns
    strings |= set(re.findall(r"author\W{0,4}[:=]\W{0,3}(\w+)", feedback))               # author value
    strings |= set(re.findall(r"\b[A-Z]+-\d{3}\b", "\n".join(t["questions"])))            # task ids
    for text in t["context"]:                                                             # people, org
        for name in re.findall(r"\*\*([A-Z][a-z]+(?: [A-Z][a-z]+)?)\*\* —", text):
            strings |= set(name.split())
        strings |= set(re.findall(r"\*\*Company\*\*: ([A-Z]\w+)", text))
        strings |= set(re.findall(r"\*\*Product\*\*: \w+ ([A-Z]\w+)", text))
    days = sorted(p.name for p in (root / "eval").iterdir())
    strings |= set(days)
    for folder in (root / "workspaces" / "shared").glob("*/"):                            # input files
        for f in folder.iterdir():
            if f.name.lower() != "readme.md":
                strings.add(f.name)
    idents = set(re.findall(r"\b[a-z][a-z0-9]*_[a-z0-9_]+\b", "\n".join(t["questions"]) + feedback))
    labels = sorted(set(re.findall(r"\bP\d\b", feedback)))
    prefix = re.match(r"[a-z]+", days[0]).group(0)
    patterns = [rf"\b{re.escape(prefix)}(?:\d|\\d)"] + [rf"\b{label}\b" for label in labels]
    return strings, idents, patterns


# Identifiers of the OpenAI wire protocol that the benchmark's questions happen to use too.
PROTOCOL = {"base_url"}


def _core_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".md")
            and "bench" not in p.relative_to(PACKAGE).parts[:1]]


def test_the_forbidden_list_is_derived_and_not_empty():
    strings, idents, patterns = forbidden_strings()
    # enough of each kind that the check means something
    assert len(strings) >= 20 and len(idents) >= 20 and patterns
    assert any(re.fullmatch(r"[+-]\d{2}:\d{2}", s) for s in strings)
    assert any(s.endswith(".log") for s in strings)


def test_no_benchmark_specific_string_outside_metaclaw_bench():
    strings, idents, patterns = forbidden_strings()
    hits = []
    for path in _core_files():
        # the end marker of the OpenAI streaming protocol is not the benchmark's log tag
        text = re.sub(r'data: \[DONE\]|"\[DONE\]"|``\[DONE\]``', "",
                      path.read_text(encoding="utf-8"))
        rel = path.relative_to(PACKAGE)
        for s in strings:
            if re.search(rf"(?<![\w.]){re.escape(s)}(?![\w])", text):
                hits.append(f"{rel}: {s!r}")
        for rx in patterns:
            if re.search(rx, text):
                hits.append(f"{rel}: /{rx}/")
        if path.name in DOUBLES:
            for ident in idents - PROTOCOL:
                if re.search(rf"\b{re.escape(ident)}\b", text):
                    hits.append(f"{rel}: field name {ident!r}")
    assert not hits, "benchmark-specific content in the core library:\n" + "\n".join(sorted(hits))


# ---------------------------------------------------------------- a task family of our own
# Conventions MetaClaw-Bench does not have: UTC-03:00 with day-first dotted dates, kebab-case
# names with the date as a suffix, ".orig" backups, a "worklog.txt" line "OK; <time>; <id>; <what>".
TODAY = "Thursday, 9 July 2026"
FEEDBACK = {
    "time": "Times are wrong. Every time value must be written like `09.07.2026 14:30 -03:00` "
            "(day first, dots, a space, then the -03:00 offset).",
    "naming": "Bad file name. New files are named like `inventory-count-2026-07-09.csv`: kebab-case "
              "description, then the date as a suffix.",
    "backup": "Before changing stock/prices.md you must first copy it to stock/prices.md.orig.",
    "log": "You forgot the work log. After each task append a line to `worklog.txt` like "
           "`OK; 09.07.2026 14:30 -03:00; restock_plan; wrote the restock plan`.",
}
TASKS = [
    ("time", "Please create a delivery schedule in JSON format saved as stock/schedule.json with "
             "fields: delivery_at (tomorrow at 10:00), pickup_at (today at 16:00), and quantity."),
    ("naming", "Please write an inventory count as a CSV file in the stock/ directory. "
               "Columns: item, count."),
    ("backup", "Please update stock/prices.md to add a section on seasonal discounts."),
    ("log", "Please draft a restock plan in Markdown and save it to the stock/ directory."),
]


def _files():
    return {"stock/README.md": f"# Stock room\n\nDate: {TODAY}\n\n- **Rosa** — buyer\n",
            "stock/prices.md": "# Prices\n\n- apples: 2\n"}


def _grade(kind: str, ws: dict[str, str]) -> bool:
    new = [p for p in ws if p not in _files() and not p.endswith(".orig") and p != "worklog.txt"]
    if kind == "time":
        data = json.loads(ws.get("stock/schedule.json", "{}"))
        return all(re.fullmatch(r"\d{2}\.\d{2}\.\d{4} \d{2}:\d{2} -03:00", str(data.get(k, "")))
                   for k in ("delivery_at", "pickup_at"))
    if kind == "naming":
        return any(re.fullmatch(r"stock/[a-z0-9]+(-[a-z0-9]+)*-2026-07-09\.csv", p) for p in new)
    if kind == "backup":
        return ws.get("stock/prices.md.orig") == _files()["stock/prices.md"] and \
            ws["stock/prices.md"] != _files()["stock/prices.md"]
    lines = ws.get("worklog.txt", "").splitlines()
    return any(re.fullmatch(r"OK; \d{2}\.\d{2}\.\d{4} \d{2}:\d{2} -03:00; [a-z0-9_]+; .+", ln) for ln in lines)


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": props}}} for name, props in (
    ("ls", {"dir": {"type": "string"}}), ("read", {"file": {"type": "string"}}),
    ("write", {"file": {"type": "string"}, "text": {"type": "string"}}),
    ("copy", {"source": {"type": "string"}, "target": {"type": "string"}}),
    ("append", {"file": {"type": "string"}, "line": {"type": "string"}}))]


def _run(kind: str, task: str, system: str) -> tuple[bool, list[dict]]:
    """One task with the simulated agent over an in-memory file store with tools of our own
    naming (not the bench's); returns (passed, the conversation)."""
    ws = _files()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    for _ in range(10):
        out = sm.agent_reply({"model": "sim-agent", "messages": messages, "tools": TOOLS})
        messages.append({"role": "assistant", "content": out["content"] or "",
                         **({"tool_calls": out["tool_calls"]} if out["tool_calls"] else {})})
        if not out["tool_calls"]:
            break
        for call in out["tool_calls"]:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            if name == "ls":
                result = json.dumps(sorted(p.split("/", 1)[1] for p in ws if p.startswith(args["dir"] + "/")))
            elif name == "read":
                result = ws.get(args["file"], "error: not found")
            elif name == "write":
                ws[args["file"]] = args["text"]
                result = "ok"
            elif name == "copy":
                ws[args["target"]] = ws[args["source"]]
                result = "ok"
            else:
                ws[args["file"]] = ws.get(args["file"], "") + args["line"]
                result = "ok"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return _grade(kind, ws), messages


def test_fast_loop_generalises_to_a_task_family_of_our_own():
    from metaclaw.evolver import build_evolver_messages, parse_operations_reply, validate_operations
    from metaclaw.retrieval import ScoredSkill, render_block
    from metaclaw.skills import Skill

    system = "You are an assistant for a small shop. Work with the tools on the shop's files."
    baseline = {kind: _run(kind, task, system)[0] for kind, task in TASKS}
    assert not any(baseline.values()), baseline        # no rule in context: every task misses it
    # the failures, with the user's feedback, go to the simulated evolver through the real prompt
    support = [{"id": i + 1, "task": task, "tools": "", "reply": "done", "rationale": "",
                "feedback": f"[Feedback] {FEEDBACK[kind]}\n\nNext task.", "reward": -1}
               for i, (kind, task) in enumerate(TASKS)]
    out = sm.sim_reply({"model": "sim-evolver", "messages": build_evolver_messages(support, [], 0)})
    ops = validate_operations(parse_operations_reply(out["content"]), {}, [1, 2, 3, 4])
    assert {op.op for op in ops} == {"add"} and len(ops) == 4
    block = render_block([ScoredSkill(op.skill, 1.0) for op in ops])
    skilled = {kind: _run(kind, task, system + "\n\n" + block)[0] for kind, task in TASKS}
    assert all(skilled.values()), (skilled, block)
    print(f"own task family (simulated model): baseline {sum(baseline.values())}/4, "
          f"with evolved skills {sum(skilled.values())}/4")


def test_feedback_in_the_conversation_teaches_the_next_task_too():
    """Without skills, a rule stated in an earlier remark of the same conversation is followed."""
    system = "You are an assistant for a small shop."
    ok, _ = _run("time", f"[Feedback] {FEEDBACK['time']}\n\n{TASKS[0][1]}", system)
    assert ok
