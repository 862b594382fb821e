"""Find what the user actually asked in an agent framework's request: the retrieval query.

Agent frameworks rarely send the user's ask as a plain last user message. What they send, and
what this module does about it (every rule lives in :data:`RULES` or in :func:`extract_ask`):

- **The ask sits several messages back.** After the model calls tools, the last messages are
  the assistant's tool calls and the tool results (``role: tool``, or a user message made only
  of ``tool_result`` parts): the ask is the last user message that carries text of the user's
  own. Messages of roles ``system`` and ``developer`` are instructions, never the ask.
- **Content is a list of parts.** Text parts are joined; images, audio and files are skipped.
- **Framework context blocks.** Claude-Code-style clients put ``<system-reminder>`` blocks (and
  other tagged context: environment details, workspace files, tool or skill inventories) into
  the same user message as the ask, or into user messages of their own. Such blocks are
  removed; a user message with nothing left is framework context, not the ask.
- **Envelopes and metadata.** Chat gateways (OpenClaw and its channels) wrap the ask in a
  bracketed envelope with the channel, sender and a timestamp (``[Telegram Ann +2m Mon
  2026-03-16 09:30 GMT+8] ...``, or just ``[Mon 2026-11-23 11:30 UTC] ...`` from the OpenClaw
  CLI), append a ``Runtime: agent=... | session=... | sessionId=...`` line to a session's first
  message, end every request with a user message holding only
  ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ... <<<END_OPENCLAW_INTERNAL_CONTEXT>>>``, and may
  prepend metadata sections such as ``Conversation info (untrusted metadata):`` followed by a
  fenced JSON block. All of these are removed.
- **A quoted ask.** ``opencode run "..."`` sends an ask that has spaces in double quotes:
  a text that is one quoted string is unquoted.
- **Edit-format reminders.** aider appends its edit format's rules ("To suggest changes to a
  file you MUST return the entire content...", "# *SEARCH/REPLACE block* Rules:", ...) to the
  user's message for some models: removed. Its user messages of its own (the files it added to
  the chat, with their contents; the repository map; "I am not sharing any files...") are
  framework context, and its prompt's worked examples (user messages before "I switched to a
  new code base") are never an ask, nor a short follow-up's context.
- **Feedback prefixes.** A ``[Previous Feedback] ...`` block (the MetaClaw-Bench protocol, and a
  common way to pass a grader's verdict) is the outcome of the previous turn, not the new ask:
  it is split off into :attr:`Ask.feedback`.
- **After a compaction.** Codex, opencode and Claude Code replace the work they compacted with
  messages of their own (a summary, "What did we do so far?", "Continue if you have next
  steps, ..."): none is the ask. The ask is the last message of the user's that is left (Codex
  keeps them), else what the summary says the user is after (its objective section).
- **Short follow-ups.** "yes", "go on", "do it": when the ask has fewer than
  :data:`SHORT_ASK_WORDS` words, the nearest earlier ask that is not short itself is prepended
  as task context (the nearest short one where there is none).

Adding a framework: append a :class:`Rule` to :data:`RULES` (a name and a function from text to
text), with a test built from a captured request of that framework.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

#: Roles whose messages are instructions for the model (skills are injected into the first).
INSTRUCTION_ROLES = ("system", "developer")
#: An ask shorter than this (in words) is completed with the previous ask.
SHORT_ASK_WORDS = 4
#: The query is cut to this many characters (the retrievers only need the gist).
MAX_QUERY_CHARS = 2000
FEEDBACK_MARK = "[Previous Feedback]"


@dataclass(frozen=True)
class Rule:
    """One way frameworks wrap the ask: ``apply(text) -> text`` removes the wrapping.
    ``needle``: text every wrapping it removes contains (a text without it is left alone
    without running the rule's expressions)."""

    name: str
    apply: Callable[[str], str]
    needle: str = ""

    def run(self, text: str) -> str:
        return self.apply(text) if self.needle in text else text


def _remove_blocks(tags: tuple[str, ...]) -> Callable[[str], str]:
    pattern = re.compile(r"<(%s)(?:\s[^>]*)?>.*?</\1>" % "|".join(map(re.escape, tags)),
                         re.S | re.I)
    return lambda text: pattern.sub("", text)


#: Tagged context blocks that frameworks put beside the ask.
CONTEXT_TAGS = ("system-reminder", "environment_details", "environment_context", "environment",
                "env", "context", "user_instructions",
                "workspace", "workspace_files", "files", "file", "tools", "available_tools",
                "skills", "available_skills", "memory", "memories", "user-prompt-submit-hook",
                "local-command-stdout", "local-command-caveat", "local-command-stderr",
                "command-name", "command-message", "reminder", "tools-used-before-summary",
                "runtime", "metadata")

_CHANNELS = (r"WhatsApp|Telegram|Discord|Slack|Signal|iMessage|BlueBubbles|Google ?Chat|"
             r"Matrix|Teams|Microsoft Teams|Mattermost|LINE|Zalo|WebChat|Web|SMS|Email|IRC|"
             r"Nostr|Twitch|Feishu|Lark|DingTalk|WeChat|QQ")
_TIMESTAMP = (r"\d{4}-\d{2}-\d{2}[ T]\d{1,2}:\d{2}|\d{1,2}:\d{2}(?::\d{2})?\s*(?:[AP]M)?\s*"
              r"(?:UTC|GMT|[A-Z]{2,5}|[+-]\d{2}:?\d{2})")
# "[Telegram Ann (@ann) id:42 +2m Mon 2026-03-16 09:30 GMT+8] text": a leading bracket that
# names a channel or carries a timestamp
_ENVELOPE = re.compile(r"\A\s*\[(?=[^\]\n]*(?:\b(?:%s)\b|%s))[^\]\n]{1,300}\]\s*"
                       % (_CHANNELS, _TIMESTAMP), re.I)
# "Conversation info (untrusted metadata):" / "Sender (untrusted metadata):" + fenced block
_METADATA = re.compile(r"^[^\n]{0,80}\((?:untrusted )?metadata\):\s*\n```[^\n]*\n.*?\n```\s*",
                       re.I | re.S | re.M)
# leading "Current time: ..." / "Sender: ..." lines (only at the very start of the text)
_HEADER_LINES = re.compile(r"\A\s*(?:(?:Current (?:time|date)|Timestamp|Sender|Channel|"
                           r"Session(?: id)?|Message id|Chat id)\s*:[^\n]*\n\s*)+", re.I)
# Codex: "# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>...</INSTRUCTIONS>", a user message
_AGENTS_MD = re.compile(
    r"^#\s*AGENTS\.md instructions for [^\n]*\n\s*<INSTRUCTIONS>.*?</INSTRUCTIONS>", re.S | re.M)
# OpenClaw: "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ... <<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
_FENCED_CONTEXT = re.compile(r"<<<BEGIN_([A-Z0-9_]+)>>>.*?<<<END_\1>>>", re.S)
# OpenClaw: "Runtime: agent=main | session=agent:main:main | sessionId=... | host=..." lines
_RUNTIME_LINE = re.compile(r"^Runtime:[^\n]*\b(?:agent|session|sessionId)=[^\n]*$", re.M)
# aider's edit-format reminder, appended to the user's message for models it gives no system
# reminder (each edit format's first line; the reminder runs to the end of the message)
_AIDER_REMINDER = re.compile(
    r"^(?:To suggest changes to a file you MUST return the entire content of the updated file\.|"
    r"# \*SEARCH/REPLACE block\* Rules:|# V4A Diff Format Rules:|# File editing rules:|"
    r"ONLY return code using the `(?:replace_lines|write_file)` function\.|NEVER RETURN CODE!)"
    r".*\Z", re.S | re.M)
# aider's own user messages: the files it put in the chat (their contents after this line), the
# repository map, read-only files, or that it shares none. Each is framework context.
_AIDER_CONTEXT = re.compile(
    r"\A\s*(?:I have \*added these files to the chat\*|I am not sharing any files that you can "
    r"edit yet\.|Don't try and edit any existing code without asking me to add the files to the "
    r"chat!|Here are summaries of some files present in my git repository\.|Here are some READ "
    r"ONLY files, provided for your reference\.)")
# aider's "I switched to a new code base ...": every user message before it is one of its prompt's
# worked examples ("Change get_factorial() to use math.factorial"), never the user's
_AIDER_EXAMPLES_END = "I switched to a new code base. Please don't consider the above files"
# Claude-Code slash commands: the command's arguments are the ask
_COMMAND_ARGS = re.compile(r"<command-args>(.*?)</command-args>", re.S)
# opencode's ``run`` sends an argument that has spaces in double quotes (its own escaped)
_QUOTED = re.compile(r'\A\s*"((?:[^"\\]|\\.)*)"\s*\Z', re.S)


# After a compaction, frameworks send messages of their own where the work they summarised
# was: none of them is the user's ask. Codex opens a user message with this sentence, its
# summary after it (the user's own messages are kept before it); opencode asks "What did we do
# so far?", answered by the summary (an assistant message), and may add "Continue if you have
# next steps, ..."; Claude Code opens the conversation again with its summary, whose first
# section is the user's request.
_CODEX_HANDOFF = ("Another language model started to solve this problem and produced a summary "
                  "of its thinking process.")
_OPENCODE_ASKS_SUMMARY = "What did we do so far?"
_CLAUDE_CODE_HANDOFF = "This session is being continued from a previous conversation"
_HANDOFF = re.compile(
    r"\A\s*(?:%s|%s\s*\Z|Continue if you have next steps, or stop and ask for clarification if "
    r"you are unsure how to proceed\.\s*\Z|%s)" % (re.escape(_CODEX_HANDOFF),
                                               re.escape(_OPENCODE_ASKS_SUMMARY),
                                               re.escape(_CLAUDE_CODE_HANDOFF)))
# where a summary states what the user is after: opencode's "## Objective", Claude Code's
# "1. Primary Request and Intent:", up to the next heading or numbered section (at the start of
# a line: an indented "1. ...:" inside the section is part of it)
_OBJECTIVE = re.compile(r"^#+[ \t]*(?:Objective|Goal)[ \t]*$|Primary Request and Intent:",
                        re.M | re.I)
_SECTION_END = re.compile(r"^(?:[ \t]*#|\d+\.[ \t]+\w[^\n]*:)", re.M)


def _objective(summary: str) -> str:
    """The objective section of a compaction summary, else the whole summary."""
    head = _OBJECTIVE.search(summary)
    if head is None:
        return summary
    section = summary[head.end():]
    end = _SECTION_END.search(section)
    return section if end is None else section[:end.start()]


def _unquote(text: str) -> str:
    found = _QUOTED.match(text)
    return text if found is None else found.group(1).replace('\\"', '"')


def _command_args(text: str) -> str:
    found = _COMMAND_ARGS.search(text)
    if found is None:
        return text
    return _COMMAND_ARGS.sub("", text) + "\n" + found.group(1)


#: The rules, applied in order to every candidate user text.
RULES: list[Rule] = [
    Rule("compaction-handoff", lambda text: "" if _HANDOFF.match(text) else text),
    Rule("command-args", _command_args, "<command-args>"),
    Rule("context-blocks", _remove_blocks(CONTEXT_TAGS), "</"),
    Rule("agents-md", lambda text: _AGENTS_MD.sub("", text), "AGENTS.md"),
    Rule("fenced-context", lambda text: _FENCED_CONTEXT.sub("", text), "<<<BEGIN_"),
    Rule("runtime-line", lambda text: _RUNTIME_LINE.sub("", text), "Runtime:"),
    Rule("metadata-sections", lambda text: _METADATA.sub("", text), "```"),
    Rule("envelope", lambda text: _ENVELOPE.sub("", text), "["),
    Rule("header-lines", lambda text: _HEADER_LINES.sub("", text), ":"),
    Rule("aider-reminder", lambda text: _AIDER_REMINDER.sub("", text), "\n"),
    Rule("aider-context", lambda text: "" if _AIDER_CONTEXT.match(text) else text),
    Rule("quoted-ask", _unquote, '"'),
]


@dataclass
class Ask:
    """What the user asked. ``text``: the retrieval query (ask plus task context, cut to
    :data:`MAX_QUERY_CHARS`); ``ask``: the ask alone; ``message_index``: where it was found
    (``None``: nowhere); ``feedback``: a feedback block that came with it; ``rules``: the rules
    that changed the text; ``context``: the previous ask, when it was added."""

    text: str = ""
    ask: str = ""
    message_index: int | None = None
    feedback: str = ""
    rules: list[str] = field(default_factory=list)
    context: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "ask": self.ask, "message_index": self.message_index,
                "feedback": self.feedback, "rules": self.rules, "context": self.context}


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, or the text of a list of parts (OpenAI
    ``text`` / ``input_text`` parts, Anthropic ``text`` blocks); other parts are skipped."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", None) \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    return ""


