"""Editing JSON, JSONC and JSON5 texts in place (:mod:`metaclaw.jsontext`): the keys change as
asked and nothing else does (comments, order, layout), on texts drawn by hypothesis."""

import copy
import json

import json5
from hypothesis import given, settings, strategies as st

from metaclaw.jsontext import DELETE, loads, set_keys

KEYS = st.sampled_from(["model", "env", "provider", "a", "b", "metaclaw", "x-y", "ÿ"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text("ab \"'\\/*,:{}", max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)), max_leaves=8)
DOCUMENTS = st.dictionaries(KEYS, VALUES, max_size=5)


@st.composite
def written(draw, value, owner="", depth=0):
    """``value`` written as a person might: JSON5 keys bare or quoted, comments, trailing
    commas, one line or many; returns the text and its comments, each named after the top-level
    key it is written inside ("" for the top level's own)."""
    comments = []

    def comment():
        if not draw(st.booleans()):
            return ""
        text = f"c{draw(st.integers(0, 10**6))}@{owner}"
        comments.append(text)
        return draw(st.sampled_from([f" // {text}\n", f" /* {text} */ "]))

    if isinstance(value, dict):
        one_line = draw(st.booleans())
        pad = "\n" + "  " * (depth + 1) if not one_line else " "
        parts = []
        for key, item in value.items():
            key_text = key if key.isidentifier() and draw(st.booleans()) else json.dumps(key)
            inner, more = draw(written(item, owner or key, depth + 1))
            comments.extend(more)
            parts.append(f"{pad}{comment()}{key_text}: {inner}")
        trailing = "," if parts and draw(st.booleans()) else ""
        end = "\n" + "  " * depth if not one_line else " "
        return "{" + ",".join(parts) + trailing + comment() + end + "}", comments
    if isinstance(value, list):
        parts = []
        for item in value:
            inner, more = draw(written(item, owner, depth + 1))
            comments.extend(more)
            parts.append(inner)
        return "[" + ", ".join(parts) + "]", comments
    return json.dumps(value, ensure_ascii=False), comments


PATHS = st.lists(KEYS, min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_keys_change_and_the_comments_stay(data):
    document = data.draw(DOCUMENTS)
    text, comments = data.draw(written(document))
    text = data.draw(st.sampled_from(["", "// header\n"])) + text + "\n"
    changes = data.draw(st.lists(st.tuples(PATHS, st.one_of(st.just(DELETE), VALUES)),
                                 min_size=1, max_size=3))
    expected, reachable = copy.deepcopy(document), True
    for keys, value in changes:
        node = expected
        for key in keys[:-1]:
            if key not in node and value is DELETE:  # nothing to remove
                node = {}
                break
            if key in node and not isinstance(node[key], dict):
                reachable = False
                break
            node = node.setdefault(key, {})
        if not reachable:
            break
        if value is DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = copy.deepcopy(value)
    edited = set_keys(text, changes)
    if not reachable:  # a parent on the path is not an object: the caller writes the file whole
        assert edited is None
        return
    assert edited is not None, text
    assert json5.loads(edited) == expected, (text, edited)
    touched = {keys[0] for keys, _ in changes}
    for comment in comments:  # those inside a value replaced or removed may go with it
        if comment.split("@")[1] not in touched:
            assert comment in edited, (comment, text, edited)
    assert text.startswith("// header") == edited.startswith("// header")


def test_an_opencode_jsonc_keeps_its_comments_and_layout():
    text = """{
  // my settings
  "$schema": "https://opencode.ai/config.json",
  "model": "anthropic/claude-sonnet-4-5", // the one I use
  "provider": {
    /* a local one */
    "ollama": {"npm": "@ai-sdk/openai-compatible"}
  }
}
"""
    wired = set_keys(text, [(["provider", "metaclaw"], {"npm": "x", "options": {"k": 1}}),
                            (["model"], "metaclaw/claude-sonnet-4-5")])
    assert wired == """{
  // my settings
  "$schema": "https://opencode.ai/config.json",
  "model": "metaclaw/claude-sonnet-4-5", // the one I use
  "provider": {
    /* a local one */
    "ollama": {"npm": "@ai-sdk/openai-compatible"},
    "metaclaw": {
      "npm": "x",
      "options": {
        "k": 1
      }
    }
  }
}
"""
    undone = set_keys(wired, [(["provider", "metaclaw"], DELETE),
                              (["model"], "anthropic/claude-sonnet-4-5")])
    assert undone == text


def test_missing_parents_are_added_and_one_line_objects_stay_on_one_line():
    assert set_keys('{"a": 1}', [(["env", "X"], "y")]) == '{"a": 1, "env": {"X": "y"}}'
    assert loads(set_keys("{\n}\n", [(["env", "X"], "y")])) == {"env": {"X": "y"}}
    assert set_keys("{a: 1, b: 'x',}", [(["b"], DELETE)]) == "{a: 1, }"


def test_a_file_with_trailing_commas_gets_them_on_what_is_added_and_undo_keeps_them():
    text = '{\n  "provider": {\n    "anthropic": {"x": 1},\n  },\n  "theme": "dark",\n}\n'
    wired = set_keys(text, [(["provider", "metaclaw"], {"y": 2}), (["z"], 1)])
    assert wired.count("},\n") == 3 and '"z": 1,' in wired and loads(wired)["z"] == 1
    assert set_keys(wired, [(["provider", "metaclaw"], DELETE), (["z"], DELETE)]) == text
    assert set_keys('{"a": 1,}', [(["b"], 2)]) == '{"a": 1, "b": 2,}'


def test_crlf_files_stay_crlf_and_an_empty_object_is_written_on_lines():
    edited = set_keys('{\r\n  "a": 1\r\n}\r\n', [(["b"], {"x": [1, 2]})])
    assert "\n" not in edited.replace("\r\n", "") and loads(edited) == {"a": 1, "b": {"x": [1, 2]}}
    assert set_keys("{}", [(["env", "X"], "y")]) == '{\n  "env": {\n    "X": "y"\n  }\n}'


def test_a_text_that_is_not_one_object_is_not_edited():
    assert set_keys("[1, 2]", [(["a"], 1)]) is None
    assert set_keys('{"a": 1} {"b": 2}', [(["a"], 2)]) is None
    assert set_keys('{"a": 1,, }', [(["a"], 2)]) is None
    assert set_keys('{"a": 5}', [(["a", "b"], 1)]) is None  # a parent that is not an object
    assert set_keys('{"a": "unclosed}', [(["a"], 1)]) is None
