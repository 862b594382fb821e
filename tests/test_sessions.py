"""Sessions and turn types without cooperation from the client: the documented precedence, real
OpenClaw requests, side-call rules, hostile session ids, and a captured request replayed
through the proxy."""

import contextlib
import json
import os
import shutil
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.proxy.sessions import ReplyThreads, identify
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.skills.retrieval import explain_frame
from metaclaw.trace import sessions as trace_sessions
from metaclaw.turns import (TASK_TURNS_SQL, IdentityError, is_task_turn, stage_of,
                            turn_type_condition)
from test_asks import captured

ASK = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("headers, body, session, how", [
    ({"X-Session-Id": "h"}, {"session_id": "b", "messages": ASK}, "h", "header:X-Session-Id"),
    ({}, {"session_id": "b", "metadata": {"session_id": "m"}, "messages": ASK}, "b",
     "body:session_id"),
    ({"X-Conversation-Id": "c1"}, {"metadata": {"session_id": "m"}, "messages": ASK}, "c1",
     "header:X-Conversation-Id"),
    ({}, {"metadata": {"session_id": "m"}, "messages": ASK}, "m", "metadata:session_id"),
    ({}, {"metadata": {"user_id": "user_ab12_account_cd34_session_0f1e2d3c-aaaa"},
          "messages": ASK}, "0f1e2d3c-aaaa", "metadata:user_id"),
    ({}, {"messages": [{"role": "user", "content": "hi\n\nRuntime: agent=main | "
                                                   "sessionId=7d3f0c1a-9b2e | host=x"}]},
     "7d3f0c1a-9b2e", "message:sessionId"),
])
def test_session_precedence(headers, body, session, how):
    identity = identify(headers, body)
    assert (identity.session_id, identity.how["session"]) == (session, how)


def test_without_any_id_the_conversation_fingerprint_keeps_conversations_apart():
    first = {"role": "user", "content": "[Mon 2026-11-23 11:30 UTC] plan my week"}
    turn1 = identify({}, {"messages": [first]})
    turn2 = identify({}, {"messages": [first, {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "and next week?"}]})
    other = identify({}, {"messages": [{"role": "user", "content": "[Mon 2026-11-23 11:42 UTC] "
                                                                   "plan my week"}]})
    another_user = identify({}, {"user": "bob", "messages": [first]})
    assert turn1.session_id == turn2.session_id and turn1.session_id.startswith("conv-")
    assert len({turn1.session_id, other.session_id, another_user.session_id}) == 3
    assert turn1.how["session"] == "fingerprint:first-user-message"
    assert identify({}, {"messages": []}).session_id == "unidentified"


def test_real_openclaw_requests_are_grouped_by_openclaws_own_session():
    ids = {name: identify(captured("openclaw", name)["headers"], captured("openclaw", name)["body"])
           for name in ("001", "002", "003", "004", "005", "006")}
    first = ids["001"].session_id
    assert first == "f97f23cd-b4ef-4851-aaa7-85ec94740015"
    assert all(ids[n].session_id == first for n in ("002", "003", "004", "006"))
    assert ids["005"].session_id == "36d02417-ff33-4cae-9520-e437d24c973a"  # `--session-id`
    assert all(i.turn_type == "main" and i.how == {"session": "message:sessionId",
                                                   "turn_type": "default"} for i in ids.values())


@pytest.mark.parametrize("body, rule", [
    ({"messages": [{"role": "system", "content": "Generate a concise title for this "
                                                 "conversation in 3-7 words."},
                   {"role": "user", "content": "how do I bake bread"}]}, "title"),
    ({"messages": [{"role": "user", "content": "Your task is to create a detailed summary of the "
                                               "conversation so far, paying attention to ..."}]},
     "summary"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}, "quota-probe"),
    ({"messages": [{"role": "user", "content": "do the subtask\n\nRuntime: agent=main | "
                                               "session=agent:main:subagent:42 | sessionId=abcdef1"}]},
     "sub-agent"),
])
def test_side_calls_are_recognised(body, rule):
    identity = identify({}, body)
    assert identity.turn_type == "side" and identity.how["turn_type"] == f"rule:{rule}"
    # the client's own word wins
    assert identify({"X-Turn-Type": "main"}, body).turn_type == "main"


def test_a_user_asking_about_titles_is_still_a_main_turn():
    body = {"tools": [{"type": "function", "function": {"name": "write"}}],
            "messages": [{"role": "user", "content": "Change the title of README.md to 'Intro'"}]}
    assert identify({}, body).turn_type == "main"


@pytest.mark.parametrize("given, expected", [
    ("stage:plan", "stage:plan"), (" Stage:Plan ", "stage:plan"),
    ("stage:write-up_2", "stage:write-up_2"), ("stage:" + "x" * 64, "stage:" + "x" * 64),
    ("MAIN", "main"), ("side", "side"),
])
def test_stage_turn_types_are_accepted_from_header_and_body(given, expected):
    identity = identify({"X-Turn-Type": given}, {"messages": ASK})
    assert (identity.turn_type, identity.how["turn_type"]) == (expected, "header:X-Turn-Type")
    identity = identify({}, {"turn_type": given, "messages": ASK})
    assert (identity.turn_type, identity.how["turn_type"]) == (expected, "body:turn_type")
    # the header wins over the body
    assert identify({"X-Turn-Type": given}, {"turn_type": "side", "messages": ASK}).turn_type \
        == expected


