"""Durable acknowledgement: the end of a reply (OpenAI ``[DONE]``, Anthropic ``message_stop``, the
body of a non-streaming reply) reaches the client only after its turn is committed to SQLite,
checked from a separate connection as another process would see it; turns commit in groups; a
stream whose client leaves early is still recorded, with a status."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.proxy.pipeline import Recorder
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store


def _committed(db, session: str) -> list[tuple]:
    with Store(db) as other:  # not the proxy's connection: what is committed
        return [(r["status"], r["protocol"], r["response"]) for r in other.query(
            "SELECT status, protocol, response FROM turns WHERE session_id = ?", (session,))]


@pytest.fixture()
def served(store, tmp_path):
    (tmp_path / "skills").mkdir()
    with DoubleServer() as upstream:
        config = ProxyConfig(upstream_url=upstream.url, retrieval="lexical", max_retries=0,
                             durable_acks=True)
        with Proxy(config, store, SkillLibrary(str(tmp_path / "skills"), store)) as proxy:
            yield proxy, upstream, tmp_path / "metaclaw.db"


def test_turn_is_committed_before_the_end_of_each_reply(served):
    proxy, upstream, db = served
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    with httpx.stream("POST", proxy.url + "/chat/completions", json={**chat, "stream": True},
                      headers={"X-Session-Id": "s-openai"}) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                assert _committed(db, "s-openai") == [("ok", "openai", "echo: hello there")]
    messages = {"model": "m", "max_tokens": 10, "stream": True,
                "messages": [{"role": "user", "content": "hi again"}]}
    with httpx.stream("POST", proxy.base_url + "/v1/messages", json=messages,
                      headers={"X-Session-Id": "s-anthropic"}) as response:
        for line in response.iter_lines():
            if line == "event: message_stop":
                assert _committed(db, "s-anthropic") == [("ok", "anthropic", "echo: hi again")]
    httpx.post(proxy.url + "/chat/completions", json=chat, headers={"X-Session-Id": "s-plain"})
    assert _committed(db, "s-plain") == [("ok", "openai", "echo: hello there")]
    upstream.add(Reply("boom", status=500))
    bad = httpx.post(proxy.base_url + "/v1/messages", json={"model": "m", "max_tokens": 5,
                     "messages": [{"role": "user", "content": "x"}]},
                     headers={"X-Session-Id": "s-bad"})
    assert bad.status_code == 500 and _committed(db, "s-bad") == [("error", "anthropic", None)]


def test_client_leaving_early_is_recorded(served):
    proxy, upstream, db = served
    upstream.add(Reply(" ".join(f"word{i}" for i in range(40)), chunk_delay=0.05))
    with httpx.stream("POST", proxy.base_url + "/v1/messages", headers={"X-Session-Id": "s-left"},
                      json={"model": "m", "max_tokens": 100, "stream": True,
                            "messages": [{"role": "user", "content": "long answer"}]}) as response:
        for line in response.iter_lines():
            if "text_delta" in line:
                break  # the client leaves mid-stream
    deadline = time.monotonic() + 10
    while not _committed(db, "s-left") and time.monotonic() < deadline:
        time.sleep(0.05)
    ((status, protocol, text),) = _committed(db, "s-left")
    assert status == "client_disconnected" and protocol == "anthropic" and text.startswith("word0")
    assert "disconnected" in proxy.store.turns("session_id = 's-left'")[0]["error"]


def test_recorder_commits_in_groups(store):
    recorder = Recorder(store)

    async def many() -> list:
        futures = [recorder.submit({"session_id": "g", "request_messages": [], "status": "ok"},
                                   False) for _ in range(50)]
        return await asyncio.gather(*futures)

    try:
        ids = asyncio.run(many())
    finally:
        recorder.stop()
    assert len(set(ids)) == 50 and None not in ids
    assert len(store.turns("session_id = 'g'")) == 50
    assert recorder.commits < 50  # turns submitted together share a commit
