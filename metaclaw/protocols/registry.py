"""The wire protocols by name: the one place a new protocol is registered.

A new protocol: its adapter file in this package, and one entry here (its instance in the
``register(...)`` line that makes :data:`PROTOCOLS`); a protocol defined outside the package (a
plug-in, a test) is registered with one call of :func:`add` instead. Registering checks the
adapter's declarations (:func:`metaclaw.protocols.check_declaration`: a protocol without
``field_types`` is an error). Everything else reads the registry: the proxy's routes and field
checks, the protocol of a request's errors, and the protocols an upstream may speak
(:func:`upstream_protocols`: ``ProxyConfig.upstream_protocol``, ``--upstream-protocol``).
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


def add(protocol: WireProtocol) -> WireProtocol:
    """Register ``protocol`` beside those of :data:`PROTOCOLS`, checked as they are
    (``TypeError``: a name taken, a second pivot, a declaration missing; a route another
    protocol serves too). A proxy built afterwards serves its routes and, when it declares an
    ``upstream_path``, forwards in it. :func:`remove` takes it out again."""
    routes = {route for p in PROTOCOLS.values() for route in p.routes}
    taken = sorted(routes.intersection(protocol.routes))
    if taken:
        raise TypeError(f"the routes {', '.join(taken)} of protocol {protocol.name!r} are "
                        "served by another protocol already")
    register(*PROTOCOLS.values(), protocol)  # the checks, before anything changes
    PROTOCOLS[protocol.name] = protocol
    return protocol


def remove(name: str) -> WireProtocol:
    """Take the protocol ``name`` out of the registry (the pivot cannot be); the protocol."""
    protocol = get_protocol(name)
    if protocol is PIVOT:
        raise ValueError(f"the pivot protocol {name!r} cannot be removed")
    return PROTOCOLS.pop(name)


def get_protocol(name: str) -> WireProtocol:
    """The registered protocol called ``name`` (``ValueError`` naming the choices otherwise)."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown wire protocol {name!r}; choose one of "
                         f"{', '.join(sorted(PROTOCOLS))}") from None


def upstream_protocols() -> list[str]:
    """The names of the registered protocols the proxy can forward in (those declaring an
    ``upstream_path``), in the order they were registered."""
    return [name for name, protocol in PROTOCOLS.items() if protocol.upstream_path]


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