@pytest.mark.parametrize("given", [
    "sidecar", "stage", "stage:", "stage:plan!", "stage:a/b", "stage:a b", "stage:-x",
    "stage:_x", "stage:" + "x" * 65, "stage:pl\u00e4n", "stage:\x1b[31mred", "stage::plan",
    "main:plan", "x" * 5000,
])
def test_malformed_turn_types_are_refused_naming_the_field(given):
    with pytest.raises(IdentityError) as caught:
        identify({"X-Turn-Type": given}, {"messages": ASK})
    message = str(caught.value)
    assert caught.value.param == "turn_type"
    assert "header X-Turn-Type" in message and "'stage:<name>'" in message
    assert "\x1b" not in message and len(message) < 400  # no raw control bytes, no echo flood
    with pytest.raises(IdentityError) as caught:
        identify({}, {"turn_type": given, "messages": ASK})
    assert "body 'turn_type'" in str(caught.value)


def test_one_predicate_says_which_turns_do_the_task(store):
    assert is_task_turn("main") and is_task_turn("stage:plan")
    assert not is_task_turn("side") and not is_task_turn(None) and not is_task_turn("")
    assert (stage_of("stage:plan"), stage_of("main"), stage_of("side"), stage_of(None)) == \
        ("plan", None, None, None)
    ids = {t: store.record_turn(session_id="s", turn_type=t, request_messages=ASK, status="ok")
           for t in ("main", "side", "stage:plan", "stage:write")}
    rows = store.query(f"SELECT turn_type FROM turns WHERE {TASK_TURNS_SQL} ORDER BY id")
    assert [r["turn_type"] for r in rows] == ["main", "stage:plan", "stage:write"]
    assert {t for t in ids if is_task_turn(t)} == {r["turn_type"] for r in rows}
    for value, expected in [("stage", ["stage:plan", "stage:write"]),
                            ("STAGE:Plan", ["stage:plan"]), ("side", ["side"])]:
        where, params = turn_type_condition(value)
        assert [r["turn_type"] for r in store.query(
            f"SELECT turn_type FROM turns WHERE {where} ORDER BY id", params)] == expected
    with pytest.raises(ValueError, match="'stage' for every stage"):
        turn_type_condition("stage:Bad!")


@pytest.mark.parametrize("value", ["a\x1b[31mred", "x" * 300, "   ", "tab\tin"])
def test_hostile_session_ids_are_refused(value):
    with pytest.raises(IdentityError) as caught:
        identify({"X-Session-Id": value}, {"messages": ASK})
    assert caught.value.param == "session_id"
    with pytest.raises(IdentityError):
        identify({}, {"session_id": value, "messages": ASK})


