"""Edit a JSON, JSONC or JSON5 text in place: set or remove keys, keeping everything else as it
was (comments, key order, layout, quoting), so that a configuration file a person wrote by hand
stays theirs after a tool changes two keys in it.

:func:`set_keys` locates each key path in the text (an object's members are scanned with their
spans; strings, comments and JSON5's unquoted keys, single quotes and trailing commas are
understood) and splices: a value that exists is replaced, a missing member is added after the
object's last member at its indentation, a missing parent object is added with it, and a member
to remove goes with its comma and its line. New values are written as JSON, which JSONC and
JSON5 accept. It returns None where it cannot edit in place (the text is not one object, or a
parent on the path holds something other than an object): the caller then writes the whole
file instead.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple, Sequence

#: Value of a change that removes the key.
DELETE = object()

_SPACE = re.compile(r"(?:\s+|//[^\n]*|/\*.*?\*/)*", re.S)
_STRING = {'"': re.compile(r'"(?:[^"\\]|\\.)*"', re.S), "'": re.compile(r"'(?:[^'\\]|\\.)*'", re.S)}
_ATOM = re.compile(r"[^\s,:\]}/]+")  # numbers, literals, JSON5's unquoted keys


class _Member(NamedTuple):
    key: str
    start: int  # the key's first character
    value: tuple[int, int]  # the value's span
    comma: int | None  # the comma after the value, where there is one


class _Object(NamedTuple):
    open: int  # the '{'
    close: int  # the '}'
    members: list[_Member]


class _Unreadable(ValueError):
    pass


def _skip(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def _token(text: str, i: int) -> int:
    """The end of the string or atom at ``i``."""
    pattern = _STRING.get(text[i:i + 1], _ATOM)
    found = pattern.match(text, i)
    if not found:
        raise _Unreadable(f"unexpected {text[i:i + 1]!r} at {i}")
    return found.end()


def _value(text: str, i: int) -> tuple[int, int]:
    """The span of the value starting at ``i`` (nested containers skipped whole)."""
    if text[i:i + 1] not in "{[":
        return i, _token(text, i)
    start, depth = i, 0
    while i < len(text):
        i = _skip(text, i)
        char = text[i:i + 1]
        if char in "{[":
            depth += 1
            i += 1
        elif char in "}]":
            depth -= 1
            i += 1
            if depth == 0:
                return start, i
        elif char in ",:":
            i += 1
        elif char:
            i = _token(text, i)
    raise _Unreadable("unclosed container")


def loads(text: str) -> Any:
    """The value ``text`` holds, read as JSON where it is (the JSON5 parser is slow on big
    files), else as JSON5 (comments, trailing commas, ...)."""
    try:
        return json.loads(text)
    except ValueError:
        import json5

        return json5.loads(text)


def _key(token: str) -> str:
    return loads(token) if token[:1] in "\"'" else token


def _object(text: str, i: int) -> _Object:
    """The object whose '{' is at ``i``, with its members' spans."""
    if text[i:i + 1] != "{":
        raise _Unreadable("not an object")
    members, j = [], _skip(text, i + 1)
    while text[j:j + 1] != "}":
        if not text[j:j + 1]:
            raise _Unreadable("unclosed object")
        key_end = _token(text, j)
        colon = _skip(text, key_end)
        if text[colon:colon + 1] != ":":
            raise _Unreadable(f"no ':' after the key at {j}")
        value = _value(text, _skip(text, colon + 1))
        after = _skip(text, value[1])
        comma = after if text[after:after + 1] == "," else None
        members.append(_Member(_key(text[j:key_end]), j, value, comma))
        j = _skip(text, after + 1) if comma is not None else after
        if comma is None and text[j:j + 1] != "}":
            raise _Unreadable(f"no ',' after the value at {value[0]}")
    return _Object(i, j, members)


def _line_start(text: str, i: int) -> int:
    return text.rfind("\n", 0, i) + 1


def _alone(text: str, i: int) -> bool:
    """Whether only spaces come before ``i`` on its line."""
    return not text[_line_start(text, i):i].strip()


def _indent_unit(text: str) -> str:
    found = re.search(r"^([ \t]+)\S", text, re.M)
    return found.group(1) if found else "  "


