"""Serving from the trained policy: OpenAI shapes, tool-call parsing, true token streaming, and
the atomic hot-swap (in-flight requests finish on the old weights, new ones get the new weights,
~50 concurrent requests during training and swaps with zero failures)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from metaclaw.proxy.upstreams import PolicyRequestError
from metaclaw.slowloop.backends import Sample
from metaclaw.slowloop.policy import PolicyResponder, parse_tool_calls


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
def backend(tiny_model):
    from metaclaw.slowloop.backends import make_backend

    return make_backend("local", tiny_model, lora_rank=4, seed=0)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "say yes"}], "max_tokens": 6}


# -- offline doubles of the responder's collaborators (not of the responder) ----------------
class CharTokenizerBackend:
    """A byte-level tokenizer double: render_chat / decode round-trip any text exactly."""

    base_model = "char-double"
    eos_token_id = 0

    def render_chat(self, messages, tools=None):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages) + "<assistant>"
        return list(text.encode())

    def decode(self, tokens):
        return bytes(t for t in tokens if t != 0).decode(errors="replace")


class ScriptedSampler:
    """Returns a fixed completion (the bytes of ``text``, then EOS); optionally waits on a gate."""

    def __init__(self, text, policy_version, gate: threading.Event | None = None):
        self.tokens = list(text.encode()) + [0]
        self.policy_version = policy_version
        self.gate = gate

    def sample(self, prompt_tokens, n=1, max_tokens=64, temperature=1.0, seed=None):
        if self.gate is not None:
            assert self.gate.wait(10)
        toks = self.tokens[:max_tokens]
        return [Sample(toks, [-0.1] * len(toks), "stop" if toks[-1] == 0 else "length")
                for _ in range(n)]


class StreamingScriptedSampler(ScriptedSampler):
    """A :class:`ScriptedSampler` that also generates token by token, ``delay`` seconds per
    token as a model takes, counting the tokens it produced (whether generation ended early)."""

    def __init__(self, text, policy_version=0, delay=0.0):
        super().__init__(text, policy_version)
        self.delay = delay
        self.produced = 0

    def stream(self, prompt_tokens, max_tokens=64, temperature=1.0, seed=None):
        for token in self.tokens[:max_tokens]:
            time.sleep(self.delay)
            self.produced += 1
            yield token, -0.1


# -- tool calls ------------------------------------------------------------------------------
def test_parse_tool_calls():
    content, calls = parse_tool_calls(
        'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert content == "Checking."
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    content, calls = parse_tool_calls('<tool_call>{"name": "a"}</tool_call>')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {}
    broken = "<tool_call>{not json}</tool_call> hi"
    assert parse_tool_calls(broken) == (broken, [])


async def test_tool_call_reply_and_stream_are_valid_openai_objects():
    text = 'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    responder = PolicyResponder(CharTokenizerBackend(), ScriptedSampler(text, 3))
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}],
            "max_tokens": 200, "stream_options": {"include_usage": True}}
    reply = await responder.complete(body)
    parsed = ChatCompletion.model_validate(reply)
    assert parsed.choices[0].finish_reason == "tool_calls"
    assert parsed.choices[0].message.content == "Let me look."
    assert parsed.choices[0].message.tool_calls[0].function.name == "weather"
    assert reply["metaclaw"]["policy_version"] == 3

    chunks = [c async for c in responder.stream(body)]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                      if c["choices"])
    assert content == "Let me look."  # the tool-call markup is never streamed as text
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks
             if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"city": "Oslo"}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals[0]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == len(text) + 1
    responder.close()


async def test_bad_requests_are_one_clear_error(backend):
    responder = PolicyResponder(backend)
    for body, fix in [({}, "messages"), ({"messages": []}, "messages"),
                      ({**CHAT, "max_tokens": 0}, "max_tokens"),
                      ({**CHAT, "temperature": -1}, "temperature"), ({**CHAT, "n": 3}, "n=1"),
                      ({**CHAT, "seed": 2**70}, "'seed'"), ({**CHAT, "seed": "7"}, "'seed'")]:
        with pytest.raises(PolicyRequestError, match=fix):
            await responder.complete(body)
    # null is the API's default for n
    reply = await responder.complete({**CHAT, "n": None, "max_tokens": 2, "seed": -5})
    assert reply["choices"][0]["message"]["role"] == "assistant"
    responder.close()


# -- stop strings ----------------------------------------------------------------------------
def _streamed(chunks):
    """(content deltas, finish_reason) of a list of stream chunks."""
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks
              if c["choices"] and c["choices"][0]["finish_reason"]]
    return deltas, finish[0]


async def test_a_stop_string_ends_the_reply_before_it_and_stops_generating():
    text = "Sure. The answer is 42. END of answer; more text the client never asked for."
    for stop, content in [("END", "Sure. The answer is 42."), (["42", "."], "Sure"),
                          (["nowhere"], text)]:
        sampler = StreamingScriptedSampler(text, delay=0.005)
        responder = PolicyResponder(CharTokenizerBackend(), sampler)
        body = {**CHAT, "max_tokens": 200, "stop": stop}
        reply = await responder.complete(body)
        ChatCompletion.model_validate(reply)
        assert reply["choices"][0]["message"]["content"] == content
        assert reply["choices"][0]["finish_reason"] == "stop"  # a stop string, or EOS
        if content != text:  # ended at the stop string, not at max_tokens
            first = min(text.find(s) + len(s) for s in ([stop] if isinstance(stop, str)
                                                          else stop) if s in text)
            assert bytes(reply["metaclaw"]["completion_token_ids"]) == text[:first].encode()
            assert reply["usage"]["completion_tokens"] == first
            assert sampler.produced < len(text)  # the generation thread stopped there too
        chunks = [c async for c in responder.stream(body)]
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
        deltas, finish = _streamed(chunks)
        assert "".join(deltas) == content and finish == "stop"
        assert chunks[-1]["metaclaw"]["completion_token_ids"] == \
            reply["metaclaw"]["completion_token_ids"]
        responder.close()
    # max_tokens reached before any stop string: "length", as without one
    responder = PolicyResponder(CharTokenizerBackend(), StreamingScriptedSampler(text))
    reply = await responder.complete({**CHAT, "max_tokens": 5, "stop": "END"})
    assert (reply["choices"][0]["message"]["content"],
            reply["choices"][0]["finish_reason"]) == ("Sure.", "length")
    responder.close()


async def test_a_partial_stop_string_is_never_streamed():
    """Text that may begin a stop string is held back until the next tokens tell: sent when
    it turns out not to be one, never sent when it is."""
    responder = PolicyResponder(CharTokenizerBackend(), StreamingScriptedSampler(
        "one EN two ENDthree"))
    chunks = [c async for c in responder.stream({**CHAT, "max_tokens": 200, "stop": "END"})]
    deltas, finish = _streamed(chunks)
    assert "".join(deltas) == "one EN two" and finish == "stop"
    # "EN" was held, then sent with the text after it; sent at once, "E" of "END" would
    # have made the streamed text "one EN two E"
    assert len([d for d in deltas if d]) > 2
    responder.close()


@pytest.mark.parametrize("stop", [5, {"a": 1}, "", [""], ["ok", 3], ["a", "b", "c", "d", "e"],
                                  [["a"]], True])
async def test_an_invalid_stop_is_one_clear_error(stop):
    responder = PolicyResponder(CharTokenizerBackend(), StreamingScriptedSampler("hi"))
    body = {**CHAT, "stop": stop}
    with pytest.raises(PolicyRequestError, match="'stop' must be a non-empty string or a list "
                                                 "of up to 4 non-empty strings") as caught:
        await responder.complete(body)
    assert caught.value.status == 400
    with pytest.raises(PolicyRequestError, match="'stop'"):
        await responder.stream(body).__anext__()  # before the first chunk
    for fine in (None, [], "x", ["a", "b", "c", "d"]):  # null and [] are no stop at all
        reply = await responder.complete({**CHAT, "stop": fine})
        assert reply["choices"][0]["message"]["content"] == "hi"
    responder.close()


_TEXT = st.text(alphabet="ab \nEND.", max_size=40)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, stops=st.lists(st.text(alphabet="ab \nEND.", min_size=1, max_size=4),
                                  min_size=1, max_size=4))
def test_no_stop_string_ever_reaches_the_client(text, stops):
    """For any completion and stop strings: the reply ends where the first stop string is
    completed, before the earliest one then present, and contains none; streaming sends
    exactly that text, so not even a part of a stop string beyond it."""
    async def run():
        responder = PolicyResponder(CharTokenizerBackend(), StreamingScriptedSampler(text))
        body = {**CHAT, "max_tokens": 100, "stop": stops}
        try:
            reply = await responder.complete(body)
            chunks = [c async for c in responder.stream(body)]
        finally:
            responder.close()
        return reply, chunks

    reply, chunks = asyncio.run(run())
    content = reply["choices"][0]["message"]["content"]
    ends = [text.find(s) + len(s) for s in stops if s in text]
    end = min(ends, default=len(text))  # where the first stop string is completed
    cut = min((i for i in (text[:end].find(s) for s in stops) if i >= 0), default=end)
    assert content == text[:cut].strip()
    assert not any(s in content for s in stops)
    assert reply["choices"][0]["finish_reason"] == "stop"
    deltas, finish = _streamed(chunks)
    assert "".join(deltas) == content and finish == "stop"


@pytest.fixture(scope="module")
def tiny_responder(tiny_model):
    from metaclaw.slowloop.backends import make_backend

    responder = PolicyResponder(make_backend("local", tiny_model, lora_rank=4, seed=0))
    yield responder
    responder.close()


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 5), data=st.data())
def test_the_tiny_model_never_returns_a_stop_string(tiny_responder, seed, data):
    """The real tiny policy, stop strings cut from its own reply or random: the reply holds
    none of them, is the reply without them cut where one appeared, and generation ended
    there (the tokens are a prefix of the unstopped reply's)."""
    body = {**CHAT, "seed": seed, "temperature": 1.0, "max_tokens": 10}
    full = asyncio.run(tiny_responder.complete(body))
    whole = tiny_responder.backend.decode(full["metaclaw"]["completion_token_ids"])
    piece = st.integers(0, len(whole)).flatmap(
        lambda i: st.integers(i + 1, len(whole) + 1).map(lambda j: whole[i:j]))
    stops = data.draw(st.lists(st.one_of(piece, st.text(min_size=1, max_size=3)),
                               min_size=1, max_size=4).map(lambda ss: [s for s in ss if s]
                                                           or ["zz"]))

    async def run():
        return (await tiny_responder.complete({**body, "stop": stops}),
                [c async for c in tiny_responder.stream({**body, "stop": stops})])

    reply, chunks = asyncio.run(run())
    content = reply["choices"][0]["message"]["content"] or ""
    tokens = reply["metaclaw"]["completion_token_ids"]
    assert not any(s in content for s in stops)
    assert tokens == full["metaclaw"]["completion_token_ids"][:len(tokens)]
    text = tiny_responder.backend.decode(tokens)
    if any(s in whole for s in stops):
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert any(s in text for s in stops)  # it ended on the token completing a stop
        assert not any(s in tiny_responder.backend.decode(tokens[:-1]) for s in stops)
        assert content == text[:min(text.find(s) for s in stops if s in text)].strip()
    else:
        assert reply["choices"][0] == full["choices"][0]
    deltas, finish = _streamed(chunks)
    assert "".join(deltas) == content and finish == reply["choices"][0]["finish_reason"]


# -- the real tiny policy --------------------------------------------------------------------
async def test_streams_tokens_as_they_are_generated(backend):
    responder = PolicyResponder(backend)
    body = {**CHAT, "seed": 5, "temperature": 1.0, "max_tokens": 8}
    reply = await responder.complete(body)
    ChatCompletion.model_validate(reply)
    chunks = [c async for c in responder.stream(body)]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    # same seed, same weights: the streamed text equals the non-streamed reply, and it came as
    # one delta per generated word, not as one blob
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:]
              if c["choices"][0]["delta"].get("content")]
    assert "".join(deltas) == (reply["choices"][0]["message"]["content"] or "")
    assert len(deltas) >= 2
    assert chunks[-1]["metaclaw"]["completion_token_ids"] == \
        reply["metaclaw"]["completion_token_ids"]
    responder.close()


