"""The wire protocols by name: the one place a new protocol is registered.

A new protocol: its adapter file in this package, and one line here (its instance in
:data:`PROTOCOLS`).
"""

from __future__ import annotations

from metaclaw.protocols import WireProtocol
from metaclaw.protocols.anthropic_messages import ANTHROPIC
from metaclaw.protocols.openai_chat import OPENAI
from metaclaw.protocols.openai_responses import RESPONSES

#: The protocols by name.
PROTOCOLS: dict[str, WireProtocol] = {p.name: p for p in (OPENAI, ANTHROPIC, RESPONSES)}


def get_protocol(name: str) -> WireProtocol:
    """The registered protocol called ``name`` (``ValueError`` naming the choices otherwise)."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown wire protocol {name!r}; choose one of "
                         f"{', '.join(sorted(PROTOCOLS))}") from None
