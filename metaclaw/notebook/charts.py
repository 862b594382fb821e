"""Altair charts drawn offline: ``%load_ext metaclaw`` makes altair render each chart to a PNG
image locally with vl-convert (no CDN script to load, so charts show offline, on GitHub, and in a
notebook that is not trusted yet, where JupyterLab shows no script or SVG output).

    enable()          # what %load_ext metaclaw does; returns the renderer now active
    png_bundle(spec)  # ({"image/png": ..., "text/plain": ...}, metadata) for one spec

Interactive charts that also need no CDN: ``alt.renderers.enable("jupyter", offline=True)``
(altair's JupyterChart widget with its JavaScript bundled by vl-convert).
"""

from __future__ import annotations

import base64
import struct
from typing import Any

#: The name this renderer is registered under in ``altair.renderers``.
RENDERER = "metaclaw"

#: Pixels per CSS pixel in the PNG: sharp on high-density screens, shown at the chart's size.
SCALE = 2


def _title(spec: dict[str, Any]) -> str:
    title = spec.get("title")
    if isinstance(title, dict):
        title = title.get("text")
    if isinstance(title, list):
        title = " ".join(str(t) for t in title)
    return str(title) if title else "chart"


def _smaller(png: bytes) -> bytes:
    """The PNG with its colours reduced to a 256-colour palette when Pillow is installed (a
    chart has a few flat colours and their anti-aliased edges: a tenth of the bytes, the same
    picture); else as it is."""
    try:
        import io

        from PIL import Image
    except ImportError:
        return png
    try:
        with Image.open(io.BytesIO(png)) as image:
            out = io.BytesIO()
            image.quantize(256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
    except Exception:  # noqa: BLE001 - the image as drawn is still right
        return png
    return out.getvalue() if len(out.getvalue()) < len(png) else png


def png_bundle(spec: dict[str, Any], scale: int = SCALE) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Vega-Lite ``spec`` drawn by vl-convert: ``({"image/png": base64, "text/plain":
    "<chart: TITLE>"}, {"image/png": {"width", "height"}})``; the image is ``scale`` times
    the chart's size and shown at the chart's size."""
    import vl_convert

    png = _smaller(vl_convert.vegalite_to_png(spec, scale=scale))
    width, height = struct.unpack(">II", png[16:24])  # the PNG header's IHDR chunk
    data = {"image/png": base64.b64encode(png).decode("ascii"),
            "text/plain": f"<chart: {_title(spec)}>"}
    return data, {"image/png": {"width": width // scale, "height": height // scale}}


def render(spec: dict[str, Any], **_options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The altair renderer: the chart as a PNG, or one line saying why it could not be drawn."""
    try:
        return png_bundle(spec)
    except Exception as exc:  # noqa: BLE001 - a sentence in the output, not a traceback
        text = " ".join(str(exc).split())[:300]
        return {"text/plain": f"<chart: {_title(spec)}: could not be drawn offline ({text})>"}, {}


def enable(*, force: bool = False) -> str:
    """Register the offline PNG renderer and make it altair's active one, unless the notebook
    already chose another (``force``: in any case). Returns the renderer now active."""
    import altair as alt

    if RENDERER not in alt.renderers.names():
        alt.renderers.register(RENDERER, render)
    if force or alt.renderers.active in ("default", "html", ""):
        alt.renderers.enable(RENDERER)
    return alt.renderers.active