async def test_a_captured_openclaw_request_through_the_proxy(tmp_path, store):
    """The request OpenClaw really sent, replayed byte for byte: the fitting skill is injected,
    the turn is recorded under OpenClaw's session with its retrieval query and scores."""
    skills = SkillLibrary(tmp_path / "skills", store)
    for name, description in [("rename-files-safely", "Rename or move files in the workspace "
                               "without overwriting existing files."),
                              ("calendar-invites", "Create calendar invites with a time zone."),
                              ("git-commit-messages", "Write conventional commit messages.")]:
        skills.add(Skill(name=name, description=description, category="ops", body="..."))
    request = captured("openclaw", "001")
    with DoubleServer([Reply("OK")]) as upstream:
        proxy = Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical", top_k=1),
                      store, skills).start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(proxy.url + "/chat/completions",
                                     data=json.dumps(request["body"]).encode(),
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": request["headers"]["User-Agent"]}) as r:
                    assert r.status == 200
                    assert r.headers["X-MetaClaw-Injected-Skills"] == "rename-files-safely"
                    await r.read()
            proxy.flush()
        finally:
            proxy.stop()
    turn = store.turns()[-1]
    assert turn["session_id"] == "f97f23cd-b4ef-4851-aaa7-85ec94740015"
    assert turn["retrieval_query"] == "Rename notes.txt to notes-2026.txt in my workspace"
    assert [s["name"] for s in turn["retrieval_scores"]] == ["rename-files-safely"]
    system = upstream.requests[-1]["body"]["messages"][0]["content"]
    assert system.startswith("<!-- openclaw:attempt:STABLE -->")  # the client's prefix intact
    assert "rename-files-safely" in system
    why = explain_frame(store).row(-1, named=True)
    assert why["retrieval_query"] == turn["retrieval_query"] and why["session_by"] == \
        "message:sessionId" and why["scores"].startswith("rename-files-safely ")


@pytest.mark.parametrize("client, name, session, how, turn_type", [
    # Claude Code: its session header; Anthropic-shaped bodies
    ("claude-code", "002", "a8b34cd9-5822-4fb7-9851-d23356cc4825",
     "header:X-Claude-Code-Session-Id", "main"),
    ("claude-code", "007", "a8b34cd9-5822-4fb7-9851-d23356cc4825",
     "header:X-Claude-Code-Session-Id", "main"),
    ("claude-code-tui", "002", "48beb998-99ab-446b-8fdb-fb3ca8751def",
     "header:X-Claude-Code-Session-Id", "side"),                      # session title
    ("claude-code-tui", "006", "48beb998-99ab-446b-8fdb-fb3ca8751def",
     "header:X-Claude-Code-Session-Id", "side"),                      # /compact summary
    ("claude-code-tui", "009", "48beb998-99ab-446b-8fdb-fb3ca8751def",
     "header:X-Claude-Code-Session-Id", "main"),
    ("openclaw-anthropic", "001", None, "message:sessionId", "main"),  # runtime line in system
    ("openclaw-gateway", "005", None, None, "side"),                  # compaction
    ("openclaw-cachekey", "001", None, "body:prompt_cache_key", "main"),
    ("openai-python", "002", None, "fingerprint:first-user-message", "main"),
    ("anthropic-python", "004", None, "fingerprint:first-user-message", "main"),
])
def test_captured_requests_of_real_clients(client, name, session, how, turn_type):
    request = captured(client, name)
    identity = identify(request["headers"], request["body"])
    assert identity.turn_type == turn_type, identity.how
    if session is not None:
        assert identity.session_id == session
    if how is not None:
        assert identity.how["session"] == how


def test_claude_codes_metadata_and_openclaws_cache_key_carry_the_session():
    body = captured("claude-code", "002")["body"]
    assert identify({}, body).session_id == "a8b34cd9-5822-4fb7-9851-d23356cc4825"
    assert identify({}, body).how["session"] == "metadata:user_id"
    cache = captured("openclaw-cachekey", "001")["body"]
    identity = identify({}, cache)
    assert identity.session_id == cache["prompt_cache_key"].rsplit(":", 1)[0]
    # the same session as the id OpenClaw writes into the first message
    assert identity.session_id in json.dumps(cache["messages"])


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Summarize the attached meeting transcript into action items"}],
    [{"role": "user", "content": "compact the session logs in /var/log/app into one file"}],
    [{"role": "system", "content": "You are a support agent. If the user asks, summarize the "
                                   "conversation in the ticket."},
     {"role": "user", "content": "My order #123 has not arrived"}],
    [{"role": "system", "content": "You are a blogging assistant. Always suggest a title for "
                                   "the conversation topic at the end of your post."},
     {"role": "user", "content": "write a post about sourdough"}],
    [{"role": "user", "content": "Create a short summary of the customer chat transcript in "
                                 "support/today.txt"}],
    [{"role": "user", "content": "Create an executive summary from the sales conversation notes "
                                 "in crm/q3.md"}],
    [{"role": "system", "content": "You are a summarization agent for our legal team."},
     {"role": "user", "content": "Condense contracts/nda.pdf into five bullet points"}],
])
def test_tasks_that_mention_summaries_or_titles_are_main_turns(messages):
    """A user's own task, or an agent's standing prompt mentioning a summary or a title in
    passing, is not a side call (which would get no skills and never be learnt from)."""
    assert identify({}, {"messages": messages}).turn_type == "main"


def test_a_later_message_quoting_session_id_code_stays_in_its_session():
    first = {"role": "user", "content": "help me with my express app"}
    pasted = {"role": "user", "content": "here is my code: const sessionId=req.params.id;"}
    before = identify({}, {"messages": [first]}).session_id
    after = identify({}, {"messages": [first, {"role": "assistant", "content": "sure"}, pasted]})
    assert after.session_id == before and after.how["session"].startswith("fingerprint")


def test_a_short_session_id_given_to_openclaw_names_the_session():
    """``openclaw agent --session-id down2`` sends ``prompt_cache_key: "down2:0"`` and the
    runtime line ``sessionId=down2``: the session is ``down2``. A name under six characters
    was ignored, and one run was split by the timestamp of its first message."""
    body = {"prompt_cache_key": "down2:0", "messages": [
        {"role": "system", "content": "## Runtime\nRuntime: agent=main | "
                                      "session=agent:main:explicit:down2 | sessionId=down2 | "
                                      "host=vm | repo=/w"},
        {"role": "user", "content": "[Sat 2026-11-28 16:27 UTC] say hello"}]}
    found = identify({}, body)
    assert (found.session_id, found.how["session"]) == ("down2", "message:sessionId")


def test_a_shared_prompt_cache_key_is_not_a_session():
    def session(key, text):
        return identify({}, {"prompt_cache_key": key,
                             "messages": [{"role": "user", "content": text}]})

    assert session("helpbot-v1", "a").session_id != session("helpbot-v1", "b").session_id
    openclaw = session("a6631154-9d92-4d17-a383-30f0923b9649:3", "a")
    assert (openclaw.session_id, openclaw.how["session"]) == (
        "a6631154-9d92-4d17-a383-30f0923b9649", "body:prompt_cache_key")


