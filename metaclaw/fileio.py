"""Files written whole or not at all: the one atomic write of the package.

    write_atomic(path, "text")                       # a reader sees the old file or the new one
    with atomic_write(path, "wb") as out:            # for writers that want a file object
        numpy.save(out, table)
    with atomic_folder(target) as staging:           # a folder filled, then moved into place
        zipfile.ZipFile(src).extractall(staging)
    durable_replace(src, dst)                        # a rename that survives a power cut

Every write goes to a temporary file beside the target (created by :func:`tempfile.mkstemp`:
readable by its owner only unless ``like`` gives another file's mode and owner, or
``private=False`` asks for the mode :func:`open` would give), is flushed and fsynced, then
replaces the target with :func:`os.replace`; on any error the temporary file is removed and the
target is left as it was. ``durable=True`` also syncs the folder's entry after the rename, so
that after an OS crash the target is the old file or the whole new one.

Writes that do not come through here, each for a stated need: a file appended to record by
record (each append fsynced: a JSONL log, a journal) and a database's own files (the engine
writes them).

A shared module: every wing may import it, and it imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


def fsync_path(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """fsync one file, or one folder's entries (where the OS can open a folder: not Windows)."""
    if directory and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Replace ``dst`` with the file ``src`` so that, after a crash, ``dst`` is either the old
    file or the whole new one: ``src``'s data is synced before the rename, and the folder's
    entry (the rename itself) after it."""
    fsync_path(src)
    os.replace(src, dst)
    fsync_path(Path(dst).parent, directory=True)


def _keep_mode_and_owner(tmp: str, like: Path | None) -> None:
    """Give ``tmp`` the mode and owner of ``like`` (when it exists)."""
    like_stat = like.stat() if like is not None and like.exists() else None
    if like_stat is None:
        return
    os.chmod(tmp, stat.S_IMODE(like_stat.st_mode))
    try:
        os.chown(tmp, like_stat.st_uid, like_stat.st_gid)
    except PermissionError:  # only root can give a file away; the user's own stays theirs
        pass


def _temp_beside(target: Path, suffix: str, private: bool) -> tuple[int, str]:
    """A new, empty temporary file beside ``target``, opened for writing: readable by its owner
    only (``private``), else with the mode :func:`open` gives a new file (0o666 less the umask,
    which :func:`os.open` applies)."""
    prefix = f".{target.name}."
    if private:
        return tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=target.parent)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = str(target.parent / f"{prefix}{os.urandom(4).hex()}{suffix}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {target}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = None,
                 newline: str | None = None, like: str | os.PathLike[str] | None = None,
                 durable: bool = False, suffix: str = ".tmp",
                 private: bool = True) -> Iterator[IO[Any]]:
    """A file object on a temporary file beside ``path``; when the block ends without an
    error, the file is flushed, fsynced and replaces ``path`` (pass ``path.resolve()`` to
    replace the file a symlink points to and keep the link). ``mode``: ``"w"`` (text, UTF-8 unless ``encoding``) or
    ``"wb"``. ``like``: a file whose mode and owner the new file gets (default: readable by
    its owner only, or, with ``private=False``, the mode :func:`open` would give a new file).
    ``durable``: also sync the folder's entry after the rename. The parent folder is created
    when missing."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(target, suffix, private)
    try:
        text = {} if "b" in mode else {"encoding": encoding or "utf-8", "newline": newline}
        with os.fdopen(fd, mode, **text) as out:
            yield out
            out.flush()
            os.fsync(out.fileno())  # on disk before the rename: a power cut leaves old or new
        _keep_mode_and_owner(tmp, None if like is None else Path(like))
        os.replace(tmp, target)
        if durable:
            fsync_path(target.parent, directory=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes, **options: Any) -> None:
    """Replace ``path`` with ``data`` (text or bytes) atomically; ``options`` as for
    :func:`atomic_write` (``newline``, ``like``, ``durable``, ...)."""
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w", **options) as out:
        out.write(data)


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike[str], *, prefix: str = ".extract-") -> Iterator[Path]:
    """An empty temporary folder beside ``target`` (named ``prefix`` and a random part: keep it
    hidden where a folder's entries are read); when the block ends without an error it
    is renamed to ``target`` (which must then not exist, or be an empty folder: otherwise the
    rename's OSError is raised). The temporary folder is removed in every case."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield staging
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["atomic_folder", "atomic_write", "durable_replace", "fsync_path", "write_atomic"]


def private_temp_dir(name: str) -> Path | None:
    """The temp folder's ``name``, a folder of this user's own: made readable and writable by
    its owner only, and, where it exists already, used only when this user owns it and no one
    else can write to it (another local user could otherwise make it first, and fill it with
    a model or table of their own); ``None`` where it cannot be had so."""
    import stat
    import tempfile

    path = Path(tempfile.gettempdir()) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode):  # a link or file put there by someone else
        return None
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        return None
    return path
