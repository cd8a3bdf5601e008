"""Each run's stats file, `output.dir/_batchvl/stats/run-<start time>-<pid>.json`: written once at the end
of a run, read by `status` and the report."""

from __future__ import annotations

import json
import os
import posixpath
import time

from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir


def write_run_stats(out: OutputDir, stats: dict) -> str:
    path = out.join(layout.STATS, f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
    out.write_text(path, json.dumps(stats, indent=2, sort_keys=True))
    return path


def read_run_stats(out: OutputDir) -> list[dict]:
    """Every run's stats, oldest first, each with its file's name under "file"; files that cannot be read
    are left out (another version's, or damaged by hand)."""
    runs = []
    for path in out.list(out.join(layout.STATS), "run-*.json"):
        try:
            stats = json.loads(out.read_text(path))
        except (OSError, ValueError):
            continue
        stats["file"] = posixpath.basename(path)
        runs.append(stats)
    return runs
