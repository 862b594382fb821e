"""The protocol adapters on their own: request / reply / stream translation both ways between
OpenAI chat and Anthropic Messages, skill injection that keeps the client's cached prefix, the
pipeline's small steps and the context budget's arithmetic. No sockets here."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from metaclaw.proxy.context_budget import KNOWN_WINDOWS, TokenCounter, context_window, fit_skills
from metaclaw.proxy.pipeline import identify_session, parse_turn, record_row, retrieval_query
import metaclaw.protocols
from metaclaw.protocols import ProxyError, sse_events
from metaclaw.protocols.anthropic_messages import ANTHROPIC, DEFAULT_MAX_TOKENS
from metaclaw.protocols.openai_chat import OPENAI, StreamAssembler
from metaclaw.protocols.registry import PROTOCOLS, get_protocol

TOOL_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}

ANTHROPIC_REQUEST = {
    "model": "claude-test", "max_tokens": 256, "temperature": 0.2, "stop_sequences": ["END"],
    "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "Repository: demo."}],
    "metadata": {"user_id": "u-7"},
    "tools": [{"name": "read_file", "description": "Read a file", "input_schema": TOOL_SCHEMA}],
    "tool_choice": {"type": "tool", "name": "read_file", "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at this"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need the file", "signature": "s1"},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "print(1)"}]},
            {"type": "text", "text": "What does it print?"}]},
    ],
}


def test_registry_names_the_protocols():
    assert set(PROTOCOLS) == {"openai", "anthropic", "responses"}
    assert get_protocol("anthropic") is ANTHROPIC
    with pytest.raises(ValueError, match="choose one of anthropic, openai, responses"):
        get_protocol("gemini")


def test_anthropic_request_to_chat():
    chat = ANTHROPIC.to_chat(ANTHROPIC_REQUEST)
    assert chat["messages"][0] == {"role": "system", "content": "You are terse.\n\nRepository: demo."}
    user = chat["messages"][1]
    assert user["content"][0] == {"type": "text", "text": "Look at this"}
    assert user["content"][1]["image_url"]["url"] == "data:image/png;base64,iVBORw0KGgo="
    assistant = chat["messages"][2]
    assert assistant["content"] == "Reading it."  # thinking dropped (documented)
    assert assistant["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "read_file", "arguments": '{"path":"a.py"}'}}]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"}
    assert chat["messages"][4] == {"role": "user", "content": "What does it print?"}
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file", "parameters": TOOL_SCHEMA}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"]
    assert chat["user"] == "u-7" and chat["max_tokens"] == 256 and chat["temperature"] == 0.2


def test_chat_request_to_anthropic_and_back():
    chat = {"model": "m", "temperature": 0.5, "stop": "END", "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "read_file",
                                                        "description": "Read",
                                                        "parameters": TOOL_SCHEMA}}],
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "data"},
                {"role": "user", "content": [{"type": "text", "text": "and?"}]}]}
    body = ANTHROPIC.from_chat(chat)
    assert body["system"] == "Be terse.\n\nUse tools."
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS and body["stop_sequences"] == ["END"]
    assert body["tool_choice"] == {"type": "any"}
    assert body["tools"][0] == {"name": "read_file", "description": "Read",
                                "input_schema": TOOL_SCHEMA}
    assert body["messages"][1] == {"role": "assistant", "content": [
        {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a"}}]}
    # the tool result and the next user text become one user turn
    assert body["messages"][2] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "c1", "content": "data"},
        {"type": "text", "text": "and?"}]}
    ANTHROPIC.parse_request(body, None)  # a valid Anthropic request
    back = ANTHROPIC.to_chat(body)
    assert back["messages"][0] == {"role": "system", "content": "Be terse.\n\nUse tools."}
    assert back["messages"][2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert json.loads(back["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"path": "a"}
    assert back["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "data"}
    assert back["tool_choice"] == "required"


def test_pdf_documents_and_file_parts_translate_both_ways():
    """A PDF reaches the model whichever protocols meet: an Anthropic base64 document becomes an
    OpenAI file part (it was dropped, the model answering without it), and an OpenAI file part
    becomes a document block (it was an empty text block, which Anthropic refuses)."""
    document = {"type": "document", "title": "report.pdf", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}
    chat = ANTHROPIC.to_chat({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [document, {"type": "text", "text": "Summarize it."}]}]})
    assert chat["messages"][0]["content"] == [
        {"type": "file", "file": {"filename": "report.pdf",
                                  "file_data": "data:application/pdf;base64,JVBERi0x"}},
        {"type": "text", "text": "Summarize it."}]
    body = ANTHROPIC.from_chat(chat)
    assert body["messages"][0]["content"][0] == document
    ANTHROPIC.parse_request(body, None)
    # a text document is still its text
    text_doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                               "data": "plain words"}}
    chat = ANTHROPIC.to_chat({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [text_doc]}]})
    assert chat["messages"][0]["content"] == "plain words"


def test_parts_with_nothing_to_send_never_become_empty_text_blocks():
    """Anthropic refuses an empty text block ("text content blocks must be non-empty"): parts
    with no text (audio, a file id, empty text) and empty user messages are left out."""
    chat = {"model": "m", "messages": [
        {"role": "user", "content": ""},
        {"role": "user", "content": [
            {"type": "text", "text": "hear this"},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "file", "file": {"file_id": "file-abc"}},
            {"type": "text", "text": ""}]}]}
    body = ANTHROPIC.from_chat(chat)
    assert body["messages"] == [{"role": "user", "content": [{"type": "text",
                                                              "text": "hear this"}]}]
    blocks = [b for m in body["messages"] for b in m["content"]]
    assert all(b.get("text") != "" for b in blocks)


def test_n_above_one_is_refused_for_an_anthropic_upstream():
    """Anthropic returns one reply per request: n > 1 is a 400 naming n, not one choice where
    the client reads n."""
    chat = {"model": "m", "n": 3, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ProxyError, match="'n' is 3") as caught:
        ANTHROPIC.from_chat(chat)
    assert caught.value.status == 400 and caught.value.param == "n"
    assert ANTHROPIC.from_chat({**chat, "n": 1})["messages"]


def test_nested_content_is_read_in_linear_time():
    """Text is read from nested lists once per part: reading each part twice made a small body
    of nested lists (a tool_result's content) take time exponential in its depth, holding the
    proxy's event loop for hours."""
    from metaclaw.protocols import anthropic_messages

    calls = 0
    text_of = anthropic_messages._text

    def counted(value):
        nonlocal calls
        calls += 1
        return text_of(value)

    nested: object = [{"type": "text", "text": "deep"}]
    for _ in range(16):
        nested = [nested]
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": nested}]}]}
    anthropic_messages._text = counted
    try:
        chat = ANTHROPIC.to_chat(body)
    finally:
        anthropic_messages._text = text_of
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "deep"}]
    assert calls < 100, calls  # 2**16 before


