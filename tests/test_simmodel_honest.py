"""The simulated model is honest: it knows nothing of MetaClaw-Bench, and what it learns carries over.

1. No benchmark-specific string appears in the core library outside ``metaclaw/bench/`` (the
   benchmark's own graders and loaders may know it; the agent, judge and evolver doubles may not).
   The forbidden strings are derived at test time from the public small subset -- its graders,
   conventions, people, file names and field names -- so this file lists none of them.
2. The fast loop's effect holds on a task family of this file's own, with conventions the
   benchmark does not have (another offset and date style, a date-suffix kebab-case naming
   pattern, another backup suffix, another log file and line): baseline vs skills written by the
   simulated evolver from the failures' feedback.
3. The words and word pairs of the simulated model's string literals are generic: any that the
   public subset also uses must be in a large generic corpus (the Python standard library's
   source) or in a short list reviewed here; no date or offset of the benchmark appears in the
   doubles at all, not even in a comment.
4. What the agent writes follows the request: a new file's name keeps the request's own words,
   a clock placeholder is read whatever the text calls it, a record's time goes into the key the
   request names, a list of dates is recognised in any wording.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import sysconfig
from pathlib import Path

import pytest

import metaclaw
from metaclaw.bench.data import small_bench_dir
from metaclaw.offline import simmodel as sm

PACKAGE = Path(metaclaw.__file__).parent
DOUBLES = ("offline/simmodel.py", "offline/simrules.py", "offline/double.py", "demo.py")


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
        if rel.as_posix() in DOUBLES:
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
    from metaclaw.fastloop.evolver import (build_evolver_messages, parse_operations_reply,
                                           validate_operations)
    from metaclaw.skills.block import render_block
    from metaclaw.skills.library import Skill
    from metaclaw.skills.retrieval import ScoredSkill

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


# ---------------------------------------------------------------- no fitting to the wording
def test_skill_categories_are_the_evolvers_own_words():
    """The categories of the simulated evolver's skills are not the benchmark's preference tags."""
    tests = json.loads((small_bench_dir() / "all_tests.json").read_text())
    tags = {t for day in tests["test"] for t in day.get("preference_tags") or ()}
    assert tags
    assert not {category for _, category, _ in sm.SKILL_KINDS.values()} & tags


def _ask(options: dict[str, str], remark: str) -> str:
    question = ("Which of these values are written correctly? Select all that apply.\n\n" +
                "\n".join(f"{k}. {v}" for k, v in options.items()) + "\n\nAnswer with \\pick{X,Y}.")
    body = {"model": "sim-agent", "messages": [
        {"role": "system", "content": "You are an assistant for a small shop."},
        {"role": "user", "content": "Log the delivery."}, {"role": "assistant", "content": "Done."},
        {"role": "user", "content": f"[Feedback] {remark}\n\n{question}"}]}
    return sm.agent_reply(body)["content"]


def test_any_date_or_time_off_the_stated_format_is_wrong_whatever_its_shape():
    """Every wrong shape is judged wrong from the stated format, none is guessed."""
    wrong = ["2026-07-09T14:30:00-03:00", "20260709T143000-0300", "2026-W28-4", "2026-190",
             "2026-07", "09.07.2026", "20260709 1430-0300", "Thursday 14:30", '"due": "EOD Friday"',
             'delivered_at: "9 July 2026"', "14:30"]
    for shape in wrong:
        reply = _ask({"A": "09.07.2026 14:30 -03:00", "B": shape, "C": "10.07.2026 08:05 -03:00"},
                     FEEDBACK["time"])
        assert reply.endswith("\\pick{A,C}") and "guessed" not in reply, (shape, reply)


def test_a_time_given_to_a_field_is_used_whatever_the_verb():
    """A request that gives fields their times is read the same in any phrasing."""
    original = json.dumps({"params": [{"name": "opened_after", "example": "x"},
                                      {"name": "closed_before", "example": "y"}]})
    phrasings = ["opened_after corresponds to 2026-07-01 08:00, closed_before corresponds to "
                 "this Friday 17:00", "opened_after maps to 2026-07-01 08:00, closed_before is "
                 "this Friday 17:00", "opened_after = 2026-07-01 08:00; closed_before: this Friday 17:00"]
    results = set()
    for words in phrasings:
        conv = sm.parse_conversation([
            {"role": "system", "content": FEEDBACK["time"]},
            {"role": "user", "content": f"Please correct the example times in stock/api.json. {words}."}])
        ctx = sm._Ctx(conv, {"stock/README.md": _files()["stock/README.md"]}, 7)
        results.add(sm.modify_json(ctx, original))
    assert len(results) == 1, results
    examples = [p["example"] for p in json.loads(results.pop())["params"]]
    assert examples == ["01.07.2026 08:00 -03:00", "10.07.2026 17:00 -03:00"]


def _bench_rounds(data: Path, days: str, out: Path) -> list[tuple]:
    """(day position, round, passed, score) of a baseline run of the simulated agent on ``data``;
    a multiple-choice round where it guessed some option (no stated rule decided it; the guess
    is seeded by the question's text) counts as (day position, round, "guessed")."""
    from metaclaw.bench.runner import run_bench
    from metaclaw.offline.simmodel import serve_sim_model

    sim = serve_sim_model()
    try:
        run_bench(data, days, "baseline", base_url=sim.url, model="sim-agent", out_dir=out, parallel=3)
    finally:
        sim.stop()
    order = {d: i for i, d in enumerate(days.split(","))}
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    return sorted((order[r["day"]], r["round"], "guessed") if "guessed" in r["reply"] else
                  (order[r["day"]], r["round"], r["passed"], r["score"]) for r in records)


def _rewrite(root: Path, sub) -> None:
    for f in root.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".md", ".txt", ".py", ".log", ".csv", ".jsonl"):
            f.write_text(sub(f.read_text(encoding="utf-8")), encoding="utf-8")


