"""Wrap a user's ask the way real agent clients wrap it, built from their captured requests.

``wrap(client, ask, previous=())`` returns the OpenAI chat-completions-style ``messages`` a client
sends for a conversation whose user turns are ``previous`` followed by ``ask`` (each earlier
turn answered by the assistant with "Done."). Every system prompt, developer message, context
block, envelope and trailing client message is kept as the client sent it in the capture; only
the user's own text is replaced. Tool definitions are dropped. The captures live in
``tests/fixtures/requests/<dir>/NNN.json`` (``{"client", "path", "headers", "body"}``) and are
read once.

What each client wraps around the ask (see :data:`CAPTURES` for the files):

- ``plain``: nothing: ``[{"role": "user", "content": ask}]``.
- ``openai-sdk``: a ``"You are a helpful assistant."`` system message before the user message
  (openai-python 002).
- ``codex`` (Codex CLI 0.171.0, Responses API, converted to chat form): the base instructions,
  skills / permissions / collaboration-mode / multi-agent developer messages, then a user message
  with ``<environment_context>`` (and ``# AGENTS.md instructions`` where the repo has one), then
  the ask alone in its own user message of one ``input_text`` part. Earlier turns: a user
  message per ask, the assistant's reply as an ``output_text`` message (codex 003, a resumed
  session). ``instructions`` (absent in 0.171's requests) would become a system message.
- ``aider`` (aider 0.86.2, whole edit format): a system prompt, a few-shot example exchange, "I
  switched to a new code base..." / "Ok.", earlier turns, the files message ("I have *added
  these files to the chat*...") / "Ok, any changes I propose will be to those files.", the ask
  as a plain user message, and a trailing system message repeating the edit-format rules.
- ``claude-code`` (Claude Code 2.1.328 ``-p``, Anthropic Messages converted to chat form): a
  system message of the four system blocks (billing header, agent identity, main prompt); the
  first user message is ``[<system-reminder> attribution block, ask]`` as two text parts, then a
  ``system``-role message with the environment, deferred tools, agents and skills. Later turns
  are plain user messages after an assistant text block. The request's last user / system message
  is a list of text parts (it carries Claude Code's ``cache_control`` marker, dropped here),
  earlier single-text ones are strings.
- ``openclaw`` (OpenClaw 2026.9.6, openai-completions): a ~46 kB system prompt; every ask wears a
  ``[Mon 2026-11-23 11:30 UTC] `` timestamp envelope, the session's first one is followed by a
  ``\\n\\nRuntime: agent=main | session=...`` line; every request ends with a user message
  holding only ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ... <<<END_...>>>``: the ask is NOT in
  the last user message there, but in the one before it.

    python benchmarks/retrieval_clients.py      # roles and lengths per client, plus self-checks
"""

from __future__ import annotations

import copy
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "requests"

CLIENTS = ("plain", "openai-sdk", "codex", "aider", "claude-code", "openclaw")

#: The captured requests each client is built from: (directory, file, the user text it holds).
CAPTURES: dict[str, list[tuple[str, str, str]]] = {
    "openai-sdk": [("openai-python", "002", "Rename notes.txt to notes-2026.txt in my workspace")],
    "codex": [("codex", "001", "Add a --verbose flag to cli.py"),
              ("codex", "003", "also add a line for Tuesday")],  # second turn of a session
    "aider": [("aider", "001", "Add a --verbose flag to cli.py")],
    "claude-code": [("claude-code", "002", "Rename notes.txt to notes-2026.txt in my workspace"),
                    ("claude-code", "004", "Thanks. Did it work?")],
    "openclaw": [("openclaw", "001", "Rename notes.txt to notes-2026.txt in my workspace"),
                 ("openclaw", "002", "Thanks. Did it work?")],
}

REPLY = "Done."


@lru_cache(maxsize=None)
def _load(directory: str, name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / directory / f"{name}.json").read_text())


def _body(directory: str, name: str) -> dict[str, Any]:
    return copy.deepcopy(_load(directory, name)["body"])