def test_tool_input_given_whole_at_block_start_is_kept():
    """A server that sends a tool_use block's whole input in content_block_start (no
    input_json_delta) still gives the OpenAI client, and the record, the call's arguments."""
    events = [
        {"type": "message_start", "message": {"id": "msg_1", "model": "m", "usage": {
            "input_tokens": 3, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a"}}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
         "usage": {"output_tokens": 4}},
        {"type": "message_stop"}]
    assembler = StreamAssembler()
    translator = ANTHROPIC.stream_to_chat()
    for event in events:
        for chunk in translator.feed(event):
            assembler.add(chunk)
    (call,) = assembler.tool_calls
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"path": "a"}
    recorder = ANTHROPIC.assembler()
    for event in events:
        recorder.add(event)
    assert json.loads(recorder.columns()["tool_calls"][0]["function"]["arguments"]) == {
        "path": "a"}


def test_replies_translate_both_ways():
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
               "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                           {"type": "text", "text": "Reading."},
                           {"type": "tool_use", "id": "toolu_9", "name": "read_file",
                            "input": {"path": "b"}}],
               "stop_reason": "tool_use", "stop_sequence": None,
               "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 90}}
    completion = ANTHROPIC.reply_to_chat(message)
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Reading."
    assert choice["message"]["reasoning_content"] == "hmm"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"path": "b"}
    assert completion["usage"]["prompt_tokens"] == 100 and completion["usage"]["completion_tokens"] == 5
    again = ANTHROPIC.reply_from_chat(completion)
    assert again["content"][1:] == message["content"][1:]
    assert again["content"][0]["thinking"] == "hmm" and again["stop_reason"] == "tool_use"
    assert again["usage"]["input_tokens"] == 10 and again["usage"]["cache_read_input_tokens"] == 90
    for finish, stop in (("stop", "end_turn"), ("length", "max_tokens"),
                         ("content_filter", "refusal")):
        reply = {"model": "m", "choices": [{"message": {"content": "x"}, "finish_reason": finish}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        out = ANTHROPIC.reply_from_chat(reply)
        assert out["stop_reason"] == stop
        assert out["usage"] == {"input_tokens": 3, "output_tokens": 1}


def _chat_chunks(text: str, call: bool) -> list:
    base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def chunk(delta, finish=None):
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": w}) for w in text.split(" ")]
    if call:
        chunks.append(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                             "function": {"name": "read_file", "arguments": ""}}]}))
        chunks += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
                   for part in ('{"pa', 'th": "a"}')]
    chunks.append(chunk({}, "tool_calls" if call else "stop"))
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
    return [*chunks, None]


