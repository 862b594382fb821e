"""The SIMULATED model of the offline demo: a rule-based stand-in, not a language model.

No LLM is reachable offline, so ``metaclaw demo`` and the bench notebook talk to this module
through a local OpenAI-compatible server (:class:`metaclaw.offline.double.DoubleServer`). Every model id
it serves starts with ``sim-`` and every reply says it is simulated. Requests are routed by the
``model`` field of the request body:

- ``sim-agent`` (any name not matching the two below): a capable but uninformed worker. It has
  generic skills only: list and read files with the tools the request offers, then write JSON,
  Markdown, CSV or Python built from the request and the files it read, change an existing file
  as asked, copy a file, append a line, format a date; multiple-choice questions are answered with
  ``\\bbox{...}``: an option is judged by the rules its context states (under a stated time
  format, a date or time value written in any other shape, or in words, is wrong; a file name is
  judged by the stated naming pattern), else by the closest sentence it was told, else guessed. It knows no workplace convention: it applies one only when its context states
  it (the system prompt with any injected skills, or what the user said earlier in the
  conversation), and it takes every parameter of the convention from that text. The rule kinds it
  can read, and how, are documented in one place: :mod:`metaclaw.offline.simrules`.
- ``sim-judge``: answers the judge wire format ``{"score": -1|0|1, "rationale": "..."}`` from the
  evidence in the turn: the user's reaction in the next user message (a complaint -> -1, a
  confirmation -> +1), 0 when there is none.
- ``sim-evolver``: answers the evolver wire format ``{"operations": [...]}`` from the failures
  alone: the sentences of their feedback that state a rule it can read become a skill that quotes
  them (one skill per rule kind, named after that kind), with the files the failed turn wrote as
  its trajectory note; an existing skill of the same kind is edited instead of duplicated.

Everything is deterministic: the same request body gives the same reply. The module holds no
knowledge of any benchmark; ``tests/test_simmodel_honest.py`` checks that no benchmark-specific
string appears in it, and that the fast loop helps on a task family with conventions of its own.

Public API: :func:`sim_reply` (request body -> ``{"content", "tool_calls"}``), :func:`agent_reply`,
:func:`judge_reply`, :func:`evolver_reply`, :func:`sim_model_server`, :func:`serve_sim_model`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from metaclaw.offline.simrules import DATETIME_RE, KINDS, Rules, read_rules, rule_sentences
from metaclaw.skills.asks import clean as clean_ask, unwrap
from metaclaw.skills.asks import content_text

#: Model ids served by the simulated model server (the ``sim-`` prefix marks them as simulated).
SIM_MODELS = ("sim-agent", "sim-judge", "sim-evolver")
#: Prefix of every free-text reply.
LABEL = "[simulated model]"
#: Seed mixed into every random choice; change it to get another (still deterministic) run.
DEFAULT_SEED = 7

WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december")


# --------------------------------------------------------------------------------------------
# Reading the conversation
# --------------------------------------------------------------------------------------------

# (a bracket with a clock time is a chat gateway's envelope, ``[Sat 2026-11-28 16:19 UTC] ...``,
# not a label: the request follows it)
_LABEL_BLOCK = re.compile(r"^\s*\[(?![^\]\n]*\b\d{1,2}:\d{2})[^\]\n]{2,40}\]")


def split_feedback(text: str) -> tuple[str, str]:
    """A user message -> (remark, question). A message that opens with a bracketed label
    (``[Note] ...``, ``[Feedback] ...``) carries a remark on the earlier work first: it ends at the
    first blank line outside a code fence; the rest is the new request."""
    if not _LABEL_BLOCK.match(text or ""):
        return "", (text or "").strip()
    lines = text.split("\n")
    fence = False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fence = not fence
        if not fence and not line.strip() and i > 0:
            return "\n".join(lines[:i]).strip(), "\n".join(lines[i + 1:]).strip()
    return text.strip(), ""


@dataclass
class Conversation:
    """What the simulated agent knows from one request body."""

    system: str = ""
    feedback: list[str] = field(default_factory=list)      # remarks on earlier work
    earlier_user: list[str] = field(default_factory=list)  # earlier user requests
    question: str = ""
    steps: list[tuple[dict, str]] = field(default_factory=list)  # this round: (tool_call, result)
    history_steps: list[tuple[dict, str]] = field(default_factory=list)  # earlier rounds
    _rules: Rules | None = None

    @property
    def knowledge(self) -> str:
        """Every text that may state a rule: system prompt (skills included), earlier remarks and
        requests, and the current request."""
        return "\n\n".join([self.system] + self.feedback + self.earlier_user + [self.question])

    @property
    def rules(self) -> Rules:
        if self._rules is None:
            self._rules = read_rules(self.knowledge)
        return self._rules

    def all_steps(self) -> list[tuple[dict, str]]:
        return self.history_steps + self.steps


def _user_own_text(message: dict) -> bool:
    """Whether a user message carries text of the user's own: not one made only of tool results
    (Anthropic-style ``tool_result`` parts), and not framework context alone (OpenClaw's
    ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>`` message, reminders, envelopes): something is left
    after the proxy's own ask cleaner (:func:`metaclaw.skills.asks.clean`), an ask or a remark."""
    content = message.get("content")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "tool_result" for p in content):
        return False
    ask, remark, _ = clean_ask(content_text(content))
    return bool(ask or remark)


def parse_conversation(messages: list[dict]) -> Conversation:
    """Chat messages -> :class:`Conversation` (system text, remarks, question, tool steps).

    The question is the last user message that carries text of the user's own
    (:func:`_user_own_text`); user messages after it (tool results, framework context) do not
    restart the task: the tool steps after the question are this task's steps."""
    conv = Conversation()
    own = {i for i, m in enumerate(messages) if m.get("role") == "user" and _user_own_text(m)}
    last_user = max(own, default=-1)
    results: dict[str, str] = {}
    for m in messages:
        if m.get("role") == "tool":
            results[str(m.get("tool_call_id"))] = content_text(m.get("content"))
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            conv.system += content_text(m.get("content")) + "\n"
        elif role == "user":
            if i not in own:
                continue  # framework context or tool results: not the user's words
            # the user's own words: a framework's wrapping (Claude Code's system reminders,
            # OpenClaw's envelope) is no part of the task
            fb, q = split_feedback(unwrap(content_text(m.get("content")))[0])
            if fb:
                conv.feedback.append(fb)
            if i == last_user:
                conv.question = q
            elif q:
                conv.earlier_user.append(q)
        elif role == "assistant":
            for call in m.get("tool_calls") or []:
                step = (call, results.get(str(call.get("id")), ""))
                (conv.steps if i > last_user else conv.history_steps).append(step)
    return conv


def _call_args(call: dict) -> dict:
    try:
        args = json.loads(call.get("function", {}).get("arguments") or "{}")
        return args if isinstance(args, dict) else {}
    except (ValueError, TypeError):
        return {}


def _result_text(result: str) -> str:
    """A tool result -> the file text it carries (JSON ``{"content": ...}``, a shell's output
    after its ``Output:`` line, or raw text)."""
    head, mark, output = result.partition("\nOutput:\n")
    if mark and "exit" in head.lower():  # a shell tool's report, then what the command printed
        return output
    try:
        obj = json.loads(result)
    except (ValueError, TypeError):
        return result
    if isinstance(obj, dict):
        for k in ("content", "text", "data", "result", "output"):
            if isinstance(obj.get(k), str):
                return obj[k]
    return result


def _is_error(result: str) -> bool:
    head = result[:200].lower()
    return (head.startswith("error") or '"error"' in head or "not found" in head
            or "refused" in head or "no such file" in head)


# --------------------------------------------------------------------------------------------
# Tools offered by the request
# --------------------------------------------------------------------------------------------

