"""Moving a workspace between stores: ``metaclaw db copy --from sqlite:///... --to postgresql://...``.

:func:`copy_store` copies every table of :data:`~metaclaw.store.TABLES`, row for row with its
keys (not ``skill_folders`` and ``proxy_activity``, the state of the machines using the
workspace: ``metaclaw db copy`` carries the folder marks over with
:func:`metaclaw.skills.library.carry_folder_marks`), into a destination that has no records
yet (a new team database, or a new file), then proves the copy: for each table the
row count and a checksum over every shared column of every row, in key order, must be the
same on both sides (:func:`checksums`). The source is only read. A destination that already
holds records is refused (its ids would collide with the source's; merge two workspaces by
importing one's transcripts into the other, ``metaclaw turns import``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from metaclaw.progress import ProgressFn, notify
from metaclaw.store.base import TABLES, Store, StoreError

#: Rows read and written at a time.
BATCH = 2000
#: Each table's key, the order rows are copied and checksummed in.
KEYS = {"sessions": "id", "skill_generations": "generation", "policy_versions": "version",
        "datasets": "name"}


def _key(table: str) -> str:
    return KEYS.get(table, "id")


def _columns(source: Store, dest: Store, table: str) -> list[str]:
    theirs = dest.declared_types(table)
    return [c for c in source.declared_types(table) if c in theirs]


def _canonical(value: Any) -> bytes:
    if value is None:
        return b"\x00N"
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # an integral REAL read back from either engine
    if isinstance(value, (int, float)):
        return b"\x00n" + repr(value).encode()
    if isinstance(value, bytes):
        return b"\x00b" + value
    return b"\x00s" + str(value).encode("utf-8", "surrogatepass")


def checksums(store: Store, tables: tuple[str, ...] = TABLES,
              columns: dict[str, list[str]] | None = None) -> dict[str, tuple[int, str]]:
    """``table -> (rows, checksum)`` over ``columns[table]`` (default: all declared columns).
    The checksum is the sum of every row's SHA-256 (modulo 2**256): independent of the order
    rows come in (two engines may sort text keys by different collations), changed by any
    missing, extra or different row."""
    out = {}
    for table in tables:
        cols = (columns or {}).get(table) or list(store.declared_types(table))
        total, count, last = 0, 0, None
        key = _key(table)
        while True:
            where = "1=1" if last is None else f"{key} > ?"
            names, rows = store._rows(
                f"SELECT {', '.join(cols)} FROM {table} WHERE {where} ORDER BY {key} "
                f"LIMIT {BATCH}", () if last is None else (last,))
            for row in rows:
                digest = hashlib.sha256()
                for value in row:
                    digest.update(_canonical(value))
                total = (total + int.from_bytes(digest.digest(), "big")) % 2 ** 256
            count += len(rows)
            if len(rows) < BATCH:
                break
            last = rows[-1][names.index(key)]
        out[table] = (count, f"{total:064x}")
    return out


def copy_store(source: Store, dest: Store, on_progress: ProgressFn | None = None
               ) -> dict[str, tuple[int, str]]:
    """Copy every row of ``source`` into the empty ``dest`` and verify it (see the module doc).
    Returns the verified ``table -> (rows, sha256)``; raises :class:`StoreError` when ``dest``
    holds records or when the verification finds a difference."""
    held = {t: n for t, n in dest.counts().items() if n}
    if held:
        raise StoreError(f"the destination {dest.location} already holds records "
                         f"({', '.join(f'{n} {t}' for t, n in held.items())}); copy into a new, "
                         "empty workspace")
    counts = source.counts()
    total, done = sum(counts.values()), 0
    columns = {table: _columns(source, dest, table) for table in TABLES}
    with dest.transaction():  # all or nothing: a failed copy leaves the destination empty
        for table in TABLES:
            cols, key, last = columns[table], _key(table), None
            while True:
                where = "1=1" if last is None else f"{key} > ?"
                names, rows = source._rows(
                    f"SELECT {', '.join(cols)} FROM {table} WHERE {where} ORDER BY {key} "
                    f"LIMIT {BATCH}", () if last is None else (last,))
                if rows:
                    dest._insert_many(table, cols, rows)
                    done += len(rows)
                    notify(on_progress, "copy", done, total, table)
                if len(rows) < BATCH:
                    break
                last = rows[-1][names.index(key)]
            dest._after_copy(table, key)
        # verified before the commit: a copy that differs is rolled back, never left half done
        theirs, ours = checksums(source, columns=columns), checksums(dest, columns=columns)
        wrong = [t for t in TABLES if theirs[t] != ours[t]]
        if wrong:
            changed = source.counts() != counts
            raise StoreError(
                (f"the source changed while it was copied ({', '.join(wrong)}: a proxy or "
                 "another process wrote to it); stop what uses it and copy again"
                 if changed else f"the copy differs from its source in {', '.join(wrong)}")
                + f"; nothing was written to {dest.location}")
    return ours
