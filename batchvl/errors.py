"""Exceptions that carry a user-facing, one-line message.

`UserError` is a mistake the user can fix (bad job file, wrong path, unknown model family): the CLI
prints its message on one line and exits with code 2. `SampleError` is bad input for one sample: it
becomes an error row (`status="error"`) and the job goes on. `JobEnded` is a run that committed what
it could and stopped early on purpose (a signal, the error budget): the CLI prints its message and
exits with its code.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in how batchvl was called; the message names the problem and the fix."""


class ConfigError(UserError):
    """The job file (or a --set override) is invalid."""


class SampleError(Exception):
    """One sample (or one request) cannot be processed; it becomes an error row."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type
        self.message = message

    def __reduce__(self):
        # Crosses process boundaries (preprocessing workers): rebuild from both fields, not from args.
        return (SampleError, (self.error_type, self.message))


class JobEnded(Exception):
    """The run stopped early after committing every complete shard; `exit_code` says why, `summary`
    holds what the run did (the job's RunSummary), for the same report a finished run gives."""

    def __init__(self, message: str, exit_code: int, summary: object | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.summary = summary


class StoppedBySignal(JobEnded):
    """SIGINT, SIGTERM or SIGUSR1 arrived: the run stopped after the current step. Exit code 128 + signal."""


class ErrorBudgetExceeded(JobEnded):
    """More error rows than `output.max_error_rate` allows. Exit code 3."""

    EXIT_CODE = 3


class StopOverdue(BaseException):
    """A run given a stop signal had not stopped within its grace period and was interrupted wherever it
    was. A BaseException, like KeyboardInterrupt, so that no handler of one sample's errors takes it for
    that sample's and carries on. The CLI exits with 128 + the signal's number, as for a clean stop."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