class ToolSet:
    """Maps the request's tool schemas to the five file operations the simulated agent uses."""

    KINDS = ("append", "copy", "list", "read", "write")
    #: Words of a parameter name that make a tool fit a kind: a file operation takes a path
    #: (``todowrite``'s ``todos`` or ``TodoWrite``'s list is no file to write).
    PATH_WORDS = {"copy": ("path", "file", "src", "source", "dst", "dest", "target"),
                  "list": ("path", "dir", "folder", "file", "name")}
    DEFAULT_PATH_WORDS = ("path", "file", "dir", "name")
    #: A shell tool: a name with one of these words and a parameter of these names.
    SHELL_WORDS = ("exec", "shell", "command", "terminal")
    SHELL_PARAMS = ("cmd", "command")
    #: The end of a file's text in a shell write (a here-document).
    HEREDOC = "SIM_EOF"

    def __init__(self, tools: list[dict] | None):
        self.tools: dict[str, tuple[str, list[str]]] = {}
        offered = []  # (name, parameter names) of each tool
        for t in tools or []:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            name = str(fn.get("name", ""))
            params = fn.get("parameters") if isinstance(fn, dict) else None
            if not isinstance(params, dict):   # Anthropic-style tools: input_schema
                params = fn.get("input_schema") if isinstance(fn, dict) else None
            properties = params.get("properties") if isinstance(params, dict) else None
            offered.append((name, list(properties.keys()) if isinstance(properties, dict) else []))
        for name, props in offered:
            for kind in self.KINDS:
                if kind in name.lower() and kind not in self.tools and self._fits(kind, props):
                    self.tools[kind] = (name, props)
                    break
        #: A shell tool that does the file work no file tool was offered for (Codex offers
        #: ``exec_command`` and no file tools): its name and its command parameter.
        self.shell: tuple[str, str] | None = None
        if not ("read" in self.tools and "write" in self.tools):
            for name, props in offered:
                command = next((p for p in props if p.lower() in self.SHELL_PARAMS), None)
                if command and any(w in name.lower() for w in self.SHELL_WORDS):
                    self.shell = (name, command)
                    for kind in ("read", "write", "list"):
                        self.tools.setdefault(kind, (name, [command]))
                    break

    @classmethod
    def _fits(cls, kind: str, props: list[str]) -> bool:
        """Whether a tool with these parameter names can do ``kind``: it takes a path-like one."""
        words = cls.PATH_WORDS.get(kind, cls.DEFAULT_PATH_WORDS)
        return any(w in str(p).lower() for p in props for w in words)

    @staticmethod
    def path_hint(call: dict) -> str | None:
        """The path argument of a read call (any tool whose name contains 'read'), if any."""
        if "read" not in str(call.get("function", {}).get("name", "")).lower():
            return None
        args = _call_args(call)
        return next((v for k, v in args.items() if isinstance(v, str) and "path" in k or k == "file"), None)

    def has(self, kind: str) -> bool:
        return kind in self.tools

    def kind_of(self, call: dict) -> str | None:
        name = call.get("function", {}).get("name")
        if self.shell is not None and name == self.shell[0]:
            return self._shell_call(call)[0]
        return next((k for k, (n, _) in self.tools.items() if n == name), None)

    def _is_shell(self, kind: str) -> bool:
        return self.shell is not None and self.tools[kind][0] == self.shell[0]

    def _shell_args(self, kind: str, path: str, other: str | None) -> dict:
        quoted = shlex.quote(path)
        if kind == "read":
            command = f"cat -- {quoted}"
        elif kind == "list":
            command = f"ls -1 -- {quoted}"
        else:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            folder = f"mkdir -p -- {shlex.quote(parent)} && " if parent else ""
            text = other or ""
            marker = self.HEREDOC  # one that is no line of the text (it would end it there)
            while marker in text.split("\n"):
                marker += "_"
            # a here-document ends its text with a newline: none added where it has one
            command = (f"{folder}cat > {quoted} <<'{marker}'\n{text}"
                       f"{'' if not text or text.endswith(chr(10)) else chr(10)}{marker}")
        return {self.shell[1]: command}

    def _shell_call(self, call: dict) -> tuple[str | None, str | None, str | None]:
        """(kind, path, content) of a shell call this tool set made (else all None)."""
        command = str(_call_args(call).get(self.shell[1]) or "")
        head, _, rest = command.partition("\n")
        try:
            words = shlex.split(head.split(" <<")[0])
        except ValueError:
            return None, None, None
        if words[:2] == ["cat", "--"] and len(words) == 3:
            return "read", words[2], None
        if words[:2] == ["ls", "-1"] and len(words) == 4:
            return "list", words[3], None
        marker = re.search(r"<<'([A-Z_]+)'$", head)
        if ">" in words[:-1] and marker:
            content = rest[:-len(marker[1])] if rest.endswith(marker[1]) else rest
            return "write", words[words.index(">") + 1], content
        return None, None, None

    @staticmethod
    def _pick(props: list[str], words: tuple[str, ...], default: int) -> str:
        for p in props:
            if any(w in p.lower() for w in words):
                return p
        return props[default] if len(props) > default else ("path", "content")[min(default, 1)]

    def args(self, kind: str, path: str, other: str | None = None) -> dict:
        if self._is_shell(kind):
            return self._shell_args(kind, path, other)
        _, props = self.tools[kind]
        if kind == "copy":
            src = self._pick(props, ("src", "source", "from"), 0)
            dst = self._pick([p for p in props if p != src], ("dst", "dest", "target", "to"), 0)
            return {src: path, dst: other}
        key = self._pick(props, ("path", "file", "dir", "name"), 0)
        if kind in ("write", "append"):
            content = self._pick([p for p in props if p != key], ("content", "text", "data", "line"), 0)
            return {key: path, content: other or ""}
        return {key: path}

    def path_of(self, call: dict) -> tuple[str | None, str | None]:
        """(path, second path or content) of a call to one of the mapped tools."""
        kind = self.kind_of(call)
        args = _call_args(call)
        if kind is None:
            return None, None
        if self.shell is not None and call.get("function", {}).get("name") == self.shell[0]:
            return self._shell_call(call)[1:]
        _, props = self.tools[kind]
        if kind == "copy":
            src = self._pick(props, ("src", "source", "from"), 0)
            dst = self._pick([p for p in props if p != src], ("dst", "dest", "target", "to"), 0)
            return args.get(src), args.get(dst)
        key = self._pick(props, ("path", "file", "dir", "name"), 0)
        content = None
        if kind in ("write", "append"):
            ck = self._pick([p for p in props if p != key], ("content", "text", "data", "line"), 0)
            content = args.get(ck)
        return args.get(key), content


# --------------------------------------------------------------------------------------------
# Dates and times
# --------------------------------------------------------------------------------------------

