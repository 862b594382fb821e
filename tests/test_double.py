"""The offline OpenAI-compatible double, exercised with the real openai client over real sockets."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import httpx
import openai
import pytest

from metaclaw.offline.double import DoubleServer, Reply, last_user_text

USER = [{"role": "user", "content": "Say hello to the world"}]


@pytest.fixture
def double():
    with DoubleServer() as server:
        yield server


def client(server: DoubleServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="double-key", max_retries=0, timeout=5)


def test_url_binds_loopback_and_lists_models():
    with DoubleServer(models=("a-model", "b-model")) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
        assert [m.id for m in client(server).models.list()] == ["a-model", "b-model"]
    # stopped: the port no longer answers
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/models", timeout=1)


def test_scripted_queue_then_echo_and_requests_recorded(double):
    double.add(Reply("first"), Reply("second", usage={"prompt_tokens": 7, "completion_tokens": 2,
                                                       "total_tokens": 9}))
    c = client(double)
    first = c.chat.completions.create(model="m", messages=USER)
    second = c.chat.completions.create(model="m", messages=USER)
    third = c.chat.completions.create(model="m", messages=USER)
    assert first.choices[0].message.content == "first"
    assert first.choices[0].finish_reason == "stop"
    assert first.usage.completion_tokens == 1 and first.usage.prompt_tokens == 5
    assert second.usage.total_tokens == 9
    assert third.choices[0].message.content == "echo: Say hello to the world"
    assert third.model == "m"
    assert len(double.requests) == 3
    seen = double.requests[0]
    assert seen["path"] == "/v1/chat/completions"
    assert seen["body"]["messages"] == USER
    assert seen["headers"]["Authorization"] == "Bearer double-key"


def test_function_replies_see_the_body():
    def reply(body):
        return Reply(f"{len(body['messages'])} messages, model {body['model']}")

    with DoubleServer(reply) as server:
        out = client(server).chat.completions.create(model="x", messages=USER * 2)
        assert out.choices[0].message.content == "2 messages, model x"


def test_n_choices_one_reply_each_and_bad_n_refused(double):
    double.add(Reply("one"), Reply("two three"), Reply(status=429), Reply("after"))
    c = client(double)
    out = c.chat.completions.create(model="m", messages=USER, n=2)
    assert [ch.message.content for ch in out.choices] == ["one", "two three"]
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 3  # prompt once
    with pytest.raises(openai.RateLimitError):  # a failed choice fails the request
        c.chat.completions.create(model="m", messages=USER, n=2)
    for bad in (0, 17, "2"):
        with pytest.raises(openai.BadRequestError, match="'n' must be an integer"):
            c.chat.completions.create(model="m", messages=USER, n=bad)
    with pytest.raises(openai.BadRequestError, match="streams one choice"):
        c.chat.completions.create(model="m", messages=USER, n=2, stream=True)


def test_stream_chunks_arrive_over_time_with_usage(double):
    double.add(Reply("one two three four five", chunk_delay=0.1))
    start = time.perf_counter()
    arrivals, text, usage = [], [], None
    stream = client(double).chat.completions.create(
        model="m", messages=USER, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        arrivals.append(time.perf_counter() - start)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(text) == "one two three four five"
    assert len(text) == 5
    assert usage is not None and usage.completion_tokens == 5
    # role chunk, five words, finish chunk, usage chunk: 8 chunks 0.1 s apart
    assert len(arrivals) == 8
    assert arrivals[-1] - arrivals[0] >= 0.6


def test_stream_without_usage_request_has_no_usage_chunk(double):
    double.add(Reply("hi"))
    chunks = list(client(double).chat.completions.create(model="m", messages=USER, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_calls_plain_and_streamed(double):
    call = {"id": "call_weather", "function": {"name": "get_weather",
                                               "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    double.add(Reply(tool_calls=[call]), Reply(tool_calls=[call]))
    c = client(double)
    out = c.chat.completions.create(model="m", messages=USER)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert message.tool_calls[0].id == "call_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}

    pieces, name, finish = [], None, None
    for chunk in c.chat.completions.create(model="m", messages=USER, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name = name or delta.function.name
            pieces.append(delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    assert len([p for p in pieces if p]) > 1  # arguments really arrive in several deltas
    assert json.loads("".join(pieces)) == {"city": "Paris", "unit": "celsius"}


def test_interleaved_parallel_tool_calls(double):
    """``interleave``: the calls start in one chunk, then their argument fragments alternate;
    the OpenAI SDK's own accumulation by index rebuilds each call."""
    calls = [{"id": "call_a", "function": {"name": "read", "arguments": '{"path": "src/a.py"}'}},
             {"id": "call_b", "function": {"name": "read", "arguments": '{"path": "src/b.py"}'}}]
    double.add(Reply(tool_calls=calls, interleave=True))
    with client(double).chat.completions.stream(model="m", messages=USER) as stream:
        indexes = [d.index for event in stream if event.type == "chunk"
                   for d in event.chunk.choices[0].delta.tool_calls or []
                   if d.function and d.function.arguments]
        final = stream.get_final_completion()
    assert indexes[:4] == [0, 1, 0, 1]  # really interleaved
    got = [(c.id, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls]
    assert got == [("call_a", {"path": "src/a.py"}), ("call_b", {"path": "src/b.py"})]


def test_injected_error_status_and_headers(double):
    double.add(Reply(status=429, content="slow down", headers={"retry-after": "7"}),
               Reply(status=500))
    c = client(double)
    with pytest.raises(openai.RateLimitError) as err:
        c.chat.completions.create(model="m", messages=USER)
    assert err.value.status_code == 429 and "slow down" in str(err.value)
    assert err.value.response.headers["retry-after"] == "7"
    with pytest.raises(openai.InternalServerError) as err:
        c.chat.completions.create(model="m", messages=USER)
    assert err.value.body["message"] == "injected upstream error (HTTP 500)"


def test_delay_triggers_client_timeout(double):
    double.add(Reply("late", delay=1.0))
    c = openai.OpenAI(base_url=double.url, api_key="k", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        c.chat.completions.create(model="m", messages=USER)


def test_disconnect_mid_stream_and_before_answer(double):
    double.add(Reply("a b c d e f", disconnect_after=3), Reply("never", disconnect_after=0))
    c = client(double)
    received = []
    with pytest.raises(openai.APIConnectionError):
        for chunk in c.chat.completions.create(model="m", messages=USER, stream=True):
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "a", " b"]
    with pytest.raises(openai.APIConnectionError):
        c.chat.completions.create(model="m", messages=USER)


def test_raw_sse_framing_and_bad_body(double):
    double.add(Reply("x y"))
    with httpx.stream("POST", double.url + "/chat/completions", timeout=5,
                      json={"model": "m", "messages": USER, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    bad = httpx.post(double.url + "/chat/completions", content=b"{not json", timeout=5)
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_last_user_text_handles_parts():
    messages = [{"role": "user", "content": "old"},
                {"role": "user", "content": [{"type": "text", "text": "new"},
                                             {"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": "reply"}]
    assert last_user_text(messages) == "new"
    assert last_user_text([]) == ""
    # text parts whose text is missing or no string are skipped, not joined (a TypeError: 500)
    assert last_user_text([{"role": "user", "content": [
        {"type": "text", "text": None}, {"type": "text"}, {"type": "text", "text": "kept"}]}]) == "kept"


class _WatchedDouble(DoubleServer):
    """A double that says when a streamed answer has finished (cleanly or not)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams_done = threading.Event()

    async def _stream(self, request, body, reply):
        try:
            return await super()._stream(request, body, reply)
        finally:
            self.streams_done.set()


def _hang_up(url: str, read_first: bool) -> None:
    """POST a streaming request over a raw socket and hang up (with a reset) before the answer
    starts, or after its first bytes."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": "m", "messages": USER, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    if read_first:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("when", ["before the answer", "mid-stream"])
def test_client_hang_up_ends_the_stream_quietly(when, caplog):
    # curl -m 0.05 against `metaclaw serve --sim`: aiohttp logged "Error handling request ...
    # ClientConnectionResetError: Cannot write to closing transport"
    reply = Reply("a b c d e f g h", delay=0.3) if when == "before the answer" else \
        Reply("a b c d e f g h", chunk_delay=0.1)
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"), _WatchedDouble([reply]) as server:
        _hang_up(server.url, read_first=when == "mid-stream")
        assert server.streams_done.wait(5)
        time.sleep(0.2)  # aiohttp finishes the response after the handler returns
        assert httpx.get(server.url + "/models", timeout=5).status_code == 200  # still serving
    errors = [r for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
