"""The wire protocols by name: the one place a new protocol is registered.

A new protocol: its adapter file in this package, and one line here (its instance in
:data:`PROTOCOLS`). Registering checks the adapter's declarations
(:func:`metaclaw.protocols.check_declaration`: a protocol without ``field_types`` is an error).
"""

from __future__ import annotations

from typing import Any

from metaclaw.protocols import WireProtocol, check_declaration
from metaclaw.protocols.anthropic_messages import ANTHROPIC
from metaclaw.protocols.openai_chat import OPENAI
from metaclaw.protocols.openai_responses import RESPONSES


def register(*protocols: WireProtocol) -> dict[str, WireProtocol]:
    """The protocols by name, each checked by :func:`~metaclaw.protocols.check_declaration`
    (``TypeError`` also for two of one name, or not exactly one pivot)."""
    registered = {p.name: check_declaration(p) for p in protocols}
    if len(registered) != len(protocols) or sum(p.pivot for p in protocols) != 1:
        raise TypeError("the protocols registered need distinct names and exactly one pivot")
    return registered


#: The protocols by name.
PROTOCOLS: dict[str, WireProtocol] = register(OPENAI, ANTHROPIC, RESPONSES)
#: The pivot protocol (OpenAI chat): the neutral shape, and the shape of errors on a route no
#: protocol owns.
PIVOT: WireProtocol = next(p for p in PROTOCOLS.values() if p.pivot)


def get_protocol(name: str) -> WireProtocol:
    """The registered protocol called ``name`` (``ValueError`` naming the choices otherwise)."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown wire protocol {name!r}; choose one of "
                         f"{', '.join(sorted(PROTOCOLS))}") from None


def client_protocol(path: str, headers: Any) -> WireProtocol:
    """The protocol a request's errors take: the one whose route ``path`` holds; on the other
    paths (``/v1/models``, an unknown path) the one whose :attr:`~WireProtocol.client_headers`
    the request carries (every Anthropic SDK sends ``anthropic-version``, and an Anthropic
    client reads only ``{"type": "error", "error": {...}}``), else the pivot's."""
    for protocol in PROTOCOLS.values():
        if any(route in path for route in protocol.routes):
            return protocol
    for protocol in PROTOCOLS.values():
        if any(header in headers for header in protocol.client_headers):
            return protocol
    return PIVOT
