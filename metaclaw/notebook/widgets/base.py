"""What every notebook widget shares: where the front-end modules are, reading the workspace
for as long as the kernel lives (:class:`_Reader`, :func:`release_store`), the static HTML form
(:class:`_StaticHTML`), the base of the widgets that read the workspace
(:class:`_WorkspaceWidget`), the observer of front-end requests (:func:`_reacts`) and the small
formatting helpers of the static forms."""

from __future__ import annotations

import functools
import html
import json
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

import anywidget
import traitlets

from metaclaw.buffers import task_previews
from metaclaw.store import IN_IDS, id_list

#: The front-end modules: ``metaclaw/_widgets`` (a link to the top-level ``widgets/`` folder).
WIDGETS_DIR = Path(__file__).resolve().parent.parent.parent / "_widgets"
CSS = WIDGETS_DIR / "metaclaw.css"
#: What every front-end module uses (``h()``, which builds a DOM element), put before each.
COMMON_JS = "common.js"


def esm(name: str) -> str:
    """The front-end module ``name`` (a file of :data:`WIDGETS_DIR`) as anywidget is given it:
    the shared helpers of :data:`COMMON_JS` followed by the module itself (one text, so that a
    module loads nothing: it works offline and in any front-end)."""
    return "\n".join((WIDGETS_DIR / file).read_text(encoding="utf-8")
                     for file in (COMMON_JS, name))


_esc = html.escape


def _short(text: str, limit: int = 100) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _json_safe(value: Any) -> Any:
    """``value`` made JSON-compatible (what a synced traitlet can carry). Infinities and NaN
    become None: JSON has no such numbers, and the kernel would send the front-end invalid JSON."""
    return json.loads(json.dumps(value, default=str), parse_constant=lambda _name: None)


#: The longest text a widget sends to the browser in one field. A turn can hold a tool result of
#: megabytes (a log file the agent read): sent whole it would slow the browser and, through the
#: static HTML, stay in the saved notebook. The store keeps the full text.
MAX_TEXT_CHARS = 20_000


def _clip_texts(value: Any, limit: int = MAX_TEXT_CHARS) -> Any:
    """``value`` with every string longer than ``limit`` cut, saying how much was left out."""
    if isinstance(value, str):
        if len(value) <= limit:
            return value
        return value[:limit] + f"\n… [{len(value) - limit:,} more characters not shown]"
    if isinstance(value, dict):
        return {k: _clip_texts(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_clip_texts(v, limit) for v in value]
    return value


# -- what a widget reads, for as long as the kernel lives ----------------------------------------
class SourceGone(RuntimeError):
    """The workspace a widget read is gone (its database file was deleted, or it was an in-memory
    store that was closed): the widget keeps what it showed last and says so in one line."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:299] + "…"


def _is_closed(store: Any) -> bool:
    """Whether ``store``'s connection was closed (``Store.close()``)."""
    try:
        store.query("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


_readers_lock = threading.RLock()
#: live widgets by the store they read; a store in ``_close_when_unread`` is closed when its
#: last reader closes (``%metaclaw stop`` hands a store to the widgets still showing it).
_readers: "weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]]" = weakref.WeakKeyDictionary()
_close_when_unread: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _live_readers(store: Any) -> list[Any]:
    with _readers_lock:
        return [r for r in list(_readers.get(store, ())) if not getattr(r, "_released", False)]


def release_store(store: Any) -> bool:
    """Close ``store`` now unless a live widget reads it; otherwise it stays open for those
    widgets and is closed when the last of them is closed. Returns whether it was closed now.
    (``%metaclaw stop`` calls this: stopping the proxy does not pull the workspace from under
    the widgets still on the page.)"""
    with _readers_lock:
        if _live_readers(store):
            _close_when_unread.add(store)
            return False
        _close_when_unread.discard(store)
    store.close()
    return True


class _Reader:
    """The store a widget reads, kept usable for as long as the widget lives: when its
    connection was closed (by ``store.close()``), the widget reopens the same workspace file;
    when the file is gone, :class:`SourceGone` says so in one line."""

    def __init__(self, widget: Any, store: Any):
        self.held = store
        self.own: Any = None
        held = getattr(store, "path", None)  # None: a database server's workspace
        # resolved now: a notebook that changes its directory later reads the same file
        self.path = None if held is None or str(held) == ":memory:" else Path(
            str(held)).resolve()
        self._widget = weakref.ref(widget)
        with _readers_lock:
            _readers.setdefault(store, weakref.WeakSet()).add(widget)

    def store(self) -> Any:
        path = self.path
        if path is not None and not path.exists():  # an open connection reads on regardless
            raise SourceGone(f"the workspace {path} was deleted: what is shown is what this "
                             f"widget read last")
        for store in (self.own, self.held):
            if store is not None and not _is_closed(store):
                return store
        if path is None and getattr(self.held, "path", None) is None:  # a server's, closed
            raise SourceGone(f"the workspace {self.held.location} was closed: what is shown is "
                             "what this widget read last")
        if path is None:
            raise SourceGone("the workspace was an in-memory store and it was closed: what is "
                             "shown is all that is left of it")
        from metaclaw.store import Store

        self.own = Store(path)
        return self.own

    def release(self) -> None:
        """The widget closed: close what it opened, and the store handed to it if it was the
        last reader."""
        widget = self._widget()
        with _readers_lock:
            readers = _readers.get(self.held)
            if readers is not None and widget is not None:
                readers.discard(widget)
            last = self.held in _close_when_unread and not _live_readers(self.held)
            if last:
                _close_when_unread.discard(self.held)
        if last:
            self.held.close()
        if self.own is not None:
            self.own.close()
            self.own = None


def _reacts(*names: str, failing: str | None = None) -> Callable[[Callable[..., Any]], Any]:
    """An observer of the synced traits ``names`` (what the front-end sets): it runs only once
    the widget is ready (not while the widget sets its own traits), and an error becomes the
    widget's one-line ``error`` (``failing``: what could not be done, by default the widget's
    ``_refresh_failure``; the kernel log is where nobody looks) instead of an exception."""
    def wrap(method: Callable[..., Any]) -> Any:
        @functools.wraps(method)
        def handler(self: Any, change: Any) -> Any:
            if not self._ready:
                return None
            try:
                return method(self, change)
            except SourceGone as exc:
                self.error = str(exc)
            except Exception as exc:  # noqa: BLE001 - shown in the widget, the kernel goes on
                self.error = f"{failing or self._refresh_failure}: {_one_line(exc)}"
            return None
        return traitlets.observe(*names)(handler)
    return wrap


def _fmt_reward(value: Any) -> str:
    if value is None:
        return "unjudged"
    value = float(value)
    return f"{value:+.0f}" if value.is_integer() else f"{value:+.2f}"


def _fmt_time(seconds: Any) -> str:
    if seconds is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(seconds)))


