"""Wide tables shown inside their own scrolling frame, so that a long column (a reply, a
grader's message) scrolls within the table instead of running past the notebook's right edge.

    scrolled(frame)                  # a polars (or pandas) DataFrame, or anything with HTML
    scrolled(frame, max_height=300)  # also scrolls down after 300 px
"""

from __future__ import annotations

from typing import Any


class Scrolled:
    """``table`` displayed in a frame ``max_height`` pixels high at most, scrolled both ways."""

    def __init__(self, table: Any, max_height: int = 420):
        if not callable(getattr(table, "_repr_html_", None)):
            raise TypeError(f"scrolled() shows a table with an HTML form (a polars DataFrame), "
                            f"got {type(table).__name__}")
        self.table, self.max_height = table, int(max_height)

    def _repr_html_(self) -> str:
        return (f"<div class='metaclaw-scrolled' style='max-width:100%;overflow:auto;"
                f"max-height:{self.max_height}px'>{self.table._repr_html_()}</div>")

    def __repr__(self) -> str:
        return repr(self.table)


def scrolled(table: Any, max_height: int = 420) -> Scrolled:
    """``table`` (a polars DataFrame, say) shown inside its own scrolling frame."""
    return Scrolled(table, max_height)
