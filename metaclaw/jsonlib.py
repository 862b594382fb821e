"""The one JSON library of the request path: orjson (faster than the standard library at both
ends), with the standard library as the fallback for the rare values orjson
refuses (integers beyond 64 bits and dictionary keys that are not strings to write, escaped lone
surrogates to read).

Written JSON is compact UTF-8 (no ASCII escaping, no spaces), the same text
``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` gives, except that a float NaN or
infinity (which JSON cannot carry) is written as ``null`` rather than as the invalid ``NaN``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

#: A lone UTF-16 surrogate (half an emoji, from a JSON escape such as ``"\\ud83d"``): Python
#: text can hold one, UTF-8 files and SQLite cannot.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

#: Raised by :func:`loads` for text that is not JSON (a ``ValueError``).
JSONDecodeError = orjson.JSONDecodeError


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON (``ValueError`` for invalid JSON, NaN or Infinity included).

    What orjson refuses but JSON allows (an escaped lone surrogate, ``"\\ud800"``) is read by
    the standard library instead."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data, parse_constant=_no_constant)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def dumpb(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits, a non-string key, a lone surrogate
        return _stdlib_dumps(value).encode()


def dumps(value: Any) -> str:
    """``value`` as compact JSON text."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _stdlib_dumps(value)


def _stdlib_dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


#: Characters that JSON leaves raw but that ``str.splitlines()`` (a common way to read JSON
#: Lines) treats as line ends, splitting a record.
_LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}
_LINE_BREAK = re.compile("[\u2028\u2029\x85]")


def jsonl_line(record: Any) -> str:
    """One JSON Lines record (``json.dumps`` text, UTF-8 kept readable) ending in ``\\n``, with
    every other line-ending character escaped: a reader splitting on any line end gets one
    record per line."""
    text = json.dumps(record, ensure_ascii=False)
    return _LINE_BREAK.sub(lambda m: _LINE_BREAKS[m.group()], text) + "\n"
