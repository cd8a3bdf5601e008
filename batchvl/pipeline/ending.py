"""How a run that did not simply finish ends: stopped by a signal, or over its error budget. Either way
its complete shards are committed by then; the exception carries the run's summary for the same report
a finished run gives."""

from __future__ import annotations

from dataclasses import dataclass

from batchvl.errors import ErrorBudgetExceeded, ServerGone, ServerUnavailable, StoppedBySignal
from batchvl.pipeline.resume import ShardPlan
from batchvl.utils.stop import StopRequests


@dataclass
class RunSummary:
    """What a run reports when it ends, finished or not."""

    output_dir: str
    stats_path: str
    stats: dict
    is_driver: bool = True  # False on a rank that only served ViT encode rounds


def raise_if_ended_early(
    summary: RunSummary,
    stop: StopRequests,
    max_error_rate: float | None,
    server_gone: ServerGone | None = None,
) -> None:
    """Raise when the run stopped on a signal or because its server went away, or when its share of error
    rows is over `max_error_rate` (None: no budget, as for retry-failed)."""
    stats = summary.stats
    left = stats["shards_total"] - stats["shards_skipped"] - stats["shards_committed"]
    if server_gone is not None:
        raise ServerUnavailable(
            f"{server_gone}; {stats['shards_committed']} shard(s) were committed, {left} shard(s) are left "
            "for the next run of the same command once the server answers",
            ServerUnavailable.EXIT_CODE,
            summary,
        )
    lost = stats["rows_not_committed"]
    # A stop that came after the last shard was committed stopped nothing: the run finished (a scheduler's
    # SIGTERM at the end of a job that is done must not read as a preempted task to requeue)
    if stop.requested and (left or lost):
        raise StoppedBySignal(
            f"stopped by {stop.signal_name} after committing {stats['shards_committed']} shard(s); "
            f"{left} shard(s) left for the next run of the same command"
            + (f" ({lost} row(s) were done in them and will be redone)" if lost else ""),
            128 + int(stop.signum),
            summary,
        )
    # The budget holds for the task's output, not for what this run added: a rerun that finds every shard
    # committed (or finishes the last few) answers for the error rows of the runs before it too, so that
    # rerunning the command that exited 3 exits 3 again until the errors are retried.
    before = stats.get("rows_committed_before") or {}
    errors = stats["errors"] + before.get("errors", 0)
    rows = stats["ok"] + stats["errors"] + stats["skipped"] + sum(before.values())
    if max_error_rate is not None and rows and errors / rows > max_error_rate:
        earlier = sum(before.values())
        raise ErrorBudgetExceeded(
            f"{errors} of {rows} rows are errors ({errors / rows:.1%}), over "
            f"output.max_error_rate={max_error_rate:g}"
            + (f" ({earlier} of the rows are of shards committed by earlier runs)" if earlier else "")
            + "; the shards are committed, error rows show why (batchvl status, then batchvl retry-failed)",
            ErrorBudgetExceeded.EXIT_CODE,
            summary,
        )


def rows_committed_before(resume: ShardPlan) -> dict[str, int]:
    """The rows of the task's shards committed before this run, by status (from their markers)."""
    done = resume.done.values()
    return {
        "ok": sum(marker.ok for marker in done),
        "errors": sum(marker.errors for marker in done),
        "skipped": sum(marker.skipped for marker in done),
    }