@pytest.mark.parametrize("system, last", [
    ("*Briefly* summarize this partial conversation about programming.\nInclude less detail "
     "about older parts.", "# USER\nfix the bug in app.py\n# ASSISTANT\nDone."),      # Aider
    (None, "Progressively summarize the lines of conversation provided, adding onto the "
           "previous summary returning a new summary.\n\nCurrent summary:\n"),  # LangChain
    ("Summarize this coding conversation in under 50 characters.", "fix the login bug"),
    (None, "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
           "history.\n### Guidelines:\n- The title should clearly represent the main theme"),
    (None, "Please generate a concise, 5-word-or-less title for the conversation, using its "
           "same language, with no punctuation."),                                # LibreChat
    (None, "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary for "
           "another LLM that will resume the task.\n\nInclude:\n- Current progress"),  # Codex
    ("You are a context summarization agent. You are given a conversation between a user and "
     "an agent. Your goal is to produce a structured summary matching the format specified so "
     "another coding agent can continue the work.",                              # opencode
     "Here is the conversation so far:\n\n<conversation>\n" + "[User]: tidy it up\n" * 300
     + "</conversation>\n\nCreate a new anchored summary from the conversation history in the "
       "<conversation> tags above so another coding agent can continue the work."),
    (None, "Here is the conversation so far:\n\n<conversation>\n[User]: fix it\n</conversation>"
           "\n\nCreate a new anchored summary from the conversation history in the "
           "<conversation> tags above so another coding agent can continue the work."),
])
def test_frameworks_title_and_summary_calls_are_side_calls(system, last):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": last}]
    assert identify({}, {"messages": messages}).turn_type == "side"


# -- telling alike-opening conversations apart by their replies ----------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(2, 4), st.lists(st.tuples(st.integers(0, 3), st.sampled_from("xyz"),
                                             st.booleans()), max_size=40))
def test_conversations_opening_alike_each_keep_a_consistent_session(runs, steps):
    """Several conversations open with the same message and go on in any interleaving, their
    replies drawn from a tiny set (so they often coincide), some turns failing (the client
    retries the same request). Each session's turns always form one conversation: every turn
    extends the previous turn's request by the reply that turn got (conversations identical so
    far may trade sessions, which changes nothing)."""
    threads = ReplyThreads()
    opening = {"role": "user", "content": "do the task"}
    history = {run: [opening] for run in range(runs)}
    sessions: dict[str, list[tuple[list, str]]] = {}  # session -> [(request, reply)] served
    for run, reply, fails in steps:
        run %= runs
        request = list(history[run])
        session, _, thread = threads.resolve("conv-f", request)
        threads.settle(thread, not fails, reply, None)
        if fails:
            continue
        served = sessions.setdefault(session, [])
        if served:
            previous, answer = served[-1]
            assert request[:len(previous)] == previous
            assert request[len(previous)] == {"role": "assistant", "content": answer}
        else:
            assert request == [opening]
        served.append((request, reply))
        history[run] = [*request, {"role": "assistant", "content": reply},
                        {"role": "user", "content": "next"}]


def test_reply_threads_match_resent_tool_calls_and_fall_back_to_the_fingerprint():
    threads = ReplyThreads()
    call = {"id": "c1", "function": {"name": "grep", "arguments": '{"q": "a", "n": 1}'}}
    opened, how, thread = threads.resolve("conv-f", [{"role": "user", "content": "hi"}])
    assert (opened, how) == ("conv-f", "fingerprint:first-user-message")
    threads.settle(thread, True, None, [call])
    second, how, _ = threads.resolve("conv-f", [{"role": "user", "content": "hi"}])
    assert (second, how) == ("conv-f.2", "fingerprint:repeated-opening")
    resent = {"role": "assistant", "content": "", "tool_calls": [  # keys reordered, id rewritten
        {"id": "other", "function": {"name": "grep", "arguments": '{"n":1,"q":"a"}'}}]}
    found, how, _ = threads.resolve("conv-f", [{"role": "user", "content": "hi"}, resent])
    assert (found, how) == ("conv-f", "fingerprint:reply-thread")
    edited = [{"role": "user", "content": "hi"}, resent, {"role": "user", "content": "again"},
              {"role": "assistant", "content": "a reply this process never served"}]
    assert threads.resolve("conv-f", edited)[:2] == ("conv-f", "fingerprint:reply-thread")
    # no assistant message it holds was served here, in a conversation known here: it continues
    # replies the client edited, so it stays with the fingerprint
    unknown = {"role": "assistant", "content": "a reply this process never served"}
    assert threads.resolve("conv-f", [{"role": "user", "content": "hi"}, unknown])[:2] == (
        "conv-f", "fingerprint:first-user-message")
    # a fingerprint new here that opens with an exchange: a fixed preamble (few-shot examples),
    # so each run of it opens a conversation, numbered after the others
    preamble = [{"role": "user", "content": "example ask"},
                {"role": "assistant", "content": "example answer"},
                {"role": "user", "content": "the real ask"}]
    assert threads.resolve("conv-p", preamble)[:2] == ("conv-p", "fingerprint:first-user-message")
    assert threads.resolve("conv-p", preamble)[:2] == ("conv-p.2", "fingerprint:repeated-opening")


def test_reply_threads_stay_bounded():
    threads = ReplyThreads()
    threads.MAX_ENTRIES = 10
    for i in range(50):
        _, _, thread = threads.resolve(f"conv-{i}", [{"role": "user", "content": "x"}])
        threads.settle(thread, True, f"reply {i}", None)
    assert len(threads._openings) == 10 and len(threads._replies) == 10


