"""What real clients send, through the real proxy, over real sockets: the official ``openai`` and
``anthropic`` SDKs against a running proxy in front of the OpenAI-compatible double (which
records what reached the upstream). Each test is a scenario an agent runs into in practice.
"""

from __future__ import annotations

import json

import openai
import pytest

anthropic = pytest.importorskip("anthropic", reason="the Anthropic scenarios need the anthropic "
                                                    "SDK (pip install -e '.[anthropic]')")

from metaclaw.offline.double import DoubleServer, Reply  # noqa: E402
from metaclaw.proxy.app import Proxy, ProxyConfig  # noqa: E402
from metaclaw.skills.block import BLOCK_HEADER  # noqa: E402
from metaclaw.skills.library import Skill, SkillLibrary  # noqa: E402
from metaclaw.store import Store  # noqa: E402

MODEL = "double-model"
COMMIT_BODY = "Write the subject line in the imperative mood, at most 50 characters."
SKILL = Skill("git-commit-messages", "How to write clear git commit messages for a change.",
              "coding", f"# Commit messages\n\n{COMMIT_BODY}")
SYSTEM = "You are a careful coding agent."
QUESTION = "How should I word the git commit message for this fix?"


@pytest.fixture()
def workspace(tmp_path):
    directory = tmp_path / "skills"
    (directory / SKILL.name).mkdir(parents=True)
    (directory / SKILL.name / "SKILL.md").write_text(SKILL.to_markdown())
    store = Store(tmp_path / "metaclaw.db")
    yield store, SkillLibrary(str(directory), store)
    store.close()


@pytest.fixture()
def double():
    with DoubleServer(models=(MODEL,)) as server:
        yield server


@pytest.fixture()
def proxy(workspace, double):
    store, library = workspace
    config = ProxyConfig(upstream_url=double.url, retrieval="lexical", max_retries=0)
    with Proxy(config, store, library) as running:
        yield running


def _openai(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0, timeout=10)


def _anthropic(proxy) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=proxy.base_url, api_key="unused", max_retries=0,
                               timeout=10)


def _turns(proxy) -> list[dict]:
    proxy.flush()
    return proxy.store.turns()


def _upstream_messages(double) -> list[dict]:
    return [r for r in double.requests if r["path"] == "/v1/chat/completions"][-1]["body"][
        "messages"]


def test_a_text_part_without_text_is_a_400_naming_it_not_an_upstream_error(proxy, double):
    """``{"type": "text", "text": null}`` (a client that built its parts from an empty value):
    the OpenAI API refuses it, and an upstream that joins the parts' texts failed on it with a
    500 that the client relayed as a server error it could not act on."""
    client = _openai(proxy)
    for part in ({"type": "text", "text": None}, {"type": "text"}, {"type": "text", "text": 7}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": [{"type": "text", "text": QUESTION}, part]}])
        error = caught.value.body
        assert error["param"] == "messages[0].content[1].text", error
        assert "must be a string" in error["message"]
    assert not double.requests  # refused before anything went upstream


def test_alike_conversations_keep_their_sessions_when_the_client_resends_the_skill_block(
        proxy, double):
    """Two runs of one task without a session id, whose client resends the system prompt as the
    upstream got it (skill block included): each later turn still joins its own run's session.
    The block used to make the history unrecognisable, so both runs' second turns fell back to
    the first run's session."""
    client = _openai(proxy)
    double.add(Reply("Use the imperative mood."), Reply("Keep it under 50 characters."))
    runs = []
    for _ in range(2):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        reply = client.chat.completions.create(model=MODEL, messages=messages)
        sent_system = _upstream_messages(double)[0]
        assert BLOCK_HEADER in sent_system["content"]
        runs.append([sent_system, messages[1],
                     {"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And the body of the commit message?"}])
    double.add(Reply("Explain why."), Reply("Wrap at 72."))
    for messages in runs:
        client.chat.completions.create(model=MODEL, messages=messages)
        assert _upstream_messages(double)[0]["content"].count(BLOCK_HEADER) == 1
    turns = _turns(proxy)
    first, second = turns[0]["session_id"], turns[1]["session_id"]
    assert second == f"{first}.2"
    assert [(t["session_id"], t["turn_index"]) for t in turns] == [
        (first, 0), (second, 0), (first, 1), (second, 1)]


def test_an_anthropic_run_resending_its_block_keeps_its_session(proxy, double):
    """The same through the Anthropic SDK, the block resent as the last system block."""
    client = _anthropic(proxy)
    double.add(Reply("Use the imperative mood."), Reply("Keep it under 50 characters."))
    runs = []
    for _ in range(2):
        message = client.messages.create(model=MODEL, max_tokens=100, system=SYSTEM,
                                         messages=[{"role": "user", "content": QUESTION}])
        block = _upstream_messages(double)[0]["content"].split("\n\n", 1)[1]
        assert block.startswith(BLOCK_HEADER)
        runs.append(([{"type": "text", "text": SYSTEM}, {"type": "text", "text": block}], [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [message.content[0].model_dump(exclude_none=True)]},
            {"role": "user", "content": "And the body of the commit message?"}]))
    double.add(Reply("Explain why."), Reply("Wrap at 72."))
    for system, messages in runs:
        client.messages.create(model=MODEL, max_tokens=100, system=system, messages=messages)
    turns = _turns(proxy)
    first = turns[0]["session_id"]
    assert [(t["session_id"], t["turn_index"]) for t in turns] == [
        (first, 0), (f"{first}.2", 0), (first, 1), (f"{first}.2", 1)]


