"""The notebook layer: ``%metaclaw`` magics, anywidget widgets and altair charts.

It only calls the core library and renders its objects; nothing here is needed from a script.
"""

from metaclaw.notebook.magics import load_ipython_extension, unload_ipython_extension
from metaclaw.notebook.tables import scrolled

__all__ = ["load_ipython_extension", "unload_ipython_extension", "scrolled"]
