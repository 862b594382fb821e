"""Views of a long-lived workspace read what they show, not every recorded conversation.

Scaled-down checks: they count what is read (conversations decoded, SQLite steps, query plans),
never a wall-clock time."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from metaclaw import buffers, cli
from metaclaw.store import Store
from metaclaw.trace import sessions

BIG = "x" * 50_000  # a tool result: recorded conversations are tens of kB a turn


class CountingStore(Store):
    """A store that counts the recorded conversations it hands out."""

    conversations_read = 0

    def query(self, sql, params=()):
        rows = super().query(sql, params)
        self.conversations_read += sum(1 for row in rows if "request_messages" in row)
        return rows


def _record(store: Store, session: str, task: str, **fields) -> int:
    messages = [{"role": "tool", "tool_call_id": "c1", "content": BIG},
                {"role": "user", "content": task}]
    return store.record_turn(session_id=session, request_messages=messages, status="ok",
                             response=f"answer to {task}", injected_skills=["s"], **fields)


@pytest.fixture()
def workspace(tmp_path):
    store = CountingStore(tmp_path / "metaclaw.db")
    with store.transaction(fsync=False):
        for i in range(60):
            turn = _record(store, f"s{i % 6}", f"task number {i}")
            buffers.refresh(store, [turn])
    store.conversations_read = 0
    yield store
    store.close()


def test_cli_turns_streams_without_the_conversations(workspace, capsys, monkeypatch):
    monkeypatch.setattr(cli, "TURN_CHUNK", 7)  # several chunks: each row once, in order
    cli.main(["turns", "--db", str(workspace.path), "--json"])
    capsys.readouterr()
    tracemalloc.start()
    try:
        assert cli.main(["turns", "--db", str(workspace.path), "--json"]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["id"] for row in listed] == list(range(1, 61))
    assert peak < 1_000_000  # 60 conversations of 50 kB are 3 MB: none of them was read
    cli.main(["turns", "--db", str(workspace.path), "--session", "s2", "--why"])
    text = capsys.readouterr().out
    assert text.count("\n#") + text.startswith("#") == 10 and "query: -" in text


@pytest.mark.sqlite_only  # looks into SQLite's own connection
def test_trace_sessions_reads_only_the_latest_sessions_turns(workspace):
    def steps() -> int:
        count = [0]

        def tick() -> int:
            count[0] += 1
            return 0

        workspace._db.set_progress_handler(tick, 1)
        try:
            assert [row["id"] for row in sessions(workspace, 1)] == ["s5"]
        finally:
            workspace._db.set_progress_handler(None, 1)
        return count[0]

    before = steps()
    with workspace.transaction(fsync=False):
        for i in range(300):  # a long old session
            _record(workspace, "s0", f"old {i}")
    workspace.execute("UPDATE sessions SET updated_at = 0 WHERE id = 's0'")
    assert steps() < before + 100  # its 300 more turns are not visited