def test_reply_threads_read_arguments_as_an_anthropic_client_resends_them():
    """A call without arguments ("" from a chat server, or no input_json_delta in a stream)
    reaches an Anthropic client as ``input: {}``, and arguments that are not a JSON object as
    ``{"_raw": ...}`` / ``{"_value": ...}``: the resent call continues the run that got it."""
    threads = ReplyThreads()
    opening = [{"role": "user", "content": "list"}]
    for arguments, resent in (("", "{}"), (None, "{}"), ('{"path": "a', '{"_raw":"{\\"path\\": \\"a"}'),
                              ("7", '{"_value":7}')):
        _, _, thread = threads.resolve("conv-a", opening)  # another run, then this one
        threads.settle(thread, True, "other", None)
        session, _, thread = threads.resolve("conv-a", opening)
        threads.settle(thread, True, None, [{"function": {"name": "ls", "arguments": arguments}}])
        again = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "function": {"name": "ls", "arguments": resent}}]}
        found, how, _ = threads.resolve("conv-a", [*opening, again])
        assert (found, how) == (session, "fingerprint:reply-thread"), arguments


def test_a_reply_continued_again_joins_the_session_that_continued_it():
    """A client that timed out resends its request while the first attempt is still in flight:
    the retry joins the run's session, not the fingerprint's (another run's). A reply that two
    alike runs continued names neither, so a second continuation of it falls back."""
    threads = ReplyThreads()
    opening = [{"role": "user", "content": "do it"}]
    replies = {}
    for reply in ("a", "b"):
        session, _, thread = threads.resolve("conv-r", opening)
        threads.settle(thread, True, reply, None)
        replies[reply] = session
    history = [*opening, {"role": "assistant", "content": "b"}, {"role": "user", "content": "more"}]
    first = threads.resolve("conv-r", history)
    retry = threads.resolve("conv-r", history)
    assert first[0] == retry[0] == replies["b"] == "conv-r.2"
    threads.settle(first[2], False)  # the first attempt ends when its client has gone
    threads.settle(retry[2], True, "done", None)
    assert threads.resolve("conv-r", [*history, {"role": "assistant", "content": "done"}])[0] == \
        "conv-r.2"
    for _ in range(2):  # two runs alike so far: one reply "same", continued by both
        _, _, thread = threads.resolve("conv-s", opening)
        threads.settle(thread, True, "same", None)
    alike = [*opening, {"role": "assistant", "content": "same"}]
    assert {threads.resolve("conv-s", alike)[0] for _ in range(2)} == {"conv-s", "conv-s.2"}
    assert threads.resolve("conv-s", alike)[:2] == ("conv-s", "fingerprint:first-user-message")


def test_reply_threads_number_openings_after_the_recorded_sessions(tmp_path):
    """A new process numbers openings after the sessions the workspace recorded for the
    fingerprint; ids that only look alike (another suffix, non-ASCII digits) are not counted.
    Once its memory is full, a fingerprint it forgot is looked up in the store."""
    from metaclaw.store import Store

    fp, other = "conv-0123456789ab", "conv-fedcba987654"
    store = Store(tmp_path / "metaclaw.db")
    for session in (fp, f"{fp}.4", f"{fp}.5x", f"{fp}.\u0669\u0669", f"{fp}-mine", f"{fp}0.9",
                    f"{other}.7", "conv-short.9"):
        store.ensure_session(session)
    threads = ReplyThreads(store)
    opening = [{"role": "user", "content": "hi"}]
    assert [threads.resolve(fp, opening)[0] for _ in range(2)] == [f"{fp}.5", f"{fp}.6"]
    assert threads.resolve("conv-aaaaaaaaaaaa", opening)[0] == "conv-aaaaaaaaaaaa"
    assert threads.resolve(other, opening)[0] == f"{other}.8"

    small = ReplyThreads(store)
    small.MAX_ENTRIES = 1
    assert small.resolve("conv-bbbbbbbbbbbb", opening)[0] == "conv-bbbbbbbbbbbb"
    store.ensure_session(f"{other}.8")
    assert small.resolve(other, opening)[0] == f"{other}.9"  # forgotten, then looked up


@contextlib.contextmanager
def _two_proxies(tmp_path: Path, *replies: Reply):
    """Two proxies on one workspace (``tmp_path / "ws.db"``) in front of a double answering
    ``replies``: yields ``ask(proxy, messages)``, a chat request through one of them (its turn
    recorded when it returns)."""
    import openai

    from metaclaw.store import Store

    db = tmp_path / "ws.db"
    with DoubleServer(list(replies)) as upstream:
        proxies = [Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical"),
                         Store(db), SkillLibrary(tmp_path / "skills", Store(db))).start()
                   for _ in range(2)]

        def ask(proxy: Proxy, messages: list[dict]) -> None:
            openai.OpenAI(base_url=proxy.url, api_key="k", max_retries=0).chat \
                .completions.create(model="m", messages=messages)
            proxy.flush()

        try:
            yield proxies, ask
        finally:
            for proxy in proxies:
                proxy.stop()


def test_two_proxies_keep_apart_two_runs_that_open_alike_one_after_the_other(tmp_path):
    """Two proxies on one workspace, a harness that sends no session id: a run through the
    second proxy that opens with the message an earlier run through the first opened with is
    another session. The second proxy had numbered its openings from what was recorded when it
    started, and put the run into the first's session, with its turns and its judge context."""
    from metaclaw.store import Store

    opening = [{"role": "user", "content": "Tidy the imports in utils.py"}]
    with _two_proxies(tmp_path, *[Reply("Done.")] * 3) as (proxies, ask):
        for proxy in (*proxies, proxies[0]):
            ask(proxy, opening)
    with Store(tmp_path / "ws.db") as store:
        sessions = [t["session_id"] for t in store.turns()]
    assert len(set(sessions)) == 3 and sessions[1] == sessions[0] + ".2" \
        and sessions[2] == sessions[0] + ".3", sessions