def test_streams_translate_both_ways():
    chunks = _chat_chunks("Reading the file", call=True)
    to_anthropic = ANTHROPIC.stream_from_chat()
    events = [e for c in chunks for e in to_anthropic.feed(c)] + to_anthropic.close()
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"input_tokens": 7, "output_tokens": 4}
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["id"] == "call_1"
    partial = "".join(e["delta"].get("partial_json", "") for e in events
                      if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"path": "a"}
    # and back: the Anthropic events assemble to the same recorded columns as the chat chunks
    to_chat = ANTHROPIC.stream_to_chat()
    back = [c for e in events for c in to_chat.feed(e)] + to_chat.close()
    assert back[-1] is None  # [DONE]
    direct, round_trip = StreamAssembler(), StreamAssembler()
    for c in chunks:
        direct.add(c)
    for c in back:
        round_trip.add(c)
    assert round_trip.content == direct.content == "Readingthefile"
    assert round_trip.finish_reason == "tool_calls"
    assert round_trip.tool_calls[0]["function"] == direct.tool_calls[0]["function"]
    assert round_trip.usage["prompt_tokens"] == 7 and round_trip.usage["completion_tokens"] == 4
    assembler = ANTHROPIC.assembler()
    for e in events:
        assembler.add(e)
    assert assembler.columns()["tool_calls"][0]["function"]["name"] == "read_file"


def test_encoding_and_terminal_events():
    event = {"type": "message_stop"}
    assert ANTHROPIC.encode_event(event) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert ANTHROPIC.is_terminal(b"", event) and not ANTHROPIC.is_terminal(b"", {"type": "ping"})
    assert OPENAI.is_terminal(OPENAI.encode_event(None), None)
    error = ProxyError(429, "slow down", type="rate_limit_error")
    assert ANTHROPIC.error_payload(error) == {"type": "error", "error": {
        "type": "rate_limit_error", "message": "slow down"}}
    assert ANTHROPIC.error_payload(ProxyError(502, "gone", type="upstream_error"))["error"][
        "type"] == "api_error"
    assert OPENAI.error_payload(error)["error"]["message"] == "slow down"
    assert ANTHROPIC.stream_error_event(error).startswith(b"event: error\ndata: ")