def text_of(content: Any) -> str:
    """The text of a message content: a string, or its parts' ``text`` joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _index_holding(items: list[dict], text: str, key: Callable[[dict], str]) -> int:
    found = [i for i, item in enumerate(items) if text in key(item)]
    if len(found) != 1:
        raise ValueError(f"the captured ask {text!r} is in {len(found)} messages, not one")
    return found[0]


# -- plain and the OpenAI SDK ----------------------------------------------------------------

def _alternate(turns: list[str]) -> list[dict]:
    out: list[dict] = []
    for i, turn in enumerate(turns):
        if i:
            out.append({"role": "assistant", "content": REPLY})
        out.append({"role": "user", "content": turn})
    return out


def _plain(turns: list[str]) -> list[dict]:
    return _alternate(turns)


def _openai_sdk(turns: list[str]) -> list[dict]:
    (directory, name, captured), = CAPTURES["openai-sdk"]
    messages = _body(directory, name)["messages"]
    at = _index_holding(messages, captured, lambda m: text_of(m.get("content")))
    return [*messages[:at], *_alternate(turns), *messages[at + 1:]]


# -- Codex CLI (Responses API) -----------------------------------------------------------------

def _codex_item_to_chat(item: dict) -> dict:
    return {"role": item["role"], "content": copy.deepcopy(item["content"])}


@lru_cache(maxsize=None)
def _codex_template() -> tuple[list[dict], dict, dict]:
    """(messages before the ask, the ask's user message, an assistant reply message)."""
    (d1, n1, ask1), (d2, n2, ask2) = CAPTURES["codex"]
    body = _body(d1, n1)
    prefix: list[dict] = []
    if body.get("instructions"):
        prefix.append({"role": "system", "content": body["instructions"]})
    items = [i for i in body.get("input") or () if i.get("type") == "message"]
    at = _index_holding(items, ask1, lambda i: text_of(i.get("content")))
    if at != max(i for i, item in enumerate(items) if item["role"] == "user"):
        raise ValueError("codex: the ask is not in the last user message")
    prefix += [_codex_item_to_chat(i) for i in items[:at]]
    ask_message = _codex_item_to_chat(items[at])
    # an earlier turn's reply, as Codex sends it back on the next turn (a resumed session)
    follow = [i for i in _body(d2, n2).get("input") or () if i.get("type") == "message"]
    reply = next(_codex_item_to_chat(i) for i in reversed(follow) if i["role"] == "assistant")
    return prefix, ask_message, reply


def _set_last_text(message: dict, captured: str, text: str, part_type: str) -> dict:
    """``message`` with its last ``part_type`` part that holds ``captured`` set to ``text``."""
    message = copy.deepcopy(message)
    if isinstance(message["content"], str):
        message["content"] = message["content"].replace(captured, text)
        return message
    for part in reversed(message["content"]):
        if part.get("type") == part_type and captured in part.get("text", ""):
            part["text"] = part["text"].replace(captured, text)
            return message
    raise ValueError(f"no {part_type} part holds {captured!r}")


def _codex(turns: list[str]) -> list[dict]:
    prefix, ask_message, reply = _codex_template()
    captured = CAPTURES["codex"][0][2]
    out = copy.deepcopy(prefix)
    for i, turn in enumerate(turns):
        if i:
            out.append(_set_last_text(reply, text_of(reply["content"]), REPLY, "output_text"))
        out.append(_set_last_text(ask_message, captured, turn, "input_text"))
    return out


# -- aider -------------------------------------------------------------------------------------

FILES_MARK = "I have *added these files to the chat*"


def _aider(turns: list[str]) -> list[dict]:
    (directory, name, captured), = CAPTURES["aider"]
    messages = _body(directory, name)["messages"]
    at = _index_holding(messages, captured, lambda m: text_of(m.get("content")))
    # aider's order: system, examples, earlier turns, the files message and its "Ok", the ask,
    # the reminder (ChatChunks: ... done + chat_files + cur + reminder)
    files = at - 2
    if not text_of(messages[files]["content"]).startswith(FILES_MARK):
        raise ValueError("aider: no files message right before the ask")
    done: list[dict] = []
    for turn in turns[:-1]:
        done += [{"role": "user", "content": turn}, {"role": "assistant", "content": REPLY}]
    ask = {**messages[at], "content": messages[at]["content"].replace(captured, turns[-1])}
    return [*messages[:files], *done, *messages[files:at], ask, *messages[at + 1:]]


# -- Claude Code (Anthropic Messages) ----------------------------------------------------------

def _blocks(content: Any) -> Any:
    """Anthropic text blocks as chat text parts (``cache_control`` dropped); strings as is."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": b["text"]} for b in content if b.get("type") == "text"]


def _as_string_unless_last(message: dict, last: bool) -> dict:
    """Claude Code sends the request's last message as a list of blocks (its last block carries
    ``cache_control``), an earlier single-text user or system message as a string."""
    content = message["content"]
    if last:
        content = [{"type": "text", "text": content}] if isinstance(content, str) else content
    elif isinstance(content, list) and len(content) == 1:
        content = content[0]["text"]
    return {**message, "content": content}


def _claude_code(turns: list[str]) -> list[dict]:
    (d1, n1, captured), _ = CAPTURES["claude-code"]
    body = _body(d1, n1)
    system = body.get("system")
    out: list[dict] = [{"role": "system", "content": _blocks(system)}] if system else []
    messages = [{"role": m["role"], "content": _blocks(m["content"])} for m in body["messages"]]
    at = _index_holding(messages, captured, lambda m: text_of(m["content"]))
    first = _set_last_text(messages[at], captured, turns[0], "text")
    rest: list[dict] = []
    for turn in turns[1:]:
        rest += [{"role": "assistant", "content": [{"type": "text", "text": REPLY}]},
                 {"role": "user", "content": turn}]
    tail = [*messages[at + 1:], *rest]  # the environment system message, then later turns
    out += messages[:at] + [first]
    out += [_as_string_unless_last(m, i == len(tail) - 1) if m["role"] != "assistant" else m
            for i, m in enumerate(tail)]
    return out


# -- OpenClaw ----------------------------------------------------------------------------------

def _split(text: str, captured: str) -> tuple[str, str]:
    before, sep, after = text.partition(captured)
    if not sep:
        raise ValueError(f"{captured!r} not in {text[:80]!r}")
    return before, after


def _openclaw(turns: list[str]) -> list[dict]:
    (d1, n1, captured1), (d2, n2, captured2) = CAPTURES["openclaw"]
    messages = _body(d1, n1)["messages"]
    at = _index_holding(messages, captured1, lambda m: text_of(m.get("content")))
    first_before, first_after = _split(messages[at]["content"], captured1)  # envelope, Runtime
    follow = _body(d2, n2)["messages"]
    later = follow[_index_holding(follow, captured2, lambda m: text_of(m.get("content")))]
    later_before, later_after = _split(later["content"], captured2)         # envelope only
    out = list(messages[:at])
    for i, turn in enumerate(turns):
        if i:
            out += [{"role": "assistant", "content": REPLY},
                    {"role": "user", "content": later_before + turn + later_after}]
        else:
            out.append({"role": "user", "content": first_before + turn + first_after})
    return out + messages[at + 1:]  # the internal-context user message


_BUILDERS: dict[str, Callable[[list[str]], list[dict]]] = {
    "plain": _plain, "openai-sdk": _openai_sdk, "codex": _codex, "aider": _aider,
    "claude-code": _claude_code, "openclaw": _openclaw,
}


def wrap(client: str, ask: str, *, previous: Iterable[str] = ()) -> list[dict]:
    """The chat ``messages`` ``client`` sends for user turns ``previous`` then ``ask``."""
    if client not in _BUILDERS:
        raise ValueError(f"unknown client {client!r}; one of {', '.join(CLIENTS)}")
    return _BUILDERS[client]([*previous, ask])


# -- self-check ----------------------------------------------------------------------------------

def ask_message_index(messages: list[dict], ask: str) -> int:
    """Index of the last user message whose text holds ``ask`` verbatim (-1: none)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and ask in text_of(messages[i]["content"]):
            return i
    return -1


