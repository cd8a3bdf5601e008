"""SIGINT, SIGTERM and SIGUSR1 as a request to stop cleanly: finish the current engine step, commit
nothing partial.

Slurm sends SIGTERM before killing a job (preemption, time limit, scancel) and, with
`--signal=B:USR1@seconds`, SIGUSR1 ahead of the time limit; a terminal sends SIGINT on Ctrl-C (to the
whole process group: preprocessing workers ignore it and leave the stop to the job). A job that stops
between steps loses only the shards it had not finished, and those are redone by the rerun or the
requeued task. A second Ctrl-C interrupts at once, for a user who will not wait for the step.
"""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """While entered (in the main thread), remembers the first stop signal instead of dying from it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> StopRequests:
        # Signal handlers can only be set from the main thread (a notebook's worker thread cannot).
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning("%s received: stopping after the current step", signal.Signals(signum).name)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, committed shards stay