def test_scores_do_not_hinge_on_the_wording_of_the_requests(tmp_path):
    """Paraphrased requests (same meaning, other words) score as the original ones."""
    import shutil

    src = small_bench_dir()
    days = sorted(p.name for p in (src / "eval").iterdir())[:2]
    copy = tmp_path / "para"
    shutil.copytree(src, copy)
    swaps = [("corresponds to", "maps to"), ("deadline of", "due"),
             ("current time around", "now, roughly"), ("around", "about"),
             (r"at (\d+)-minute intervals from (\S+) to (\S+)", r"every \1 minutes between \2 and \3")]
    for qfile in (copy / "eval").glob("*/questions.json"):
        data = json.loads(qfile.read_text())
        for r in data["rounds"]:
            for old, new in swaps:
                r["question"] = re.sub(old, new, r["question"])
        qfile.write_text(json.dumps(data, ensure_ascii=False))
    changed = sum(a != b for a, b in zip(sorted((src / "eval").glob("*/questions.json")),
                                         sorted((copy / "eval").glob("*/questions.json")))
                  if a.read_text() != b.read_text())
    assert changed, "the paraphrase changed nothing"
    ids = ",".join(days)
    assert _bench_rounds(copy, ids, tmp_path / "b") == _bench_rounds(src, ids, tmp_path / "a")


