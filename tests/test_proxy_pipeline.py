"""The turn pipeline on its own: built from its :class:`Collaborators`, with no
:class:`~metaclaw.proxy.app.Proxy` (which only builds them, starts the server and sets what changes
while it serves), and the protocol adapters' declarations the pipeline and the edge read."""

from __future__ import annotations

import threading

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from metaclaw.protocols import NO_FIELD_CHECKS, STRING, ProxyError, WireProtocol
from metaclaw.protocols.anthropic_messages import ANTHROPIC
from metaclaw.protocols.openai_chat import OPENAI
from metaclaw.protocols.registry import PIVOT, PROTOCOLS, client_protocol, register
from metaclaw.proxy import edge
from metaclaw.proxy.app import ProxyConfig
from metaclaw.proxy.context_budget import TokenCounter
from metaclaw.proxy.pipeline import (Collaborators, Recorder, Scrubber, TurnListeners,
                                     TurnPipeline)
from metaclaw.proxy.sessions import ReplyThreads
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.skills.retrieval import make_retriever

BACKUP = Skill("backup-before-modify", "Copy a config file before changing it.", "safety",
               "Run `cp config.yaml config.yaml.bak` before the first edit.")
KEY = "sk-upstream-secret-1234"


class Policy:
    """A responder: answers every request with one line that quotes the upstream key."""

    policy_version = 7

    async def complete(self, body):
        return {"id": "c1", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": f"backed up with {KEY}"}}]}

    async def stream(self, body):  # pragma: no cover - the tests ask for whole replies
        yield {}


@pytest.fixture()
def parts(store, tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_PIPELINE_KEY", KEY)
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(BACKUP, reason="test")
    listeners = TurnListeners()
    recorder = Recorder(store, listeners=listeners)
    parts = Collaborators(ProxyConfig(retrieval="lexical", api_key_env="TEST_PIPELINE_KEY"),
                          library, make_retriever("lexical"), recorder,
                          Scrubber("TEST_PIPELINE_KEY"), ReplyThreads(store), TokenCounter())
    listeners.start()
    yield parts
    recorder.stop()
    listeners.stop()


async def _client(pipeline: TurnPipeline) -> TestClient:
    app = web.Application()
    for protocol in PROTOCOLS.values():
        for route in protocol.routes:
            app.router.add_post("/v1" + route, lambda request, p=protocol: pipeline.serve(
                p, request))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_the_pipeline_serves_and_records_a_turn_without_a_proxy(parts, store):
    heard = threading.Event()
    parts.recorder.listeners.add(lambda turn_id: heard.set())
    parts.responder = Policy()
    client = await _client(TurnPipeline(parts))
    try:
        response = await client.post("/v1/chat/completions", headers={"X-Session-Id": "s1"},
                                     json={"model": "m", "messages": [
                                         {"role": "user", "content": "I must edit config.yaml"}]})
        reply = await response.json()
    finally:
        await client.close()
    assert response.status == 200
    assert response.headers["X-MetaClaw-Injected-Skills"] == "backup-before-modify"
    assert response.headers["X-MetaClaw-Policy-Version"] == "7"
    assert KEY not in reply["choices"][0]["message"]["content"]  # masked by the scrubber
    (turn,) = store.turns()  # durable acks: committed before the reply was sent
    assert turn["session_id"] == "s1" and turn["status"] == "ok"
    assert turn["protocol"] == "openai" and turn["policy_version"] == 7
    assert turn["injected_skills"] == ["backup-before-modify"] and KEY not in turn["response"]
    assert heard.wait(5)  # the recorder told the listeners


async def test_without_an_upstream_the_turn_is_a_503_in_the_clients_shape(parts, store):
    client = await _client(TurnPipeline(parts))
    try:
        response = await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        error = await response.json()
    finally:
        await client.close()
    assert response.status == 503 and error["type"] == "error"  # Anthropic's shape
    assert error["error"]["message"].startswith("no upstream is configured")
    (turn,) = store.turns()
    assert turn["status"] == "error" and turn["protocol"] == "anthropic"


def test_the_scrubber_masks_the_key_the_token_and_a_callers_key(monkeypatch):
    monkeypatch.setenv("TEST_PIPELINE_KEY", KEY)
    scrubber = Scrubber("TEST_PIPELINE_KEY", token="proxy-token")
    text = scrubber.text(f"{KEY} proxy-token caller-key-42", "caller-key-42")
    assert KEY not in text and "proxy-token" not in text and "caller-key-42" not in text
    error = scrubber.error(ProxyError(502, f"upstream said {KEY}", headers={"x": KEY}))
    assert KEY not in error.message and KEY not in str(error.payload) and KEY not in str(
        error.headers)
    assert Scrubber("TEST_PIPELINE_UNSET").secrets() == ()


# ---------------------------------------------------------------------------------------------
# what each adapter declares
# ---------------------------------------------------------------------------------------------
class Bare(WireProtocol):
    name = "bare"
    routes = ("/bare",)


def test_a_protocol_without_field_types_cannot_be_registered():
    with pytest.raises(TypeError, match="declares no field_types"):
        register(OPENAI, Bare())

    class Unchecked(Bare):
        field_types = NO_FIELD_CHECKS

    class Typo(Bare):
        field_types = {"stream": ("bool",)}

    assert register(OPENAI, Unchecked())["bare"].field_types == {}
    with pytest.raises(TypeError, match="'stream'"):
        register(OPENAI, Typo())
    with pytest.raises(TypeError, match="one pivot"):
        register(Unchecked())


def test_the_edge_reads_the_field_types_from_the_adapter():
    class Strict(Bare):
        field_types = {"mode": STRING}

    with pytest.raises(ProxyError) as caught:
        edge.check_fields(Strict(), {"mode": 3})
    assert caught.value.param == "mode" and caught.value.code == "invalid_type"
    assert edge.check_fields(Strict(), {"mode": None, "other": 3}) == {"other": 3}
    with pytest.raises(ProxyError, match="session_id"):  # the proxy's own fields, always
        edge.check_fields(Strict(), {"session_id": 3})
    with pytest.raises(ProxyError, match=r"messages\[0\]\.role"):  # the chat messages' fields
        edge.check_fields(OPENAI, {"messages": [{"role": 1}]})
    assert edge.check_fields(ANTHROPIC, {"messages": [{"role": 1}]})  # not Anthropic's


def test_routes_and_headers_come_from_the_registered_adapters():
    assert PIVOT is OPENAI
    assert client_protocol("/v1/messages/count_tokens", {}) is ANTHROPIC
    assert client_protocol("/v1/models", {"anthropic-version": "2023-06-01"}) is ANTHROPIC
    assert client_protocol("/v1/models", {}) is OPENAI
    assert [p.name for p in PROTOCOLS.values() if p.count_tokens_route] == ["anthropic"]
    assert ANTHROPIC.forward_headers == ("anthropic-version", "anthropic-beta")
    assert OPENAI.forward_headers == ()
