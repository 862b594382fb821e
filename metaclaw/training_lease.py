"""One trainer per workspace: the lease a process holds while it trains the workspace's policy.

Every process of a workspace may run a slow loop (``metaclaw train``, a notebook kernel, a
second kernel on the same folder), and each has its own idle scheduler. Two of them training at
once would each build weights on a policy the other is replacing: versions of two lineages
interleave in ``policy_versions``, and each process's steps are lost to the other's. So a process
trains only while it holds this lease: an exclusive ``flock`` on a file beside the workspace
database (``metaclaw.db.training.lock``), taken without waiting. The operating system releases
it when its holder exits, ``kill -9`` included, so a dead trainer never blocks the workspace.
The file also names its holder (``pid N on HOST``, what it is doing, since when), for the
message another process shows while it waits.

Where ``fcntl`` does not exist (Windows) the lease is held within the process only. A store in
memory (``:memory:``) is one process's alone, so its lease is too.

Why ``flock`` by hand, where the package's other file locks use :mod:`filelock`: the holder's
record is kept in the lock file itself, and filelock owns that file's contents. The 3.x releases
this package accepts (``filelock>=3.12``) open the lock file with ``O_TRUNC`` on every attempt,
a failed non-blocking one included, so a process that only tried would erase the name it is
about to show; 4.x writes its own marker into the file where the file system has no ``flock``,
and on Windows it locks the file across processes (where the record then cannot be read) and
removes it on release. The lease also needs what filelock's defaults do not give: release from
another thread than the acquiring one, and a forked child that closes its copy of the
descriptor (:func:`_forget_in_child`) on every filelock version accepted.

A shared module: every wing may import it; it imports :mod:`metaclaw.jsonlib` and
:mod:`metaclaw.store` of the package.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from metaclaw.jsonlib import dumps, loads
from metaclaw.store import this_process

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


#: Without ``fcntl``: the leases this process holds (by file), so two objects still exclude
#: each other.
_HELD_HERE: set[str] = set()
_HELD_GUARD = threading.Lock()

#: The leases of this process, for a forked child to drop (see :func:`_forget_in_child`).
_LEASES: "weakref.WeakSet[TrainingLease]" = weakref.WeakSet()

#: The most of the lock file read to name its holder (a record is a few hundred bytes).
_RECORD_BYTES = 4096


class TrainingBusy(RuntimeError):
    """Another process holds the workspace's training lease."""