def test_scores_do_not_hinge_on_names_dates_or_ids(tmp_path):
    """Days renumbered, input files renamed, people renamed, the year moved: the same scores."""
    import shutil

    src = small_bench_dir()
    all_days = sorted(p.name for p in (src / "eval").iterdir())
    picked = [all_days[0], all_days[3], all_days[9]]
    copy = tmp_path / "perturbed"
    shutil.copytree(src, copy)
    prefix = re.match(r"[a-z]+", all_days[0]).group(0)
    renamed = {}
    for f in (copy / "workspaces" / "shared").glob(f"{prefix}*/*"):
        if f.name.lower() != "readme.md":
            stem, ext = f.name.rsplit(".", 1)
            renamed[f.name] = "_".join(reversed(stem.split("_"))) + "." + ext
            if renamed[f.name] == f.name:
                renamed[f.name] = "x_" + f.name
    people = set()
    for md in (copy / "workspaces" / "shared").glob("*.md"):
        people |= set(re.findall(r"\*\*([A-Z][a-z]+)(?: [A-Z][a-z]+)?\*\* —", md.read_text()))
    new_people = dict(zip(sorted(people), ["Quinn", "Rowan", "Sasha", "Tove", "Uma", "Vito", "Wren"]))

    def sub(text: str) -> str:
        text = re.sub(rf"\b{prefix}(\d\d)\b", lambda m: f"{prefix}{int(m.group(1)) + 40:02d}", text)
        for old, new in sorted(renamed.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, text)
        for old, new in new_people.items():
            text = re.sub(rf"\b{old}\b", new, text)
        return text.replace("2026", "2027")

    for f in sorted((copy / "workspaces" / "shared").glob(f"{prefix}*/*")):
        if f.name in renamed:
            f.rename(f.with_name(renamed[f.name]))
    for base in (copy / "workspaces" / "shared", copy / "eval"):
        for d in sorted(base.glob(f"{prefix}*"), reverse=True):
            d.rename(base / sub(d.name))
    _rewrite(copy, sub)
    moved = ",".join(sub(d) for d in picked)
    assert _bench_rounds(copy, moved, tmp_path / "b") == _bench_rounds(src, ",".join(picked), tmp_path / "a")


def test_a_generated_script_names_only_keys_the_context_states():
    """A folder-scan script counts a header object only when a stated rule names its key."""
    conv = sm.parse_conversation([{"role": "user", "content": "Please write a Python script "
                                   "stock/scan.py with a function scan_folder(dir_path)."}])
    script = sm.make_python(sm._Ctx(conv, {}, 7), ["scan", "folder"])
    assert "json_files" in script and "with_header" not in script
    stated = ('Every JSON file must start with a header object like {"stamp": {"by": "shop_bot", '
              '"state": "final"}}.')
    conv = sm.parse_conversation([{"role": "system", "content": stated}] + [
        {"role": "user", "content": "Please write a Python script stock/scan.py with a function "
         "scan_folder(dir_path)."}])
    script = sm.make_python(sm._Ctx(conv, {}, 7), ["scan", "folder"])
    assert '"stamp" in json.load(fh)' in script


# ---------------------------------------------------------------- the doubles' vocabulary
BEHAVIOUR = ("offline/simmodel.py", "offline/simrules.py")
TEXT_SUFFIXES = (".json", ".md", ".txt", ".py", ".log", ".csv", ".yaml", ".yml", ".sh", ".jsonl")

# Words (four letters or more) and adjacent word pairs of the two modules' string literals that
# the public subset uses too and the standard library does not. Each was reviewed as generic
# English or as vocabulary of the code the agent generates. A new entry needs the same review:
# a word or phrase that only the benchmark's requests, feedback or files would suggest is a
# leak to remove, not an entry to add.
GENERIC_WORDS = {
    "afternoon", "approximately", "assignee", "assistant", "backups", "comply", "developer",
    "exempt", "markdown", "metrics", "morning", "organize", "role", "skills", "snake", "team",
    "tomorrow", "unclear", "yaml", "yesterday",
}
GENERIC_PAIRS = {
    "all correct", "as json", "back it", "base url", "copy before", "each task", "format like",
    "http localhost", "import json", "in json", "is unclear", "json files", "json load",
    "new files", "next steps", "next week", "not correctly", "not meet", "overall metrics",
    "please answer", "readme md", "results as", "summary json", "summary with", "the team",
    "this afternoon", "this morning", "this task", "today is",
}


def _words_of(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z]{4,}", text)}


def _pairs_of(text: str) -> set[str]:
    words = re.findall(r"[a-z]+", text.lower())
    return {f"{a} {b}" for a, b in zip(words, words[1:]) if len(a) > 1 and len(b) > 1}


