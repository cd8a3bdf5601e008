"""Shard commits: the shard's Parquet file, then a completion marker saying which config wrote it.

A shard is committed once both exist. The Parquet file is renamed into place only when complete, and
the marker is written (also atomically) after it, so a crash at any point leaves either a committed
shard or one that the next run redoes from scratch, never a partial one. The marker records the
output-defining config, so a rerun with a changed config is detected and the changed keys named.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from batchvl.io.writers import ResultRow, output_path, write_json_atomic, write_shard

MARKER_DIR = os.path.join("_batchvl", "done")


@dataclass
class ShardMarker:
    shard: str
    fingerprint: str  # hash of `config`
    config: dict  # the output-defining part of the job config that wrote the rows
    rows: int
    ok: int
    errors: int
    errors_by_type: dict[str, int]
    task: str | None  # "I/N" when the run was one task of a split job
    skipped: int = 0  # rows of follow-up prompts whose `when` did not match
    host: str = field(default_factory=socket.gethostname)
    written_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    batchvl_version: str = ""
    retries: list[dict] = field(default_factory=list)  # one record per `retry-failed` that changed rows

    @classmethod
    def for_rows(
        cls, shard: str, rows: list[ResultRow], config: dict, fingerprint: str, **extra
    ) -> ShardMarker:
        marker = cls(shard, fingerprint, config, rows=0, ok=0, errors=0, errors_by_type={}, **extra)
        marker.count([(row.status, row.error_type) for row in rows])
        return marker

    def count(self, statuses: list[tuple[str, str | None]]) -> None:
        """Set the row counts from each row's (status, error_type)."""
        self.errors_by_type = {}
        for status, error_type in statuses:
            if status == "error":
                name = error_type or "unknown"
                self.errors_by_type[name] = self.errors_by_type.get(name, 0) + 1
        self.rows = len(statuses)
        self.errors = sum(self.errors_by_type.values())
        self.skipped = sum(status == "skipped" for status, _ in statuses)
        self.ok = self.rows - self.errors - self.skipped


def marker_path(out_dir: str, shard: str) -> str:
    relative = os.path.relpath(output_path(out_dir, shard), out_dir)
    return os.path.join(out_dir, MARKER_DIR, relative.removesuffix(".parquet") + ".json")


def read_marker(out_dir: str, shard: str) -> ShardMarker | None:
    """The shard's marker, or None when the shard is not committed (no marker, no output, or unreadable)."""
    if not os.path.isfile(output_path(out_dir, shard)):
        return None
    try:
        with open(marker_path(out_dir, shard)) as handle:
            return ShardMarker(**json.load(handle))
    except (OSError, ValueError, TypeError):
        return None  # a marker from a killed write or another version: the shard is redone


def is_committed_by(out_dir: str, fingerprint: str, shard: str) -> bool:
    """Whether the shard is committed with rows of the config that has this fingerprint."""
    marker = read_marker(out_dir, shard)
    return marker is not None and marker.fingerprint == fingerprint


def commit_shard(
    out_dir: str,
    shard: str,
    rows: list[ResultRow],
    metadata: dict[str, str],
    marker: ShardMarker,
    optional: tuple[str, ...] = (),
    companion: Callable[[str, str], None] | None = None,
) -> str:
    """Write the shard's rows (with the `optional` columns the job writes), then `companion(shard, path)`
    (files made from the Parquet file, such as the batch API output), then its marker; returns the
    Parquet path."""
    path = write_shard(out_dir, shard, rows, metadata, optional)
    if companion is not None:
        companion(shard, path)
    write_marker(out_dir, marker)
    return path


def write_marker(out_dir: str, marker: ShardMarker) -> None:
    write_json_atomic(marker_path(out_dir, marker.shard), asdict(marker))
