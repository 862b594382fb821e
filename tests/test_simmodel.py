"""The simulated model of the offline demo: agent, judge and evolver, graded with the real bench code.

The agent is driven in-process with the benchmark's own pieces (workspace tools, system prompt,
feedback protocol, graders) so these tests stay fast; one test goes through the HTTP server and the
real agent loop. Skills given to the agent here are always written by the simulated evolver from
the feedback of failed rounds: nothing is hand-written for the benchmark.
"""

from __future__ import annotations

import ast
import json

import httpx
import pytest

from metaclaw.bench.agent import system_prompt
from metaclaw.bench.data import load_benchmark, small_bench_dir
from metaclaw.bench.grading import (feedback_text, run_check, score_choice, standalone_feedback,
                                    with_feedback)
from metaclaw.bench.workspace import TOOL_SCHEMAS, Workspace, execute_tool
from metaclaw.offline import simmodel as sm
from metaclaw.skills.block import render_block
from metaclaw.skills.library import Skill
from metaclaw.skills.retrieval import ScoredSkill

DATA = small_bench_dir()


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(DATA)


def learned_block(support) -> str:
    """The injected block for the skills the simulated evolver writes from ``support`` items."""
    from metaclaw.fastloop.evolver import build_evolver_messages

    out = sm.sim_reply({"model": "sim-evolver", "messages": build_evolver_messages(support, [], 0)})
    ops = json.loads(out["content"])["operations"]
    return render_block([ScoredSkill(Skill(name=o["name"], description=o["description"],
                                           category=o["category"], body=o["body"]), 1.0) for o in ops])


def drive_day(bench, day_id, block="", rounds=None, seed=sm.DEFAULT_SEED):
    """Run a day's rounds with the simulated agent in-process; returns round records."""
    day = bench.day(day_id)
    ws = Workspace.create(day.workspace_src, day.id)
    try:
        system = system_prompt(ws)
        if block:
            system += "\n\n" + block
        messages = [{"role": "system", "content": system}] + [dict(m) for m in day.seed_messages]
        records, feedback = [], None
        for round_ in day.rounds[:rounds]:
            messages.append({"role": "user", "content": with_feedback(feedback, round_.question)})
            calls = 0
            while True:
                out = sm.sim_reply({"model": "sim-agent", "messages": messages, "tools": TOOL_SCHEMAS}, seed)
                calls += 1
                assert calls < 12, "the simulated agent did not finish the round"
                messages.append({"role": "assistant", "content": out["content"] or "",
                                 **({"tool_calls": out["tool_calls"]} if out["tool_calls"] else {})})
                if not out["tool_calls"]:
                    break
                for call in out["tool_calls"]:
                    result = execute_tool(ws, call["function"]["name"], call["function"]["arguments"])
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            reply = out["content"]
            choice = None
            if round_.type == "file_check":
                check = run_check(round_, ws.root, initial_files=ws.initial_files)
                passed, score, detail = check.passed, float(check.passed), check.stdout + check.stderr
            else:
                choice = score_choice(reply, round_)
                passed, score, detail = choice.passed, choice.score, choice.selected
            malformed = []
            for rel in set(ws.files()) - set(ws.initial_files):
                text = (ws.root / rel).read_text()
                try:
                    if rel.endswith(".json"):
                        json.loads(text)
                    elif rel.endswith(".py"):
                        ast.parse(text)
                except (ValueError, SyntaxError) as exc:
                    malformed.append(f"{rel}: {exc}")
            records.append({"day": day_id, "round": round_.id, "type": round_.type, "passed": passed,
                            "score": score, "detail": detail, "reply": reply,
                            "files": ws.files(), "malformed": malformed})
            feedback = feedback_text(round_, passed, choice) or None
        return records
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- the fast loop in miniature
@pytest.mark.parametrize("day_id", ["day01", "day03", "day07"])
def test_first_round_fails_naive_and_passes_with_skills_from_its_own_feedback(bench, day_id):
    """Round 1 fails with nothing in context; the evolver turns that failure's feedback into a
    skill; with the skill injected the same round passes."""
    naive = drive_day(bench, day_id, rounds=1)[0]
    assert naive["type"] == "file_check"
    assert not naive["passed"], f"{day_id} passed with no rule in context: {naive['detail']}"
    block = learned_block([_support(bench, day_id, 0, 1)])
    assert block
    skilled = drive_day(bench, day_id, block, rounds=1)[0]
    assert skilled["passed"], f"{day_id} failed with the learned skill: {skilled['detail']}\n{block}"