def test_runs_that_alternate_between_two_proxies_each_keep_their_own_session(tmp_path):
    """A round-robin in front of two proxies, three runs of one task one after the other, no
    session id: each proxy read the other's recorded replies once per opening, so the later
    runs' turns continued replies it had not seen and fell back into the first run's
    session."""
    from metaclaw.store import Store

    first = {"role": "user", "content": "Rotate the TLS certificates on staging"}
    with _two_proxies(tmp_path, *[Reply(f"Step {i} done.") for i in range(12)]) as \
            (proxies, ask):
        for run in range(3):
            messages = [first]
            for step in range(4):
                ask(proxies[(step + run) % 2], messages)
                with Store(tmp_path / "ws.db") as store:
                    reply = store.turns()[-1]["response"]
                messages = [*messages, {"role": "assistant", "content": reply},
                            {"role": "user", "content": f"run {run}: go on ({step})"}]
    with Store(tmp_path / "ws.db") as store:
        by_session: dict[str, list[int]] = {}
        for turn in store.turns():
            by_session.setdefault(turn["session_id"], []).append(turn["turn_index"])
    assert sorted(by_session.values()) == [[0, 1, 2, 3]] * 3, by_session


def test_more_runs_at_once_than_a_page_each_keep_their_own_session(tmp_path, monkeypatch):
    """A batch of alike tasks on two proxies, more at once than one read of recorded replies
    holds (64; 2 here): the other proxy read only the newest sessions' replies, moved past the
    rest, and their next turns fell into the first run's session."""
    from metaclaw.store import Store

    monkeypatch.setattr(ReplyThreads, "RECORDED_SESSIONS", 2)
    first = {"role": "user", "content": "Rotate the TLS certificates on staging"}
    with _two_proxies(tmp_path, *[Reply(f"Run {i} started.") for i in range(10)]) as \
            (proxies, ask):
        for _ in range(5):  # five runs open on the first proxy
            ask(proxies[0], [first])
        with Store(tmp_path / "ws.db") as store:
            replies = [t["response"] for t in store.turns()]
        for run, reply in enumerate(replies):  # each goes on through the other
            ask(proxies[1], [first, {"role": "assistant", "content": reply},
                             {"role": "user", "content": f"run {run}: go on"}])
    with Store(tmp_path / "ws.db") as store:
        by_session: dict[str, list[int]] = {}
        for turn in store.turns():
            by_session.setdefault(turn["session_id"], []).append(turn["turn_index"])
    assert sorted(by_session.values()) == [[0, 1]] * 5, by_session


def test_two_proxies_keep_apart_two_runs_that_open_alike_at_the_same_time(tmp_path):
    """Two proxies on one workspace get the same first message at once, before either reply
    is recorded (a turn is recorded when its reply ends): two sessions. Each proxy numbered
    the opening from what was recorded, found nothing, and both took the fingerprint's id."""
    from concurrent.futures import ThreadPoolExecutor

    from metaclaw.store import Store

    opening = [{"role": "user", "content": "Summarise the open pull requests"}]
    with _two_proxies(tmp_path, *[Reply("Two are open.", delay=1.0)] * 2) as (proxies, ask), \
            ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda proxy: ask(proxy, opening), proxies))
    with Store(tmp_path / "ws.db") as store:
        sessions = sorted(t["session_id"] for t in store.turns())
        listed = {row["id"] for row in trace_sessions(store)}
    assert len(sessions) == 2 and sessions[1] == sessions[0] + ".2", sessions
    assert listed == set(sessions)


def test_an_opening_claims_its_session_before_its_reply(tmp_path):
    """The claim is in the workspace at once: a second process's opening takes the next
    number; a failed opening's id goes to this process's next opening (no gap), and a
    session claimed but with no turn yet is not listed. A claim never waits for the write
    lock: SQLite's is skipped while another connection holds it; PostgreSQL's goes without
    it (the key keeps it unique)."""
    from metaclaw.store import Store

    fp = "conv-0123456789ab"
    opening = [{"role": "user", "content": "hi"}]
    store = Store(tmp_path / "ws.db")
    first, second = ReplyThreads(Store(tmp_path / "ws.db")), ReplyThreads(Store(tmp_path / "ws.db"))
    taken, _, thread = first.resolve(fp, opening)
    assert taken == fp and store.session(fp) is not None
    assert second.resolve(fp, opening)[0] == f"{fp}.2"
    first.settle(thread, False)  # its turn failed: the id is this process's to give again
    assert first.resolve(fp, opening)[0] == fp
    assert first.resolve(fp, opening)[0] == f"{fp}.3"
    assert trace_sessions(store) == []
    store.ensure_session(f"{fp}.4")
    assert store.claim_session(f"{fp}.3") is False and store.claim_session("conv-x") is True
    # the first of a family: written only where none of its ids is recorded
    store.ensure_session("conv-m.2")
    assert store.claim_session("conv-m", first_of=("conv-m", "conv-m/")) is False
    assert store.session("conv-m") is None
    assert store.claim_session("conv-n", first_of=("conv-n", "conv-n/")) is True
    assert store.claim_session("conv-n", first_of=("conv-n", "conv-n/")) is False
    other = Store(tmp_path / "ws.db")
    sqlite = getattr(store, "engine", "sqlite") == "sqlite"
    with store.transaction():  # another connection holds the write lock
        assert other.claim_session("conv-y") is (None if sqlite else True)
        # an opening whose claim is not written is still numbered after what was recorded
        # (fp.4 by another process since this one looked)
        assert first.resolve(fp, opening)[0] == f"{fp}.5"
    assert (store.session("conv-y") is None) is sqlite


