"""Run the tutorials from top to bottom and save their outputs in place: the committed
notebooks then show what the current code prints, figures and widgets included.

    python notebooks/regenerate.py                          # every notebook in this folder
    python notebooks/regenerate.py notebooks/04_bench.ipynb # some of them

Each notebook runs in a fresh kernel started in this folder, offline (``HF_HUB_OFFLINE=1``),
with the widgets' state saved beside the outputs (what JupyterLab shows before the kernel
runs). A widget whose state carries a bundled JavaScript library of its own (altair's live
chart: about 900 kB) is not saved: its output keeps its static forms (a PNG chart) instead
of a reference to a state that is not there. Execution counts are renumbered from 1 and the
per-cell timing metadata is dropped. Outputs that differ from run to run still change the
files: the proxy's port, latencies, times, run ids, widget model ids and PNG bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
#: A saved widget model larger than this is left out (see the module doc).
MAX_WIDGET_STATE = 200_000


def _trim_widgets(nb: Any) -> list[str]:
    """Leave out the widget models too large to save, and their views from the outputs that
    have another form to show. Returns the model ids left out."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    large = [mid for mid, model in state.items() if len(json.dumps(model)) > MAX_WIDGET_STATE]
    for mid in large:
        del state[mid]
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            view = data.get(WIDGET_VIEW)
            if view and view.get("model_id") not in state and len(data) > 1:
                del data[WIDGET_VIEW]
    if state:
        # the layout models of views left out are not needed either
        used = json.dumps([state[m]["state"] for m in state])
        for mid in [m for m, model in state.items()
                    if model.get("model_name") == "LayoutModel" and f"IPY_MODEL_{m}" not in used]:
            del state[mid]
    return large


def _tidy(nb: Any) -> None:
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        for output in cell.get("outputs", []):
            if "execution_count" in output:
                output["execution_count"] = count


def run(path: Path, timeout: int) -> None:
    """Execute one notebook and write it back with its new outputs."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    started = time.time()
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    left_out = _trim_widgets(nb)
    _tidy(nb)
    nbformat.write(nb, path)
    note = f" ({len(left_out)} large widget state(s) not saved)" if left_out else ""
    print(f"{path.name}: ran in {time.time() - started:.0f} s, outputs saved{note}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebook files (default: all here)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    paths = [Path(p).resolve() for p in args.notebooks] or sorted(HERE.glob("[0-9]*.ipynb"))
    for path in paths:
        if not path.exists():
            parser.error(f"no notebook at {path}")
    for path in paths:
        run(path, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