def test_agent_uses_real_tool_calls_and_backs_up_before_modifying(bench):
    day = bench.day("day07")
    ws = Workspace.create(day.workspace_src, day.id)
    try:
        block = learned_block([_support(bench, "day07", 0, 1)])
        messages = [{"role": "system", "content": system_prompt(ws) + "\n\n" + block},
                    {"role": "user", "content": day.rounds[0].question}]
        names = []
        for _ in range(10):
            out = sm.agent_reply({"model": "sim-agent", "messages": messages, "tools": TOOL_SCHEMAS})
            messages.append({"role": "assistant", "content": out["content"] or "",
                             **({"tool_calls": out["tool_calls"]} if out["tool_calls"] else {})})
            if not out["tool_calls"]:
                break
            for call in out["tool_calls"]:
                assert call["type"] == "function" and call["id"].startswith("call_sim_")
                json.loads(call["function"]["arguments"])
                names.append(call["function"]["name"])
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": execute_tool(ws, call["function"]["name"],
                                                         call["function"]["arguments"])})
        assert names[0] in ("list_dir", "read_file")
        assert names.index("copy_file") < names.index("write_file")
        assert out["content"].startswith(sm.LABEL)
        bak = [p for p in ws.files() if p not in ws.initial_files and p.endswith(".bak")]
        assert len(bak) == 1
        original = (day.workspace_src / bak[0][:-4]).read_text()
        assert (ws.root / bak[0]).read_text() == original
        assert (ws.root / bak[0][:-4]).read_text() != original
    finally:
        ws.cleanup()


def test_outputs_are_well_formed_all_days(bench):
    for day in bench.days:
        for r in drive_day(bench, day.id):
            assert not r["malformed"], r


def _judge_body(next_user):
    from metaclaw.fastloop.judge import build_judge_messages

    turn = {"request_messages": [{"role": "user", "content": "Please write day01/standup.json"}],
            "response": "[simulated model] Done.", "tool_calls": None}
    return {"model": "sim-judge", "messages": build_judge_messages(turn, next_user)}


def test_judge_speaks_the_wire_format_and_reads_feedback(bench):
    from metaclaw.fastloop.judge import parse_verdict

    r1 = bench.day("day01").rounds[0]
    wrong = with_feedback(feedback_text(r1, False), bench.day("day01").rounds[1].question)
    right = with_feedback(feedback_text(r1, True), bench.day("day01").rounds[1].question)
    scores = {}
    for name, nxt in (("wrong", wrong), ("right", right), ("none", None),
                      ("closing", "That is all for today, thank you.")):
        out = sm.sim_reply(_judge_body(nxt))
        data = json.loads(out["content"])
        assert set(data) == {"score", "rationale"} and data["score"] in (-1, 0, 1)
        assert data["rationale"].startswith("simulated judge")
        assert parse_verdict(out["content"])[0] == data["score"]
        scores[name] = data["score"]
    assert scores == {"wrong": -1, "right": 1, "none": 0, "closing": 0}


def test_judge_scores_every_feedback_text_of_the_data(bench):
    for day in bench.days:
        for round_ in day.rounds:
            assert sm.feedback_score(feedback_text(round_, True, _choice(round_, True))) == 1
            assert sm.feedback_score(feedback_text(round_, False, _choice(round_, False))) == -1


def _choice(round_, passed):
    if round_.type != "multi_choice":
        return None
    reply = "\\bbox{" + ",".join(round_.answer if passed else ["Z"]) + "}"
    return score_choice(reply, round_)


def _support(bench, day_id, round_index, turn_id):
    day = bench.day(day_id)
    round_ = day.rounds[round_index]
    nxt = with_feedback(feedback_text(round_, False, _choice(round_, False)),
                        day.rounds[round_index + 1].question) if round_index + 1 < len(day.rounds) \
        else standalone_feedback(feedback_text(round_, False, _choice(round_, False)))
    return {"id": turn_id, "task": round_.question, "tools": "(no tool calls)", "reply": "done",
            "rationale": "simulated judge: the user's feedback reports a problem", "feedback": nxt,
            "reward": -1}


