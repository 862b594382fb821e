"""Fixtures shared by the test modules."""

import pytest

try:  # import numpy fully before any test starts a server: hypothesis looks at
    import numpy  # noqa: F401  sys.modules["numpy"], which a server thread may be importing
except ImportError:  # pragma: no cover
    pass

from metaclaw.store import Store


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