def _dumps(value: Any, indent: str, unit: str, compact: bool) -> str:
    if compact:
        return json.dumps(value, ensure_ascii=False)
    width: Any = len(unit) if set(unit) == {" "} else unit
    return json.dumps(value, indent=width, ensure_ascii=False).replace("\n", "\n" + indent)


def _nest(keys: Sequence[str], value: Any) -> Any:
    for key in reversed(keys):
        value = {key: value}
    return value


def _insert(text: str, obj: _Object, key: str, value: Any, unit: str) -> str:
    """``text`` with the member ``key: value`` added after ``obj``'s last member (on one line
    where the object's members are, else on lines of their own, ending as the file's do)."""
    last = obj.members[-1] if obj.members else None
    compact = last is not None and "\n" not in text[obj.open:obj.close]
    newline = "\r\n" if "\r\n" in text else "\n"
    if last is not None and _alone(text, last.start):
        indent = text[_line_start(text, last.start):last.start]
    else:
        indent = text[_line_start(text, obj.open):obj.open]
        indent = indent[:len(indent) - len(indent.lstrip())] + unit
    member = f"{json.dumps(key, ensure_ascii=False)}: {_dumps(value, indent, unit, compact)}"
    member = member.replace("\n", newline)
    if last is not None and last.comma is not None:  # a trailing comma: the file's style
        member += ","
    if compact:
        glue = ", " if last is not None and last.comma is None else " " if last else ""
        return text[:obj.close].rstrip() + glue + member + text[obj.close:]
    if _alone(text, obj.close):  # the '}' on a line of its own: the member goes on the line above
        at = _line_start(text, obj.close)
        text = text[:at] + indent + member + newline + text[at:]
    else:
        closing = text[_line_start(text, obj.open):obj.open]
        closing = closing[:len(closing) - len(closing.lstrip())]
        text = text[:obj.close] + newline + indent + member + newline + closing + \
            text[obj.close:]
    if last is not None and last.comma is None:
        text = text[:last.value[1]] + "," + text[last.value[1]:]
    return text


def _remove(text: str, obj: _Object, index: int) -> str:
    member = obj.members[index]
    start, end = member.start, member.value[1]
    if member.comma is not None:
        end = member.comma + 1
    elif index > 0:  # the last member: the comma before it goes instead
        before = obj.members[index - 1]
        if before.comma is not None:
            text = text[:before.comma] + text[before.comma + 1:]
            start, end = start - 1, end - 1
    if _alone(text, start):
        line_end = re.match(r"[ \t]*(?:\r?\n)?", text[end:])
        if text[end:end + line_end.end()].strip() == "" and (
                line_end.group().endswith("\n") or end + line_end.end() == len(text)):
            start, end = _line_start(text, start), end + line_end.end()
    return text[:start] + text[end:]


def set_keys(text: str, changes: Sequence[tuple[Sequence[str], Any]]) -> str | None:
    """``text`` with each ``(keys, value)`` of ``changes`` made in turn: ``config[k1][k2]... =
    value``, or the key removed where ``value`` is :data:`DELETE` (nothing to do where it is
    absent). None where the text cannot be edited in place (see the module docstring)."""
    unit = _indent_unit(text)
    try:
        for keys, value in changes:
            obj = _object(text, _skip(text, 0))
            if _skip(text, obj.close + 1) != len(text):
                return None
            for depth, key in enumerate(keys):
                found = [i for i, m in enumerate(obj.members) if m.key == key]
                last = depth == len(keys) - 1
                if not found:
                    if value is not DELETE:
                        text = _insert(text, obj, key, _nest(keys[depth + 1:], value), unit)
                    break
                member = obj.members[found[-1]]  # the one a parser keeps
                if last and value is DELETE:
                    text = _remove(text, obj, found[-1])
                elif last:
                    start, end = member.value
                    indent = text[_line_start(text, member.start):member.start]
                    indent = indent if not indent.strip() else ""
                    newline = "\r\n" if "\r\n" in text else "\n"
                    text = text[:start] + _dumps(value, indent, unit, False).replace(
                        "\n", newline) + text[end:]
                else:
                    if text[member.value[0]] != "{":
                        return None
                    obj = _object(text, member.value[0])
                    continue
                break
    except (_Unreadable, ValueError):
        return None
    return text
