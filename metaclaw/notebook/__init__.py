"""The notebook layer: ``%metaclaw`` magics, anywidget widgets and altair charts.

It only calls the core library and renders its objects; nothing here is needed from a script.

May import: everything else in the package: the shared modules, every wing and the outer layers
(the command line, whose options the magics share, the runtime, the trace, the benchmark). Nothing
imports it but the ``%load_ext metaclaw`` hooks of ``metaclaw/__init__.py`` (checked by
``tests/test_architecture.py``).
"""

from metaclaw.notebook.magics import load_ipython_extension, unload_ipython_extension
from metaclaw.notebook.tables import scrolled

__all__ = ["load_ipython_extension", "unload_ipython_extension", "scrolled"]