def _month_date(text: str, default_year: int) -> dt.date | None:
    """'July 9, 2026' or '9 July 2026' (year optional) -> date."""
    months = "|".join(MONTHS)
    m = re.search(rf"\b({months})\s+(\d{{1,2}})(?:st|nd|rd|th)?\b(?:,?\s*(\d{{4}}))?", text, re.I)
    if m:
        month, day, year = m.group(1), m.group(2), m.group(3)
    else:
        m = re.search(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({months})\b(?:,?\s*(\d{{4}}))?", text, re.I)
        if not m:
            return None
        day, month, year = m.group(1), m.group(2), m.group(3)
    try:
        return dt.date(int(year) if year else default_year, MONTHS.index(month.lower()) + 1, int(day))
    except ValueError:
        return None


def find_today(texts: list[str]) -> dt.date:
    """The conversation's 'today': 'Today is ...' first, then 'Date:' lines, then any date."""
    years = [int(y) for t in texts for y in re.findall(r"\b((?:19|20)\d{2})\b", t)]
    year = years[0] if years else dt.date.today().year
    for t in texts:
        for m in re.finditer(r"today is([^\n]{0,60})", t, re.I):
            d = _month_date(m.group(1), year)
            if d:
                return d
    for t in texts:
        for m in re.finditer(r"(?:^|\n)\W*date\W*:?\W*([^\n]{0,60})", t, re.I):
            d = _month_date(m.group(1), year)
            if d:
                return d
            iso = re.search(r"(\d{4})-(\d{2})-(\d{2})", m.group(1))
            if iso:
                return dt.date(*map(int, iso.groups()))
    for t in texts:
        d = _month_date(t, year)
        if d:
            return d
    for t in texts:
        iso = re.search(r"\b((?:19|20)\d{2})-(\d{2})-(\d{2})\b", t)
        if iso:
            try:
                return dt.date(*map(int, iso.groups()))
            except ValueError:
                pass
    return dt.date(year, 1, 1)


_WORD_HOURS = {"nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "one": 13, "two": 14,
               "three": 15, "four": 16, "five": 17, "six": 18}


def parse_when(text: str, today: dt.date, default: dt.time = dt.time(9, 30)) -> dt.datetime | None:
    """A time expression ('this Friday 18:00', 'today at 14:00', '2026-09-30 17:00') -> datetime.

    Returns None when the text holds no date or time hint at all."""
    low = text.lower()
    day: dt.date | None = None
    clock: dt.time | None = None
    m = re.search(r"(\d{4})-(\d{2})-(\d{2})(?:[ t](\d{1,2}):(\d{2}))?", low)
    if m:
        try:
            day = dt.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
            if m.group(4):
                clock = dt.time(int(m.group(4)), int(m.group(5)))
        except ValueError:
            day = None
    if day is None:
        md = _month_date(text, today.year)
        if md:
            day = md
    if day is None:
        wm = re.search(r"\b(this|next)?\s*(" + "|".join(WEEKDAYS) + r")\b", low)
        if wm:
            target = WEEKDAYS.index(wm.group(2))
            monday = today - dt.timedelta(days=today.weekday())
            day = monday + dt.timedelta(days=target)
            if wm.group(1) == "next" or (wm.group(1) is None and (day < today or "next week" in low)):
                day += dt.timedelta(days=7)
        elif "tomorrow" in low:
            day = today + dt.timedelta(days=1)
        elif "yesterday" in low:
            day = today - dt.timedelta(days=1)
        elif "today" in low or "this morning" in low or "this afternoon" in low or "current" in low:
            day = today
    if clock is None:
        tm = re.search(r"\b(\d{1,2}):(\d{2})\s*(am|pm)?", low) or \
            re.search(r"\b(\d{1,2})()\s*(am|pm)\b", low)
        if tm:
            hour = int(tm.group(1)) % 24
            if tm.group(3) == "pm" and hour < 12:
                hour += 12
            clock = dt.time(hour, int(tm.group(2) or 0))
        elif "noon" in low:
            clock = dt.time(12, 0)
        elif "end of day" in low or "eod" in low:
            clock = dt.time(18, 0)
        else:
            wm = re.search(r"\bat (" + "|".join(_WORD_HOURS) + r")\b", low)
            if wm:
                clock = dt.time(_WORD_HOURS[wm.group(1)] if "morning" not in low
                                else _WORD_HOURS[wm.group(1)] % 12 or 12, 0)
    if day is None and clock is None:
        return None
    return dt.datetime.combine(day or today, clock or default)


# --------------------------------------------------------------------------------------------
# Reading the task
# --------------------------------------------------------------------------------------------

_STOP = {"a", "an", "the", "this", "that", "of", "to", "with", "and", "in", "on", "our", "for",
         "new", "formal", "structured", "comprehensive", "detailed", "brief", "json", "markdown",
         "csv", "python", "format", "file", "please", "its", "their", "all", "some",
         "we", "you", "it", "as", "from", "by", "at", "into", "is", "are", "be", "or", "s",
         "directory", "folder"}
_GENERIC = {"utility", "helper", "module", "class", "script", "tool", "document", "doc"}
_PATH = r"[A-Za-z0-9_][\w.\-]*/[\w.\-/]*\.[A-Za-z0-9]+"


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _snake(words: list[str], limit: int = 5) -> str:
    out: list[str] = []
    for w in words:
        if w in _STOP:
            continue
        if w.isdigit() and out and not out[-1][-1].isdigit():
            out[-1] += w
        else:
            out.append(w)
    while out and out[0][0].isdigit():
        out.pop(0)
    return "_".join(out[:limit]) or "output"


def describe(question: str) -> list[str]:
    """A few words describing the requested output (['build', 'report'])."""
    q = re.sub(r"\S+/\S*", " ", question)
    m = re.search(r"\b(?:create|generate|write|draft|compile|prepare|produce)\s+(?:me\s+)?"
                  r"(?:(?:a|an|the)\s+)?(.+?)(?=\s+(?:in|as)\s+(?:json|markdown|csv|python)\b|,|\.\s|\.$|\(|"
                  r"\s+(?:saved?|and save|under|based on|that|which|for \w+ing)\b|$)",
                  q, re.I)
    phrase = m.group(1) if m else ""
    if not m:
        noun = re.search(r"\b(?:into|as) (?:a|an)\s+(?:[\w-]+\s+){0,3}?(report|document|summary|list|file|record)\b",
                         q, re.I)
        src = mentioned_paths(question)
        if src:
            stem = [w for w in _words(src[0].rsplit("/", 1)[-1].rsplit(".", 1)[0])
                    if w not in ("raw", "notes", "data", "draft", "input")]
            return _snake(stem[:3] + [noun.group(1).lower() if noun else "summary"]).split("_")
        m = re.search(r"\b(?:organize|format|process|parse)\s+(?:the\s+)?(.+?)(?=\s+(?:into|as|from)\b|,|\.)",
                      q, re.I)
        phrase = m.group(1) if m else "output"
    words = [w for w in _words(phrase) if w not in _STOP]
    if words and all(w in _GENERIC for w in words):
        fm = re.search(r"\bfor\s+(\w+?)ing\s+(?:with\s+|on\s+)?(?:the\s+)?([\w ]+?)(?=\s+(?:to|in|from|for)\b|[,.(]|$)",
                       question, re.I)
        if fm:
            # "a helper for exporting sprint data" -> the object, the verb, the noun (no word dropped)
            return _snake(_words(fm.group(2)) + [fm.group(1).lower()] + words[:1]).split("_")
    return _snake(words or ["output"]).split("_")


def output_format(question: str, default: str = "json") -> str:
    """The output's file extension: the first format the question names ('md', 'json', 'py', ...)."""
    low = question.lower()
    hits = [(m.start(), ext) for word, ext in (("markdown", "md"), ("json", "json"), ("python", "py"),
                                                ("csv", "csv"), ("yaml", "yaml"))
            for m in [re.search(rf"\b{word}\b", low)] if m]
    if hits:
        return min(hits)[1]
    if re.search(r"\b(script|module)\b", low):
        return "py"
    if re.search(r"\b(document|notes|guide|doc)\b", low):
        return "md"
    return default


def mentioned_paths(question: str) -> list[str]:
    """File paths (with a folder and an extension) the text names, in order."""
    return list(dict.fromkeys(p.rstrip(".") for p in re.findall(rf"(?<![\w/])({_PATH})", question)))


def work_dir(conv: Conversation) -> str:
    """The folder the request is about: the folder of a path it names, or a 'name/' it mentions
    (this request first, then earlier ones); '.' when there is none."""
    for t in [conv.question] + conv.earlier_user[::-1]:
        paths = mentioned_paths(t)
        if paths:
            return paths[0].rsplit("/", 1)[0]
        m = re.search(r"(?<![\w/.])([A-Za-z0-9_][\w.\-]*)/(?=[\s,.;)]|$)", t)
        if m:
            return m.group(1)
    return "."


def _top_split(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


@dataclass
class FieldSpec:
    name: str
    hint: str = ""                       # the rest of the item (parenthesis, 'array with ...')
    children: list[str] = field(default_factory=list)


_IDENT = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")


def parse_fields(question: str) -> list[FieldSpec]:
    """Field names the question asks for, with nested children where stated."""
    m = re.search(r"(?:fields?|include(?:s|ing)?(?: the following(?: fields)?)?|columns)\s*:?\s+(.+)",
                  question, re.I | re.S)
    if not m:
        return []
    body = re.split(r"\.\s+(?=[A-Z])|\.$|\n\n", m.group(1).strip())[0]
    specs: list[FieldSpec] = []
    for item in _top_split(body):
        item = re.sub(r"^(and|or)\s+", "", item.strip())
        tok = item.split()[0] if item.split() else ""
        tok = tok.strip("`'\"")
        if not _IDENT.match(tok) or tok in _STOP or tok in ("each", "sections", "both"):
            continue
        hint = item[len(tok):].strip()
        children: list[str] = []
        inner = re.search(r"\((.*)\)", hint)
        src = inner.group(1) if inner else (hint if re.match(r"(array|object|list)\b", hint) else "")
        if src:
            pieces = [re.sub(r"\s+for each \w+$", "", p.strip()) for p in re.split(r",|\band\b", src)]
            pieces = [p for p in pieces if p]
            first_ok = len(pieces[0].split()) == 1 or re.search(r"\b(contains?|with|having|containing|of)\s+\w+$",
                                                               pieces[0])
            if len(pieces) >= 2 and first_ok and all(len(p.split()) == 1 for p in pieces[1:]):
                cands = [pieces[0].split()[-1]] + [p.split()[0] for p in pieces[1:]]
                children = [c for c in cands if _IDENT.match(c) and c not in _STOP]
        specs.append(FieldSpec(tok, hint, children))
    return specs


def _is_time_field(name: str, hint: str = "") -> bool:
    n = name.lower()
    return (n.endswith(("_at", "_time", "_date", "_start", "_end", "_on")) or
            n in ("deadline", "start", "end", "date", "timestamp", "time", "when") or
            bool(re.search(r"\b(times?|datetimes?|dates?|timestamps?)\b", hint.lower())))


def _is_number_field(name: str, hint: str = "") -> bool:
    n = name.lower()
    return ("(number)" in hint or bool(re.search(r"\b(number|count|integer|amount)\b", hint.lower())) or
            n.endswith(("_ms", "_pct", "_rate", "_count", "_seconds", "_hours", "_percent", "_rps",
                        "_score", "_total", "_size", "_num")) or
            n.startswith(("total_", "num_", "avg_", "mean_", "max_", "min_", "count_")) or
            bool(re.fullmatch(r"p\d{2}", n)))


def _is_list_field(name: str, hint: str) -> bool:
    return bool(re.search(r"\b(array|list|items|entries)\b", hint.lower()))


# --------------------------------------------------------------------------------------------
# The simulated agent
# --------------------------------------------------------------------------------------------

@dataclass
class Action:
    kind: str                 # read | list | copy | write | append
    path: str
    other: str | None = None  # content, or copy destination


class _Ctx:
    """Everything the content generators need."""

    def __init__(self, conv: Conversation, files: dict[str, str], seed: int, round_reads=()):
        self.conv = conv
        self.q = conv.question
        self.files = files
        self.round_reads = list(round_reads)
        self.rules = conv.rules
        texts = list(conv.earlier_user) + [files[p] for p in sorted(files) if
                                           p.lower().endswith("readme.md")] + [conv.question]
        self.today = find_today(texts + [files[p] for p in sorted(files)])
        self.now = parse_when(_current_time_hint(conv.question), self.today) or \
            dt.datetime.combine(self.today, dt.time(9, 30))
        self.rng = random.Random(_seed_of(seed, conv.question))

    @property
    def iso(self) -> bool:
        """Whether a time format was stated (then every time value follows it)."""
        return self.rules.time is not None

    def t(self, when: dt.datetime | None = None) -> str:
        """A time value: in the stated format when there is one, else plain ``2026-07-09 14:30``."""
        when = when or self.now
        return self.rules.time.format(when) if self.rules.time else when.strftime("%Y-%m-%d %H:%M")

    def inputs(self) -> dict[str, str]:
        """The task's input files: those the question names or this round read (else all read)."""
        mine = set(mentioned_paths(self.q)) | set(self.round_reads)
        chosen = {k: v for k, v in self.files.items() if k in mine and not k.lower().endswith("readme.md")}
        return chosen or {k: v for k, v in self.files.items() if not k.lower().endswith("readme.md")}

    def inputs_text(self) -> str:
        return "\n".join(v for _, v in sorted(self.inputs().items()))

    def people(self) -> list[str]:
        """People named in the files read and the request: names that lead a list item, or follow
        'assign(ed) to' / 'by'; a generic placeholder when there are none."""
        text = "\n".join(self.files.values()) + "\n" + self.q
        found = re.findall(r"^\s*(?:[-*]|\d+[.)])\s+\**([A-Z][a-z]+)\b(?:\s+[A-Z][a-z]+)?\**\s*(?:[:—–-]|to\b)",
                           text, re.M)
        found += re.findall(r"\b(?:assign(?:ed)?(?: it)? to|owner:?|by)\s+([A-Z][a-z]+)\b", text)
        return list(dict.fromkeys(found)) or ["Owner"]


def _header_now(ctx: _Ctx) -> str:
    return ctx.t()


def _current_time_hint(q: str) -> str:
    """The clock time the request gives for "now" (``current time 09:30``, ``now, about 09:30``,
    ``around 15:30``), or ""."""
    m = re.search(r"\b(?:current(?:ly)?|now|around|about|roughly|approximately|circa)\b[^)\d]{0,20}?"
                  r"(\d{1,2}:\d{2})", q, re.I)
    return m.group(1) if m else ""


def _seed_of(seed: int, text: str) -> int:
    return int(hashlib.sha256(f"{seed}:{text}".encode()).hexdigest()[:12], 16)


def _field_segment(question: str, name: str) -> str:
    i = question.find(name)
    if i < 0:
        return ""
    seg, depth = "", 0
    for ch in question[i + len(name):]:
        depth += ch == "("
        depth -= ch == ")"
        if depth <= 0 and ch in ",;" or (depth <= 0 and ch == "." and seg and not seg[-1].isdigit()):
            break
        seg += ch
    return seg


def _time_for(ctx: _Ctx, name: str, hint: str) -> str:
    seg = _field_segment(ctx.q, name) or hint
    when = parse_when(seg, ctx.today, ctx.now.time())
    span = re.search(r"\b(\d{1,2}:\d{2})\s*[-–]\s*(\d{1,2}:\d{2})\b", ctx.q)
    if when is None and span and name.endswith(("_start", "_end")):
        when = parse_when(span.group(1 if name.endswith("_start") else 2), ctx.today)
    if when is None and name.endswith(("_start",)) and "today" in ctx.q.lower():
        when = dt.datetime.combine(ctx.today, dt.time(0, 0))
    return ctx.t(when)


def _content_lines(text: str, limit: int = 6) -> list[str]:
    out = []
    for line in text.splitlines():
        s = line.strip(" -*#=\t")
        if len(s) > 12 and not s.startswith(("{", "}", "[", "]", '"')):
            out.append(s[:120])
        if len(out) >= limit:
            break
    return out


def _is_person_field(name: str) -> bool:
    n = name.lower()
    return n in ("assignee", "owner", "author", "name", "reviewer") or n.endswith(("_by", "_name", "_owner"))


def _value(ctx: _Ctx, spec: FieldSpec, depth: int = 0) -> Any:
    name, hint = spec.name, spec.hint
    quoted = re.search(r"\(\s*\"([^\"]+)\"\s*\)", hint)
    if quoted:
        return quoted.group(1)
    minutes = re.search(r"(\d+)[- ]minutes?\b", hint)
    if minutes and re.search(r"\b(intervals?|every|each)\b", hint) and re.search(r"\btimes?\b|\d:\d\d", hint):
        count = re.search(r"\b(\d+)\b(?![- ]minute)(?![:\d])", hint)
        n = min(int(count.group(1)), 48) if count else 4
        step = int(minutes.group(1))
        start_at = re.search(r"\b(?:from|between|starting(?: at)?)\s+(\d{1,2}:\d{2})", hint)
        start = parse_when(start_at.group(1), ctx.today) if start_at else ctx.now
        return [ctx.t(start + dt.timedelta(minutes=step * i)) for i in range(n)]
    if _is_list_field(name, hint):
        if spec.children:
            return [_object(ctx, [FieldSpec(c) for c in spec.children], i) for i in range(3)]
        if "people" in hint or "who" in hint or "attend" in name:
            return ctx.people()
        if _is_time_field(name, hint):
            base = parse_when(_field_segment(ctx.q, name), ctx.today) or ctx.now
            return [ctx.t(base + dt.timedelta(days=i)) for i in range(3)]
        lines = _content_lines(ctx.inputs_text()) or [f"{name.replace('_', ' ')} item {i + 1}" for i in range(3)]
        return lines[:4]
    if spec.children:
        return _object(ctx, [FieldSpec(c) for c in spec.children], 0)
    if _is_time_field(name, hint):
        return _time_for(ctx, name, hint)
    counted = _count_from_inputs(ctx, name)
    if counted is not None:
        return counted
    if _is_number_field(name, hint):
        m = re.search(rf"{re.escape(name)}\s*\((\d+)\)", ctx.q)
        if m:
            return int(m.group(1))
        if name.endswith("_ms"):
            return round(ctx.rng.uniform(60, 180) * (3 if re.search(r"p9\d", name) else 1), 1)
        if any(k in name for k in ("pct", "rate", "percent")):
            return round(ctx.rng.uniform(0.1, 2.5) if "error" in name else ctx.rng.uniform(95, 99.9), 2)
        return ctx.rng.randint(1, 20)
    if "object" in hint or name.endswith(("_counts", "_summary", "_metrics")):
        return {"total": ctx.rng.randint(10, 200)}
    if _is_person_field(name):
        return ctx.rng.choice(ctx.people())
    if name == "status":
        return "done"
    lines = _content_lines(ctx.inputs_text())
    return ctx.rng.choice(lines) if lines else f"{name.replace('_', ' ')}"


def _count_from_inputs(ctx: _Ctx, name: str) -> Any:
    """Counts taken from a log among the inputs: request totals, status code counts."""
    logs = [v for k, v in sorted(ctx.files.items()) if k.endswith(".log")]
    if not logs:
        return None
    lines = [ln for ln in "\n".join(logs).splitlines() if ln.strip()]
    if "status" in name and "count" in name:
        counts: dict[str, int] = {}
        for ln in lines:
            m = re.search(r"\s([1-5]\d\d)\s", ln)
            if m:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        return dict(sorted(counts.items()))
    if "request" in name and ("total" in name or "count" in name):
        return len(lines)
    return None


def _object(ctx: _Ctx, specs: list[FieldSpec], index: int) -> dict:
    obj: dict[str, Any] = {}
    people = ctx.people()
    for s in specs:
        if _is_person_field(s.name):
            obj[s.name] = people[index % len(people)]
        elif s.name in ("task", "issue", "description", "title", "item"):
            lines = _action_lines(ctx.inputs_text())
            obj[s.name] = lines[index % len(lines)] if lines else f"{s.name} {index + 1}"
        elif s.name in ("id",):
            obj[s.name] = f"ITEM-{index + 1:03d}"
        else:
            obj[s.name] = _value(ctx, s)
    return obj


def _action_lines(text: str, limit: int = 6) -> list[str]:
    """List items of the text ('1. ...', '- ...'), those under an 'Action Items' heading first."""
    head = re.search(r"action items", text, re.I)
    ordered = text[head.end():] + "\n" + text[:head.start()] if head else text
    items = re.findall(r"^\s*(?:\d+[.)]|-)\s+(.{8,120})$", ordered, re.M)
    return items[:limit]


def _json_from_specs(ctx: _Ctx, specs: list[FieldSpec]) -> dict:
    data: dict[str, Any] = {}
    for s in specs:
        items = _assigned_items(ctx, s) if s.children and _is_list_field(s.name, s.hint) else None
        data[s.name] = items if items else _value(ctx, s)
    return data


def _assigned_items(ctx: _Ctx, spec: FieldSpec) -> list[dict] | None:
    """List items of the inputs of the form '<Person> to <task> [by <when>]' as objects with the
    requested children (a person field, a task field, a time field)."""
    out = []
    for line in _action_lines(ctx.inputs_text(), 50):
        m = re.match(r"([A-Z][a-z]+) (?:to|will) (.+?)(?: by (.+))?$", line)
        if not m:
            continue
        item: dict[str, Any] = {}
        for c in spec.children:
            if _is_person_field(c):
                item[c] = m.group(1)
            elif _is_time_field(c):
                item[c] = ctx.t(parse_when(m.group(3) or "", ctx.today, dt.time(18, 0)) or ctx.now)
            else:
                item[c] = m.group(2)
        out.append(item)
    return out or None


def _title(ctx: _Ctx, words: list[str]) -> str:
    return " ".join(w.capitalize() for w in words)


def _sections(q: str) -> list[str]:
    m = re.search(r"(?:include(?:s|ing)?(?: sections for)?|covering|with)\s*:?\s+(.+?)(?:\.\s|\.$|$)", q, re.I)
    if not m:
        return ["Overview", "Details", "Next Steps"]
    parts = [re.sub(r"^(and|or)\s+", "", p.strip()) for p in re.split(r",|;", m.group(1))]
    return [p[:60].strip().capitalize() for p in parts if p.strip()][:8] or ["Overview"]


def _header_lines(ctx: _Ctx, ext: str) -> list[str]:
    """The stated header for a new file of this type, as lines ([] when none is stated)."""
    h = ctx.rules.headers.get(ext)
    if not h:
        return []
    pairs = h.values(_header_now(ctx))
    if ext == "md":
        return ["---"] + [f"{k}: {v}" for k, v in pairs] + ["---", ""]
    if ext == "py":
        return ["", f"{h.container}:"] + [f"  {k}: {v}" for k, v in pairs]
    if ext == "csv":
        return [f"# {h.container}: " + " ".join(f"{k}={v}" for k, v in pairs)]
    return []


def make_markdown(ctx: _Ctx, words: list[str]) -> str:
    lines = _header_lines(ctx, "md")
    lines += [f"# {_title(ctx, words)}", "", f"Date: {ctx.t()}", ""]
    source = _content_lines(ctx.inputs_text(), 12)
    for i, sec in enumerate(_sections(ctx.q)):
        lines += [f"## {sec}", ""]
        picked = source[i * 2:i * 2 + 2] or [f"{sec}: to be completed with the team."]
        lines += [f"- {p}" for p in picked] + [""]
    return "\n".join(lines)


def _py_functions(q: str) -> list[tuple[str, str]]:
    return list(dict.fromkeys(re.findall(r"\b([a-z_][a-z0-9_]*)\(([^)]*)\)", q)))


def make_python(ctx: _Ctx, words: list[str]) -> str:
    doc = [f"{_title(ctx, words)}.", "", (ctx.q.split(".")[0] + ".")[:200]]
    doc += _header_lines(ctx, "py")
    body = ['"""' + "\n".join(doc) + '\n"""', "", "import json", "import os", ""]
    cls = re.search(r"\b(?i:implement|class)\s+([A-Z][A-Za-z0-9]+)", ctx.q)
    funcs = _py_functions(ctx.q)
    if cls:
        body += ["", f"class {cls.group(1)}:", f'    """{_title(ctx, words)}."""', "",
                 "    def __init__(self, base_url=\"http://localhost\"):", "        self.base_url = base_url", ""]
        for name, args in funcs:
            params = ", ".join(a.strip() for a in args.split(",") if a.strip())
            body += [f"    def {name}(self{', ' + params if params else ''}):",
                     f'        """{name.replace("_", " ").capitalize()}."""',
                     "        try:",
                     f"            return {{\"call\": \"{name}\", \"args\": [{params}]}}",
                     "        except Exception as exc:  # error handling",
                     "            raise RuntimeError(str(exc)) from exc", ""]
    else:
        for name, args in funcs or [("main", "path=\".\"")]:
            params = [a.strip() for a in args.split(",") if a.strip()]
            body += ["", f"def {name}({', '.join(params)}):", f'    """{name.replace("_", " ").capitalize()}."""']
            body += [f"    {line}" for line in _py_function_body(name, [p.split("=")[0] for p in params],
                                                                  _json_header_key(ctx))] + [""]
        first = (funcs or [("main", "")])[0][0]
        call = "main()" if not funcs else f"print({first}.__doc__)"
        body += ["", 'if __name__ == "__main__":', f"    {call}", ""]
    return "\n".join(body)


def _json_header_key(ctx: _Ctx) -> str | None:
    """The key of the header object JSON files must carry, when a stated rule names one."""
    h = ctx.rules.headers.get("json")
    return h.container if h else None


def _py_function_body(name: str, params: list[str], header_key: str | None = None) -> list[str]:
    """A small working body for a function, chosen from its name and parameters; a folder scan
    also counts the JSON files carrying ``header_key`` (the stated header object) when known."""
    data = params[0] if params else "{}"
    path = next((p for p in params if "path" in p or "file" in p or "dir" in p), None)
    rows = f"{data} if isinstance({data}, list) else [{data}]"
    if path and "json" in name:
        return [f"with open({path}, \"w\", encoding=\"utf-8\") as fh:",
                f"    json.dump({data}, fh, indent=2, ensure_ascii=False)", f"return {path}"]
    if path and "csv" in name:
        return ["import csv", "", f"rows = {rows}", "fields = sorted({k for row in rows for k in row})",
                f"with open({path}, \"w\", newline=\"\", encoding=\"utf-8\") as fh:",
                "    writer = csv.DictWriter(fh, fieldnames=fields)", "    writer.writeheader()",
                "    writer.writerows(rows)", f"return {path}"]
    if path and ("markdown" in name or name.endswith("_md")):
        return [f"rows = {rows}", "fields = sorted({k for row in rows for k in row})",
                "lines = [\"| \" + \" | \".join(fields) + \" |\", \"|\" + \"---|\" * len(fields)]",
                "lines += [\"| \" + \" | \".join(str(row.get(f, \"\")) for f in fields) + \" |\" for row in rows]",
                f"with open({path}, \"w\", encoding=\"utf-8\") as fh:", "    fh.write(\"\\n\".join(lines) + \"\\n\")",
                f"return {path}"]
    if path:
        scan = ["target = " + path,
                "names = sorted(os.listdir(target)) if os.path.isdir(target) else [target]",
                "summary = {\"files\": len(names), \"json_files\": 0}",
                "for name in names:",
                "    full = os.path.join(target, name) if os.path.isdir(target) else name",
                "    if full.endswith(\".json\"):",
                "        summary[\"json_files\"] += 1"]
        if header_key:
            key = json.dumps(header_key)
            scan[2] = "summary = {\"files\": len(names), \"json_files\": 0, \"with_header\": 0}"
            scan += ["        with open(full, encoding=\"utf-8\") as fh:",
                     f"            summary[\"with_header\"] += {key} in json.load(fh)"]
        return scan + ["print(summary)", "return summary"]
    args = ", ".join(f"\"{p}\": {p}" for p in params)
    return [f"return {{\"action\": \"{name}\", {args}}}" if args else f"return {{\"action\": \"{name}\"}}"]


def make_csv(ctx: _Ctx) -> str:
    m = re.search(r"columns?\s*:?\s+(.+?)(?:\.\s|\.$|$)", ctx.q, re.I)
    cols = [c.strip(" .") for c in re.split(r",|\band\b", m.group(1))] if m else ["name", "value"]
    cols = [c for c in cols if _IDENT.match(c)] or ["name", "value"]
    lines = _header_lines(ctx, "csv")
    lines.append(",".join(cols))
    for who in ctx.people():
        row = [who if i == 0 else str(ctx.rng.randint(0, 12)) for i in range(len(cols))]
        lines.append(",".join(row))
    return "\n".join(lines) + "\n"


def _summarize_json(source: Any) -> dict:
    """A normalized summary of a JSON input: its lists of records kept, with totals and means."""
    out: dict[str, Any] = {}
    overall: dict[str, Any] = {}
    if not isinstance(source, dict):
        return {"records": source}
    for key, value in source.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out[f"{key}_summary"] = value
            numeric = sorted({k for v in value for k, x in v.items() if isinstance(x, (int, float))})
            for k in numeric:
                xs = [v[k] for v in value if isinstance(v.get(k), (int, float))]
                overall[f"total_{k}" if k in ("calls", "count", "requests") else f"mean_{k}"] = \
                    sum(xs) if k in ("calls", "count", "requests") else round(sum(xs) / len(xs), 4)
            overall[f"{key}_count"] = len(value)
        elif not isinstance(value, (dict, list)):
            out[key] = value
    out["overall_metrics"] = overall
    return out


def _with_json_header(ctx: _Ctx, data: Any) -> Any:
    h = ctx.rules.headers.get("json")
    if not h or not isinstance(data, dict):
        return data
    block = dict(h.values(_header_now(ctx)))
    old = data.get(h.container)
    return {h.container: {**block, **old} if isinstance(old, dict) else block,
            **{k: v for k, v in data.items() if k != h.container}}


def make_json(ctx: _Ctx) -> str:
    specs = parse_fields(ctx.q)
    sources = [v for k, v in sorted(ctx.inputs().items()) if k.endswith(".json")]
    if sources and not any("_" in s.name for s in specs):
        try:
            data = _summarize_json(json.loads(sources[0]))
        except ValueError:
            data = {}
    else:
        data = _json_from_specs(ctx, specs)
    if not data:
        data = {"summary": _content_lines(ctx.inputs_text(), 4), "generated": ctx.t()}
    return json.dumps(_with_json_header(ctx, data), indent=2, ensure_ascii=False) + "\n"


def _walk_times(ctx: _Ctx, obj: Any, mapping: dict[str, str], normalize: bool) -> Any:
    """Set time values in a JSON document: fields named in ``mapping`` (and, when ``normalize``,
    every time-like field) get the agent's timestamp format. A record that only names a mapped
    field (``{"name": "opened_after", "sample": "..."}``) gets its time in the keys the request
    itself mentions ("correct the sample values")."""
    asked = set(_words(ctx.q)) - _STOP
    if isinstance(obj, dict):
        name = obj.get("name")
        for k, v in list(obj.items()):
            if k != "name" and k in asked and isinstance(name, str) and name in mapping and \
                    not isinstance(v, (dict, list)):
                obj[k] = mapping[name]
            elif k in mapping and not isinstance(v, (dict, list)):
                obj[k] = mapping[k]
            elif isinstance(v, (dict, list)):
                _walk_times(ctx, v, mapping, normalize)
            elif normalize and _is_time_field(k) and isinstance(v, str):
                when = parse_when(v, ctx.today, ctx.now.time()) if v else ctx.now
                obj[k] = ctx.t(when or ctx.now)
    elif isinstance(obj, list):
        for v in obj:
            _walk_times(ctx, v, mapping, normalize)
    return obj


def modify_json(ctx: _Ctx, original: str) -> str:
    try:
        data = json.loads(original)
    except ValueError:
        return original.rstrip() + "\n"
    mapping = {}
    for name in re.findall(r"\b([a-z][a-z0-9]*_[a-z0-9_]+)\b", ctx.q):
        # "<field> is / maps to / = <a time>": the time the request gives that field
        when = parse_when(_field_segment(ctx.q, name), ctx.today, ctx.now.time())
        if when is not None:
            mapping[name] = ctx.t(when)
    add = re.search(r"\bid\s+([A-Z]+-\d+)", ctx.q)
    if add:
        lst = next((v for v in data.values() if isinstance(v, list)), None) if isinstance(data, dict) else None
        if lst is not None:
            template = lst[0] if lst and isinstance(lst[0], dict) else {}
            item = {k: "" for k in template}
            item["id"] = add.group(1)
            what = re.search(r":\s*([^.:]+?)\.(?:\s|$)", ctx.q)
            if "title" in item or not item:
                title = (what.group(1) if what else "New item").strip()
                item["title"] = title[:1].upper() + title[1:]
            who = re.search(r"\bassign(?:ed)? it to (\w+)", ctx.q, re.I)
            owner = next((k for k in item if _is_person_field(k)), "assignee")
            item[owner] = who.group(1) if who else "unassigned"
            due = re.search(r"\b(?:deadline(?:\s+(?:of|is|at))?|due(?:\s+(?:by|on|at))?)\s+([^,.]+)", ctx.q)
            for name in re.findall(r"\b([a-z]+_[a-z]+)\b", ctx.q):   # time fields the request names
                if _is_time_field(name):
                    item[name] = ctx.t(parse_when(due.group(1), ctx.today, dt.time(18, 0))
                                       if due and "creat" not in name else ctx.now)
            if due and not any(_is_time_field(k) and item.get(k) for k in item):
                item["due"] = ctx.t(parse_when(due.group(1), ctx.today, dt.time(18, 0)))
            lst.append(item)
    _walk_times(ctx, data, mapping, normalize=ctx.iso)
    return json.dumps(_with_json_header(ctx, data), indent=2, ensure_ascii=False) + "\n"


def modify_text(ctx: _Ctx, path: str, original: str) -> str:
    ext = path.rsplit(".", 1)[-1].lower()
    if ext == "json":
        return modify_json(ctx, original)
    text = original
    changes = re.findall(r"change\s+(\w+)\s+from\s+(\"[^\"]*\"|\S+?)\s+to\s+(\"[^\"]*\"|[^\s,]+)", ctx.q, re.I)
    for name, old, new in changes:
        text = re.sub(rf"^(\s*{re.escape(name)}\s*=\s*){re.escape(old)}", lambda m: m.group(1) + new, text,
                      flags=re.M)
    if text != original:
        return text
    note = re.sub(r"^please\s+", "", ctx.q.split(".")[0], flags=re.I)[:90]
    if ext == "py":
        return original.rstrip() + f"\n\n# Updated {ctx.t()}: {note}\n"
    if ext in ("md", "txt", "rst"):
        add = ["", f"## Update ({ctx.t()})", "", f"{note}.", ""]
        for sec in _sections(ctx.q):
            add += [f"### {sec}", "", f"- {sec}: documented in this update.", ""]
        return original.rstrip() + "\n" + "\n".join(add)
    return original.rstrip() + "\n# updated " + ctx.t() + "\n"


def _modify_target(conv: Conversation) -> str | None:
    """The existing file the question asks to change in place, if any."""
    q = conv.question
    if re.search(r"\bsave (?:it )?as\b|do not modify", q, re.I):
        return None
    for p in mentioned_paths(q):
        verb = re.search(r"\b(update|modify|refactor|change|fix|correct|edit|add\b[^.]*\bto)\s+[^.]*?"
                         + re.escape(p), q, re.I) or re.search(re.escape(p) + r"\s*:\s*change", q, re.I)
        if verb:
            return p
    return None


#: "create hello.py", "write a file named notes.md", "save it as report.csv": a bare file name
#: (no folder) the request asks to create or write.
_BARE_TARGET = re.compile(
    r"\b(?:save[ds]?|create|store|write)\s+(?:it\s+|them\s+|the results\s+)?(?:(?:as|to|in|into)\s+)?"
    r"(?:(?:a|an|the|new)\s+){0,2}(?:[\w-]+\s+){0,2}?(?:(?:called|named)\s+)?"
    r"(?<![\w/.\-])([A-Za-z0-9_][\w\-]*(?:\.[\w\-]+)*\.(?:[A-Za-z][A-Za-z0-9]{1,5}|[chr]))(?![\w/\-]|\.[A-Za-z0-9])",
    re.I)


def _new_target(ctx: _Ctx, conv: Conversation) -> str:
    q = conv.question
    m = re.search(rf"\b(?:save[ds]?|saved|create|store|write)\s+(?:it\s+|them\s+|the results\s+)?(?:(?:as|to|in)\b\s*)?"
                  rf"({_PATH})", q, re.I)
    if m:
        return m.group(1).rstrip(".")
    folder = work_dir(conv)
    if folder == "." and ctx.rules.naming is None:
        bare = _BARE_TARGET.search(q)
        if bare:   # "create hello.py that prints hi": no folder, no naming rule -> that file
            return bare.group(1)
    ext = output_format(q)
    words = describe(q)
    name = ctx.rules.naming.name(words, ext, ctx.today) if ctx.rules.naming else f"{'_'.join(words)}.{ext}"
    return f"{folder}/{name}" if folder != "." else name


def plan_outputs(conv: Conversation, files: dict[str, str], seed: int,
                 has_copy: bool = True) -> tuple[list[Action], str, _Ctx]:
    """The write actions for a file task (after reading), and a one-line summary."""
    reads = [p for c, r in conv.steps for p in [ToolSet.path_hint(c)] if p]
    ctx = _Ctx(conv, files, seed, reads)
    actions: list[Action] = []
    target = _modify_target(conv)
    if target is not None:
        original = files.get(target, "")
        new = modify_text(ctx, target, original)
        backup = ctx.rules.backup
        if backup is not None:
            copy = target + backup.suffix
            actions.append(Action("copy", target, copy) if has_copy else Action("write", copy, original))
        actions.append(Action("write", target, new))
        summary = f"Updated {target}"
    else:
        path = _new_target(ctx, conv)
        ext = path.rsplit(".", 1)[-1].lower()
        source = next((p for p in mentioned_paths(conv.question) if p != path and p in files), None)
        if ext == "json" and source and source.endswith(".json") and \
                re.search(r"\b(correct|fix|convert|normalize)\b", conv.question, re.I):
            content = modify_json(ctx, files[source])
        elif ext == "json":
            content = make_json(ctx)
        elif ext == "py":
            content = make_python(ctx, describe(conv.question))
        elif ext == "csv":
            content = make_csv(ctx)
        else:
            content = make_markdown(ctx, describe(conv.question))
        actions.append(Action("write", path, content))
        summary = f"Created {path}"
    return actions, summary, ctx


def log_line(ctx: _Ctx, summary: str) -> str:
    """The stated log line for a finished task (the log rule must be known)."""
    return ctx.rules.log.line(ctx.t(), "_".join(describe(ctx.q)[:4]), summary)


# ---- multiple choice -----------------------------------------------------------------------

def parse_options(question: str) -> dict[str, str]:
    """'A. text' blocks (possibly multi-line) -> {letter: text}."""
    options: dict[str, str] = {}
    current = None
    for line in question.splitlines():
        m = re.match(r"^\s*([A-H])[.)](?:\s+(.*)|\s*$)", line)
        if m:
            current = m.group(1)
            options[current] = (m.group(2) or "").strip()
        elif current and re.match(r"^\s*(answer|please answer)", line, re.I):
            current = None
        elif current is not None:
            options[current] += "\n" + line
    return {k: v.strip() for k, v in options.items()}


_ANSWER_MACRO = re.compile(r"\\([A-Za-z]+)\{")


def is_multi_choice(question: str) -> bool:
    """Lettered options plus an answer format like ``\\name{X}`` stated in the question."""
    return bool(_ANSWER_MACRO.search(question)) and len(parse_options(question)) >= 2


_FILE_RE = re.compile(r"(?<![\w/])([\w\-]+\.[a-z]{2,4})\b")


def _stem_words(text: str) -> set[str]:
    return {w[:6] for w in _words(text) if w not in _STOP and len(w) > 2}


_NEGATION = re.compile(r"\b(no|not|never|cannot|can't|need no|exempt|incorrect|wrong|invalid|violat\w*|"
                       r"non-compliant|only when|only if)\b", re.I)


def _lexical_verdict(opt: str, knowledge: str) -> bool | None:
    """Judge a statement by the most similar sentence of the known text, if similar enough: the
    option is taken as true when it agrees in sign (negated or not) with that sentence."""
    words = _stem_words(opt)
    if len(words) < 2 or not knowledge.strip():
        return None
    best, best_score = "", 0.0
    for sent in re.split(r"(?<=[.!?;])\s+|\n+", knowledge):
        sw = _stem_words(sent)
        if len(sw) < 2:
            continue
        score = len(words & sw) / min(len(words), len(sw))
        if score > best_score:
            best, best_score = sent, score
    if best_score < 0.6:
        return None
    return (not _NEGATION.search(best)) == (not _NEGATION.search(opt))


_TIME_WORDS = re.compile(r"\b(?:" + "|".join(WEEKDAYS + MONTHS) + r"|today|tomorrow|yesterday|tonight|"
                         r"noon|midnight|eod|am|pm)\b", re.I)
_TOKEN = re.compile(r"[\w:+\-./]+")


def _date_like(token: str) -> bool:
    """A token that writes a date or a time in some shape: a clock (9:30), or a year with more
    digits beside it (2026-07-09, 2026-W28-4, 2026-190, 20260709T1430)."""
    if re.search(r"\d{1,2}:\d{2}", token):
        return True
    digits = re.findall(r"\d+", token)
    year = any(re.match(r"(?:19|20)\d{2}(?:\d{4})?$", d) or re.match(r"(?:19|20)\d{6}", d) for d in digits)
    return year and (len(digits) >= 2 or any(len(d) >= 8 for d in digits))


def _value_spans(opt: str) -> list[str]:
    """The parts of an option that are values rather than prose: quoted strings, what follows a
    ``key:`` label, or the whole option when it is only a value (at most three words)."""
    if len(opt.split()) <= 3:
        return [opt]
    spans = re.findall(r"\"([^\"]*)\"|'([^']*)'", opt)
    out = [a or b for a, b in spans]
    label = re.search(r"(?<!\d):\s+(.+)$", re.sub(r"\"[^\"]*\"|'[^']*'", " ", opt), re.S)
    if label:
        out.append(label.group(1))
    return out


def _time_verdict(opt: str, time_rule: Any) -> bool | None:
    """Under a stated time format: False when a value of the option writes a date or time in any
    other shape (or in words: 'Friday', 'July 10'), True when all its date-times follow the
    format, None when it holds no date or time value. File names are left to the naming rule."""
    seen = False
    for span in _value_spans(opt):
        for m in DATETIME_RE.finditer(span):
            seen = True
            if not time_rule.matches(m.group(0)):
                return False
        rest = DATETIME_RE.sub(" ", span)
        tokens = [t for t in _TOKEN.findall(rest) if not _FILE_RE.fullmatch(t.strip(".,;:"))]
        if any(_date_like(t) for t in tokens) or _TIME_WORDS.search(" ".join(tokens)):
            return False
    return True if seen else None


def _option_verdict(opt: str, rules: Rules, knowledge: str) -> bool | None:
    """True/False when a stated rule (or the known text) decides the option, None otherwise."""
    verdicts: list[bool] = []
    if rules.time is not None:
        verdict = _time_verdict(opt, rules.time)
        if verdict is not None:
            verdicts.append(verdict)
    if rules.naming is not None:
        files = [f for f in _FILE_RE.findall(opt) if not (rules.backup and f.endswith(rules.backup.suffix))]
        if files and re.search(r"\b(name|named|file|new|create)", opt, re.I) or files == _FILE_RE.findall(opt.strip()):
            if files:
                verdicts.append(all(rules.naming.matches(f) for f in files))
    if verdicts:
        return all(verdicts)
    return _lexical_verdict(opt, knowledge)


def answer_multi_choice(conv: Conversation, seed: int) -> str:
    """The reply to a multiple-choice round: reasoning lines and one ``\\bbox{...}``."""
    options = parse_options(conv.question)
    rules = conv.rules
    rng = random.Random(_seed_of(seed, conv.question))
    picks, notes = [], []
    knowledge = "\n".join([conv.system] + conv.feedback)
    for letter, text in options.items():
        verdict = _option_verdict(text, rules, knowledge)
        if verdict is None:
            verdict = rng.random() < 0.5
            notes.append(f"{letter}: no stated rule applies; guessed {'yes' if verdict else 'no'}")
        if verdict:
            picks.append(letter)
    if not picks:
        picks = [sorted(options)[0]]
    macro = _ANSWER_MACRO.search(conv.question).group(1)   # answer in the format the question asks
    return (f"{LABEL} Rules known from context: {rules.describe()}.\n" + "\n".join(notes) +
            f"\n\\{macro}{{{','.join(picks)}}}")


# ---- the agent's step function ---------------------------------------------------------------

def _tool_call(tools: ToolSet, action: Action, index: int, salt: str) -> dict:
    if action.kind == "copy":
        args = tools.args("copy", action.path, action.other)
    else:
        args = tools.args(action.kind, action.path, action.other)
    cid = "call_sim_" + hashlib.sha256(f"{salt}:{index}:{action.kind}:{action.path}".encode()).hexdigest()[:16]
    return {"id": cid, "type": "function",
            "function": {"name": tools.tools[action.kind][0], "arguments": json.dumps(args, ensure_ascii=False)}}


def _listing_names(result: str) -> list[str]:
    try:
        obj = json.loads(result)
    except (ValueError, TypeError):
        obj = None
    names: list[str] = []
    if isinstance(obj, dict):
        for k in ("entries", "files", "items", "listing", "content"):
            if k in obj:
                obj = obj[k]
                break
    if isinstance(obj, list):
        for e in obj:
            names.append(e.get("name") or e.get("path") if isinstance(e, dict) else str(e))
    elif isinstance(obj, str):
        names = obj.split()
    else:
        names = re.findall(r"[\w.\-/]+\.[A-Za-z0-9]+", result)
    return [str(n).rstrip("/") for n in names if n]


def agent_reply(body: dict, seed: int = DEFAULT_SEED) -> dict:
    """The simulated agent's next message for a chat request body.

    In: an OpenAI chat-completions request body (messages, tools). Out: ``{"content": str|None,
    "tool_calls": list|None}``. Stateless: the step is re-derived from the tool calls already made
    since the user's last message of their own (see :func:`parse_conversation`).
    """
    conv = parse_conversation(body.get("messages") or [])
    tools = ToolSet(body.get("tools"))
    if not conv.question:
        text = "Thanks, I will keep that in mind." if conv.feedback else "Hello. Give me a task."
        return {"content": f"{LABEL} {text}", "tool_calls": None}
    if is_multi_choice(conv.question):
        return {"content": answer_multi_choice(conv, seed), "tool_calls": None}
    if not (tools.has("write") and tools.has("read")):
        return {"content": f"{LABEL} I need file tools (read and write) to do this task; none were offered.",
                "tool_calls": None}
    files: dict[str, str] = {}
    listing: set[str] = set()
    done_kinds: list[tuple[str, str | None]] = []
    for call, result in conv.all_steps():
        kind = tools.kind_of(call)
        path, _ = tools.path_of(call)
        if kind == "read" and path and not _is_error(result):
            files[path] = _result_text(result)
        elif kind == "list" and path and not _is_error(result):
            base = path.rstrip("/")
            listing.update(n if "/" in n else f"{base}/{n}" for n in _listing_names(result))
    for call, _ in conv.steps:
        kind = tools.kind_of(call)
        path, _ = tools.path_of(call)
        done_kinds.append((kind or "", path))
    salt = conv.question
    folder = work_dir(conv)
    # step 1: look around (list the folder, read its README and the files the task names)
    if not conv.steps:
        actions = []
        if tools.has("list") and folder != "." and not any(p.startswith(folder + "/") for p in listing):
            actions.append(Action("list", folder))
        readme = f"{folder}/README.md"
        if folder != "." and readme not in files and (readme in listing or not listing):
            actions.append(Action("read", readme))
        actions += [Action("read", p) for p in mentioned_paths(conv.question) if p not in files]
        if actions:
            return {"content": None, "tool_calls": [_tool_call(tools, a, i, salt) for i, a in enumerate(actions)]}
    # step 2: read the input files whose names share a word with the task
    qwords = {w for w in _words(conv.question) if len(w) > 3 and w not in _STOP}
    wanted = []
    for p in sorted(listing):
        if p in files or not p.startswith(folder + "/") or p.lower().endswith("readme.md"):
            continue
        if set(_words(p.rsplit("/", 1)[-1].rsplit(".", 1)[0])) & qwords:
            wanted.append(p)
    mpaths = [p for p in mentioned_paths(conv.question) if p not in files and ("read", p) not in done_kinds]
    reads = [p for p in wanted + mpaths if ("read", p) not in done_kinds][:4]
    if reads and not any(k in ("write", "copy", "append") for k, _ in done_kinds):
        return {"content": None,
                "tool_calls": [_tool_call(tools, Action("read", p), 100 + i, salt) for i, p in enumerate(reads)]}
    # step 3..: back up, write, log
    actions, summary, ctx = plan_outputs(conv, files, seed, has_copy=tools.has("copy"))
    log = ctx.rules.log
    if log is not None:
        line = log_line(ctx, summary)
        if tools.has("append"):
            actions.append(Action("append", log.path, line))
        else:
            actions.append(Action("write", log.path, files.get(log.path, "") + line))
    pending = [a for a in actions if (a.kind, a.path) not in done_kinds]
    if pending:
        first = pending[0]
        # a backup goes alone (it must happen before the write); writes go together
        batch = [first] if first.kind != "write" else [a for a in pending if a.kind == "write"]
        return {"content": None,
                "tool_calls": [_tool_call(tools, a, 200 + actions.index(a), salt) for a in batch]}
    wrote = ", ".join(a.path for a in actions if a.kind in ("write", "append"))
    return {"content": f"{LABEL} Done. {summary}. Files written: {wrote}. Rules followed: "
                       f"{ctx.rules.describe()}.", "tool_calls": None}


# --------------------------------------------------------------------------------------------
# The simulated judge
# --------------------------------------------------------------------------------------------

_NEG = re.compile(r"\b(incorrect|incorrectly|wrong|missing|missed|does not|doesn't|did not|not correctly|"
                  r"not correct|not right|not quite|not what|not the|is not|isn't|nope|"
                  r"not conform|not meet|not follow|violat\w*|issues?|fail\w*|must|requires?|should be|"
                  r"bad|forgot\w*|instead|(?:switch|change) (?:it |them )?to)\b", re.I)
# a reaction that opens with a refusal ("Nope.", "No: ...", "No, use ...") or asks for a fix
# ("Correct the time: ...", a request, not praise)
_OPENS_NEG = re.compile(r"^\W*(?:nope\b|no\s*[:.]|no,\s*use\b|"
                        r"correct\s+(?:the|this|that|these|those|it|its|your|my|them)\b)", re.I)
# "No, I asked for X", "No, it should ...": a refusal that says what was wanted ("No, that's
# fine", "No, all good" are not)
_OPENS_NO = re.compile(r"^\W*no\s*,\s*(?:i\s+(?:asked|said|wanted|meant|need(?:ed)?)\b|"
                       r"(?:it|that|this|they|you)\s+(?:should|must|needs?\s+to|"
                       r"(?:is|are|was|were)\s+(?:wrong|not)\b))", re.I)
# ... or with praise: "Correct!", "Perfect, thanks" (not "Correct the time: ...", a request)
_OPENS_POS = re.compile(r"^\W*(correct|all correct|excellent|perfect|great|well done)\b"
                        r"(?!\s+(?:the|this|that|these|those|it|its|your|my|them)\b)", re.I)
_POS = re.compile(r"\b(correct|correctly|perfect|excellent|properly|follows|complies|comply|compliant|"
                  r"success\w*|well done|looks good|works)\b", re.I)
_SECTION_RE = re.compile(r"^=== (.+?) ===$", re.M)


def prompt_sections(text: str) -> dict[str, str]:
    """``=== Title ===`` delimited sections of a judge or evolver prompt -> {title: text}."""
    parts = _SECTION_RE.split(text)
    return {parts[i]: parts[i + 1].strip("\n") for i in range(1, len(parts) - 1, 2)}


def feedback_of(next_user: str) -> str:
    """The user's reaction in a next user message: its opening remark when it has one, else the
    whole message when it is short."""
    remark, rest = split_feedback(next_user or "")
    if remark:
        return _LABEL_BLOCK.sub("", remark).strip()
    if len(rest) > 200 and _OPENS_NO.search(rest):
        return rest[:200]  # a long message that opens saying what was wanted reacts to it
    return rest if len(rest) <= 200 else ""   # a long unlabelled message is a new request


def feedback_score(text: str) -> int:
    """-1 when a feedback text reports a problem, +1 when it confirms success, 0 otherwise."""
    if not text.strip():
        return 0
    if _OPENS_NEG.search(text) or _OPENS_NO.search(text):
        return -1
    if _OPENS_POS.search(text):
        return 1
    if _NEG.search(text):
        return -1
    if _POS.search(text):
        return 1
    return 0


def judge_reply(body: dict) -> dict:
    """The simulated judge: ``{"score": -1|0|1, "rationale": "simulated judge: ..."}`` as JSON text.

    Scores from the evidence in the turn: the user's reaction in the prompt's ``Next user message
    (feedback)`` section; 0 when there is none.
    """
    messages = body.get("messages") or []
    prompt = content_text(next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), ""))
    fb = feedback_of(prompt_sections(prompt).get("Next user message (feedback)", ""))
    if not fb:
        out = {"score": 0, "rationale": "simulated judge: no reaction from the user follows this turn, "
                                        "so its outcome is unclear."}
    else:
        score = feedback_score(fb)
        word = {1: "confirms success", -1: "reports a problem", 0: "is neutral"}[score]
        out = {"score": score, "rationale": f"simulated judge: the user's reaction {word}: {fb[:200]}"}
    return {"content": json.dumps(out, ensure_ascii=False), "tool_calls": None}


