"""A throwaway PostgreSQL cluster for tests and benchmarks: ``initdb`` in a temporary folder,
listening on a Unix socket only (no TCP port), trust authentication for the user ``metaclaw``,
removed when stopped.

PostgreSQL refuses to run as root: as root, the cluster runs as the unprivileged ``nobody``
(through ``setpriv``). :func:`start` returns ``None`` with the reason in :data:`WHY_NOT` where
no cluster can be started (no ``initdb`` on PATH, no way to drop privileges).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

WHY_NOT: list[str] = []
USER = "metaclaw"


@dataclass
class Cluster:
    folder: Path
    run_as: list[str]

    @property
    def socket_dir(self) -> Path:
        return self.folder / "socket"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}@/{dbname}?host={self.socket_dir}"

    def new_database(self, prefix: str = "w") -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" STRATEGY FILE_COPY')
        return self.url(name)

    def pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.run_as, "pg_ctl", "-D", str(self.folder / "data"), *args],
                              capture_output=True, text=True, check=check, timeout=120)

    def start(self) -> None:
        self.pg_ctl("-w", "-l", str(self.folder / "server.log"), "-o",
                    f"-k {self.socket_dir} -c listen_addresses='' -p 5432 "
                    f"-c max_connections=200 -c fsync={'on' if self.fsync else 'off'}", "start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-w", "-m", mode, "stop", check=False)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)

    fsync: bool = False


def start(fsync: bool = False) -> Cluster | None:
    """A running throwaway cluster, or ``None`` (see :data:`WHY_NOT`). ``fsync=False`` (tests):
    the server does not flush to disk, which changes nothing for a client killed with -9 and
    keeps a 2-core machine quick; benchmarks pass ``fsync=True``."""
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        WHY_NOT.append("PostgreSQL's initdb/pg_ctl are not on PATH")
        return None
    run_as: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            WHY_NOT.append("running as root and setpriv is missing (PostgreSQL refuses root)")
            return None
        run_as = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    folder = Path(tempfile.mkdtemp(prefix="mcpg-"))  # short: a socket path has ~100 bytes
    (folder / "socket").mkdir()
    if run_as:
        for path in (folder, folder / "socket"):
            shutil.chown(path, "nobody", "nogroup")
    cluster = Cluster(folder, run_as, fsync)
    try:
        subprocess.run([*run_as, "initdb", "-D", str(folder / "data"), "-U", USER,
                        "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"],
                       capture_output=True, text=True, check=True, timeout=120)
        cluster.start()
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        WHY_NOT.append(f"could not start a PostgreSQL cluster: {detail.strip()[:300]}")
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return cluster


#: Environment variable naming the cluster's socket folder for :func:`map_paths` in child
#: processes (read by ``tests/pgmap/sitecustomize.py``).
MAP_ENV = "METACLAW_TEST_PG_SOCKET"


def database_url(socket_dir: str, path: str) -> str:
    """The URL of the database standing in for the SQLite file ``path`` (created on first use:
    the same path gives the same database in every process)."""
    import hashlib

    import psycopg

    key = os.path.realpath(os.path.abspath(path))
    name = "f_" + hashlib.sha1(key.encode()).hexdigest()[:20]
    url = f"postgresql://{USER}@/{name}?host={socket_dir}"
    if name not in _CREATED:
        with psycopg.connect(f"postgresql://{USER}@/postgres?host={socket_dir}",
                             autocommit=True) as conn:
            try:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{_template(conn, socket_dir)}" '
                             "STRATEGY FILE_COPY")
            except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                pass
        _CREATED.add(name)
    return url


_CREATED: set[str] = set()
TEMPLATE = "metaclaw_template"


def _template(conn, socket_dir: str) -> str:
    """A database with the current schema, the template of the stand-in databases (a copy is
    cheaper than migrating each one); made once per cluster, by whichever process is first."""
    if TEMPLATE in _CREATED:
        return TEMPLATE
    conn.execute("SELECT pg_advisory_lock(42)")
    try:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                            (TEMPLATE,)).fetchone():
            conn.execute(f'CREATE DATABASE "{TEMPLATE}_new" STRATEGY FILE_COPY')
            from metaclaw.store.postgres import PostgresStore

            PostgresStore(f"postgresql://{USER}@/{TEMPLATE}_new?host={socket_dir}").close()
            conn.execute(f'ALTER DATABASE "{TEMPLATE}_new" RENAME TO "{TEMPLATE}"')
    finally:
        conn.execute("SELECT pg_advisory_unlock(42)")
    _CREATED.add(TEMPLATE)
    return TEMPLATE


def map_paths(socket_dir: str) -> None:
    """Make every ``Store(path)`` of this process open a database of the cluster instead of the
    SQLite file (the suite's second run, against PostgreSQL). ``:memory:`` stays SQLite."""
    import metaclaw.store.base as store

    original = getattr(store.parse_target, "original", store.parse_target)

    def parse_target(target):
        engine, where = original(target)
        if engine == "sqlite" and where != ":memory:":
            Path(where).parent.mkdir(parents=True, exist_ok=True)
            return "postgresql", database_url(socket_dir, where)
        return engine, where

    parse_target.original = original
    store.parse_target = parse_target