def _only_tool_results(content: Any) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") == "tool_result" for p in content)


def split_feedback(text: str) -> tuple[str, str]:
    """``text`` -> (feedback, the rest). The feedback block starts at ``[Previous Feedback]``
    and ends at the first blank line outside a code fence."""
    head, mark, rest = text.partition(FEEDBACK_MARK)
    if not mark:
        return "", text
    lines = rest.split("\n")
    fence = False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fence = not fence
        if not fence and i > 0 and not line.strip():
            return "\n".join(lines[:i]).strip(), (head + "\n".join(lines[i + 1:])).strip()
    return rest.strip(), head.strip()


def unwrap(text: str) -> tuple[str, list[str]]:
    """``text`` with :data:`RULES` applied (a framework's wrapping removed, the user's own text
    kept as written), and the names of the rules that fired."""
    fired = []
    for rule in RULES:
        new = rule.run(text)
        if new != text:
            fired.append(rule.name)
            text = new
    return text, fired


def clean(text: str) -> tuple[str, str, list[str]]:
    """Apply :data:`RULES` and split off feedback: (ask, feedback, names of rules that fired)."""
    text, fired = unwrap(text)
    feedback, text = split_feedback(text)
    if feedback:
        fired.append("feedback")
    return " ".join(text.split()), " ".join(feedback.split()), fired