# --------------------------------------------------------------------------------------------
# The simulated evolver
# --------------------------------------------------------------------------------------------

#: Skill names and categories per rule kind (the evolver's own vocabulary, not the task's).
SKILL_KINDS: dict[str, tuple[str, str, str]] = {
    "time": ("stated-time-format", "timestamps", "Time values"),
    "naming": ("stated-file-naming", "file-names", "Names of new files"),
    "header": ("stated-file-header", "file-headers", "Header fields in output files"),
    "backup": ("stated-backup-rule", "backups", "Backups before changing a file"),
    "log": ("stated-task-log", "task-log", "A log line after each task"),
}
_QUOTES_HEADER = "## What the user said"
_MAX_QUOTES = 4
_QUOTE_CHARS = 400


def skill_body(kind: str, quotes: list[str], trail: list[str] = ()) -> str:
    """The Markdown body of the simulated evolver's skill for one rule kind: the user's own
    sentences (verbatim, as block quotes, so every parameter comes from them) and what the failed
    turns did."""
    title = SKILL_KINDS[kind][2]
    lines = [f"# {title}: as the user stated them", "",
             "Follow the rule exactly as stated below, with the same formats and values.", "",
             _QUOTES_HEADER, ""]
    for q in quotes[:_MAX_QUOTES]:
        lines += [f"> {line}".rstrip() for line in q.strip().splitlines()] + [""]
    if trail:
        lines += ["## The failed turns", ""] + [f"- {t}" for t in list(trail)[:3]] + [""]
    lines += ["_Written by the simulated offline evolver from judged feedback (not a language model)._"]
    return "\n".join(lines)


