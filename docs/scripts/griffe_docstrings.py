"""A griffe extension for the API pages: the package's docstrings are reStructuredText-flavoured,
the pages Markdown. Before rendering:

- a Sphinx cross-reference role (``:class:`Store```, ``:func:`~metaclaw.skills.retrieval.select```) is
  shown as the inline code it names (``~`` keeps the last part, as Sphinx does), instead of the
  role's raw text;
- a square bracket that opens a command-line option (``[--flag N]``, as in a script's usage line)
  is escaped, so Markdown does not read two of them side by side as a reference link (which the
  strict build reports as a broken link).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref):`(~?)([^`]+)`")
_OPTION = re.compile(r"(?<!\\)\[(?=-)")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class Docstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _ROLE.sub(_role, obj.docstring.value)
            obj.docstring.value = _OPTION.sub(r"\\[", text)