def _last_ask(messages: list[Any], end: int) -> Ask:
    """The last user ask in ``messages[:end]``, without task context (one backward scan)."""
    found = Ask()
    for index in range(end - 1, -1, -1):
        message = messages[index]
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if _only_tool_results(content):
            continue
        text = content_text(content)
        if text.startswith(_AIDER_EXAMPLES_END):  # the prompt's examples are before it
            break
        ask, feedback, fired = clean(text)
        if not ask:
            if feedback and not found.feedback:
                found.feedback, found.rules = feedback, fired
            continue  # framework context or feedback alone: look further back
        return Ask(ask, ask, index, feedback or found.feedback, fired or found.rules)
    return found


def _handoff_objective(messages: list[Any]) -> Ask:
    """No ask of the user's is left (a compaction replaced them): what the latest compaction
    summary says the user is after (its objective section, else its start)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        text = content_text(message.get("content")).strip()
        if text.startswith(_CODEX_HANDOFF):  # its instructions end where the summary starts
            summary = text.partition("to assist with your own analysis:")[2] or text
        elif text.startswith(_CLAUDE_CODE_HANDOFF):
            summary = text
        elif text == _OPENCODE_ASKS_SUMMARY and index + 1 < len(messages) \
                and isinstance(messages[index + 1], dict) \
                and messages[index + 1].get("role") == "assistant":
            summary = content_text(messages[index + 1].get("content"))
        else:
            continue
        ask = " ".join(_objective(summary).split()).strip(" -")
        if ask:
            return Ask(ask, ask, index, rules=["compaction-handoff"])
    return Ask()


def extract_ask(messages: list[dict[str, Any]] | None) -> Ask:
    """The user's real ask in an OpenAI-style message list (see the module docstring).

    A short follow-up ("ok", "continue") takes as context the nearest earlier ask that is not
    short itself: the scan goes on backwards from where the last one was found, so the search
    reads each message at most once. Where a compaction left no ask of the user's, one more
    backward pass finds the summary, whose objective is the ask (linear in the conversation's
    length either way)."""
    messages = messages if isinstance(messages, list) else []
    found = _last_ask(messages, len(messages))
    if found.message_index is None:
        found = _handoff_objective(messages)
    if found.message_index is not None and len(found.ask.split()) < SHORT_ASK_WORDS:
        previous = nearest = _last_ask(messages, found.message_index)
        while previous.message_index is not None and \
                len(previous.ask.split()) < SHORT_ASK_WORDS:
            previous = _last_ask(messages, previous.message_index)
        if previous.message_index is None:
            previous = nearest  # only short asks before it: the nearest one is the context
        if previous.ask:
            found.context = previous.ask
            found.text = f"{previous.ask}\n{found.ask}"
    found.text = found.text[:MAX_QUERY_CHARS]
    return found
