"""Give freed heap memory back to the operating system now and then (glibc only).

The job loop allocates buffers of ever-changing sizes from two threads (prepared samples arrive in the
input thread, the engine's tensors come and go in the main thread). glibc keeps such freed memory in its
arenas, so resident memory creeps up with the number of samples although nothing is alive.
`malloc_trim` returns those free pages; called every few seconds it costs well under a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_libc = None
_checked = False


def _load_libc():
    global _libc, _checked
    if not _checked:
        _checked = True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            _libc = libc if libc is not None and hasattr(libc, "malloc_trim") else None
        except OSError:
            _libc = None
    return _libc


class HeapTrimmer:
    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self._last = time.monotonic()

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            libc = _load_libc()
            if libc is not None:
                libc.malloc_trim(0)