def test_evolver_adds_one_skill_per_convention_and_validates(bench):
    from metaclaw.fastloop.evolver import build_evolver_messages, validate_operations

    support = [_support(bench, "day01", 0, 11), _support(bench, "day03", 0, 12),
               _support(bench, "day07", 0, 13)]
    body = {"model": "sim-evolver", "messages": build_evolver_messages(support, [], 0)}
    out = sm.sim_reply(body)
    data = json.loads(out["content"])
    ops = validate_operations(data, {}, [11, 12, 13])
    names = {op.name: op for op in ops}
    assert set(names) == {"stated-time-format", "stated-file-naming", "stated-backup-rule"}
    assert all(op.op == "add" for op in ops)
    assert names["stated-time-format"].evidence == [11]
    for op in ops:
        assert "simulated" in op.reason and "simulated" in op.skill.body
    # each skill quotes the feedback verbatim, so the agent reads the same rule back from it
    from metaclaw.offline.simrules import read_rules

    for kind, name in (("time", "stated-time-format"), ("naming", "stated-file-naming"),
                       ("backup", "stated-backup-rule")):
        assert kind in read_rules(names[name].skill.body).kinds
    fb = feedback_text(bench.day("day01").rounds[0], False)
    assert read_rules(names["stated-time-format"].skill.body).time == read_rules(fb).time


def test_evolver_edits_instead_of_duplicating(bench):
    from metaclaw.fastloop.evolver import build_evolver_messages, validate_operations
    from metaclaw.offline.simrules import read_rules

    first = json.loads(sm.sim_reply({"model": "sim-evolver", "messages": build_evolver_messages(
        [_support(bench, "day01", 0, 1)], [], 0)})["content"])
    op = first["operations"][0]
    library = [Skill(name=op["name"], description=op["description"], category=op["category"],
                     body=op["body"])]
    again = sm.sim_reply({"model": "sim-evolver", "messages": build_evolver_messages(
        [_support(bench, "day02", 0, 2)], library, 1)})
    ops = validate_operations(json.loads(again["content"]), {s.name: s for s in library}, [2])
    assert [(o.op, o.name) for o in ops] == [("edit", "stated-time-format")]
    new_fb = feedback_text(bench.day("day02").rounds[0], False)
    assert read_rules(new_fb).time.example in ops[0].skill.body   # the new feedback is quoted
    # the same feedback again adds nothing new: no operation
    same = sm.sim_reply({"model": "sim-evolver", "messages": build_evolver_messages(
        [_support(bench, "day01", 0, 3)], library, 1)})
    assert json.loads(same["content"]) == {"operations": []}


def test_evolver_ignores_success_feedback_and_next_question(bench):
    from metaclaw.fastloop.evolver import build_evolver_messages

    day = bench.day("day01")
    ok = {"id": 5, "task": "t", "tools": "", "reply": "r", "rationale": "", "reward": 1,
          "feedback": with_feedback(feedback_text(day.rounds[0], True), day.rounds[1].question)}
    out = sm.sim_reply({"model": "sim-evolver", "messages": build_evolver_messages([ok], [], 0)})
    assert json.loads(out["content"]) == {"operations": []}   # options of the next question are not rules


# ---------------------------------------------------------------- determinism and the server
def test_deterministic(bench):
    a = drive_day(bench, "day04")
    b = drive_day(bench, "day04")
    assert [(r["passed"], r["reply"], r["files"]) for r in a] == [(r["passed"], r["reply"], r["files"]) for r in b]
    body = {"model": "sim-agent", "messages": [{"role": "user", "content": bench.day("day01").rounds[1].question}]}
    assert sm.sim_reply(body) == sm.sim_reply(body)


def test_conversation_parsing_edge_cases():
    assert sm.split_feedback("[Note] bad.\nKeep this in mind.\n\nQ1\n\nA. x") == \
        ("[Note] bad.\nKeep this in mind.", "Q1\n\nA. x")
    assert sm.split_feedback("just a question") == ("", "just a question")
    out = sm.sim_reply({"model": "sim-agent", "messages": [{"role": "user", "content": "[Note] ok"}]})
    assert out["content"].startswith(sm.LABEL) and out["tool_calls"] is None
    no_tools = sm.sim_reply({"model": "sim-agent", "messages": [
        {"role": "user", "content": "Please create day01/x.json with fields: a_at"}]})
    assert "tools" in no_tools["content"] and no_tools["tool_calls"] is None
    assert sm.parse_when("this Friday 18:00", __import__("datetime").date(2026, 3, 16)).isoformat() == \
        "2026-03-20T18:00:00"


