"""Fixtures shared by the test modules.

``--store-engine postgresql`` (or ``METACLAW_TEST_ENGINE=postgresql``) runs the tests against a
throwaway PostgreSQL cluster: every ``Store(path)`` of the test process and of the processes it
starts opens a database of the cluster standing in for that file (``tests/pgcluster.py``).
Tests marked ``sqlite_only`` (they look at the SQLite file itself) skip there, and only the
modules of :data:`ENGINE_SUITE` run (the workspace, the fast and slow loops, durability and
hostile input), unless ``--every-module`` asks for all.
"""

import os
import sys
from pathlib import Path

import pytest

try:  # import numpy fully before any test starts a server: hypothesis looks at
    import numpy  # noqa: F401  sys.modules["numpy"], which a server thread may be importing
except ImportError:  # pragma: no cover
    pass

from metaclaw.store import Store


TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import pgcluster  # noqa: E402


#: The modules the PostgreSQL run covers: every behaviour that depends on the store engine.
ENGINE_SUITE = {
    "test_store", "test_workspace", "test_buffers", "test_sessions", "test_trace",
    "test_judge", "test_judge_hostile", "test_fastloop", "test_fastloop_crash", "test_evolver",
    "test_evolver_hostile", "test_gate", "test_labels", "test_evidence",
    "test_slowloop", "test_training_lease", "test_proxy_durable", "test_proxy_hostile",
    "test_scopes",
}


def pytest_addoption(parser):
    parser.addoption("--store-engine", choices=("sqlite", "postgresql"),
                     default=os.environ.get("METACLAW_TEST_ENGINE", "sqlite"),
                     help="the workspace store engine the tests run against")
    parser.addoption("--every-module", action="store_true",
                     help="with --store-engine postgresql: every module, not only ENGINE_SUITE")


def pytest_configure(config):
    config.addinivalue_line("markers", "sqlite_only: looks at the SQLite file; skipped when "
                                       "the suite runs against PostgreSQL")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--store-engine") == "postgresql":
        if not config.getoption("--every-module"):
            kept = [i for i in items if Path(str(i.fspath)).stem in ENGINE_SUITE]
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept
        skip = pytest.mark.skip(reason="looks at the SQLite file itself")
        for item in items:
            if "sqlite_only" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster for this test process (skips where none can start)."""
    cluster = pgcluster.start()
    if cluster is None:
        pytest.skip(f"no PostgreSQL: {'; '.join(pgcluster.WHY_NOT)}")
    yield cluster
    cluster.remove()


@pytest.fixture(scope="session", autouse=True)
def store_engine(request):
    """The engine under test; for PostgreSQL, maps every store path to a cluster database."""
    engine = request.config.getoption("--store-engine")
    if engine == "postgresql":
        cluster = request.getfixturevalue("pg_cluster")
        socket = str(cluster.socket_dir)
        pgcluster.map_paths(socket)
        os.environ[pgcluster.MAP_ENV] = socket
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(TESTS / "pgmap"), os.environ.get("PYTHONPATH")]))
    return engine


@pytest.fixture(scope="session", autouse=True)
def static_embedding_table():
    """Load the packaged static embedding table once before any test starts a proxy."""
    from metaclaw.skills import retrieval

    if retrieval.static_embedding_packaged() or retrieval.embeddings_available():
        try:
            retrieval.load_model(retrieval.STATIC_MODEL)
        except retrieval.RetrievalError:  # no offline MiniLM package: embedding tests skip or fail
            pass


@pytest.fixture()
def store(tmp_path):
    """A fresh workspace store in the test's temporary folder."""
    with Store(tmp_path / "metaclaw.db") as s:
        yield s


@pytest.fixture()
def add_buffer_turn(store):
    """Record a turn with a given task text, reward and buffer place; returns its id."""
    def add(session, text, *, reward=None, set_=None, state=None, generation=0, response="ok"):
        return store.record_turn(
            session_id=session, status="ok", response=response, reward=reward,
            request_messages=[{"role": "system", "content": "You are helpful."},
                              {"role": "user", "content": text}],
            buffer_set=set_, buffer_state=state, skill_generation=generation)
    return add