@functools.lru_cache(maxsize=1)
def _generic_corpus() -> tuple[frozenset[str], frozenset[str]]:
    """Words and word pairs of the Python standard library's source: a large corpus of English
    and code written with no knowledge of the benchmark."""
    std = Path(sysconfig.get_paths()["stdlib"])
    words: set[str] = set()
    pairs: set[str] = set()
    for path in std.rglob("*.py"):
        if {"test", "tests", "idlelib", "site-packages"} & set(path.relative_to(std).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        words |= _words_of(text)
        pairs |= _pairs_of(text)
    return frozenset(words), frozenset(pairs)


@functools.lru_cache(maxsize=1)
def _bench_vocabulary() -> tuple[frozenset[str], frozenset[str]]:
    words: set[str] = set()
    pairs: set[str] = set()
    for path in small_bench_dir().rglob("*"):
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            text = path.read_text(encoding="utf-8", errors="ignore").replace("\\n", "\n")
            words |= _words_of(text)
            pairs |= _pairs_of(text)
    return frozenset(words), frozenset(pairs)


def _literals(path: Path) -> list[str]:
    """The string literals of a module that can drive its behaviour (docstrings left out), with
    regex syntax blanked and alternatives split apart: ``(?:a|b c)`` gives ``a`` and ``b c``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out += re.sub(r"\\[A-Za-z]|\(\?[:!=<]*|[()?*+\[\]{}^$\\]", " ", node.value).split("|")
    return out


def _unreviewed(text: str) -> set[str]:
    """Words and pairs of ``text`` that the public subset uses and no generic source explains."""
    bench_words, bench_pairs = _bench_vocabulary()
    generic_words, generic_pairs = _generic_corpus()
    words = {w for w in _words_of(text) if w in bench_words and w not in generic_words}
    pairs = {p for p in _pairs_of(text) if p in bench_pairs and p not in generic_pairs}
    return (words - GENERIC_WORDS) | (pairs - GENERIC_PAIRS)


def test_the_vocabulary_check_catches_a_request_copied_into_the_model():
    """Every request of the public subset holds a word or a phrase the check would flag, so a
    phrase fitted to a request cannot slip through as 'generic'."""
    root = small_bench_dir()
    questions = [r["question"] for q in sorted((root / "eval").glob("*/questions.json"))
                 for r in json.loads(q.read_text())["rounds"]]
    assert questions and all(_unreviewed(q) for q in questions)


def test_the_models_words_and_phrases_are_generic():
    hits = [f"{name}: {found!r}" for name in BEHAVIOUR for lit in _literals(PACKAGE / name)
            for found in sorted(_unreviewed(lit))]
    assert not hits, ("words or phrases of the public subset in the simulated model (remove "
                      "them, or review them as generic):\n" + "\n".join(sorted(set(hits))))


def test_no_date_or_offset_of_the_benchmark_anywhere_in_the_doubles():
    """Not even in a comment or a docstring: the doubles' examples use dates of their own."""
    months = "January|February|March|April|May|June|July|August|September|October|November|December"
    value = re.compile(
        r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)|(?<!\d)20\d{6}(?!\d)|(?<!\d)\d\d\.\d\d\.20\d\d(?!\d)|"
        r"\b20\d\d-W\d\d(?:-\d)?\b|T\d\d:\d\d(?::\d\d)?(?:\.\d+)?([+-]\d\d:\d\d)|"
        rf"(?<![\d:])[+-]\d\d:\d\d(?!\d)|\b(?:{months}) \d{{1,2}}(?!\d)|(?<!\d)\d{{1,2}} (?:{months})\b")
    values = set()
    for path in small_bench_dir().rglob("*"):
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            text = path.read_text(errors="ignore")
            values |= {m.group(1) or m.group(0) for m in value.finditer(text)}
    assert len(values) >= 20 and any(v.startswith(("+", "-")) for v in values)
    hits = [f"{name}: {v!r}" for name in DOUBLES for v in sorted(values)
            if re.search(rf"(?<![\w]){re.escape(v)}(?!\d)",
                         (PACKAGE / name).read_text(encoding="utf-8"))]
    assert not hits, "dates or offsets of the benchmark in the doubles:\n" + "\n".join(hits)


