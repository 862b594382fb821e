"""The output folder of a bench or demo run: claimed for the run, never emptied blindly.

    with claim_out_dir(Path("bench-out"), RUN_ENTRIES):
        ...   # write the run's files

A run writes a marker file (:data:`MARKER`) into its folder and holds an exclusive lock on it
(:mod:`filelock`) for as long as it runs. So:

- a folder that holds files but no marker was not written by a run: it is refused, untouched;
- a folder with a marker is an earlier run's output: the entries a run creates (``entries``)
  are replaced; anything else a user put there is kept;
- while one run holds the lock, a second run on the same folder fails at once.

The lock is released by the operating system when the process ends, killed or not, so a crash
never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

MARKER = ".metaclaw-run"

#: Top-level entries of one benchmark run's folder (store and the files beside it, skill
#: library, rounds, snapshots).
RUN_ENTRIES = ("metaclaw.db", "metaclaw.db-wal", "metaclaw.db-shm", "metaclaw.db-journal",
               "metaclaw.db-skill-folders.json", "metaclaw.db.training.lock",
               "metaclaw.db.evolve.lock", "skills", "run", "snapshots")
#: Top-level entries of a demo's folder (its two runs and the result).
DEMO_ENTRIES = ("baseline", "skills", "demo.json")


class OutDirError(ValueError):
    """The output folder cannot be used for this run (message says why and what to do)."""


@contextlib.contextmanager
def claim_out_dir(out: Path, entries: tuple[str, ...], *, replace: bool = True,
                  kind: str = "bench") -> Iterator[Path]:
    """Lock ``out`` for one run of ``kind`` (``bench`` or ``demo``) and clear an earlier run's
    ``entries`` (when ``replace``).

    Raises :class:`OutDirError` when ``out`` is a file, holds files no run wrote or another
    kind of run's output (a bench run in a demo's folder would replace its learned skills), or
    another run holds it.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{out} is a file, not a folder; choose a folder for --out")
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise OutDirError(f"{out} already holds files that no metaclaw run wrote; choose an empty "
                          "or new --out folder (nothing in it was changed)")
    earlier = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # none, or an older marker
        earlier = json.loads((out / MARKER).read_text()).get("kind")
    if earlier and earlier != kind:
        raise OutDirError(f"{out} holds a metaclaw {earlier} run's output; choose another "
                          f"--out folder for this {kind} run (nothing in it was changed)")
    out.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock, Timeout

    lock = FileLock(out / MARKER, timeout=0, mode=0o644)
    try:
        lock.acquire()
    except Timeout:
        raise OutDirError(f"another metaclaw run is writing to {out}; wait for it to finish "
                          "or choose another --out folder") from None
    try:
        (out / MARKER).write_text(json.dumps({"written_by": "metaclaw run", "kind": kind,
                                              "pid": os.getpid(), "started": time.time()})
                                  + "\n")
        if replace:
            for name in entries:
                path = out / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
        yield out
    finally:
        lock.release()