def test_injection_keeps_the_cached_system_prefix():
    block = "## Skills\n\nskill text"
    injected = ANTHROPIC.inject(ANTHROPIC_REQUEST, block)
    assert injected["system"][:2] == ANTHROPIC_REQUEST["system"]  # byte-identical prefix
    assert injected["system"][2] == {"type": "text", "text": block}  # no breakpoint of its own
    assert injected["messages"] is ANTHROPIC_REQUEST["messages"]
    as_string = ANTHROPIC.inject({**ANTHROPIC_REQUEST, "system": "Be terse."}, block)
    assert as_string["system"] == [{"type": "text", "text": "Be terse."},
                                   {"type": "text", "text": block}]
    assert ANTHROPIC.inject({"messages": []}, block)["system"] == [{"type": "text", "text": block}]
    assert ANTHROPIC.inject(ANTHROPIC_REQUEST, "") is ANTHROPIC_REQUEST


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "max_tokens": 5}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]},
     "messages.0.content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "x"}]},
     "system"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "max_tokens": 5, "stream": "yes", "messages": [{"role": "user", "content": "x"}]},
     "stream"),
])
def test_anthropic_validation_names_the_field(body, param):
    with pytest.raises(ProxyError) as caught:
        ANTHROPIC.parse_request(body, None)
    assert caught.value.status == 400 and caught.value.param == param


def test_pipeline_steps_on_a_neutral_turn():
    raw = json.dumps(ANTHROPIC_REQUEST).encode()
    turn = parse_turn(ANTHROPIC, {**ANTHROPIC_REQUEST, "session_id": "s-body"}, raw)
    assert "session_id" not in turn.body and turn.model == "claude-test" and not turn.stream
    assert retrieval_query(turn) == "What does it print?"
    def identified(headers, body):
        identity = identify_session(headers, body)
        return identity.session_id, identity.turn_type, identity.done

    assert identified({"X-Session-Id": "s-1", "X-Turn-Type": "Side",
                       "X-Session-Done": "true"}, {}) == ("s-1", "side", True)
    assert identified({}, {"session_id": "s-body"}) == ("s-body", "main", False)
    with pytest.raises(ProxyError, match="X-Turn-Type"):
        identify_session({"X-Turn-Type": "other"}, {})
    row = record_row(turn, policy_version=3)
    assert row["protocol"] == "anthropic" and row["policy_version"] == 3
    assert row["request_messages"][0]["role"] == "system"
    assert row["request_params"]["tools"][0]["type"] == "function"  # neutral (OpenAI) params
    assert "messages" not in row["request_params"] and "model" not in row["request_params"]
    openai_turn = parse_turn(OPENAI, {"model": "m", "messages": [{"role": "user", "content": "q"}]},
                             b"{}")
    assert record_row(openai_turn, 0)["protocol"] == "openai"  # no protocol is left implicit


def test_context_budget_arithmetic():
    assert context_window("claude-sonnet-4", None, None) == KNOWN_WINDOWS["claude-"]
    assert context_window("my-model", {"my-model": 1000}, 5) == 1000
    assert context_window("unknown", None, None) is None
    counter = TokenCounter()
    assert counter.method == "estimate" and counter.count("abcdef") == 2 and counter.count(b"abcd") == 2
    blocks = {1: "a" * 30, 2: "a" * 300, 3: "a" * 3000}
    budget = fit_skills(["s1", "s2", "s3"], blocks.__getitem__, b"x" * 300, window=400,
                        reserve=100, counter=counter)
    # 400 - 100 request - 100 reserved = 200 tokens for the block: s1 and s2 fit (108), s3 not
    assert budget.keep == 2 and budget.record["cut"] == ["s3"]
    assert budget.record["block_tokens"] == 100 + 8 and not budget.record["over_window"]
    over = fit_skills(["s1"], blocks.__getitem__, b"x" * 1500, 400, 0, counter)
    assert over.keep == 0 and over.record["over_window"] and over.record["cut"] == ["s1"]
    words = TokenCounter(lambda text: len(text.split()))
    assert words.method == "tokenizer" and words.count("a b c") == 3


# ---------------------------------------------------------------------------------------------
# malformed messages through every request step (property-based)
# ---------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                              st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=6), inner,
                                                            max_size=3)),
                    max_leaves=6)
#: The fields the adapters read, by the type of the block or part that holds them.
_FIELDS = {"text": ["text"], "image": ["source"], "document": ["source"],
           "tool_use": ["id", "name", "input"], "server_tool_use": ["input"],
           "tool_result": ["tool_use_id", "content", "is_error"], "search_result": ["content"],
           "image_url": ["image_url"], "thinking": ["thinking"], "file": ["file"]}