def test_a_client_that_edits_the_replies_it_resends_stays_in_its_conversation():
    """A chat client that strips the model's reasoning before resending never sends a reply
    verbatim: its turns stay one session (they are not a fixed preamble's new runs)."""
    threads = ReplyThreads()
    messages = [{"role": "user", "content": "Refactor deploy/config.yaml safely"}]
    sessions = []
    for i in range(3):
        session, _, thread = threads.resolve("conv-e", messages)
        threads.settle(thread, True, f"<think>plan {i}</think>Step {i}.", None)
        sessions.append(session)
        messages = [*messages, {"role": "assistant", "content": f"Step {i}."},
                    {"role": "user", "content": f"next {i}"}]
    assert sessions == ["conv-e"] * 3


# ---------------------------------------------------------------------------------------------
# clients with a fixed preamble (aider's example exchange)
# ---------------------------------------------------------------------------------------------
AIDER = Path(__file__).parent / "fixtures" / "requests" / "aider"


def _aider_body(name: str) -> dict:
    return {**json.loads((AIDER / f"{name}.json").read_text())["body"], "stream": False}


def test_aider_runs_stay_separate_sessions_and_its_next_turn_joins_its_own(tmp_path):
    """Every aider conversation opens with the same example exchange: two runs were one session.
    Its second turn moves the chat history before its files message and ends with a fixed
    exchange, so it is followed by the reply after the ask it answered. The query is the ask,
    without aider's boilerplate (captured aider 0.86.2 requests)."""
    import httpx

    from metaclaw.offline.double import DoubleServer
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import Skill, SkillLibrary
    from metaclaw.store import Store

    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(Skill("cli-flags", "Add command-line flags with argparse and document them.",
                      "coding", "Use argparse; add the flag to --help."), reason="test")
    with DoubleServer() as upstream, Proxy(ProxyConfig(
            upstream_url=upstream.url, retrieval="lexical", max_retries=0), store,
            library) as proxy:
        url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
        first = httpx.post(url, json=_aider_body("001"), timeout=30).json()
        second = _aider_body("003")  # the next turn of 001's conversation, as aider sends it
        assert second["messages"][5]["content"].strip() == "Add a --verbose flag to cli.py"
        second["messages"][6]["content"] = first["choices"][0]["message"]["content"]
        assert httpx.post(url, json=second, timeout=30).status_code == 200
        assert httpx.post(url, json=_aider_body("002"), timeout=30).status_code == 200
        proxy.flush()
        turns = store.turns()
    store.close()
    sessions = [t["session_id"] for t in turns]
    assert sessions[0] == sessions[1] != sessions[2]
    assert [t["identified_by"]["session"] for t in turns] == [
        "fingerprint:first-user-message", "fingerprint:reply-thread",
        "fingerprint:repeated-opening"]
    assert [t["retrieval_query"] for t in turns] == [
        "Add a --verbose flag to cli.py", "also print the parsed args when verbose",
        "write the standup notes into notes.md"]
    assert turns[0]["injected_skills"] == ["cli-flags"]


def _aider() -> str | None:
    found = os.environ.get("METACLAW_AIDER") or shutil.which("aider")
    local = Path(__file__).resolve().parent.parent / ".ci" / "aider" / "bin" / "aider"
    return found or (str(local) if local.is_file() else None)


@pytest.mark.skipif(_aider() is None, reason="aider is not installed (pip install aider-chat in "
                    "its own virtualenv, or set METACLAW_AIDER to its binary)")
def test_aider_runs_through_the_proxy(tmp_path):
    """The real aider (``--message``, whole edit format): two runs with different asks are two
    sessions, each gets the fitting skill, and the files it edits come from the proxy's reply."""
    import subprocess

    from metaclaw.offline.double import DoubleServer
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import Skill, SkillLibrary
    from metaclaw.store import Store

    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(Skill("cli-flags", "Add command-line flags with argparse and document them.",
                      "coding", "Use argparse; add the flag to --help."), reason="test")
    library.add(Skill("standup-notes", "Write standup notes as three bullet lists.", "writing",
                      "Yesterday, today, blockers."), reason="test")
    work = tmp_path / "work"
    work.mkdir()
    (work / "cli.py").write_text("print('hello')\n")
    with DoubleServer() as upstream, Proxy(ProxyConfig(
            upstream_url=upstream.url, retrieval="lexical", max_retries=0), store,
            library) as proxy:
        for ask in ("Add a --verbose flag to cli.py", "write the standup notes into notes.md"):
            done = subprocess.run(
                [_aider(), "--message", ask, "--yes-always", "--no-git", "--openai-api-base",
                 f"http://127.0.0.1:{proxy.port}/v1", "--openai-api-key", "unused", "--model",
                 "openai/double-model", "--no-show-model-warnings", "--no-check-update",
                 "--no-analytics", "--no-stream", "cli.py"],
                cwd=work, capture_output=True, text=True, timeout=300,
                env={**os.environ, "HOME": str(tmp_path)})
            assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
        proxy.flush()
        turns = [t for t in store.turns() if t["turn_type"] == "main"]
    store.close()
    assert len({t["session_id"] for t in turns}) == 2, [t["session_id"] for t in turns]
    assert [t["retrieval_query"] for t in turns] == [
        "Add a --verbose flag to cli.py", "write the standup notes into notes.md"]
    assert [t["injected_skills"][0] for t in turns] == ["cli-flags", "standup-notes"]