def check(client: str, ask: str, previous: Iterable[str] = ()) -> list[dict]:
    """Wrap and verify: the ask is verbatim in the last user message, or (OpenClaw) in the last
    one before the client's own trailing internal-context message; the earlier asks appear in
    order in earlier user messages; no text of the capture's own asks is left."""
    previous = list(previous)
    messages = wrap(client, ask, previous=previous)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    at = ask_message_index(messages, ask)
    assert at >= 0, f"{client}: the ask is in no user message"
    trailing = [i for i in users if i > at]
    if client == "openclaw":
        assert len(trailing) == 1 and text_of(messages[trailing[0]]["content"]).startswith(
            "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"), f"{client}: unexpected trailing messages"
    else:
        assert not trailing, f"{client}: the ask is not in the last user message"
    position = 0
    for turn in previous:
        hits = [i for i in users if i >= position and i < at
                and turn in text_of(messages[i]["content"])]
        assert hits, f"{client}: earlier turn {turn!r} missing or out of order"
        position = hits[0] + 1
    replies = [m for m in messages if m["role"] == "assistant" and text_of(m["content"]) == REPLY]
    assert len(replies) == len(previous), f"{client}: {len(replies)} replies, {len(previous)} turns"
    everything = json.dumps(messages)
    for spec in CAPTURES.get(client, ()):
        assert json.dumps(spec[2])[1:-1] not in everything, f"{client}: captured ask left"
    return messages


def main() -> None:
    ask = "Summarise the failing tests in tests/test_api.py and fix the flaky one"
    previous = ["List the files in this repo", "Which of them are tests?"]
    for client in CLIENTS:
        messages = check(client, ask)
        check(client, ask, previous)
        shape = ", ".join(f"{m['role']}:{len(text_of(m['content']))}" for m in messages)
        at = ask_message_index(messages, ask)
        chars = sum(len(text_of(m["content"])) for m in messages)
        print(f"{client:12s} {len(messages):2d} messages, {chars:6d} chars;"
              f" ask in message {at} ({messages[at]['role']})")
        print(f"{'':12s} {shape}")
    sys.path.insert(0, str(FIXTURES.parents[2]))  # the repository root: metaclaw from a checkout
    try:  # how the proxy's ask extractor reads them
        from metaclaw.skills.asks import extract_ask
    except ImportError:
        print("(metaclaw not importable: extract_ask comparison skipped)")
    else:
        for client in CLIENTS:
            for prev in ((), previous):
                found = extract_ask(wrap(client, ask, previous=prev))
                print(f"extract_ask {client:12s} previous={len(prev)}: "
                      f"{'ok' if found.ask == ask else 'DIFFERS: ' + repr(found.ask[:80])}"
                      f" (message {found.message_index}, rules {found.rules})")
    print("self-check passed: the ask is verbatim in the last user message (OpenClaw: the last "
          "before its internal-context message) for every client, with and without earlier turns")


if __name__ == "__main__":
    main()
