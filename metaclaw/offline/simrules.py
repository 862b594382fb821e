"""The rules the SIMULATED agent can follow, and how it reads them from its context.

The simulated agent (:mod:`metaclaw.offline.simmodel`) is a capable but uninformed worker: it knows how to
read and write files, build JSON / Markdown / CSV / Python from a request, format a date, copy a
file and append a line, but it knows no workplace convention. It follows a convention only when a
text in its context states it: the system prompt (context files and injected skills) or what the
user said earlier in the conversation (feedback on earlier answers). Every parameter of a rule is
taken from that text, usually from an example; nothing is built in.

Five kinds of rule can be read (:func:`read_rules`; each reader looks at one sentence or one
example at a time):

``time`` -- a timestamp format. Read from an example date-time literal in a sentence about time,
    dates or formats (``... written as 2026-07-09T14:30:00+05:00``, ``format like `09.07.2026 14:30
    UTC-3```). The example becomes a ``strftime`` pattern: the digits are matched to year, month,
    day, hour, minute and second; separators, a ``T``, and the zone suffix (``Z``, ``+hh:mm``,
    ``UTC-3``) are kept literally. A placeholder in the clock's place (``<time>``, ``<hh:mm>``)
    stands for ``HH:MM:SS`` (``HH:MM`` when it shows one colon). Once known, every
    time value the agent writes uses it; without it the agent writes ``2026-07-09 14:30``.
``naming`` -- a file-name pattern for new files. Read from a pattern or an example in a sentence
    about names (``named like `20260709_stock_report.json```, ``use `<description>-2026-07-09.md```,
    ``(20260709_*.csv)``): where the date goes (prefix or suffix), its format (8 digits or
    year-month-day letters style, with the example's separators), the separator between date and
    description, and the word separator and case of the description.
``header`` -- a metadata header that files of one type must carry, copied from an example in the
    text: a YAML front matter block (``--- key: value ... ---``) for Markdown, a top-level JSON
    object (``{"info": {"key": ...}}``) for JSON, a titled section in a Python module docstring
    (``Meta:`` followed by ``key: value`` lines), a first-line comment with ``key=value`` pairs for
    CSV. Keys and literal values are kept; a value that looks like a timestamp (or is a
    placeholder for one) is filled with the current time in the known time format.
``backup`` -- copy a file before changing it. Read from a sentence that says to back up / copy
    before modifying, with the backup's name as an example (``a.md.bak``, ``<file>.orig``): the
    suffix is what the example adds to a file name.
``log`` -- append a line to a file after each task. Read from a sentence that says to append /
    log / record a line to a named file, with the line given as a template or an example in
    backticks (``[OK] <time> | <id> | <summary>``). Fields of the line are filled by their
    look: a timestamp -> now, a ``<..id..>`` placeholder or a word_with_underscores -> a short task id, the
    rest -> a summary of what was done (cut to "at most N characters" when the text says so).

What it cannot do is as important: it does not guess a rule from a rule's name ("follow the naming
convention" alone teaches nothing), does not remember across conversations, and reads one rule
of each kind (the most often stated, the latest on a tie).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter
from dataclasses import dataclass, field

KINDS = ("time", "naming", "header", "backup", "log")

_TIME_WORDS = re.compile(r"\b(time|times|timestamp\w*|date|dates|datetime\w*|format\w*|"
                         r"(?:recorded|written|stored|given) as|"
                         r"should be|must be|e\.g\.|example|like|offset|zone)\b", re.I)
_NAME_WORDS = re.compile(r"\b(name|names|named|naming|filename\w*|file name\w*|files?|format|"
                         r"e\.g\.|example|should use|must use)\b", re.I)
_BACKUP_WORDS = re.compile(r"\b(back\s*up|backup|back it up|copy)\b", re.I)
_BEFORE_CHANGE = re.compile(r"\b(before|prior to)\b[^.]*\b(modif\w*|chang\w*|edit\w*|updat\w*|"
                            r"refactor\w*|touch\w*|overwrit\w*)", re.I)
_LOG_WORDS = re.compile(r"\b(append\w*|log|record|add)\b[^.]*\b(line|entry|entries|row)\b|"
                        r"\b(append\w*)\b", re.I)

# A date-time literal: year-first (2026-07-09T14:30:00.000+05:00, 2026/07/09 14:30) or day-first
# (09.07.2026 14:30), with an optional zone suffix; a placeholder (<time>, <hh:mm:ss>) may stand
# for the clock time, whatever the text calls it.
_PLACEHOLDER = r"<(?:[\w .\-]*(?<![a-z])(?:time|clock|now)(?![a-z])[\w .\-]*|[hHmMsS]{1,2}(?::[hHmMsS]{1,2}){1,2})>"
_CLOCK = r"(?:\d{1,2}:\d{2}(?::\d{2})?(?:\.\d+)?|" + _PLACEHOLDER + ")"
_ZONE = r"(?:Z|\s?(?:UTC|GMT)?[+-]\d{1,2}(?::?\d{2})?)?"
DATETIME_RE = re.compile(r"(?<![\w-])(?:\d{4}[-/.]\d{1,2}[-/.]\d{1,2}|\d{1,2}[-/.]\d{1,2}[-/.]\d{4})"
                         r"(?:[T ]|, )" + _CLOCK + _ZONE + r"(?![\w:])")


# --------------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimeFormat:
    """A timestamp format learned from an example: ``strftime`` pattern + a validator."""

    pattern: str          # e.g. "%Y-%m-%dT%H:%M:%S+02:00"
    example: str

    def format(self, when: dt.datetime) -> str:
        return when.strftime(self.pattern)

    @property
    def regex(self) -> re.Pattern:
        out = ""
        i = 0
        p = self.pattern
        while i < len(p):
            if p[i] == "%" and i + 1 < len(p):
                code = p[i + 1]
                out += {"Y": r"\d{4}", "m": r"\d{2}", "d": r"\d{2}", "H": r"\d{2}", "M": r"\d{2}"}.get(
                    code, r"\d{2}(?:\.\d+)?" if code == "S" else re.escape(p[i:i + 2]))
                i += 2
            else:
                out += re.escape(p[i])
                i += 1
        return re.compile("^" + out + "$")

    def matches(self, value: str) -> bool:
        return bool(self.regex.match(value.strip()))


def time_format_of(example: str) -> TimeFormat | None:
    """An example date-time literal -> its :class:`TimeFormat` (None if it is not one)."""
    text = example.strip()
    m = re.match(r"(\d{1,4})([-/.])(\d{1,2})\2(\d{1,4})([T ]|, )(.*)$", text)
    if not m:
        return None
    a, sep, b, c, between, rest = m.groups()
    if len(a) == 4:
        date = f"%Y{sep}%m{sep}%d"
    elif len(c) == 4:
        # day-first unless the first number cannot be a day-of-month position (then month-first)
        date = f"%d{sep}%m{sep}%Y" if int(b) <= 12 else f"%m{sep}%d{sep}%Y"
    else:
        return None
    cm = re.match(r"(" + _PLACEHOLDER + r"|\d{1,2}:\d{2}(:\d{2})?)(\.\d+)?(.*)$", rest)
    if not cm:
        return None
    placeholder = cm.group(1).startswith("<")
    clock = "%H:%M:%S" if (cm.group(1).count(":") != 1 if placeholder else cm.group(2)) else "%H:%M"
    zone = cm.group(4).replace("%", "%%")
    return TimeFormat(date + between.replace("%", "%%") + clock + zone, text)


def _sentences(text: str) -> list[str]:
    """Sentences and list items of a text; code fences and backticked spans are kept whole."""
    out, buf, fence = [], [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fence = not fence
        if fence or line.strip().startswith("```"):
            buf.append(line)
            continue
        if not line.strip() or re.match(r"^\s*([-*]|\d+[.)]|#+)\s", line):
            if buf:
                out.append("\n".join(buf))
            buf = [line] if line.strip() else []
            continue
        buf.append(line)
    if buf:
        out.append("\n".join(buf))
    pieces: list[str] = []
    for block in out:
        if "```" in block:
            pieces.append(block)
            continue
        pieces += [p for p in re.split(r"(?<=[.!?;])(?<!e\.g\.)(?<!i\.e\.)\s+(?=[A-Z(`'\"\[])", block) if p.strip()]
    return [p.strip() for p in pieces if p.strip()]


def read_time(sentence: str) -> list[TimeFormat]:
    if not _TIME_WORDS.search(sentence):
        return []
    out = []
    for m in DATETIME_RE.finditer(sentence):
        tf = time_format_of(m.group(0))
        # a format with a zone is a convention; a bare "2026-07-01 08:00:00" is just a value
        if tf and re.search(r"(Z|[+-]\d{1,2}(:?\d{2})?)$", tf.example):
            out.append(tf)
    return out


# --------------------------------------------------------------------------------------------
# naming
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NamePattern:
    """A file-name pattern: date (format, prefix or suffix), joiner, word separator, case."""

    date_format: str | None     # strftime of the date part, None when names carry no date
    date_first: bool = True
    joiner: str = "_"           # between the date and the description
    word_sep: str = "_"
    lower: bool = True
    example: str = ""

    def name(self, words: list[str], ext: str, today: dt.date) -> str:
        desc = self.word_sep.join(w.lower() if self.lower else w for w in words if w) or "output"
        if not self.date_format:
            return f"{desc}.{ext.lower()}"
        date = today.strftime(self.date_format)
        stem = f"{date}{self.joiner}{desc}" if self.date_first else f"{desc}{self.joiner}{date}"
        return f"{stem}.{ext.lower() if self.lower else ext}"

    @property
    def regex(self) -> re.Pattern:
        word = r"[a-z0-9]+" if self.lower else r"[A-Za-z0-9]+"
        desc = f"{word}(?:{re.escape(self.word_sep)}{word})*"
        if not self.date_format:
            return re.compile(f"^{desc}\\.[a-z0-9]+$")
        date = re.escape(self.date_format)
        for code, rx in (("%Y", r"\d{4}"), ("%m", r"\d{2}"), ("%d", r"\d{2}")):
            date = date.replace(re.escape(code), rx)
        joiner = re.escape(self.joiner)
        stem = f"{date}{joiner}{desc}" if self.date_first else f"{desc}{joiner}{date}"
        return re.compile(f"^{stem}\\.[a-z0-9]+$")

    def matches(self, filename: str) -> bool:
        return bool(self.regex.match(filename.rsplit("/", 1)[-1]))


# The date part of a name: letters (a year of four Y, a month of two M, a day of two D, in any
# order, with one separator) or digits (year first or year last, one separator or none).
_Y, _M, _D = "Y" * 4, "M" * 2, "D" * 2
_LETTER_DATE = rf"(?:{_Y}|{_M}|{_D})([-_.]?)(?:{_Y}|{_M}|{_D})\1(?:{_Y}|{_M}|{_D})"
_DIGIT_DATE = r"\d{4}([-_.]?)\d{2}\2\d{2}|\d{2}([-_.]?)\d{2}\3\d{4}"
_DATE_PART = re.compile(rf"{_LETTER_DATE}|{_DIGIT_DATE}")
_NAME_TOKEN = re.compile(r"(?<![\w/.-])([\w<>*\-]+\.(?:[a-z0-9]{1,5}|ext|<ext>))(?![\w])", re.I)


def _date_format(part: str) -> str | None:
    """'YYYY-MM-DD' / '20260709' / '09.07.2026' -> strftime ('%Y-%m-%d', '%Y%m%d', '%d.%m.%Y')."""
    if part[0].isalpha():
        return part.replace(_Y, "%Y").replace(_M, "%m").replace(_D, "%d")
    digits = re.sub(r"\D", "", part)
    sep = re.sub(r"\d", "", part)[:1]
    fmt = f"%Y{sep}%m{sep}%d" if re.match(r"\d{4}", part) else f"%d{sep}%m{sep}%Y"
    try:
        dt.datetime.strptime(part, fmt)
    except ValueError:
        return None
    return fmt if len(digits) == 8 else None


def name_pattern_of(token: str, sentence: str = "") -> NamePattern | None:
    """A file name or pattern (``20260709_stock_report.json``, ``<desc>-2026-07-09.md``) -> pattern."""
    stem = token.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    for m in _DATE_PART.finditer(stem):
        fmt = _date_format(m.group(0))
        if fmt is None:
            continue
        before, after = stem[:m.start()], stem[m.end():]
        if before and after or not (before or after):
            continue          # the date must be a prefix or a suffix of a longer name
        first = not before
        rest = after if first else before
        joiner = rest[0] if rest[0] in "_-." else ""
        words = re.sub(r"[<>*]", "", rest.strip("_-."))
        low = sentence.lower()
        if "kebab" in low or ("-" in words and "_" not in words):
            sep = "-"
        elif "camel" in low:
            sep = ""
        else:
            sep = "_" if "_" in words or "snake" in low or not words else joiner or "_"
        lower = not re.search(r"[A-Z]", words) or "lower" in low
        return NamePattern(fmt, first, joiner or sep, sep, lower, token)
    return None


def read_naming(sentence: str) -> list[NamePattern]:
    if not _NAME_WORDS.search(sentence):
        return []
    out = []
    for m in _NAME_TOKEN.finditer(sentence):
        p = name_pattern_of(m.group(1), sentence)
        if p:
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------
# header
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    """A metadata header for one file type, copied from an example."""

    ext: str                                   # md | json | py | csv
    fields: tuple[tuple[str, str], ...]        # (key, example value)
    container: str = ""                        # JSON: top-level key; Python: section title
    example: str = ""

    def values(self, now_text: str) -> list[tuple[str, str]]:
        """The fields with timestamps (and placeholders for one) replaced by ``now_text``."""
        out = []
        for key, value in self.fields:
            if DATETIME_RE.fullmatch(value.strip()) or _TIME_PLACEHOLDER.fullmatch(value.strip()):
                value = now_text
            out.append((key, value))
        return out


# a placeholder that names a time on its own ("<time>", "<now>", "<created timestamp>")
_TIME_PLACEHOLDER = re.compile(r"<[^<>]*(?<![a-z])(time|date|datetime|timestamp|now)(?![a-z])[^<>]*>", re.I)
_KV = re.compile(r"([A-Za-z_][\w-]*)\s*:\s*(\"[^\"]*\"|[^\s\"]+)")


def _pairs(block: str, sep: str = ":") -> list[tuple[str, str]]:
    if sep == "=":
        return [(k, v.strip('"').rstrip("`.,;")) for k, v in
                re.findall(r"([A-Za-z_][\w-]*)=(\"[^\"]*\"|\S+)", block)]
    return [(k, v.strip('"')) for k, v in _KV.findall(block)]


def read_header(sentence: str) -> list[Header]:
    out: list[Header] = []
    low = sentence.lower()
    for m in re.finditer(r"(?<!-)---\s+(.+?)\s+---(?!-)", sentence, re.S):   # YAML front matter
        pairs = _pairs(m.group(1))
        if len(pairs) >= 2:
            out.append(Header("md", tuple(pairs), "", m.group(0)))
    for m in re.finditer(r"\{\s*\"([\w-]+)\"\s*:\s*(\{[^{}]*\})", sentence):   # JSON top-level object
        try:
            inner = json.loads(m.group(2))
        except ValueError:
            continue
        if isinstance(inner, dict) and len(inner) >= 2:
            out.append(Header("json", tuple((str(k), str(v)) for k, v in inner.items()), m.group(1),
                              m.group(0)))
    if "docstring" in low:   # a titled section in a Python module docstring
        m = re.search(r"\b([A-Z][\w ]{0,20}):\s+((?:[A-Za-z_][\w-]*:\s*\S+\s*){2,})", sentence)
        if m:
            out.append(Header("py", tuple(_pairs(m.group(2))), m.group(1), m.group(0)))
    m = re.search(r"(#\s*[\w-]+:\s*(?:[A-Za-z_][\w-]*=\S+\s*){2,})", sentence)   # CSV comment line
    if m and ("csv" in low or "comment" in low):
        title = re.match(r"#\s*([\w-]+):", m.group(1)).group(1)
        out.append(Header("csv", tuple(_pairs(m.group(1), "=")), title, m.group(1).strip().rstrip("`")))
    return out


# --------------------------------------------------------------------------------------------
# backup
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backup:
    suffix: str          # appended to the file name: ".bak", ".orig", "~"
    example: str = ""


def read_backup(sentence: str) -> list[Backup]:
    if not (_BEFORE_CHANGE.search(sentence) and (_BACKUP_WORDS.search(sentence) or
                                                 re.search(r"\b(create|make|keep)\b", sentence, re.I))):
        return []
    out = []
    for m in re.finditer(r"(?<![\w/])([\w<>/.-]+?\.[a-z0-9]{1,5})(\.[a-z0-9]{2,5}|~)(?![\w])", sentence, re.I):
        base = m.group(1)
        if "<" in base or sentence.count(base) >= 2:   # "before changing a.md, copy it to a.md.bak"
            out.append(Backup(m.group(2), m.group(0)))
    if not out:
        m = re.search(r"\ba\s+(\.[a-z0-9]{2,5}|~)\s+(copy|file|backup)\b", sentence, re.I)
        if m:
            out.append(Backup(m.group(1), m.group(0)))
    return out


# --------------------------------------------------------------------------------------------
# log
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogLine:
    """Append one line per finished task to ``path``; ``fields`` is the line's template split on
    its separator (each field: ``time``, ``id``, ``summary`` or a literal)."""

    path: str
    prefix: str
    fields: tuple[str, ...]
    sep: str = " | "
    max_summary: int | None = None
    example: str = ""

    def line(self, now_text: str, ident: str, summary: str) -> str:
        if self.max_summary and len(summary) > self.max_summary:
            summary = summary[:self.max_summary - 3].rsplit(" ", 1)[0] + "..."
        parts = [{"time": now_text, "id": ident, "summary": summary}.get(f, f) for f in self.fields]
        return (self.prefix + self.sep.join(parts)).rstrip() + "\n"


def _field_kind(text: str) -> str:
    t = text.strip()
    if DATETIME_RE.fullmatch(t) or _TIME_PLACEHOLDER.fullmatch(t):
        return "time"
    if re.fullmatch(r"<[^>]*(id|name|task)[^>]*>", t, re.I) or re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", t):
        return "id"
    if t.startswith("<") or len(t.split()) >= 2:
        return "summary"
    return t


def read_log(sentence: str) -> list[LogLine]:
    if not _LOG_WORDS.search(sentence):
        return []
    fm = re.search(r"\b(?:to|in|into)\s+`?([\w./-]+\.(?:log|txt|md|csv))`?", sentence) or \
        re.search(r"(?<![\w/.-])`?([\w./-]+\.(?:log|txt))`?(?!\w)", sentence)
    if not fm:
        return []
    spans = re.findall(r"`([^`\n]{6,200})`", sentence)
    template = next((s for s in spans if re.search(r"\s?[|;,]\s|\s-\s|<\w+>", s) and s != fm.group(1)), None)
    if template is None:
        return []
    sep = next((s for s in (" | ", " ; ", "; ", " - ", ", ") if s in template), " ")
    prefix_m = re.match(r"^(\[[^\]]+\]\s*|[A-Z]{2,}:?\s+)", template)
    prefix = prefix_m.group(1) if prefix_m else ""
    body = template[len(prefix):]
    # a bracketed prefix ("[OK] <time> | ...") keeps its space
    fields = tuple(_field_kind(p) for p in body.split(sep.strip() if sep != " " else " ") if p.strip())
    cap = re.search(r"(?:at most|max(?:imum)?|up to|<=?)\s*(\d{2,3})\s*(?:char|characters)", sentence, re.I)
    return [LogLine(fm.group(1), prefix, fields, sep, int(cap.group(1)) if cap else None, template)]


# --------------------------------------------------------------------------------------------
# all rules
# --------------------------------------------------------------------------------------------

@dataclass
class Rules:
    """What the agent has read: at most one rule of each kind, plus the sentences it came from."""

    time: TimeFormat | None = None
    naming: NamePattern | None = None
    headers: dict[str, Header] = field(default_factory=dict)     # by file extension
    backup: Backup | None = None
    log: LogLine | None = None
    sources: dict[str, list[str]] = field(default_factory=dict)  # kind -> sentences

    @property
    def kinds(self) -> set[str]:
        found = {k for k in ("time", "naming", "backup", "log") if getattr(self, k) is not None}
        return found | ({"header"} if self.headers else set())

    def describe(self) -> str:
        parts = []
        if self.time:
            parts.append(f"time format like {self.time.example}")
        if self.naming:
            parts.append(f"new file names like {self.naming.example}")
        for ext, h in sorted(self.headers.items()):
            parts.append(f"a header in .{ext} files ({', '.join(k for k, _ in h.fields)})")
        if self.backup:
            parts.append(f"a {self.backup.suffix} copy before changing a file")
        if self.log:
            parts.append(f"a line appended to {self.log.path} after each task")
        return "; ".join(parts) or "none"


def _pick(items: list, key) -> object | None:
    if not items:
        return None
    counts = Counter(key(i) for i in items)
    best = max(counts.values())
    return next(i for i in reversed(items) if counts[key(i)] == best)


def rule_sentences(text: str) -> list[tuple[str, str]]:
    """(kind, sentence) for every sentence of ``text`` that states a rule the agent can read."""
    out = []
    for s in _sentences(text):
        for kind, reader in (("time", read_time), ("naming", read_naming), ("header", read_header),
                             ("backup", read_backup), ("log", read_log)):
            if reader(s):
                out.append((kind, s))
    return out


def read_rules(text: str) -> Rules:
    """Every rule stated in ``text`` (system prompt, skills, earlier user messages)."""
    rules = Rules()
    times, names, backups, logs, headers = [], [], [], [], []
    for s in _sentences(text):
        found = False
        for reader, bucket, kind in ((read_time, times, "time"), (read_naming, names, "naming"),
                                     (read_header, headers, "header"), (read_backup, backups, "backup"),
                                     (read_log, logs, "log")):
            got = reader(s)
            if got:
                bucket += got
                rules.sources.setdefault(kind, []).append(s)
                found = True
        del found
    rules.time = _pick(times, lambda t: t.pattern)
    rules.naming = _pick(names, lambda n: (n.date_format, n.date_first, n.joiner, n.word_sep, n.lower))
    rules.backup = _pick(backups, lambda b: b.suffix)
    rules.log = _pick(logs, lambda l: (l.path, l.prefix, l.fields))
    for ext in {h.ext for h in headers}:
        rules.headers[ext] = _pick([h for h in headers if h.ext == ext], lambda h: h.fields)
    return rules
