"""The node's stats: its engine processes' stats added into one file, as one run's, with each process's
own entry under "processes" (its device, how it ended, and how long it waited for input).

Counts add (samples, rows, tokens, seconds spent in the engine or waiting, per-type and per-rank counts).
The processes ran side by side, so the node's wall and model-load times are the longest of theirs, its
processing time runs from the first process's start of processing to the last one's end, and its rates
are the summed counts over that time. What the launcher planned (the
task's shards, those done before) is the node's, not a sum of the processes' views of it.
"""

from __future__ import annotations

from batchvl.utils.stats import add_counts, add_rates

SIDE_BY_SIDE = ("wall_s", "model_load_s", "processing_s")
THE_SAME = ("vit_parallel_ranks",)  # each process's own: 1, since a node's launch refuses ViT-DP
EACH_PROCESS = ("samples", "shards_committed", "input_wait_s", "input_wait_share", "preprocess_workers")


def node_stats(
    zero: dict,
    runs: list[dict | None],
    devices: list[str],
    exit_codes: list[int | None],
    ended_at: list[float | None],
) -> dict:
    """`runs[i]`: process i's stats (None: it died before it could say), which reached the launcher at
    `ended_at[i]` (its monotonic clock); `zero`: a run's stats that counted nothing, so that every key is
    there when no process reported."""
    stats: dict = {}
    for run in [zero, *(run for run in runs if run is not None)]:
        for key, value in run.items():
            if key not in stats or key in THE_SAME:
                stats[key] = value
            elif key in SIDE_BY_SIDE:
                stats[key] = max(stats[key], value)
            elif isinstance(value, dict):
                stats[key] = {k: stats[key].get(k, 0) + value.get(k, 0) for k in {*stats[key], *value}}
            elif isinstance(value, int | float | list) and not isinstance(value, bool):
                stats[key] = add_counts(stats[key], value)
            # else: a name (mode, task, stopped_by), the same for every process
    # the processes started processing at different times (each loads its model): the node processed from
    # the first one's start to the last one's end
    spans = [(end - run["processing_s"], end) for run, end in zip(runs, ended_at, strict=True) if run and end]
    if spans:
        stats["processing_s"] = round(max(end for _, end in spans) - min(start for start, _ in spans), 3)
    add_rates(stats, len(runs))
    stats["processes"] = [
        {
            "device": device,
            "exit_code": code,
            **({key: run.get(key) for key in EACH_PROCESS} if run is not None else {}),
        }
        for run, device, code in zip(runs, devices, exit_codes, strict=True)
    ]
    return stats
