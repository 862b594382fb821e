"""Adding a wire protocol is its adapter and one registration, nothing else.

This module defines a toy protocol entirely here (``POST /v1/toy``: ``{"model", "prompt",
"system"}`` answered with ``{"text"}``), registers it with one call of
:func:`metaclaw.protocols.registry.add` and takes it out again after each test. With no other
change anywhere, a real running proxy serves its clients (skills injected, turn recorded) in front
of an OpenAI-compatible upstream, and forwards to an upstream that speaks it, from its own
clients and, through the chat pivot, from an OpenAI client; ``--upstream-protocol`` offers it.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
from aiohttp import web

from metaclaw import cli
from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.protocols import NO_FIELD_CHECKS, STRING, ProxyError, WireProtocol
from metaclaw.protocols.registry import PROTOCOLS, add, remove, upstream_protocols
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.proxy.server import BackgroundServer, ServedApp
from metaclaw.proxy.upstreams import make_upstream
from metaclaw.skills.block import BLOCK_TAG, inject as inject_block
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.store import Store

BACKUP = Skill("backup-before-modify", "Copy a config file before changing it.", "safety",
               "Run `cp config.yaml config.yaml.bak` before the first edit.")
ASK = "I have to change deploy/config.yaml before tonight's release. What should I do first?"
KEY = "sk-toy-upstream-key-5678"


class ToyProtocol(WireProtocol):
    """A toy JSON protocol: one prompt (and an optional system text) in, one text out."""

    name = "toy"
    routes = ("/toy",)
    field_types = {"model": STRING, "prompt": STRING, "system": STRING}
    upstream_path = "/toy"  # after the upstream's base URL (``.../v1``)

    # -- requests -------------------------------------------------------------------------
    def parse_request(self, body, model):
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            raise ProxyError(400, "'prompt' is required: a non-empty string", param="prompt")
        return model or body.get("model") or "toy-model", False  # the toy never streams

    def to_chat(self, body):
        system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
        return {"model": body.get("model"),
                "messages": [*system, {"role": "user", "content": body["prompt"]}]}

    def from_chat(self, chat):
        def text(role):
            return "\n\n".join(str(m.get("content") or "") for m in chat["messages"]
                               if m.get("role") == role)

        prompt = next((str(m.get("content") or "") for m in reversed(chat["messages"])
                       if m.get("role") == "user"), "")
        system = text("system")
        return {"model": chat.get("model"), "prompt": prompt, **({"system": system} if system
                                                                  else {})}

    def inject(self, body, block):
        chat = self.to_chat(body)
        return {**body, **self.from_chat({**chat, "messages": inject_block(chat["messages"],
                                                                           block)})}

    # -- replies --------------------------------------------------------------------------
    def reply_problem(self, data):
        return None if isinstance(data, dict) and isinstance(data.get("text"), str) \
            else "no 'text'"

    def reply_to_chat(self, data):
        return {"id": "toy", "object": "chat.completion", "model": data.get("model"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": data["text"]}}]}

    def reply_from_chat(self, completion, request=None):
        message = (completion.get("choices") or [{}])[0].get("message") or {}
        return {"text": message.get("content") or ""}

    def error_payload(self, error):
        return {"error": {"message": error.message, "code": error.code}}


TOY = ToyProtocol()


class ToyUpstream(ServedApp):
    """A model server speaking the toy protocol: answers ``{"text": "toy says: <prompt>"}``
    and keeps each request's path, headers and body."""

    def __init__(self):
        self.requests: list[dict] = []
        self._server = BackgroundServer(self._make_app, "127.0.0.1", 0, "toy-upstream")

    def _make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/toy", self._toy)
        return app

    async def _toy(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"path": request.path, "headers": dict(request.headers),
                              "body": body})
        return web.json_response({"text": f"toy says: {body['prompt']}"})


@pytest.fixture()
def toy():
    """The toy protocol, registered for the test (one call) and taken out after it."""
    before = dict(PROTOCOLS)
    yield add(TOY)
    remove(TOY.name)
    assert PROTOCOLS == before


@pytest.fixture()
def workspace(tmp_path):
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(BACKUP, reason="test")
    yield store, library
    store.close()


def _proxy(workspace, url: str, protocol: str) -> Proxy:
    store, library = workspace
    return Proxy(ProxyConfig(upstream_url=url, upstream_protocol=protocol, retrieval="lexical",
                             max_retries=0, api_key_env="TOY_UPSTREAM_KEY"), store, library)


def _turns(proxy: Proxy, store: Store) -> list[dict]:
    proxy.flush()
    return store.turns()


