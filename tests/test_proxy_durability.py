"""Durability of recorded turns (both protocols, streaming and not).

- kill -9 under concurrent load over >= 1000 turns: no acknowledged turn is missing after restart
  (benchmarks/soak_kill9.py, run small; the longer soak is the same script with more turns);
- the ordering contract, checked at the moment it matters: when a client holds the whole reply,
  a fresh SQLite connection already sees the turn, even when commits are slow (a store whose
  writes take 40 ms stands in for a slow disk);
- group commit: concurrent turns share transactions;
- a turn the store cannot take is not acknowledged; a client that leaves before the headers or
  mid-stream still leaves a turn saying so.
"""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from metaclaw.offline.double import DoubleServer, Reply, last_user_text
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak_kill9.py"


def test_kill9_under_load_loses_no_acknowledged_turn():
    proc = subprocess.run([sys.executable, str(SOAK), "--turns", "1000", "--cycles", "3",
                           "--concurrency", "32"], capture_output=True, text=True, timeout=170)
    out = proc.stdout
    print(out)
    figures = re.search(r"sent (\d+), acknowledged (\d+), lost (\d+)", out.splitlines()[-1])
    assert figures, out + proc.stderr
    sent, acked, lost = map(int, figures.groups())
    assert sent >= 1000 and acked > 0.5 * sent
    assert lost == 0 and proc.returncode == 0, out


class SlowStore(Store):
    """A store on a slow disk: every turn write takes 40 ms (or fails, when told to)."""

    delay = 0.04
    fail = False

    def record_turn(self, **fields):
        time.sleep(self.delay)
        if self.fail or "store-refuses" in json.dumps(fields.get("request_messages")):
            raise OSError("disk full")
        return super().record_turn(**fields)


def _reply(body):
    text = last_user_text(body.get("messages") or [])
    return Reply(content=f"echo {text}", delay=0.5 if "slow upstream" in text else 0.0,
                 chunk_delay=0.2 if "slow chunks" in text else 0.0)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("durable")
    store = SlowStore(root / "metaclaw.db")
    library = SkillLibrary(root / "skills", store)
    with DoubleServer(_reply) as double:
        with Proxy(ProxyConfig(upstream_url=double.url, retrieval="lexical"), store,
                   library) as proxy:
            yield proxy, store, root / "metaclaw.db"
    store.close()


def _send(proxy, protocol, stream, session, text="hello there"):
    if protocol == "openai":
        url, body = proxy.url + "/chat/completions", {"model": "m", "stream": stream, "messages": [
            {"role": "user", "content": text}]}
    else:
        url, body = proxy.base_url + "/v1/messages", {"model": "m", "max_tokens": 32,
                                                      "stream": stream, "messages": [
                                                          {"role": "user", "content": text}]}
    return httpx.post(url, json=body, headers={"X-Session-Id": session}, timeout=30)


def _committed(db: Path, session: str) -> list[tuple]:
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("SELECT status, error FROM turns WHERE session_id = ?",
                            (session,)).fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_turn_is_committed_before_the_client_hears_the_end(env, protocol, stream):
    proxy, _, db = env
    session = f"ordered-{protocol}-{stream}"
    reply = _send(proxy, protocol, stream, session)
    assert reply.status_code == 200
    end = {"openai": "data: [DONE]", "anthropic": "event: message_stop"}[protocol]
    assert not stream or end in reply.text
    assert _committed(db, session) == [("ok", None)]  # no flush: it is on disk already


def test_group_commit_shares_transactions(env):
    proxy, _, db = env
    before = proxy._recorder.commits
    threads = [threading.Thread(target=_send, args=(proxy, "openai", i % 2 == 0, f"group-{i}"))
               for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    batches = proxy._recorder.commits - before
    assert all(_committed(db, f"group-{i}") for i in range(24))
    assert batches < 24, f"{batches} transactions for 24 concurrent turns"


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_the_store_refuses_is_not_acknowledged(env, protocol, stream):
    proxy, _, _ = env
    reply = _send(proxy, protocol, stream, f"refused-{protocol}-{stream}", "store-refuses this")
    if stream:
        assert reply.status_code == 200
        assert "[DONE]" not in reply.text and "message_stop" not in reply.text
        assert "could not record this turn" in reply.text
    else:
        assert reply.status_code == 500 and "could not record this turn" in reply.text


def _raw_post(proxy, body: bytes, path="/v1/chat/completions", session="x") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"X-Session-Id: {session}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _wait_turn(db, session):
    for _ in range(100):
        rows = _committed(db, session)
        if rows:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"no turn for {session}")


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_client_leaving_before_the_headers_is_recorded(env, protocol):
    proxy, _, db = env
    body = {"model": "m", "stream": True, "max_tokens": 32,
            "messages": [{"role": "user", "content": "slow upstream please"}]}
    path = "/v1/chat/completions" if protocol == "openai" else "/v1/messages"
    session = f"left-early-{protocol}"
    sock = _raw_post(proxy, json.dumps(body).encode(), path, session)
    time.sleep(0.1)
    sock.close()  # gone while the upstream is still thinking
    rows = _wait_turn(db, session)
    assert rows[0][0] == "client_disconnected" and "before" in rows[0][1]


def test_client_leaving_mid_stream_is_recorded(env):
    proxy, _, db = env
    body = {"model": "m", "stream": True,
            "messages": [{"role": "user", "content": "slow chunks one two three four five"}]}
    sock = _raw_post(proxy, json.dumps(body).encode(), session="left-mid")
    seen = b""
    while b"data:" not in seen:
        seen += sock.recv(65536)
    sock.close()
    rows = _wait_turn(db, "left-mid")
    assert rows[0][0] == "client_disconnected" and "mid-stream" in rows[0][1]
