"""MetaClaw: an LLM agent that meta-learns and evolves in the wild.

``import metaclaw`` is light: heavy parts (torch, sentence-transformers, tinker, altair) are
imported only by the code that needs them. In a notebook, ``%load_ext metaclaw`` registers the
``%metaclaw`` magics.

May import: nothing of the package when imported; the ``%load_ext metaclaw`` hooks load
:mod:`metaclaw.notebook.magics` when IPython calls them (checked by ``tests/test_architecture.py``).
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):  # pragma: no cover - exercised by notebook tests
    from metaclaw.notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):  # pragma: no cover
    from metaclaw.notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