def test_a_toy_client_is_served_through_a_running_proxy_with_skills_and_a_record(toy,
                                                                                 workspace):
    store, _ = workspace
    with DoubleServer([Reply("Back the file up first.")]) as upstream, \
            _proxy(workspace, upstream.url, "openai") as proxy:
        response = httpx.post(f"{proxy.base_url}/v1/toy", timeout=30,
                              headers={"X-Session-Id": "toy-1"},
                              json={"model": "double-model", "prompt": ASK})
        refused = httpx.post(f"{proxy.base_url}/v1/toy", json={"prompt": 7}, timeout=30)
        turns = _turns(proxy, store)
    assert response.status_code == 200, response.text
    assert response.json() == {"text": "Back the file up first."}  # the toy's reply shape
    assert response.headers["X-MetaClaw-Injected-Skills"] == BACKUP.name
    # the OpenAI-compatible upstream got the ask with the skill block in its system message
    sent = upstream.requests[-1]["body"]["messages"]
    assert sent[0]["role"] == "system" and BLOCK_TAG in sent[0]["content"]
    assert BACKUP.body in sent[0]["content"] and sent[-1] == {"role": "user", "content": ASK}
    # the field checks the adapter declares are made at the edge, the error in its shape
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_type"
    [turn] = turns
    assert (turn["protocol"], turn["session_id"], turn["response"]) == (
        "toy", "toy-1", "Back the file up first.")
    assert turn["injected_skills"] == [BACKUP.name]
    assert turn["request_messages"][-1] == {"role": "user", "content": ASK}


def test_the_proxy_forwards_to_a_toy_upstream_from_toy_and_openai_clients(toy, workspace,
                                                                           monkeypatch):
    monkeypatch.setenv("TOY_UPSTREAM_KEY", KEY)
    store, _ = workspace
    with ToyUpstream() as upstream, _proxy(workspace, upstream.url, "toy") as proxy:
        own = httpx.post(f"{proxy.base_url}/v1/toy", timeout=30,
                         json={"model": "toy-model", "prompt": ASK, "system": "Be brief."})
        chat = httpx.post(f"{proxy.url}/chat/completions", timeout=30,
                          json={"model": "toy-model", "messages": [
                              {"role": "user", "content": ASK}]})
        turns = _turns(proxy, store)
    assert own.status_code == 200, own.text
    assert own.json() == {"text": f"toy says: {ASK}"}
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == f"toy says: {ASK}"
    first, second = upstream.requests
    # the adapter's upstream path and the default key header, the server key sent
    assert first["path"] == second["path"] == "/v1/toy"
    assert first["headers"]["Authorization"] == f"Bearer {KEY}"
    # a toy client's body goes on as sent, with only the skill block added to its system text
    assert first["body"]["prompt"] == ASK and first["body"]["model"] == "toy-model"
    assert first["body"]["system"].startswith("Be brief.")
    assert BLOCK_TAG in first["body"]["system"]
    # an OpenAI client's request is translated through the chat pivot into the toy's shape
    assert second["body"]["prompt"] == ASK and BLOCK_TAG in second["body"]["system"]
    assert [(t["protocol"], t["response"], t["injected_skills"]) for t in turns] == [
        ("toy", f"toy says: {ASK}", [BACKUP.name]),
        ("openai", f"toy says: {ASK}", [BACKUP.name])]
    assert all(KEY not in str(t) for t in turns)


def test_a_registered_protocol_is_an_upstream_choice_until_it_is_removed(toy):
    parser = next(a for a in cli.build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert "toy" in upstream_protocols()
    assert parser.parse_args(["--upstream-protocol", "toy"]).upstream_protocol == "toy"
    assert make_upstream("toy", "http://127.0.0.1:9/v1", "K", 1.0, 0).path == "/toy"
    remove("toy")
    try:
        with pytest.raises(SystemExit):
            parser.parse_args(["--upstream-protocol", "toy"])
        with pytest.raises(ValueError, match="'openai', 'anthropic', 'responses'"):
            make_upstream("toy", "http://127.0.0.1:9/v1", "K", 1.0, 0)
    finally:
        add(TOY)  # the fixture takes it out


def test_registering_checks_the_adapter():
    class Clash(ToyProtocol):
        name = "clash"
        routes = ("/chat/completions",)

    class ClientsOnly(ToyProtocol):
        name = "clients-only"
        routes = ("/clients-only",)
        upstream_path = None
        field_types = NO_FIELD_CHECKS

    before = dict(PROTOCOLS)
    with pytest.raises(TypeError, match="served by another protocol"):
        add(Clash())
    with pytest.raises(TypeError, match="distinct names"):
        add(type("Twin", (ToyProtocol,), {"name": "openai", "routes": ("/twin",)})())
    assert PROTOCOLS == before
    add(ClientsOnly())
    try:  # served to clients, never a choice of upstream
        assert "clients-only" in PROTOCOLS and "clients-only" not in upstream_protocols()
        with pytest.raises(ValueError, match="unknown upstream protocol"):
            make_upstream("clients-only", "http://127.0.0.1:9/v1", "K", 1.0, 0)
    finally:
        remove("clients-only")
    with pytest.raises(ValueError, match="pivot"):
        remove("openai")
    assert PROTOCOLS == before


def test_the_request_path_names_no_protocol():
    """What the proxy does with a protocol comes from its adapter: no module of
    ``metaclaw/proxy`` tests or looks up a protocol by its name (docstrings aside, and the
    default of ``ProxyConfig.upstream_protocol``, the protocol an upstream speaks unless told)."""
    import ast
    from pathlib import Path

    import metaclaw.proxy

    names = set(PROTOCOLS)
    found = []
    for path in sorted(Path(metaclaw.proxy.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
                skip.add(id(body[0].value))  # a docstring
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == \
                    "upstream_protocol":
                skip.add(id(node.value))
        found += [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names
                  and id(node) not in skip]
    assert found == []