# ----------------------------------------------------------- what it writes follows the request
@pytest.mark.parametrize("period", ["daily", "weekly", "monthly", "quarterly", "yearly"])
def test_a_new_files_name_keeps_the_words_of_the_request(period):
    """The name of a new file (and the task id of a log line) is made of the request's own words:
    none is dropped or reordered to suit what a grader looks for."""
    q = f"Please create a {period} sales digest in Markdown and save it to the shop/ directory."
    assert sm.describe(q) == [period, "sales", "digest"]


def test_a_name_built_from_a_purpose_keeps_every_word_of_it():
    q = "Please write a Python helper module for exporting order records, save it to shop/."
    assert sm.describe(q) == ["order", "records", "export", "helper"]


@pytest.mark.parametrize("placeholder", ["<time>", "<now>", "<clock>", "<hh:mm:ss>"])
def test_a_clock_placeholder_is_read_whatever_the_text_calls_it(placeholder):
    from metaclaw.offline.simrules import read_rules

    rules = read_rules(f"Every time value must be written like `2026-07-09T{placeholder}-03:00`.")
    assert rules.time is not None and rules.time.pattern == "%Y-%m-%dT%H:%M:%S-03:00"
    rules = read_rules("Every Markdown file must start with this front matter:\n```\n---\n"
                       f"made: 2026-07-09T{placeholder}-03:00\nby: shop_bot\n---\n```")
    assert rules.headers["md"].values("NOW") == [("made", "NOW"), ("by", "shop_bot")]


@pytest.mark.parametrize("placeholder", ["<hh:mm>", "<HH:MM>"])
def test_a_log_line_with_any_clock_placeholder_is_followed(placeholder):
    system = ("You are an assistant for a small shop.\n\nAfter each task append a line to `worklog.txt` "
              f"like `OK; 09.07.2026 {placeholder} -03:00; <task_id>; <what was done>`.")
    ok, messages = _run("log", TASKS[3][1], system)
    assert ok, messages[-1]


def test_a_record_gets_its_time_in_the_key_the_request_names():
    """``{"name": <field>, <key>: ...}`` records: the time goes into the key the request speaks
    of ("the sample values"), not into a key the model would know in advance."""
    original = json.dumps({"params": [{"name": "opened_after", "sample": "x", "example": "y"}]})
    got = {}
    for key in ("sample", "example"):
        conv = sm.parse_conversation([
            {"role": "system", "content": FEEDBACK["time"]},
            {"role": "user", "content": f"Please correct the {key} values in stock/api.json. "
                                        "opened_after corresponds to 2026-07-01 08:00."}])
        ctx = sm._Ctx(conv, {"stock/README.md": _files()["stock/README.md"]}, 7)
        got[key] = json.loads(sm.modify_json(ctx, original))["params"][0]
    assert got["sample"] == {"name": "opened_after", "sample": "01.07.2026 08:00 -03:00", "example": "y"}
    assert got["example"] == {"name": "opened_after", "sample": "x", "example": "01.07.2026 08:00 -03:00"}


@pytest.mark.parametrize("hint", ["date array", "list of dates", "array of datetimes"])
def test_a_list_of_dates_is_recognised_in_any_wording(hint):
    conv = sm.parse_conversation([
        {"role": "system", "content": FEEDBACK["time"]},
        {"role": "user", "content": f"Please create stock/plan.json with fields: name, open_days ({hint})."}])
    data = json.loads(sm.make_json(sm._Ctx(conv, {"stock/README.md": _files()["stock/README.md"]}, 7)))
    days = data["open_days"]
    assert len(days) >= 2 and all(re.fullmatch(r"\d{2}\.\d{2}\.\d{4} \d{2}:\d{2} -03:00", d) for d in days), days