def _quotes_in(body: str) -> list[str]:
    """The block quotes of a skill body written by :func:`skill_body`."""
    out, cur = [], []
    for line in body.splitlines() + [""]:
        if line.startswith(">"):
            cur.append(line[2:] if line.startswith("> ") else line[1:])
        elif cur:
            out.append("\n".join(cur))
            cur = []
    return out


def _trail(item: dict) -> str:
    """What a failed turn did, from its trajectory: the files its write-like calls touched."""
    written = []
    for line in str(item.get("tools") or "").splitlines():
        if line.startswith("call") and re.search(r"write|copy|append|move|edit", line.split("{")[0], re.I):
            # the key as each agent names it (file_path: Claude Code's; filePath: opencode's)
            written += re.findall(r"\"(?:path|dst|destination|target|file|file_?path|filePath)\""
                                  r"\s*:\s*\"([^\"]+)\"", line)
    task = str(item.get("task") or "").strip().splitlines()
    head = unwrap(task[-1] if task else "")[0][:100]  # (opencode quotes an ask)
    return f"turn {item.get('id')}: {head!r} -> wrote {', '.join(dict.fromkeys(written)) or 'nothing'}"


def evolver_reply(body: dict) -> dict:
    """The simulated evolver: ``{"operations": [...]}`` as JSON text.

    Reads the ``Support turns`` (failed turns with the user's feedback) and the ``Current skill
    library`` sections. Every feedback sentence that states a rule the simulated agent can read
    (:func:`metaclaw.offline.simrules.rule_sentences`) is quoted, verbatim, in the skill of its rule kind:
    a new skill, or an edit of the library's skill of that kind when the feedback adds something.
    Feedback that names a rule without stating it ("follow the naming rule") teaches nothing and
    writes nothing.
    """
    messages = body.get("messages") or []
    prompt = content_text(next((m.get("content") for m in reversed(messages)
                         if m.get("role") == "user" and not content_text(m.get("content")).startswith(
                             "Your previous reply was invalid")), ""))
    sections = prompt_sections(prompt)
    try:
        support = json.loads(sections.get("Support turns") or "[]")
        library = json.loads(sections.get("Current skill library") or "{}").get("skills", [])
    except (ValueError, AttributeError):
        support, library = [], []
    if not isinstance(support, list):
        support = []
    quotes: dict[str, list[str]] = {}
    evidence: dict[str, list[int]] = {}
    trails: dict[str, list[str]] = {}
    for item in support:
        if not isinstance(item, dict):
            continue
        fb = feedback_of(str(item.get("feedback") or ""))
        if feedback_score(fb) >= 0:
            continue
        fb = _LABEL_BLOCK.sub("", fb).strip()
        for kind, sent in rule_sentences(fb):
            if len(sent) > _QUOTE_CHARS:
                sent = sent[:_QUOTE_CHARS - 3].rsplit(" ", 1)[0] + "..."
            bucket = quotes.setdefault(kind, [])
            if sent not in bucket:
                bucket.append(sent)
            if isinstance(item.get("id"), int) and item["id"] not in evidence.setdefault(kind, []):
                evidence[kind].append(item["id"])
                trails.setdefault(kind, []).append(_trail(item))
    existing = {sk.get("name"): sk for sk in library if isinstance(sk, dict)} if isinstance(library, list) else {}
    ops = []
    for kind in KINDS:
        if kind not in quotes:
            continue
        name, category, title = SKILL_KINDS[kind]
        old = existing.get(name)
        if old is None:
            first = quotes[kind][0]
            ops.append({"op": "add", "name": name, "category": category,
                        "description": f"{title}, as the user stated: {first[:160]}",
                        "body": skill_body(kind, quotes[kind], trails.get(kind, [])),
                        "reason": f"simulated evolver: the feedback on {len(evidence.get(kind, []))} failed "
                                  f"turn(s) states this rule",
                        "evidence": evidence.get(kind, [])})
            continue
        known = _quotes_in(str(old.get("body", "")))
        new_quotes = [q for q in quotes[kind] if q not in known]
        if not new_quotes:
            continue
        merged = (new_quotes + known)[:_MAX_QUOTES]
        ops.append({"op": "edit", "name": name, "description": str(old.get("description") or title),
                    "category": str(old.get("category") or category),
                    "body": skill_body(kind, merged, trails.get(kind, [])),
                    "reason": "simulated evolver: the rule was missed again; the skill now quotes the new "
                              "feedback",
                    "evidence": evidence.get(kind, [])})
    return {"content": json.dumps({"operations": ops}, ensure_ascii=False), "tool_calls": None}


