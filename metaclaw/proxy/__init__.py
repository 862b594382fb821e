"""The request path wing: the proxy an agent talks to, from the request's edge to the store.

- :mod:`~metaclaw.proxy.app`: the :class:`~metaclaw.proxy.app.Proxy` (an aiohttp application)
  and its configuration;
- :mod:`~metaclaw.proxy.pipeline`: the turn pipeline every request goes through, and the recorder;
- :mod:`~metaclaw.proxy.edge`: what a request must be before the pipeline sees it;
- :mod:`~metaclaw.proxy.sessions`: which session a request belongs to and its turn type;
- :mod:`~metaclaw.proxy.context_budget`: the skill block never pushes a request past the window;
- :mod:`~metaclaw.proxy.upstreams`: where a turn is forwarded;
- :mod:`~metaclaw.proxy.server`: serving an aiohttp application on its own event loop.

May import: the shared modules, :mod:`metaclaw.skills` and :mod:`metaclaw.protocols` (the wire
formats, which stay a package of their own: one adapter file per protocol). Never the loops,
the offline stand-ins or the outer layers (checked by ``tests/test_architecture.py``).

``from metaclaw.proxy import Proxy, ProxyConfig`` keeps working: the names are read from
:mod:`~metaclaw.proxy.app` when first used (``import metaclaw.proxy.sessions`` does not load
aiohttp through this file).
"""

_PUBLIC = {"Proxy": "app", "ProxyConfig": "app"}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
