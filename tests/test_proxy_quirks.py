"""What OpenAI-compatible servers leave out or say differently, through the proxy to each client
protocol: the official SDKs' stream accumulators must rebuild the reply, and the recorded turn
must match what was served.

A scripted upstream (tests/fault_upstream.py, ``fault=scripted``: real sockets, real SSE) sends
a model's refusal, parallel tool calls without ``index``, a call without ``id``, a tool name in
pieces, tool calls ending with ``finish_reason: "stop"``, cached prompt tokens, and a finished
stream without ``data: [DONE]``.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest

from fault_upstream import FaultUpstream
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import SkillLibrary
from metaclaw.store import Store
from waiting import wait_until

ASK = "fault=scripted please"
TOOLS_OPENAI = [{"type": "function", "name": name, "parameters": {"type": "object"}}
                for name in ("shell", "read")]
TOOLS_ANTHROPIC = [{"name": name, "input_schema": {"type": "object"}} for name in ("shell", "read")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("quirks")
    upstream = FaultUpstream().start()
    store = Store(str(root / "metaclaw.db"))
    proxy = Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="lexical", max_retries=0),
                  store, SkillLibrary(str(root / "skills"), store)).start()
    yield upstream, proxy, store
    proxy.stop()
    upstream.stop()
    store.close()


def _chunk(delta=None, finish=None, usage=None):
    chunk = {"id": "chatcmpl-q", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage:
        chunk["usage"] = usage
    return chunk


def _last_turn(store, session):
    # a failed stream is recorded after the client has seen the error: wait for the row
    rows = wait_until(lambda: store.turns("session_id = ?", (session,)), what=session)
    return rows[-1]


def _clients(proxy):
    return (openai.OpenAI(base_url=proxy.url, api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=proxy.base_url, api_key="x", max_retries=0))


def _responses(client, session, stream):
    kwargs = dict(model="m", input=ASK, tools=TOOLS_OPENAI,
                  extra_headers={"X-Session-Id": session})
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_response()


def _messages(client, session, stream):
    kwargs = dict(model="m", max_tokens=64, tools=TOOLS_ANTHROPIC,
                  messages=[{"role": "user", "content": ASK}],
                  extra_headers={"X-Session-Id": session})
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [True, False])
def test_a_refusal_reaches_every_client_and_the_record(env, stream):
    upstream, proxy, store = env
    upstream.chunks = [_chunk({"role": "assistant", "content": None, "refusal": ""}),
                       _chunk({"refusal": "I can't "}), _chunk({"refusal": "help with that."}),
                       _chunk(finish="stop")]
    upstream.json_body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                          "choices": [{"index": 0, "finish_reason": "stop", "message": {
                              "role": "assistant", "content": None,
                              "refusal": "I can't help with that."}}]}
    chat, messages = _clients(proxy)
    session = f"refusal-{uuid.uuid4().hex[:8]}"
    reply = _responses(chat, session + "-r", stream)
    part = reply.output[0].content[0]
    assert part.type == "refusal" and part.refusal == "I can't help with that."
    assert _last_turn(store, session + "-r")["response"] == "I can't help with that."
    message = _messages(messages, session + "-a", stream)
    assert [b.text for b in message.content] == ["I can't help with that."]
    assert message.stop_reason == "refusal"
    assert _last_turn(store, session + "-a")["response"] == "I can't help with that."


def test_parallel_calls_without_index_stay_two_calls_with_the_recorded_ids(env):
    upstream, proxy, store = env
    upstream.done = True
    upstream.chunks = [
        _chunk({"role": "assistant"}),
        _chunk({"tool_calls": [{"id": "call_G0", "type": "function", "function": {
            "name": "shell", "arguments": '{"cmd": "ls"}'}}]}),
        _chunk({"tool_calls": [{"id": "call_G1", "type": "function", "function": {
            "name": "read", "arguments": '{"path": '}}]}),
        _chunk({"tool_calls": [{"function": {"arguments": '"a.txt"}'}}]}),  # continues G1
        _chunk(finish="tool_calls")]
    chat, messages = _clients(proxy)
    session = f"noindex-{uuid.uuid4().hex[:8]}"
    reply = _responses(chat, session + "-r", True)
    calls = [(item.call_id, item.name, json.loads(item.arguments)) for item in reply.output]
    assert calls == [("call_G0", "shell", {"cmd": "ls"}), ("call_G1", "read", {"path": "a.txt"})]
    message = _messages(messages, session + "-a", True)
    assert [(b.id, b.name, b.input) for b in message.content] == [
        ("call_G0", "shell", {"cmd": "ls"}), ("call_G1", "read", {"path": "a.txt"})]
    recorded = _last_turn(store, session + "-a")["tool_calls"]
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in recorded] == [
        ("call_G0", {"cmd": "ls"}), ("call_G1", {"path": "a.txt"})]


def test_parallel_calls_with_neither_index_nor_id_are_told_apart_by_their_names():
    from metaclaw.protocols.openai_chat import CallNumbering, StreamAssembler

    numbering, assembler = CallNumbering(), StreamAssembler()
    for delta in ({"tool_calls": [{"function": {"name": "shell", "arguments": '{"cmd": '}}]},
                  {"tool_calls": [{"function": {"arguments": '"ls"}'}}]},
                  {"tool_calls": [{"function": {"name": "read", "arguments": '{"path": '}}]},
                  {"tool_calls": [{"function": {"arguments": '"a.txt"}'}}]}):
        raw = ("data: " + json.dumps(_chunk(delta)) + "\n\n").encode()
        assembler.add(numbering.fix((raw, json.loads(raw[6:])))[1])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in assembler.tool_calls] == [("shell", {"cmd": "ls"}),
                                               ("read", {"path": "a.txt"})]
    assert len({c["id"] for c in assembler.tool_calls}) == 2
    # a server that repeats the name on every fragment of one call: still one call
    numbering, assembler = CallNumbering(), StreamAssembler()
    for delta in ({"tool_calls": [{"id": "call_1", "function": {"name": "get_weather",
                                                                "arguments": '{"city":'}}]},
                  {"tool_calls": [{"function": {"name": "get_weather",
                                                "arguments": '"Paris"}'}}]}):
        raw = ("data: " + json.dumps(_chunk(delta)) + "\n\n").encode()
        assembler.add(numbering.fix((raw, json.loads(raw[6:])))[1])
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in assembler.tool_calls] == [("call_1", "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [True, False])
def test_a_call_without_an_id_is_served_and_recorded_with_one_id(env, stream):
    upstream, proxy, store = env
    upstream.done = True
    upstream.chunks = [_chunk({"role": "assistant"}),
                       _chunk({"tool_calls": [{"index": 0, "type": "function", "function": {
                           "name": "sh", "arguments": ""}}]}),
                       _chunk({"tool_calls": [{"index": 0, "function": {"name": "ell"}}]}),
                       _chunk({"tool_calls": [{"index": 0, "function": {
                           "arguments": '{"cmd": "pwd"}'}}]}),
                       _chunk(finish="stop")]  # Ollama-style: "stop" after tool calls
    upstream.json_body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                          "choices": [{"index": 0, "finish_reason": "stop", "message": {
                              "role": "assistant", "content": None, "tool_calls": [{
                                  "type": "function", "function": {
                                      "name": "shell", "arguments": '{"cmd": "pwd"}'}}]}}]}
    chat, messages = _clients(proxy)
    session = f"noid-{uuid.uuid4().hex[:8]}"
    message = _messages(messages, session + "-a", stream)
    (block,) = message.content
    assert block.name == "shell" and block.input == {"cmd": "pwd"}  # the name whole
    assert message.stop_reason == "tool_use"  # an agent loop runs the call
    assert block.id and _last_turn(store, session + "-a")["tool_calls"][0]["id"] == block.id
    reply = _responses(chat, session + "-r", stream)
    (item,) = reply.output
    assert item.call_id and _last_turn(store, session + "-r")["tool_calls"][0]["id"] == \
        item.call_id
    plain = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}],
                                         extra_headers={"X-Session-Id": session + "-c"},
                                         stream=stream)
    if stream:
        ids = [c.id for chunk in plain for c in (chunk.choices[0].delta.tool_calls or ())
               if chunk.choices and c.id]
    else:
        ids = [c.id for c in plain.choices[0].message.tool_calls]
    assert len(ids) == 1 and ids[0] == _last_turn(store, session + "-c")["tool_calls"][0]["id"]


def test_cached_prompt_tokens_reach_an_anthropic_client_apart(env):
    upstream, proxy, _ = env
    upstream.done = True
    upstream.chunks = [_chunk({"role": "assistant", "content": "hi"}), _chunk(finish="stop"),
                       {**_chunk(), "choices": [], "usage": {
                           "prompt_tokens": 1000, "completion_tokens": 5, "total_tokens": 1005,
                           "prompt_tokens_details": {"cached_tokens": 800}}}]
    _, messages = _clients(proxy)
    message = _messages(messages, f"cache-{uuid.uuid4().hex[:8]}", True)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (200, 800)


def test_a_finished_stream_without_done_is_a_whole_reply(env):
    upstream, proxy, store = env
    upstream.done = False
    upstream.chunks = [_chunk({"role": "assistant", "content": "all "}),
                       _chunk({"content": "done"}), _chunk(finish="stop"),
                       {**_chunk(), "choices": [], "usage": {
                           "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
    try:
        chat, messages = _clients(proxy)
        session = f"nodone-{uuid.uuid4().hex[:8]}"
        text = "".join(chunk.choices[0].delta.content or "" for chunk in
                       chat.chat.completions.create(
                           model="m", stream=True, messages=[{"role": "user", "content": ASK}],
                           extra_headers={"X-Session-Id": session + "-c"}) if chunk.choices)
        assert text == "all done"
        assert _messages(messages, session + "-a", True).content[0].text == "all done"
        assert _responses(chat, session + "-r", True).output_text == "all done"
        for suffix in ("-c", "-a", "-r"):
            turn = _last_turn(store, session + suffix)
            assert (turn["status"], turn["response"]) == ("ok", "all done")
        # cut off before its finish reason: still a truncated reply, never a complete one
        upstream.chunks = upstream.chunks[:2]
        with pytest.raises(anthropic.APIError):
            _messages(messages, session + "-t", True)
        assert _last_turn(store, session + "-t")["status"] == "error"
    finally:
        upstream.done = True
