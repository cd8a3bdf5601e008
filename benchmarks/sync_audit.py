"""Where the host waits for the GPU over a window of engine steps, and how often.

An overlapped step (`engine.overlap`) pays only where nothing in it makes the host wait for the device: one
wait is enough to leave the GPU idle while the host builds the next step, and the vision tower's code (the
engine's own and transformers') may read sizes from device tensors. torch's sync debug mode warns on each
implicit wait (`item`, `tolist`, a copy to the host, `nonzero`, a stream's `synchronize`); the explicit
ones, `torch.cuda.synchronize` and an event's `synchronize`, which it does not flag, are counted by wrapping
them. Each wait is counted at its site: the innermost frame of batchvl, transformers or the benchmarks that
led to it, with the batchvl frame that called into transformers, so that the report names the lines to
change. Taking a stack per wait costs the host time, so the audit has a window of its own, after the
kernel-time window (`step_timing`).
"""

from __future__ import annotations

import collections
import traceback
import warnings
from pathlib import Path

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text (c10's warn_or_error_on_sync)
OWN_PACKAGES = ("batchvl", "transformers", "benchmarks")  # a site is a frame of one of these
TOP_SITES = 12


def package_path(filename: str) -> tuple[str, str] | None:
    """(package, path from the package's folder on) of a frame's file inside OWN_PACKAGES, else None."""
    parts = Path(filename).parts
    for index in range(len(parts) - 1, -1, -1):
        if parts[index] in OWN_PACKAGES:
            return parts[index], "/".join(parts[index:])
    return None


def site_of(frames: list[traceback.FrameSummary]) -> str:
    """The site of a wait whose stack is `frames` (outermost first): the innermost frame of OWN_PACKAGES
    (this file's own aside), and where that is transformers', the innermost batchvl frame that led there."""
    located = []
    for frame in reversed(frames):
        found = package_path(frame.filename)
        if found is not None and Path(frame.filename).name != Path(__file__).name:
            located.append((found[0], f"{found[1]}:{frame.lineno} {frame.name}"))
    if not located:
        return "elsewhere"
    package, innermost = located[0]
    if package == "transformers":
        caller = next((where for owner, where in located if owner == "batchvl"), None)
        if caller is not None:
            return f"{innermost} <- {caller}"
    return innermost


class SyncAudit:
    """Counts the host's waits for the GPU while it is on (`start` to `stop`), by kind and site. `cuda` is
    torch.cuda (a stand-in in the tests)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()  # (kind, site) -> waits
        self._undo: list = []

    def _count(self, kind: str) -> None:
        self.sites[kind, site_of(traceback.extract_stack())] += 1

    def start(self) -> None:
        cuda = self.cuda
        previous_mode = cuda.get_sync_debug_mode()
        cuda.set_sync_debug_mode("warn")
        catching = warnings.catch_warnings()  # restores the filters and `showwarning` when it exits
        catching.__enter__()
        warnings.filterwarnings("always", message=SYNC_WARNING)  # each wait, not the first per line
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                self._count("implicit")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        synchronize, event_synchronize = cuda.synchronize, cuda.Event.synchronize

        def counted_synchronize(*args, **kwargs):
            self._count("explicit")
            return synchronize(*args, **kwargs)

        def counted_event_synchronize(event):
            self._count("explicit")
            return event_synchronize(event)

        cuda.synchronize, cuda.Event.synchronize = counted_synchronize, counted_event_synchronize

        def undo():
            cuda.synchronize, cuda.Event.synchronize = synchronize, event_synchronize
            catching.__exit__(None, None, None)
            cuda.set_sync_debug_mode(previous_mode)

        self._undo.append(undo)

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def report(self, steps: int) -> dict:
        """The waits per step by kind, and the TOP_SITES sites with the most waits."""
        by_kind = collections.Counter()
        for (kind, _), count in self.sites.items():
            by_kind[kind] += count
        return {
            "steps": steps,
            "host_waits_per_step": {
                kind: round(by_kind[kind] / max(steps, 1), 2) for kind in ("implicit", "explicit")
            },
            "host_wait_sites": [
                {"kind": kind, "site": site, "waits": count}
                for (kind, site), count in self.sites.most_common(TOP_SITES)
            ],
        }
