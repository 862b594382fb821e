"""The upstream key goes to the upstream's origin only, and never shows in start-up output."""

import json
import os
import subprocess

import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.redact import same_origin
from metaclaw.runtime import Runtime
from test_cli import CLI, free_port, wait_for_port

CANARY = "sk-canary-0f9e8d7c6b5a"


def test_same_origin():
    assert same_origin("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/other")
    assert same_origin("https://api.example.com/v1", "https://API.example.com:443/x")
    assert not same_origin("http://127.0.0.1:8000/v1", "http://localhost:8000/v1")
    assert not same_origin("http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1")
    assert not same_origin("http://api.example.com/v1", "https://api.example.com/v1")


def _verdict(body):
    return Reply(json.dumps({"score": 1, "rationale": "fine"}))


def test_the_upstream_key_is_not_sent_to_a_judge_on_another_host(tmp_path, monkeypatch):
    monkeypatch.setenv("METACLAW_UPSTREAM_API_KEY", CANARY)
    monkeypatch.delenv("METACLAW_JUDGE_API_KEY", raising=False)
    with DoubleServer([Reply("done")]) as agent, DoubleServer(_verdict) as judge:
        elsewhere = judge.url.replace("127.0.0.1", "localhost")  # another origin, same server
        for judge_url, key_expected in ((elsewhere, False), (agent.url, True)):
            runtime = Runtime.build(upstream_url=agent.url, model="m", judge_url=judge_url,
                                    judge_model="j", db_path=str(tmp_path / f"{key_expected}.db"),
                                    skills_dir=str(tmp_path / "skills"), retrieval="lexical")
            try:
                turn = runtime.store.record_turn(
                    session_id="s", status="ok", response="done",
                    request_messages=[{"role": "user", "content": "hi"}])
                runtime.judge.judge_turns(runtime.store, [turn])
            finally:
                runtime.stop()
            called = agent if key_expected else judge
            sent = called.requests[-1]["headers"].get("Authorization", "")
            assert (CANARY in sent) is key_expected, sent


def test_serve_prints_the_upstream_without_its_password(tmp_path):
    port = free_port()
    with DoubleServer([Reply("ok")]) as agent:
        upstream = agent.url.replace("http://", f"http://user:{CANARY}@")
        proc = subprocess.Popen([str(a) for a in [
            *CLI, "serve", "--upstream", upstream, "--port", port, "--db", tmp_path / "ws.db",
            "--skills", tmp_path / "skills", "--retrieval", "lexical"]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "METACLAW_UPSTREAM_API_KEY": CANARY})
        try:
            wait_for_port(proc, port)
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=20)
    assert agent.url in out and CANARY not in out + err


def test_bench_sends_the_upstream_key_to_the_upstream_only(tmp_path, monkeypatch):
    """``metaclaw demo`` / ``bench`` with a judge and an evolver on another origin: they get their
    own keys, never the upstream's."""
    from metaclaw.demo import run_demo

    monkeypatch.setenv("METACLAW_UPSTREAM_API_KEY", CANARY)
    monkeypatch.setenv("METACLAW_JUDGE_API_KEY", "judge-key-1234")
    monkeypatch.setenv("METACLAW_EVOLVER_API_KEY", "evolver-key-5678")
    with DoubleServer() as agent, DoubleServer(_verdict) as judge:
        elsewhere = judge.url.replace("127.0.0.1", "localhost")
        run_demo(days="day01", out_dir=tmp_path / "run", upstream=agent.url, model="m",
                 judge_url=elsewhere, judge_model="j", evolver_url=elsewhere,
                 evolver_model="e", votes=1, parallel=2, echo=None)
    upstream_keys = {r["headers"].get("Authorization") for r in agent.requests}
    judge_keys = {r["headers"].get("Authorization") for r in judge.requests}
    assert upstream_keys == {f"Bearer {CANARY}"}
    assert judge.requests and judge_keys <= {"Bearer judge-key-1234", "Bearer evolver-key-5678"}
    assert "Bearer judge-key-1234" in judge_keys


