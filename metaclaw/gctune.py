"""The cyclic garbage collector tuned for a burst of many short-lived objects.

    with fewer_collections():
        ...  # thousands of rows, tasks or replies alive for a moment, none of them in a cycle

Python collects its youngest generation every 700 allocations; work that keeps tens of thousands
of objects alive for a few seconds (an experiment's replays in flight, a batch of turns read for
per-skill evidence) makes it run hundreds of times, each run promoting survivors towards full
collections that scan them all again. Collecting every :data:`YOUNG_COLLECTION_OBJECTS`
allocations instead keeps cycles collected while the burst lasts, at a small fraction of the cost
(measured in ``benchmarks/bench_experiment.py`` and ``benchmarks/bench_evidence.py``).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

#: The youngest generation is collected every this many allocations inside
#: :func:`fewer_collections` (Python's default: 700).
YOUNG_COLLECTION_OBJECTS = 20_000


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collect the youngest generation less often for the duration, then restore the thresholds.
    Left alone where the collector is off or already set to collect less often, and not restored
    where someone else changed the threshold meanwhile."""
    first, *older = gc.get_threshold()
    if first == 0 or first >= YOUNG_COLLECTION_OBJECTS:
        yield
        return
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS, *older)
    try:
        yield
    finally:
        if gc.get_threshold()[0] == YOUNG_COLLECTION_OBJECTS:  # nobody else changed it since
            gc.set_threshold(first, *older)