async def test_in_flight_request_finishes_on_old_weights_new_requests_get_new(backend):
    gate = threading.Event()
    old = ScriptedSampler("old answer", 1, gate)
    responder = PolicyResponder(CharTokenizerBackend(), old, 1)
    in_flight = asyncio.ensure_future(responder.complete(CHAT | {"max_tokens": 50}))
    await asyncio.sleep(0.05)  # the request has started and is generating on version 1
    assert responder.swap(ScriptedSampler("new answer", 2), 2) == 2
    assert responder.policy_version == 2
    fresh = await responder.complete(CHAT | {"max_tokens": 50})  # not blocked by the old one
    assert not in_flight.done()
    gate.set()
    first = await in_flight
    assert (first["metaclaw"]["policy_version"], first["choices"][0]["message"]["content"]) == \
        (1, "old answer")
    assert (fresh["metaclaw"]["policy_version"], fresh["choices"][0]["message"]["content"]) == \
        (2, "new answer")
    responder.close()


async def test_hot_swap_under_50_concurrent_requests_while_training(backend, tiny_model):
    from metaclaw.slowloop.grpo import GRPOConfig, Task, prompts_from_tasks, train_grpo

    responder = PolicyResponder(backend, max_workers=8)
    published: list[int] = []

    def on_publish(sampler, version):
        responder.swap(sampler, version)
        published.append(version)

    tasks = [Task("say yes", lambda t: t.split().count("yes") / max(len(t.split()), 1))]
    training = threading.Thread(target=train_grpo, args=(backend, prompts_from_tasks(backend,
                                                                                   tasks)),
                                kwargs={"config": GRPOConfig(steps=6, groups_per_step=2,
                                                             group_size=4, max_tokens=6),
                                        "on_publish": on_publish})
    training.start()
    results, failures = [], []

    async def one(i):
        try:
            body = {**CHAT, "seed": i, "stream": i % 2 == 1}
            if body["stream"]:
                chunks = [c async for c in responder.stream(body)]
                results.append(chunks[-1]["metaclaw"]["policy_version"])
            else:
                results.append((await responder.complete(body))["metaclaw"]["policy_version"])
        except Exception as exc:  # pragma: no cover - reported below
            failures.append(repr(exc))

    waves = 0
    while training.is_alive() and waves < 6:  # waves of 50 concurrent requests during training
        await asyncio.gather(*(one(i) for i in range(50)))
        waves += 1
    training.join()
    await asyncio.gather(*(one(i) for i in range(50)))  # and one wave after the last swap
    assert failures == []
    assert len(results) == 50 * (waves + 1)
    assert set(results) <= {0, *published}
    assert 0 in results and published[-1] in results  # served across the swaps
    assert published == list(range(1, len(published) + 1)) and published
    after = await responder.complete(CHAT)
    assert after["metaclaw"]["policy_version"] == published[-1] == responder.policy_version
    responder.close()
