"""The job loop's heap policy (glibc only): reuse freed memory between steps, and give it back to the
operating system every few seconds.

Reuse: by default glibc serves each allocation over a moving threshold (up to 32 MiB) with a fresh `mmap`
and unmaps it on free, and hands the top of the heap back once more than twice that is free. An engine
step allocates and frees activations of many MiB per layer, so each one was first touched as new pages:
on the vision tower, elementwise ops over such tensors ran 5-10x slower than over reused memory.
`keep_freed_memory` serves allocations up to 32 MiB from the heap and keeps freed pages mapped.

Give back: the loop allocates buffers of ever-changing sizes from two threads (prepared samples arrive in
the input thread, the engine's tensors come and go in the main thread). Kept free memory would let
resident memory creep up with the number of samples although nothing is alive. `malloc_trim` returns
those free pages; called every few seconds it costs well under a millisecond (plus re-touching the pages
the next steps use).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

MB = 1 << 20  # a MiB: memory settings (`*_mb`, `*_gb`) count in binary units
GB = 1 << 30

_libc = None
_checked = False


def load_libc():
    """The process's C library (loaded once), or None where it cannot be found; glibc-only functions
    (`malloc_trim`, `mallopt`) are checked for where they are used."""
    global _libc, _checked
    if not _checked:
        _checked = True
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else None
        except OSError:
            _libc = None
    return _libc


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
LARGEST_HEAP_ALLOCATION = 32 * 1024 * 1024  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems


def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from the heap and never shrink it on free; returns whether it
    applied (not on other C libraries). Process-wide: it is set once, when a job loop starts."""
    libc = load_libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    # Setting either parameter also turns off glibc's moving thresholds. The heap is then only given back by
    # HeapTrimmer.
    return bool(libc.mallopt(M_MMAP_THRESHOLD, LARGEST_HEAP_ALLOCATION)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    )


class HeapTrimmer:
    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self._last = time.monotonic()

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            release_free_heap()


def release_free_heap() -> None:
    """Hand the heap's free pages back to the operating system now (glibc only)."""
    libc = load_libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