_SOURCE = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["base64", "url", "text", "content"]), "data": _ANY,
    "media_type": _ANY, "url": _ANY, "content": _ANY})


def _field(name: str, depth: int):
    nested = [_SOURCE] if name == "source" else []
    if name == "file":
        nested.append(st.fixed_dictionaries({}, optional={"filename": _ANY, "file_data": st.one_of(
            _ANY, st.sampled_from(["data:application/pdf;base64,QUJD", "data:;base64,"]))}))
    if depth and name in ("content", "image_url", "source"):
        nested += [st.lists(_block(depth - 1), max_size=2),
                   st.fixed_dictionaries({}, optional={"url": _ANY, "detail": _ANY})]
    return st.one_of(_ANY, *nested)


def _block(depth: int = 1):
    """A block or part of a type the adapters know, with any of its fields, holding anything."""
    return st.sampled_from(sorted(_FIELDS)).flatmap(lambda kind: st.fixed_dictionaries(
        {"type": st.just(kind)}, optional={name: _field(name, depth) for name in _FIELDS[kind]}))


_CALL = st.one_of(_ANY, st.fixed_dictionaries({"id": _ANY, "type": st.just("function")}, optional={
    "function": st.one_of(_ANY, st.fixed_dictionaries({}, optional={"name": _ANY,
                                                                    "arguments": _ANY}))}))
_TOOL = st.one_of(_ANY, st.fixed_dictionaries({"type": st.just("function")}, optional={
    "function": st.one_of(_ANY, st.fixed_dictionaries({"name": _ANY}, optional={
        "parameters": _ANY}))}), st.fixed_dictionaries({"name": _ANY, "input_schema": _ANY}))


@st.composite
def _request(draw):
    protocol = draw(st.sampled_from([OPENAI, ANTHROPIC]))
    roles = ["user", "assistant"] + (["system", "tool", "developer"] if protocol is OPENAI else [])
    messages = draw(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(roles),
         "content": st.one_of(st.text(max_size=10), st.lists(_block(), min_size=1, max_size=3),
                              _ANY)},
        optional={"tool_calls": st.one_of(st.lists(_CALL, max_size=2), _ANY),
                  "tool_call_id": _ANY}), min_size=1, max_size=3))
    body = {"model": "m", "max_tokens": 16, "messages": messages}
    if draw(st.booleans()):
        body["tools"] = draw(st.one_of(st.lists(_TOOL, max_size=2), _ANY))
    if draw(st.booleans()):
        body["tool_choice"] = draw(st.one_of(st.sampled_from(["auto", "required", "none"]), _ANY,
                                             st.fixed_dictionaries({"type": _ANY}, optional={
                                                 "function": _ANY, "name": _ANY})))
    if draw(st.booleans()):
        body["system"] = draw(st.one_of(st.text(max_size=8), st.lists(_block(0), max_size=2)))
    return protocol, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_request())
def test_malformed_messages_are_refused_with_a_400_or_served(request):
    """Whatever a client sends, every step before forwarding (parse, identify, query, row, the
    translation to the other protocol) either works or refuses it with a 400 naming the field:
    a body the steps cannot read is never a 500 (nor a 502 blamed on an upstream)."""
    protocol, body = request
    raw = json.dumps(body).encode()
    try:
        from metaclaw.proxy import edge

        turn = parse_turn(protocol, edge.decode_body(raw), raw)
    except ProxyError as exc:
        assert exc.status == 400 and exc.message
        return
    identify_session({}, body)
    retrieval_query(turn)
    json.dumps(record_row(turn, 0), default=str)
    for target in (OPENAI, ANTHROPIC):
        forward = turn.body if target is protocol else target.from_chat(
            protocol.to_chat(turn.body))
        target.prepare_forward(forward, True)
        json.dumps(forward)