def test_a_side_call_resending_the_skill_block_reaches_the_upstream_without_it(proxy, double):
    """A side call (a title, a summary) gets no skills, also when its client resends the system
    prompt of an earlier turn with that turn's block: the upstream and the record see none."""
    openai_client, anthropic_client = _openai(proxy), _anthropic(proxy)
    double.add(Reply("Use the imperative mood."), Reply("Commit wording"),
               Reply("Commit wording"))
    openai_client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    with_block = _upstream_messages(double)[0]["content"]
    assert BLOCK_HEADER in with_block
    side = {"X-Turn-Type": "side", "X-Session-Id": "titles"}
    openai_client.chat.completions.create(model=MODEL, extra_headers=side, messages=[
        {"role": "system", "content": with_block}, {"role": "user", "content": QUESTION}])
    assert _upstream_messages(double)[0] == {"role": "system", "content": SYSTEM}
    anthropic_client.messages.create(
        model=MODEL, max_tokens=20, extra_headers=side,
        system=[{"type": "text", "text": SYSTEM},
                {"type": "text", "text": with_block.split("\n\n", 1)[1]}],
        messages=[{"role": "user", "content": QUESTION}])
    assert _upstream_messages(double)[0] == {"role": "system", "content": SYSTEM}
    recorded = [t for t in _turns(proxy) if t["session_id"] == "titles"]
    assert [t["turn_type"] for t in recorded] == ["side", "side"]
    assert all(BLOCK_HEADER not in json.dumps(t["request_messages"]) for t in recorded)
    assert all(t["injected_skills"] == [] for t in recorded)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_session_header_that_is_not_utf8_is_a_400_in_the_clients_shape(proxy, double, path):
    """Header bytes that are not UTF-8 (a client that encoded its session id as Latin-1) arrive
    as lone surrogates: refused naming the header, rather than recorded under an id the store
    rewrote (every such id became the same U+FFFD text, merging unrelated sessions)."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(proxy.base_url)
    body = json.dumps({"model": MODEL, "max_tokens": 20,
                       "messages": [{"role": "user", "content": QUESTION}]}).encode()
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: proxy\r\n"
                           b"X-Session-Id: caf\xe9-\xff\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    error = json.loads(payload)["error"]  # both protocols' shapes keep it under "error"
    assert "session id (header X-Session-Id)" in error["message"] and "UTF-8" in error["message"]
    assert not double.requests and not _turns(proxy)