def test_a_401_says_when_the_proxy_sent_no_key(tmp_path, monkeypatch):
    """Without $METACLAW_UPSTREAM_API_KEY a provider's 401 would read as the agent's own key
    being wrong: the relayed error says the proxy sent none. Not so with a key, or when callers'
    own keys are forwarded."""
    import openai

    for env_key, caller_auth, hinted in ((None, False, True), (CANARY, False, False),
                                         (None, True, False)):
        if env_key is None:
            monkeypatch.delenv("METACLAW_UPSTREAM_API_KEY", raising=False)
        else:
            monkeypatch.setenv("METACLAW_UPSTREAM_API_KEY", env_key)
        with DoubleServer([Reply(status=401, content="Incorrect API key provided")]) as up:
            runtime = Runtime.start(upstream_url=up.url, model="m", caller_auth=caller_auth,
                                    db_path=str(tmp_path / f"{hinted}{caller_auth}.db"),
                                    skills_dir=str(tmp_path / "skills"), retrieval="lexical")
            try:
                client = openai.OpenAI(base_url=runtime.url, api_key="caller-key-9876",
                                       max_retries=0)
                try:
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}])
                except openai.APIStatusError as exc:
                    message, status = exc.message, exc.status_code
                else:
                    raise AssertionError("the upstream's 401 was not relayed")
            finally:
                runtime.stop()
        assert "Incorrect API key provided" in message
        # the agent's key was refused only when it was forwarded: else a 403, which agents
        # show as it is (a 401 makes them ask for a new key of their own)
        assert status == (401 if caller_auth else 403), (status, message)
        assert ("METACLAW_UPSTREAM_API_KEY is unset" in message) is hinted, message
        # with a key of the proxy's own, it is that key the upstream refused, not the agent's
        assert ("refused the key the proxy sends" in message) is (env_key is not None), message
    monkeypatch.delenv("METACLAW_UPSTREAM_API_KEY", raising=False)
    with DoubleServer([Reply(status=401, content="Incorrect API key provided")]) as up:
        with_credentials = up.url.replace("http://", "http://team:s3cret-pw@")
        runtime = Runtime.start(upstream_url=with_credentials, model="m",
                                db_path=str(tmp_path / "basic.db"),
                                skills_dir=str(tmp_path / "skills"), retrieval="lexical")
        try:
            with pytest.raises(openai.PermissionDeniedError) as err:
                openai.OpenAI(base_url=runtime.url, api_key="x", max_retries=0).chat.completions \
                    .create(model="m", messages=[{"role": "user", "content": "hi"}])
        finally:
            runtime.stop()
    assert "refused the credentials in its URL" in err.value.message
    assert "s3cret-pw" not in err.value.message and "is unset" not in err.value.message


def test_serve_warns_of_a_remote_upstream_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "METACLAW_UPSTREAM_API_KEY"}
    for upstream, warned in (("https://api.example.com/v1", True),
                             ("http://127.0.0.1:9/v1", False)):
        port = free_port()
        proc = subprocess.Popen([str(a) for a in [
            *CLI, "serve", "--upstream", upstream, "--model", "m", "--port", port,
            "--db", tmp_path / "ws.db", "--skills", tmp_path / "skills",
            "--retrieval", "lexical"]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            wait_for_port(proc, port)
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=20)
        assert ("METACLAW_UPSTREAM_API_KEY is unset" in err) is warned, err
        assert "metaclaw serve: stopped" in err


def test_only_a_remote_upstream_without_a_key_is_warned_of(monkeypatch):
    import argparse

    from metaclaw.cli import _keyless_remote_upstream

    monkeypatch.delenv("METACLAW_UPSTREAM_API_KEY", raising=False)

    def warned(url, caller_auth=False):
        return _keyless_remote_upstream(argparse.Namespace(upstream=url, caller_auth=caller_auth))

    assert warned("https://api.openai.com/v1") and warned("http://8.8.8.8:8000/v1")
    for local in ("http://127.0.0.1:8000/v1", "http://0.0.0.0:8000/v1", "http://[::1]:8000/v1",
                  "http://[::ffff:127.0.0.1]:8000/v1", "http://localhost.localdomain:8000/v1",
                  "http://192.168.1.5:8000/v1", "http://gpu-box.local:8000/v1"):
        assert not warned(local), local
    assert not warned("https://user:pass@api.example.com/v1")
    # a key in the query (Azure's api-key, sent with every request); api-version alone is none
    assert not warned("https://x.openai.azure.com/openai?api-version=2024-06-01&api-key=k-12345")
    assert warned("https://x.openai.azure.com/openai?api-version=2024-06-01")
    assert not warned("https://api.openai.com/v1", caller_auth=True)
    monkeypatch.setenv("METACLAW_UPSTREAM_API_KEY", CANARY)
    assert not warned("https://api.openai.com/v1")
