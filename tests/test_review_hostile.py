"""A client that hangs up on a turn the proxy answers from its local policy: the generation
stops with the turn, as an upstream request is cancelled (a real proxy, a real socket, the
local backend's tiny model)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import SkillLibrary
from metaclaw.slowloop.policy import PolicyResponder
from metaclaw.store import Store


def _waited(check, within: float = 10.0):
    deadline = time.monotonic() + within
    while not (answer := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_stops_the_local_policy_generating(tmp_path, stream):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.slowloop.backends import make_backend

    torch.set_num_threads(1)
    backend = make_backend("local", str(write_tiny_model(tmp_path / "tiny", seed=0)),
                           lora_rank=8, seed=0)
    forwards = []  # one per generated token
    backend.sampler().model.register_forward_hook(lambda *_: forwards.append(1))
    store = Store(tmp_path / "metaclaw.db")
    proxy = Proxy(ProxyConfig(upstream_url="http://127.0.0.1:9", retrieval="lexical"), store,
                  SkillLibrary(tmp_path / "skills", store)).start()
    # greedy: the tiny model never ends its reply by itself before max_tokens
    proxy.set_responder(PolicyResponder(backend, temperature=0.0))
    body = json.dumps({"model": "m", "stream": stream, "max_tokens": 3000,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nX-Session-Id: gone\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert _waited(lambda: len(forwards) > 20), "the policy never started generating"
        turns = _waited(lambda: store.turns("session_id = ?", ("gone",)))
        assert [t["status"] for t in turns] == ["client_disconnected"]
        time.sleep(0.2)  # the token being generated when the client left
        generated = len(forwards)
        time.sleep(0.5)
        assert len(forwards) - generated <= 1, "the policy went on generating for nobody"
    finally:
        proxy.stop()
        store.close()
