"""How a run that did not simply finish ends: stopped by a signal, or over its error budget. Either way
its complete shards are committed by then; the exception carries the run's summary for the same report
a finished run gives."""

from __future__ import annotations

from dataclasses import dataclass

from batchvl.errors import ErrorBudgetExceeded, ServerGone, ServerUnavailable, StoppedBySignal
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
    if server_gone is not None:
        left = stats["shards_total"] - stats["shards_skipped"] - stats["shards_committed"]
        raise ServerUnavailable(
            f"{server_gone}; {stats['shards_committed']} shard(s) were committed, {left} shard(s) are left "
            "for the next run of the same command once the server answers",
            ServerUnavailable.EXIT_CODE,
            summary,
        )
    if stop.requested:
        left = stats["shards_total"] - stats["shards_skipped"] - stats["shards_committed"]
        lost = stats["rows_not_committed"]
        raise StoppedBySignal(
            f"stopped by {stop.signal_name} after committing {stats['shards_committed']} shard(s); "
            f"{left} shard(s) left for the next run of the same command"
            + (f" ({lost} row(s) were done in them and will be redone)" if lost else ""),
            128 + int(stop.signum),
            summary,
        )
    rows = stats["ok"] + stats["errors"] + stats["skipped"]
    if max_error_rate is not None and rows and stats["errors"] / rows > max_error_rate:
        raise ErrorBudgetExceeded(
            f"{stats['errors']} of {rows} rows are errors ({stats['errors'] / rows:.1%}), over "
            f"output.max_error_rate={max_error_rate:g}; the shards are committed, error rows show why "
            "(batchvl status, then batchvl retry-failed)",
            ErrorBudgetExceeded.EXIT_CODE,
            summary,
        )
