"""SIGINT, SIGTERM and SIGUSR1 as a request to stop cleanly: finish the current engine step, commit
nothing partial.

Slurm sends SIGTERM before killing a job (preemption, time limit, scancel) and, with
`--signal=B:USR1@seconds`, SIGUSR1 ahead of the time limit; a terminal sends SIGINT on Ctrl-C (to the
whole process group: preprocessing workers ignore it and leave the stop to the job). A job that stops
between steps loses only the shards it had not finished, and those are redone by the rerun or the
requeued task. A second Ctrl-C interrupts at once, for a user who will not wait for the step.

A stop is also a deadline: a step that does not end (a hung call, a pathological input) must not keep a
preempted task alive until Slurm kills it, nor make a rerun hang the same way. `STOP_GRACE_S` after the
signal, `StopOverdue` is raised wherever the main thread is, and the run's cleanup runs on its way out; if
that cleanup hangs too, the process ends `HARD_EXIT_S` later from faulthandler's watchdog thread, with every
thread's traceback on stderr. Committed shards are whole either way: a commit cut short is not committed,
and the rerun redoes that shard. (Python runs signal handlers between bytecodes, so native code that never
returns, a C loop that holds the interpreter, is out of reach: Slurm's SIGKILL after KillWait ends it.)
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading

from batchvl.errors import StopOverdue

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
STOP_GRACE_S = 10.0  # a clean stop takes a step and the workers' shutdown; Slurm's KillWait is 30 s
HARD_EXIT_S = 10.0  # after the grace, for a main thread that Python's signal handling cannot reach


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
            self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._overdue)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous:  # the run has stopped: no deadline any more
            signal.setitimer(signal.ITIMER_REAL, 0)
            faulthandler.cancel_dump_traceback_later()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning(
                "%s received: stopping after the current step (interrupting it if it has not ended in %g s)",
                signal.Signals(signum).name,
                STOP_GRACE_S,
            )
            signal.setitimer(signal.ITIMER_REAL, STOP_GRACE_S)
            faulthandler.dump_traceback_later(STOP_GRACE_S + HARD_EXIT_S, exit=True, file=sys.stderr)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, committed shards stay

    def _overdue(self, signum: int, frame) -> None:
        name = signal.Signals(self.signum).name
        raise StopOverdue(
            f"stopped by {name}: the current step had not ended {STOP_GRACE_S:g} s later, so it was "
            "interrupted; committed shards stay, the rerun redoes the others",
            self.signum,
        )