def test_custom_tool_calls_are_not_refused():
    """The OpenAI SDK's custom tools have calls without a 'function' object: served as sent."""
    body = {"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "grammar", "input": "x"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [{"type": "custom", "custom": {"name": "grammar"}}]}
    assert OPENAI.parse_request(body, None) == ("m", False)
    with pytest.raises(ProxyError, match=r"tool_calls\[0\] must be an object"):
        OPENAI.parse_request({**body, "messages": [body["messages"][0], {
            "role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]}, None)


def test_text_between_fragments_of_a_call_does_not_split_the_call():
    """Some chat servers send text between two argument fragments of a tool call. An Anthropic
    block takes no delta after it stops, so the text follows the call instead of cutting it
    into two tool_use blocks with half the arguments each."""
    def chunk(delta, finish=None):
        return {"id": "c", "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": "Checking. "}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {
                  "name": "read_file", "arguments": '{"pa'}}]}),
              chunk({"content": "One moment."}),
              chunk({"reasoning_content": "the path is a"}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th": "a"}'}}]}),
              chunk({}, "tool_calls")]
    to_anthropic = ANTHROPIC.stream_from_chat()
    events = [e for c in chunks for e in to_anthropic.feed(c)] + to_anthropic.close()
    assembler = ANTHROPIC.assembler()
    for event in events:
        assembler.add(event)
    columns = assembler.columns()
    assert [c["function"]["name"] for c in columns["tool_calls"]] == ["read_file"]
    assert json.loads(columns["tool_calls"][0]["function"]["arguments"]) == {"path": "a"}
    assert columns["response"] == "Checking. One moment."
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use", "thinking", "text"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2, 3]  # every block closed once, in order


# -- server-sent events of any length ------------------------------------------------------------
async def _events(data: bytes, piece: int = 16384) -> list:
    async def source():
        for i in range(0, len(data), piece):
            yield data[i:i + piece]

    return [event async for batch in sse_events(source()) for event in batch]


def _long_event(size: int, newline: bytes = b"\n") -> bytes:
    return b'data: {"a": "' + b"x" * size + b'"}' + newline * 2


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_sse_events_take_time_linear_in_an_events_length(newline):
    """One long event arriving in many chunks: eight times the bytes take about eight times
    the time (copying the whole buffer on each chunk took about fifty)."""
    def best(size: int) -> float:
        times = []
        for _ in range(3):
            start = time.thread_time()  # CPU time: other processes' load is not counted
            events = asyncio.run(_events(_long_event(size, newline)))
            times.append(time.thread_time() - start)
        assert len(events) == 1 and len(events[0][1]["a"]) == size
        return min(times)

    ratio = best(8 * 2**20) / best(2**20)
    assert ratio < 20, f"8 MB took {ratio:.1f} times as long as 1 MB"


def test_an_event_longer_than_the_bound_is_a_502_after_the_good_events(monkeypatch):
    """Whether the long event ends, ends with the stream or never ends, and however it is cut:
    the events before it are yielded, then a 502 naming the bound; an event as long as the
    bound is read."""
    monkeypatch.setattr(metaclaw.protocols, "MAX_EVENT_BYTES", 1000)
    first = b'data: {"a": 1}\n\n'
    at_bound = b'data: {"a": "' + b"x" * (1000 - 15) + b'"}'
    assert len(at_bound) == 1000
    over = at_bound[:-2] + b'x"}'
    for data in (first + at_bound + b"\n\n", first + b"\n" + at_bound + b"\r\n\r\n",
                 first + at_bound):
        for piece in range(1, 30):
            assert asyncio.run(_events(data, piece)) == [(first, {"a": 1}),
                                                         (at_bound + b"\n\n", {"a": "x" * 985})]
    for data in (first + over + b"\n\n", first + b"\n" + over + b"\r\n\r\n", first + over,
                 first + b"data: " + b"x" * 100_000):
        for piece in (*range(1, 30), 1500, len(data)):
            got = []

            async def run():
                async def source():
                    for i in range(0, len(data), piece):
                        yield data[i:i + piece]

                async for batch in sse_events(source()):
                    got.extend(batch)

            with pytest.raises(ProxyError) as caught:
                asyncio.run(run())
            assert got == [(first, {"a": 1})], piece
            assert caught.value.status == 502 and caught.value.code == "upstream_event_too_large"
            assert "larger than 0 MiB" not in caught.value.message