def test_a_prompt_of_many_blank_lines_is_read_in_linear_time():
    """A line's lead-in could run across the blank lines after it, so every line start rescanned
    them all: 20,000 blank lines after "summary" took a minute on the proxy's event loop."""
    import time

    body = {"messages": [{"role": "system", "content": "summary\n" + "\n" * 200_000},
                         {"role": "user", "content": "title\n" + "\n" * 200_000}]}
    started = time.perf_counter()
    assert identify({}, body).turn_type == "main"
    assert time.perf_counter() - started < 2


def test_runs_of_a_preamble_client_stay_apart_across_proxies_and_restarts(tmp_path):
    """A client that opens every run with the same example exchange (aider) and sends no
    session id: a run through a second proxy, or after a restart, is a new session. It joined
    the first run's session: the fingerprint was known from the store, and the preamble only
    to the process that had seen it."""
    from metaclaw.store import Store

    db = tmp_path / "ws.db"
    fingerprint = "conv-0123456789ab"  # of the example ask, the same for every run
    preamble = [{"role": "system", "content": "You are a coding assistant."},
                {"role": "user", "content": "Change get_factorial() to use math.factorial"},
                {"role": "assistant", "content": "To make this change we need to modify ..."}]
    store = Store(db)

    def run(threads: ReplyThreads, task: str) -> str:
        messages = [*preamble, {"role": "user", "content": task}]
        session, _, thread = threads.resolve(fingerprint, messages)
        threads.settle(thread, True, f"done: {task}", None)
        store.record_turn(session_id=session, request_messages=messages, status="ok",
                          response=f"done: {task}")
        return session

    first, second = ReplyThreads(Store(db)), ReplyThreads(Store(db))
    sessions = [run(first, "fix the parser"), run(first, "add a flag"),
                run(second, "rename a module"), run(second, "write the docs")]
    assert sessions == [fingerprint, *(f"{fingerprint}.{n}" for n in (2, 3, 4))]
    # a conversation that opened without a preamble is continued, not taken for a new run
    plain = ReplyThreads(Store(db))
    opening = [{"role": "user", "content": "hello"}]
    session, _, thread = plain.resolve("conv-fedcba987654", opening)
    plain.settle(thread, True, "hi there", None)
    store.record_turn(session_id=session, request_messages=opening, status="ok",
                      response="hi there")
    later = ReplyThreads(Store(db))
    edited = [*opening, {"role": "assistant", "content": "hi (edited)"},
              {"role": "user", "content": "go on"}]
    assert later.resolve("conv-fedcba987654", edited)[0] == "conv-fedcba987654"


def test_two_people_opening_alike_never_share_a_fingerprinted_session():
    """Alice and bob sent the same first message through one proxy: their turns were threaded
    into each other's sessions (the judge then read bob's follow-up as alice's reaction)."""
    import hashlib

    from metaclaw.proxy.sessions import identify

    body = {"messages": [{"role": "user", "content": "Plan my week"}]}
    alice = identify({"X-MetaClaw-User": "alice"}, body).session_id
    bob = identify({"X-MetaClaw-User": "bob"}, body).session_id
    nobody = identify({}, body).session_id
    assert len({alice, bob, nobody}) == 3
    # a conversation that names no one keeps the fingerprint it always had
    digest = hashlib.sha256("\x00Plan my week".encode()).hexdigest()
    assert nobody == f"conv-{digest[:12]}"
    assert identify({"X-MetaClaw-Agent": "bot"}, body).session_id not in (alice, bob, nobody)
    # a proxy serving one person (serve --user) fingerprints as if the header named them
    assert identify({}, body, ("alice", None)).session_id == alice


def test_openings_alike_while_the_database_server_is_down_stay_apart(monkeypatch):
    """A server's store unreachable: every look-up and claim fails after a wait, during which
    the lock is let go. An opening that waited wrote back the number it had read before its
    wait over the ones other threads took meanwhile: two conversations shared an id."""
    import threading
    import time

    class Down:
        engine = "postgresql"

        def loop_writer(self):
            return None

        def claim_session(self, session_id, first_of=None):
            time.sleep(0.0 if first_of else 0.3)
            raise RuntimeError("server down")

        def query(self, sql, params=()):
            time.sleep(0.3)
            raise RuntimeError("server down")

    monkeypatch.setattr(ReplyThreads, "reads_network", property(lambda self: True))
    threads, taken = ReplyThreads(Down()), []
    opening = [{"role": "user", "content": "the same first message"}]
    started = []
    for delay in (0, 0.05, 0.15):  # three runs opening alike within 0.15 s
        time.sleep(delay)
        started.append(threading.Thread(
            target=lambda: taken.append(threads.resolve("conv-565656565656", opening)[0])))
        started[-1].start()
    for thread in started:
        thread.join()
    assert len(set(taken)) == 3, taken
