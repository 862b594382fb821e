"""Bringing your own traces (:mod:`metaclaw.transcripts`): transcripts the real agents wrote
(captured with each CLI against the SIMULATED model, see tests/fixtures/transcripts/README.md)
become imported turns that can be judged, labelled and evolved from, and are never trained on;
malformed and hostile files are refused whole, with the file and line named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaclaw import buffers, transcripts
from metaclaw.fastloop import labels
from metaclaw.slowloop.grpo import select_query_turns
from metaclaw.store import Store
from metaclaw.transcripts import TranscriptError

FIXTURES = Path(__file__).parent / "fixtures" / "transcripts"
CLAUDE = next((FIXTURES / "claude-code").glob("*.jsonl"))
CODEX = next((FIXTURES / "codex").glob("rollout-*.jsonl"))
OPENCLAW = sorted((FIXTURES / "openclaw").glob("*.jsonl"))


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "ws.db")
    yield s
    s.close()


def _counts(store: Store) -> tuple[int, int]:
    return (store.query("SELECT COUNT(*) AS n FROM turns")[0]["n"],
            store.query("SELECT COUNT(*) AS n FROM sessions")[0]["n"])


def _roles(turn) -> list[str]:
    return [m["role"] for m in turn["request_messages"]]


def _calls(turn) -> list[str]:
    return [c["function"]["name"] for c in turn["tool_calls"] or []]


# -- the captured transcripts -----------------------------------------------------------------
def test_a_claude_code_session_becomes_its_replies(store):
    result = transcripts.import_files(store, [CLAUDE])
    assert result.formats == {str(CLAUDE): "claude-code"} and result.imported == 2
    first, second = store.turns()
    assert {first["session_id"], second["session_id"]} == {CLAUDE.stem}
    assert [first["turn_index"], second["turn_index"]] == [0, 1]
    # the first reply is a tool call (Write), the second the answer after its result
    assert _roles(first) == ["system", "user"] and _calls(first) == ["Write"]
    assert first["response"] is None and first["finish_reason"] == "tool_calls"
    assert _roles(second) == ["system", "user", "assistant", "tool"]
    assert second["request_messages"][2]["tool_calls"][0]["id"] == first["tool_calls"][0]["id"]
    assert second["response"].startswith("[simulated model]") and second["tool_calls"] is None
    assert "Write" in [t["function"]["name"] for t in first["request_params"]["tools"]]
    assert first["protocol"] == "anthropic" and first["model"] == "sim-agent"
    assert first["status"] == "ok" and first["turn_type"] == "main"
    assert first["retrieval_query"].startswith("Read notes.txt and write summary.json")
    assert first["prompt_tokens"] == 2529 and first["completion_tokens"] == 10
    assert first["identified_by"]["session"] == f"imported:claude-code:{CLAUDE.name}"
    assert first["identified_by"]["line"] == 19  # the line of the reply's first entry
    assert (first["buffer_set"], first["buffer_state"]) == ("support", "live")
    assert transcripts.is_imported(first)


def test_a_codex_rollout_becomes_its_replies(store):
    result = transcripts.import_files(store, [CODEX])
    assert result.formats[str(CODEX)] == "codex" and result.imported == 2
    first, second = store.turns()
    session = CODEX.stem.split("-", 6)[-1]  # rollout-<time>-<session id>
    assert first["session_id"] == second["session_id"] == session
    # Codex's instructions, its developer and environment messages (as one system message and
    # a user message of context), then the ask; the second turn continues the conversation
    assert _roles(first) == ["system", "user", "user"]
    assert _roles(second) == ["system", "user", "user", "assistant", "user"]
    assert "Codex" in first["request_messages"][0]["content"]
    assert first["retrieval_query"].startswith("List the files here")
    assert second["request_messages"][-1]["content"] == "Then just tell me the total of 3 and 5."
    assert first["response"].startswith("[simulated model]")
    assert first["protocol"] == "responses" and first["model"] == "sim-agent"


@pytest.mark.skipif(not OPENCLAW, reason="no OpenClaw capture")
@pytest.mark.parametrize("path", OPENCLAW, ids=lambda p: p.name)
def test_an_openclaw_session_becomes_its_replies(store, path):
    result = transcripts.import_files(store, [path])
    assert result.formats[str(path)] == "openclaw" and result.imported == 31
    turns = store.turns()
    # the run ended on its time limit: the last reply is recorded as the failure it was
    *served, cut = turns
    assert cut["status"] == "error" and "timed out" in cut["error"]
    assert (cut["buffer_set"], cut["buffer_state"]) == (None, None)
    assert all(t["status"] == "ok" and t["buffer_set"] == "support" for t in served)
    assert len({t["session_id"] for t in turns}) == 1 and len(turns[0]["session_id"]) == 36
    first = turns[0]
    assert _roles(first)[-1] == "user" and first["retrieval_query"]
    assert _calls(first), "the capture's first reply is a tool call"
    assert _roles(turns[1])[-2:] == ["assistant", "tool"]
    assert turns[1]["request_messages"][-1]["tool_call_id"] == first["tool_calls"][0]["id"]
    assert all(t["model"] == "sim-agent" and t["protocol"] == "openai" for t in turns)


def test_the_two_openclaw_shapes_give_the_same_turns(tmp_path):
    """The session records and the trajectory export of one OpenClaw session."""
    records = [p for p in OPENCLAW if "trajectory" not in p.name]
    exported = [p for p in OPENCLAW if "trajectory" in p.name]
    if not records or not exported:
        pytest.skip("both OpenClaw shapes are needed")
    a, b = (transcripts.read_transcript(p).turns for p in (records[0], exported[0]))
    assert [(t.session_id, t.messages, t.reply) for t in a] == [
        (t.session_id, t.messages, t.reply) for t in b]


def test_importing_again_records_nothing_twice(store, tmp_path):
    first = transcripts.import_files(store, [CLAUDE, CODEX, *OPENCLAW])
    before = _counts(store)
    again = transcripts.import_files(store, [CODEX, CLAUDE, *OPENCLAW])
    # the two OpenClaw files are one session in two shapes: its turns are recorded once
    assert first.imported == 2 + 2 + 31 and first.skipped == (31 if len(OPENCLAW) == 2 else 0)
    assert again.imported == 0 and again.skipped == first.imported + first.skipped
    assert _counts(store) == before
    # a copy under another name is the same transcript
    copy = tmp_path / "copy.jsonl"
    shutil.copy(CLAUDE, copy)
    assert transcripts.import_files(store, [copy]).imported == 0
    # the same file twice in one import: once
    other = Store(tmp_path / "other.db")
    assert transcripts.import_files(other, [CLAUDE, copy]).imported == 2
    other.close()


def test_a_transcript_that_grew_adds_only_its_new_replies(store, tmp_path):
    lines = CODEX.read_bytes().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if b'"task_complete"' in line) + 1
    partial = tmp_path / CODEX.name
    partial.write_bytes(b"".join(lines[:cut]))
    assert transcripts.import_files(store, [partial]).imported == 1
    partial.write_bytes(b"".join(lines))
    grown = transcripts.import_files(store, [partial])
    assert grown.imported == 1 and grown.skipped == 1
    assert [t["turn_index"] for t in store.turns()] == [0, 1]


def test_export_then_import_is_a_round_trip(store, tmp_path):
    transcripts.import_files(store, [CLAUDE, CODEX])
    for turn in store.turns():
        labels.label(store, turn["id"], "pass", author="test")
    out = tmp_path / "export.jsonl"
    assert labels.export_jsonl(store, out) == 4
    fresh = Store(tmp_path / "fresh.db")
    result = transcripts.import_files(fresh, [out])
    assert result.formats[str(out)] == "openai" and result.imported == 4

    def kept(turn):
        return (turn["request_messages"], turn["response"], turn["tool_calls"],
                (turn["request_params"] or {}).get("tools"))

    assert [kept(t) for t in fresh.turns()] == [kept(t) for t in store.turns()]
    # one conversation, one session: the two turns of each transcript stay together
    sessions = [t["session_id"] for t in fresh.turns()]
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]
    assert transcripts.import_files(fresh, [out]).imported == 0
    fresh.close()


def test_a_proxied_turn_exported_comes_back_without_its_skill_block(store, tmp_path):
    from metaclaw.skills.block import BLOCK_FOOTER, BLOCK_HEADER, inject

    asked = [{"role": "system", "content": "You are helpful."},
             {"role": "user", "content": "Rename notes.txt"}]
    served = inject(asked, f"{BLOCK_HEADER}\n\n### rename-safely\nCheck the target.\n\n"
                           f"{BLOCK_FOOTER}")
    assert served != asked
    turn_id = store.record_turn(session_id="s1", request_messages=served, status="ok",
                                response="Done.", request_params={})
    labels.label(store, turn_id, "pass", author="test")
    out = tmp_path / "one.jsonl"
    labels.export_jsonl(store, out)
    fresh = Store(tmp_path / "fresh.db")
    transcripts.import_files(fresh, [out], format="openai")
    (back,) = fresh.turns()
    assert back["request_messages"] == asked and back["response"] == "Done."
    fresh.close()


# -- judged, labelled, evolved from; never trained on -----------------------------------------
def test_imported_turns_are_judged_and_labelled_but_never_trained_on(store):
    from metaclaw.fastloop.judge import Judge
    from metaclaw.offline.simmodel import serve_sim_model

    ids = transcripts.import_files(store, [CLAUDE, CODEX]).turn_ids
    served = store.record_turn(session_id="proxied", request_messages=[
        {"role": "user", "content": "hi"}], status="ok", response="hello",
        buffer_set="query", buffer_state="live")
    server = serve_sim_model()  # the SIMULATED model answers as the judge
    try:
        results = Judge(server.url, "sim-judge", votes=1, retries=0).judge_turns(store, ids)
    finally:
        server.stop()
    assert sorted(r.turn_id for r in results) == sorted(ids)
    assert all(store.turn(i)["reward"] is not None for i in ids)
    labels.label(store, ids[0], "fail", note="wrote here.json, not summary.json", author="test")
    buffers.refresh(store)
    assert [t["id"] for t in select_query_turns(store)] == [served]  # the proxied turn only
    claim = buffers.new_claim_id()
    assert buffers.claim_for_training(store, [*ids, served], claim) == {served}
    buffers.release_training_claim(store, claim)
    assert ids[0] in [t["id"] for t in buffers.support_set(store)]  # the evolver's evidence
    assert {t["id"] for t in buffers.query_set(store, state=None)} == {served}
    # an evolution consumes the imported failure; still never a query turn
    buffers.advance(store, buffers.current_generation(store) + 1, consumed=[ids[0]])
    assert (store.turn(ids[0])["buffer_set"], store.turn(ids[0])["buffer_state"]) == (
        "support", "consumed")
    assert all(store.turn(i)["buffer_set"] == "support" for i in ids)
    assert all(not store.turn(i)["completion_tokens_ids"] for i in ids)


# -- malformed and hostile files --------------------------------------------------------------
def _refused(store, path, line, *words, format="auto"):
    before = _counts(store)
    with pytest.raises(TranscriptError) as caught:
        transcripts.import_files(store, [CLAUDE, path] if format == "auto" else [path],
                                 format=format)
    message = str(caught.value)
    where = f"{path}:{line}:" if line is not None else f"{path}:"
    assert message.startswith(where), message
    for word in words:
        assert word in message, message
    assert _counts(store) == before  # nothing half-imported, the good file neither
    return caught.value


def test_a_truncated_last_line_is_named(store, tmp_path):
    data = CLAUDE.read_bytes().rstrip(b"\n")
    path = tmp_path / "cut.jsonl"
    path.write_bytes(data[:-40])
    lines = data.count(b"\n") + 1
    _refused(store, path, lines, "not valid JSON", "cut short")


def test_a_record_of_the_wrong_types_is_named(store, tmp_path):
    lines = CLAUDE.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if '"type":"assistant"' in line)
    entry = json.loads(lines[index])
    entry["message"]["content"] = 5
    lines[index] = json.dumps(entry)
    path = tmp_path / "types.jsonl"
    path.write_text("\n".join(lines) + "\n")
    _refused(store, path, index + 1, "content")


def test_wrong_types_in_every_format_are_named(store, tmp_path):
    cases = {
        "codex": (CODEX, '"type":"response_item"', lambda e: e["payload"].update(content=7)),
        "openai": (None, None, None),
        **({"openclaw": (OPENCLAW[0], '"role":"assistant"',
                         lambda e: (e.get("message") or e["data"]["message"]).update(
                             content=[{"type": "toolCall", "id": 3}]))} if OPENCLAW else {}),
    }
    for name, (source, needle, spoil) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        if source is None:
            path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "user", "content": "again"}]})
                            + "\n" + json.dumps({"messages": "no"}) + "\n")
            _refused(store, path, 1, "assistant", format=name)
            continue
        lines = source.read_text().splitlines()
        index = next(i for i, line in enumerate(lines) if needle in line.replace(" ", ""))
        entry = json.loads(lines[index])
        spoil(entry)
        lines[index] = json.dumps(entry)
        path.write_text("\n".join(lines) + "\n")
        _refused(store, path, index + 1)


def test_a_line_of_binary_is_named(store, tmp_path):
    lines = CODEX.read_bytes().splitlines(keepends=True)
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b"".join([*lines[:3], bytes(range(256)) + b"\n", *lines[3:]]))
    _refused(store, path, 4, "binary")
    zipped = tmp_path / "gzipped.jsonl"
    zipped.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(200, 256)))
    _refused(store, zipped, 1, "binary")


def test_a_huge_line_is_refused_without_reading_it_whole(store, tmp_path, monkeypatch):
    monkeypatch.setattr(transcripts, "MAX_LINE_BYTES", 100_000)
    path = tmp_path / "huge.jsonl"
    path.write_bytes(b'{"messages": "' + b"x" * 300_000 + b'"}\n')
    _refused(store, path, 1, "longer than")


def test_files_that_are_not_transcripts(store, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _refused(store, empty, None, "empty")
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    _refused(store, other, None, "not a transcript of a known format", "--format")
    array = tmp_path / "array.jsonl"
    array.write_text("[1, 2]\n")
    _refused(store, array, 1, "JSON array, not an object")
    _refused(store, tmp_path / "missing.jsonl", None, "cannot be read")
    _refused(store, tmp_path, None, "folder")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    _refused(store, deep, 1, "not valid JSON")
    nested = tmp_path / "nested.jsonl"  # deep, but within what the JSON reader takes
    nested.write_text('{"messages": ' + "[" * 500 + "]" * 500 + "}\n")
    _refused(store, nested, 1, "nested deeper than")
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text(json.dumps({"messages": [{"role": "user", "content": "\\ud800"},
                                                  {"role": "assistant", "content": "ok"}]})
                         .replace("\\\\ud800", "\\ud800") + "\n")
    transcripts.import_files(store, [surrogate])  # read, and stored with a replacement mark
    assert store.turns()[-1]["request_messages"][0]["content"] == "\ufffd"


def test_a_claude_code_file_read_as_codex_is_refused_with_its_reason(store):
    with pytest.raises(TranscriptError):
        transcripts.import_files(store, [CLAUDE], format="openai")
    assert _counts(store) == (0, 0)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "message", "role", "content", "payload", "messages", "id",
                         "parentId", "sessionId", "tool_calls", "text", "name", "data",
                         "traceSchema", "source", "version", "call_id", "arguments"]) | st.text(
            max_size=8), inner, max_size=5),
    max_leaves=20)
_LINE = st.one_of(
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
    st.sampled_from([b'{"type":"session","version":4,"id":"s"}',
                     b'{"type":"session_meta","payload":{"id":"x"}}',
                     b'{"type":"user","sessionId":"s","message":{"role":"user","content":"hi"}}',
                     b'{"type":"assistant","sessionId":"s","message":{"role":"assistant",'
                     b'"content":[{"type":"text","text":"ok"}]}}',
                     b'{"type":"response_item","payload":{"type":"message","role":"user",'
                     b'"content":"hi"}}',
                     b'{"type":"response_item","payload":{"type":"function_call","call_id":"c",'
                     b'"name":"f","arguments":"{}"}}',
                     b'{"type":"message","id":"a","parentId":null,"message":{"role":"user",'
                     b'"content":"hi"}}',
                     b'{"type":"message","id":"b","parentId":"a","message":{"role":"assistant",'
                     b'"content":[{"type":"toolCall","id":"c","name":"f","arguments":{}}]}}',
                     b'{"messages":[{"role":"user","content":"hi"},{"role":"assistant",'
                     b'"content":"ok"}]}']))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, min_size=1, max_size=8),
       format=st.sampled_from(["auto", *transcripts.FORMATS]))
def test_random_lines_raise_nothing_but_the_importers_error(tmp_path_factory, lines, format):
    path = tmp_path_factory.mktemp("random") / "t.jsonl"
    path.write_bytes(b"\n".join(lines))
    store = Store(":memory:")
    try:
        transcripts.import_files(store, [path], format=format)
    except TranscriptError as exc:
        assert str(exc).startswith(str(path))
    finally:
        store.close()


# -- the command line -------------------------------------------------------------------------
def test_turns_import_and_export_on_the_command_line(tmp_path, capsys):
    from metaclaw import cli

    db, fresh, out = tmp_path / "ws.db", tmp_path / "fresh.db", tmp_path / "out.jsonl"
    assert cli.main(["turns", "import", str(CLAUDE), str(CODEX), "--db", str(db)]) == 0
    assert "imported 4 turns in 2 sessions" in capsys.readouterr().out
    # options before the files (argparse took the files after an option for unknown words)
    assert cli.main(["turns", "import", "--db", str(db), "--json", str(CLAUDE)]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 2
    with pytest.raises(SystemExit):  # an unknown option is still refused
        cli.main(["turns", "import", "--db", str(db), str(CLAUDE), "--bogus"])
    capsys.readouterr()
    assert cli.main(["turns", "--db", str(db), "--json"]) == 0  # `turns` alone still lists
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(listed) == 4 and listed[0]["identified_by"]["session"].startswith("imported:")
    store = Store(db)
    for turn in store.turns():
        labels.label(store, turn["id"], "pass", author="test")
    store.close()
    assert cli.main(["export", str(out), "--db", str(db)]) == 0
    assert "wrote 4 records" in capsys.readouterr().out
    table = tmp_path / "out.parquet"  # was JSON Lines under a .parquet name
    assert cli.main(["export", str(table), "--db", str(db)]) == 0
    assert "a table of turns" in capsys.readouterr().out
    import polars as pl

    assert pl.read_parquet(table).height == 4
    assert cli.main(["export", str(tmp_path / "out.csv"), "--db", str(db)]) == 2
    assert "ending in .jsonl or .parquet" in capsys.readouterr().err
    assert not (tmp_path / "out.csv").exists()
    assert cli.main(["turns", "import", str(out), "--db", str(fresh)]) == 0
    assert "imported 4 turns in 2 sessions" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(CLAUDE.read_bytes()[:5000])
    assert cli.main(["turns", "import", str(bad), "--db", str(fresh)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "not valid JSON" in err and "Traceback" not in err
    assert cli.main(["turns", "import", "--db", str(fresh)]) == 2  # no files named