@pytest.mark.parametrize("body", [
    {}, {"messages": "nope"}, {"model": "sim-judge", "messages": [None, 3]},
    {"model": "sim-evolver", "messages": [{"role": "user", "content": "=== Support turns ===\n{oops"}]},
    {"model": "sim-agent", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "tools": ["bad", {"function": {"name": "read_file"}}]},
    # text parts whose text is missing or no string (read as no text, not joined)
    {"model": "sim-agent", "messages": [{"role": "system", "content": [{"type": "text"}]},
                                        {"role": "user", "content": [{"type": "text", "text": None},
                                                                     {"type": "text", "text": 7}]}]},
    {"model": "sim-judge", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    {"model": "sim-evolver", "messages": [{"role": "user", "content": [{"text": None}]}]},
])
def test_odd_requests_get_a_labelled_reply_not_a_crash(body):
    out = sm.sim_reply(body)
    assert isinstance(out["content"], str) and out["content"]
    if "judge" in str(body.get("model")):
        assert json.loads(out["content"])["score"] == 0
    elif "evolver" in str(body.get("model")):
        assert json.loads(out["content"]) == {"operations": []}
    else:
        assert out["content"].startswith(sm.LABEL)


def test_server_lists_sim_models_and_runs_a_day(bench, tmp_path):
    from metaclaw.bench.runner import run_bench

    server = sm.serve_sim_model()
    try:
        models = httpx.get(server.url + "/models").json()
        ids = [m["id"] for m in models["data"]]
        assert ids and all(i.startswith("sim-") for i in ids)
        summary = run_bench(DATA, "day01", "baseline", base_url=server.url, model="sim-agent",
                            out_dir=tmp_path / "out")
        assert summary["rounds"] == 5 and not summary["errors"]
        rows = [json.loads(line) for line in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
        assert [r["passed"] for r in rows] == [r["passed"] for r in drive_day(bench, "day01")]
        assert all(r["reply"].startswith(sm.LABEL) for r in rows)
        judge = httpx.post(server.url + "/chat/completions", json=_judge_body(None)).json()
        assert json.loads(judge["choices"][0]["message"]["content"])["score"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("reaction, score", [
    ("Not correct - times are ISO 8601 with +08:00, e.g. 2026-03-16T09:30:00+08:00", -1),
    ("Correct the time: it should use ISO 8601", -1),
    ("Nope. Use ISO 8601 with the offset", -1),
    ("Hmm, not quite: the offset is missing", -1),
    ("That is not the format we use for times", -1),
    ("Could you switch to ISO 8601?", -1),
    ("No: times must be ISO 8601", -1),
    ("Correct the date format, please", -1), ("Correct your answer: ISO 8601 times", -1),
    ("Correct!", 1), ("Perfect, thanks", 1), ("Thanks, looks good", 1),
    ("No, that's perfect, thanks!", 1), ("No problems, all correct.", 1),
    ("That's correct - nothing should change", 1), ("Hmm, that works, thanks", 1),
    ("No complaints - works great", 1), ("Looks good. Please use the same format next time.", 1),
    ("That is all for today, thank you.", 0),
    ("No, I asked for the file to be named notes.md, not release_notes.md.", -1),
    ("No, I asked for notes.md. " + "The release notes belong in that one file. " * 5, -1),
    ("No problem, next task: write a haiku", 0), ("No worries. Now list the files.", 0),
    ("That's exactly what I asked for, thanks!", 0), ("Like I said, this works great.", 1),
    ("No, that's fine.", 0), ("No, you're right.", 0), ("No, it should be ISO 8601", -1),
    ("Now, I asked my team and they want a summary too.", 0),
    ("No. Now a new task: " + "write the quarterly report and send it to finance. " * 5, 0)])
def test_the_simulated_judge_reads_a_correction_as_people_phrase_it(reaction, score):
    """"Not correct ..." scored +1 (its "correct"), and "Nope", "not quite", "switch to ..."
    scored 0: a real user's correction taught nothing. Praise that opens with "No," or says
    "should" stays praise."""
    assert sm.feedback_score(sm.feedback_of(reaction)) == score


def test_the_simulated_evolver_names_the_files_each_agent_wrote():
    """Claude Code's write tool takes ``file_path`` and opencode's ``filePath``: every failed
    turn was noted "-> wrote nothing", and opencode's quotes around its ask leaked in."""
    line = sm._trail({"id": 3, "task": '"write the standup time into notes.json"',
                      "tools": 'call Write {"file_path": "notes.json", "content": "x"}\n'
                               'call write {"filePath": "b.json", "content": "y"}'})
    assert line == "turn 3: 'write the standup time into notes.json' -> wrote notes.json, b.json"
