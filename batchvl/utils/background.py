"""Run an iterator in a background thread and hand its items over through a bounded queue.

The consumer can then poll without blocking (the engine keeps stepping while input is not ready) and
measure how long it truly waited. Exceptions in the producer are re-raised in the consumer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

END = object()  # returned by get() once the iterator is exhausted


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
