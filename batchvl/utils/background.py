"""Run an iterator in a background thread and hand its items over through a bounded queue.

The consumer can then poll without blocking (the engine keeps stepping while input is not ready) and
measure how long it truly waited. Exceptions in the producer are re-raised in the consumer.

The producer thread and the consumer share the GIL. Each item the producer takes from a preprocessing
worker crosses several blocking calls (the queue's poll, its message's length and body, its pixels' file:
`preprocess/shared_pixels.py`), and after each it must get the GIL back from the consumer; a consumer busy
in Python (an engine launching a GPU's kernels, which holds the GIL between them) lets go of it only when
the interpreter asks it to, by default every 5 ms. Behind such a consumer a worker's samples arrived at 16
a second where it prepared 126 (`benchmarks/input_rate.py`, with torch's descriptors for the pixels): the
job's input, not its engine, set its rate. `prompt_handoffs` shortens the interval while the consumer
runs.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from collections.abc import Iterable, Iterator

END = object()  # returned by get() once the iterator is exhausted
# The longest a thread that waits for the GIL waits while a job's input runs beside its engine
HANDOFF_INTERVAL_S = 0.001


@contextlib.contextmanager
def prompt_handoffs(interval_s: float = HANDOFF_INTERVAL_S) -> Iterator[None]:
    """The interpreter's thread switch interval at most `interval_s` inside the block, restored after it
    (a process-wide setting: a notebook's own threads get it back as they had it)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, interval_s))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class BackgroundIterator:
    def __init__(self, iterable: Iterable, maxsize: int, name: str = "batchvl-input"):
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._iterator = iter(iterable)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._iterator:
                if not self._put(("item", item)):
                    break
            else:
                self._put(("end", None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(("error", exc))
        finally:
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()  # a generator's finally blocks run here (e.g. worker shutdown)

    def get(self, block: bool = True, timeout: float | None = None):
        """The next item, END when exhausted; raises queue.Empty if none is ready (now or within timeout)."""
        kind, value = self._queue.get(block=block, timeout=timeout)
        if kind == "error":
            raise value
        return END if kind == "end" else value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
