"""Taking what a queue holds: the job loop's `step` over work that runs in other threads (engine replicas,
a server backend's requests) hands back every finished item at once, waiting briefly only when none is."""

from __future__ import annotations

import contextlib
import queue


def take_ready(source: queue.Queue | queue.SimpleQueue, wait_s: float) -> list:
    """Every item `source` holds now, after waiting up to `wait_s` for a first one (0: no wait)."""
    items = []
    if wait_s > 0:
        with contextlib.suppress(queue.Empty):
            items.append(source.get(timeout=wait_s))
    while not source.empty():
        items.append(source.get_nowait())
    return items
