"""Each run's stats file, `output.dir/_batchvl/stats/run-<start time>-<pid>.json`: written once at the end
of a run, read by `status` and the report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from batchvl.io.writers import write_json_atomic


def _folder(out_dir: str) -> Path:
    return Path(out_dir, "_batchvl", "stats")


def write_run_stats(out_dir: str, stats: dict) -> str:
    path = _folder(out_dir) / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    write_json_atomic(str(path), stats)
    return str(path)


def read_run_stats(out_dir: str) -> list[dict]:
    """Every run's stats, oldest first, each with its file's name under "file"; files that cannot be read
    are left out (another version's, or damaged by hand)."""
    paths = sorted(_folder(out_dir).glob("run-*.json"), key=lambda p: (p.stat().st_mtime, p.name))
    runs = []
    for path in paths:
        try:
            stats = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        stats["file"] = path.name
        runs.append(stats)
    return runs