def turn_previews(store: Any, ids: Iterable[int]) -> dict[str, dict[str, Any]]:
    """Short descriptions of some turns: ``{str(id): {id, session_id, skill_generation, reward,
    task}}`` where ``task`` is the turn's last user message, shortened. Unknown ids are absent."""
    wanted = sorted({int(i) for i in ids})
    tasks = task_previews(store, wanted, limit=100)
    rows = store.query("SELECT id, session_id, skill_generation, reward FROM turns "
                       f"WHERE id {IN_IDS}", (id_list(wanted),))
    return {str(row["id"]): {
        "id": row["id"], "session_id": row["session_id"],
        "skill_generation": row["skill_generation"],
        "reward": None if row["reward"] is None else float(row["reward"]),
        "task": tasks.get(row["id"], "")} for row in rows}


class _StaticHTML:
    """Adds the widget's static HTML (``_repr_html_``) to its MIME bundle, next to the widget view."""

    def _repr_mimebundle_(self, **kwargs: Any):
        bundle = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
        data = dict(data)
        data["text/html"] = self._repr_html_()
        data["text/plain"] = repr(self)
        return data, metadata

    def _repr_html_(self) -> str:  # pragma: no cover - every widget overrides it
        raise NotImplementedError


class _WorkspaceWidget(_StaticHTML, anywidget.AnyWidget):
    """A widget that reads the workspace through a ``_reader`` (``None``: it reads none): it
    keeps working after ``%metaclaw stop`` (the workspace stays open while a widget shows it)
    and after ``store.close()`` (it reopens the workspace file). Its front-end's *refresh*
    button (``refresh_requests``) calls :meth:`refresh`; a failure is said in ``error``."""

    error = traitlets.Unicode("").tag(sync=True)
    refresh_requests = traitlets.Int(0).tag(sync=True)
    #: What ``error`` says when a refresh asked by the front-end fails.
    _refresh_failure = "cannot refresh"

    def _read_from(self, store: Any) -> None:
        """Set up the reading of ``store`` (before the widget's traits are set)."""
        self._ready = False
        self._released = False
        self._reader = _Reader(self, store) if store is not None else None

    @property
    def _store(self) -> Any:
        """The store, through an open connection to its workspace (or :class:`SourceGone`)."""
        return self._reader.store()

    def _lib(self) -> Any:
        """The skill library (``_library``), reading through an open connection to its
        workspace."""
        store = self._store
        if self._library.store is not store:  # its connection was closed: use the reopened one
            self._library.store = store
        return self._library

    def refresh(self) -> Any:  # pragma: no cover - every widget overrides it
        raise NotImplementedError

    def _selection_failed(self, change: Any, exc: Exception,
                          said: type[Exception] | tuple[type[Exception], ...] = SourceGone) -> None:
        """The turn chosen in ``selected`` cannot be shown: the selection goes back to where it
        was, and ``error`` says why (an error of a ``said`` type in its own words)."""
        self._ready = False
        self.selected = change["old"]
        self._ready = True
        self.error = (str(exc) if isinstance(exc, said)
                      else f"cannot show turn #{change['new']}: {_one_line(exc)}")

    @_reacts("refresh_requests")
    def _on_refresh_request(self, _change: Any) -> None:
        self.refresh()

    def close(self) -> None:
        """Close the widget (and the workspace kept open for it after ``%metaclaw stop``, when
        it is the last widget showing it)."""
        self._released = True
        if getattr(self, "_reader", None) is not None:
            self._reader.release()
        super().close()
