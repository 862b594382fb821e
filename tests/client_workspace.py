"""What the tests of real clients through the proxy share (``tests/test_proxy_clients.py``,
``tests/test_proxy_responses.py``): a workspace with two skills, an ask that one of them fits, a
proxy in front of a double upstream, and the Agents SDK's function tool that backs a file up."""

from __future__ import annotations

import pytest

from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.store import Store

BACKUP = Skill("backup-before-modify", "Copy a config file before changing it.", "safety",
               "Run `cp config.yaml config.yaml.bak` before the first edit.")
COMMITS = Skill("git-commit-messages", "How to write clear git commit messages.", "coding",
                "Write the subject in the imperative mood.")
ASK = "I have to change deploy/config.yaml before tonight's release. What should I do first?"
#: The model's call of :func:`backup_tool`'s tool.
BACKUP_CALL = {"id": "call_b", "function": {"name": "backup_file",
                                            "arguments": '{"path": "deploy/config.yaml"}'}}


@pytest.fixture()
def workspace(tmp_path):
    """(store, library) with :data:`BACKUP` and :data:`COMMITS`."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(BACKUP, reason="test")
    library.add(COMMITS, reason="test")
    yield store, library
    store.close()


def proxy_for(workspace, upstream, protocol: str = "openai") -> Proxy:
    """A proxy (not started) in front of ``upstream``, a double speaking ``protocol``."""
    store, library = workspace
    url = upstream.url if protocol == "openai" else upstream.base_url
    return Proxy(ProxyConfig(upstream_url=url, upstream_protocol=protocol, retrieval="lexical",
                             max_retries=0), store, library)


def turns_of(proxy, store) -> list[dict]:
    """The turns recorded so far, once every answered one is in the store."""
    proxy.flush()
    return store.turns()


def backup_tool(agents):
    """The Agents SDK's ``backup_file`` function tool, and the list of paths it was called
    with."""
    called: list[str] = []

    @agents.function_tool
    def backup_file(path: str) -> str:
        """Copy a file to path + '.bak' before changing it."""
        called.append(path)
        return f"copied {path} to {path}.bak"

    return backup_file, called