class TrainingLease:
    """The workspace's training lease, as this process sees it.

    :meth:`acquire` takes it without waiting (``False``: another process, or another lease
    object of this process, holds it; :meth:`holder` says who). It is re-entrant for this
    object: a scheduler holds it for a training window while each step takes it again, and
    it is freed when every acquire has been released, from whichever thread.
    """

    def __init__(self, path: str | os.PathLike[str] | None, lock: Any = None):
        self.path = None if path is None else Path(path)
        #: A database server's lock instead of a file (a workspace on PostgreSQL, shared by
        #: machines): ``try_acquire(record)``, ``release()``, ``forget()``, ``record()``.
        self._lock = lock
        self._guard = threading.Lock()
        self._count = 0
        self._handle: Any = None
        _LEASES.add(self)

    @classmethod
    def for_store(cls, store: Any, purpose: str = "training") -> "TrainingLease":
        """The lease ``purpose`` (``training``, ``evolve``) of ``store``'s workspace: a file
        beside its SQLite database, or the database server's lock for a PostgreSQL workspace
        (held across machines; the server frees it when its holder's connection ends)."""
        if getattr(store, "engine", "sqlite") != "sqlite":
            return cls(None, lock=store.session_lock(purpose))
        path = getattr(store, "path", None)
        if path is None or str(path) == ":memory:":
            return cls(None)
        path = Path(path).resolve()
        return cls(path.with_name(f"{path.name}.{purpose}.lock"))

    @property
    def held(self) -> bool:
        """Whether this object holds the lease now."""
        return self._count > 0

    def acquire(self, doing: str = "training") -> bool:
        """Take the lease if nobody else holds it; ``doing`` is shown to whoever waits."""
        with self._guard:
            if self._count:
                self._count += 1
                return True
            if self._lock is not None:
                if not self._lock.try_acquire(dumps(self._record(doing))):
                    return False
            elif self.path is not None and fcntl is None:  # pragma: no cover - not POSIX
                with _HELD_GUARD:
                    if str(self.path) in _HELD_HERE:
                        return False
                    _HELD_HERE.add(str(self.path))
            elif self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # read-write without truncating: the holder's name stays readable
                handle = open(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    return False
                except BaseException:
                    handle.close()
                    raise
                handle.truncate(0)
                handle.write(dumps(self._record(doing)).encode())
                handle.flush()
                self._handle = handle
            self._count = 1
            return True

    @staticmethod
    def _record(doing: str) -> dict[str, Any]:
        return {"process": this_process(), "pid": os.getpid(), "host": socket.gethostname(),
                "doing": doing, "since": time.time()}

    def release(self) -> None:
        """Give back one :meth:`acquire`; the last one frees the lease."""
        with self._guard:
            if not self._count:
                return
            self._count -= 1
            if self._count:
                return
            if self._lock is not None:
                self._lock.release()
                return
            if self._handle is None:
                with _HELD_GUARD:
                    _HELD_HERE.discard(str(self.path))
                return
            handle, self._handle = self._handle, None
            with contextlib.suppress(OSError):  # a holder's name left behind is harmless
                handle.truncate(0)
            handle.close()  # closing drops the flock

    @contextlib.contextmanager
    def holding(self, doing: str = "training") -> Iterator[None]:
        """Hold the lease for a block, or raise :class:`TrainingBusy` naming its holder."""
        if not self.acquire(doing):
            raise TrainingBusy(f"{self.holder()} is training this workspace, and one process "
                               "trains it at a time: nothing was trained here; stop that one, "
                               "or try again once it is done")
        try:
            yield
        finally:
            self.release()

    def holder(self) -> str:
        """Who holds the lease, as a phrase (``pid N on HOST (idle-window training, since
        2026-11-24 14:02:11)``); ``another process`` when the file does not say."""
        if self.held:
            return f"this process ({this_process()})"
        info = self._holder_record()
        if info is None:
            return "another process"
        return self._describe(info)

    def training_elsewhere(self) -> str | None:
        """Who trains this workspace now, read without taking the lease (a status view must
        not hold off a trainer): the holder the file names while that process lives, else
        None. A holder on another host is taken at its word."""
        if self.held:
            return None
        info = self._holder_record()
        if info is None:
            return None
        pid = info.get("pid")
        if info.get("host") == socket.gethostname() and type(pid) is int and pid > 0:
            try:
                os.kill(pid, 0)
            # killed while holding it, or a pid no process can have: the lease is free
            except (ProcessLookupError, OverflowError):
                return None
            except OSError:  # alive, another user's
                pass
        return self._describe(info)

    def _holder_record(self) -> dict[str, Any] | None:
        try:
            if self._lock is not None:
                raw = self._lock.record()
                if raw is None:
                    return None
                info = loads(raw)
            elif self.path is None:
                return None
            else:
                with open(self.path, "rb") as handle:
                    info = loads(handle.read(_RECORD_BYTES))
        except (OSError, ValueError, RecursionError):  # gone, or not a record this wrote
            return None
        if not isinstance(info, dict) or not isinstance(info.get("process"), str):
            return None
        return info

    @staticmethod
    def _describe(info: dict[str, Any]) -> str:
        details = [info["doing"][:80]] if isinstance(info.get("doing"), str) else []
        with contextlib.suppress(TypeError, ValueError, OverflowError, OSError):
            details.append(f"since {datetime.fromtimestamp(info.get('since')):%Y-%m-%d %H:%M:%S}")
        return info["process"][:120] + (f" ({', '.join(details)})" if details else "")

    def __repr__(self) -> str:
        where = "database" if self._lock is not None else str(self.path) if self.path \
            else "in-process"
        return f"TrainingLease({where}, held={self.held})"


def _forget_in_child() -> None:
    """In a child forked while this process held a lease (a multiprocessing pool started in a
    notebook that trains): the child shares the lock file's open description, and a flock is
    freed only when every descriptor of it is closed, so the child would keep the workspace
    locked after its parent gave the lease back. The lease is the parent's: the child closes
    its copy (which leaves the parent's lock in place) and holds nothing."""
    for lease in list(_LEASES):
        lease._guard = threading.Lock()  # another thread of the parent may have held it
        if lease._handle is not None:
            with contextlib.suppress(OSError):
                lease._handle.close()
        if lease._lock is not None:
            lease._lock.forget()
        lease._handle, lease._count = None, 0
    _HELD_HERE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["TrainingBusy", "TrainingLease"]