# --------------------------------------------------------------------------------------------
# Routing and serving
# --------------------------------------------------------------------------------------------

def sim_reply(body: dict, seed: int = DEFAULT_SEED) -> dict:
    """Route a chat request body by its ``model`` -> ``{"content", "tool_calls"}``."""
    if not isinstance(body, dict):
        body = {}
    messages = body.get("messages")
    body = {**body, "messages": [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []}
    model = str(body.get("model") or "sim-agent").lower()
    if "judge" in model:
        return judge_reply(body)
    if "evolver" in model:
        return evolver_reply(body)
    return agent_reply(body, seed)


def sim_model_server(host: str = "127.0.0.1", port: int = 0, seed: int = DEFAULT_SEED):
    """The simulated model server, not started: a :class:`metaclaw.offline.double.DoubleServer` whose
    replies are :func:`sim_reply` of each request and whose ``/v1/models`` lists
    :data:`SIM_MODELS`. Call ``.start()`` (background) or ``.serve_forever()`` (blocking, CLI)."""
    from metaclaw.offline.double import DoubleServer, Reply

    def respond(body: dict) -> Reply:
        out = sim_reply(body, seed)
        return Reply(content=out["content"], tool_calls=out["tool_calls"])

    return DoubleServer(respond, host=host, port=port, models=SIM_MODELS)


def serve_sim_model(host: str = "127.0.0.1", port: int = 0, seed: int = DEFAULT_SEED):
    """Start the simulated model server in the background and return it (started).

    In: bind address (port 0 = any free port). Out: a started :class:`metaclaw.offline.double.DoubleServer`;
    ``.url`` is the base URL (``http://host:port/v1``), ``.stop()`` ends it.
    """
    return sim_model_server(host, port, seed).start()
