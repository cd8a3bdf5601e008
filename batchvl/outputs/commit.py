"""Shard commits, the same on a local disk and on an object store (which has no rename):

1. the shard's Parquet file is written under its final name, whole (`OutputDir.write_bytes`: a temp file
   renamed into place locally; one upload on an object store, which shows the object only once complete);
2. files made from it (the batch API output) are written beside it;
3. the completion marker `_batchvl/done/<shard>.json` is written last. It names the output-defining config
   that wrote the rows (so a rerun with a changed config is detected and the changed keys named) and the
   Parquet file's size and SHA-256.

Beside the marker, `_batchvl/inputs/<shard>.json` holds the stamp of the input file the rows were made
from (`inputs/stamps.py`), written once the Parquet file is whole: a shard whose stamp is another is
redone whole; one stopped before its new stamp is written has the old one, so it too is redone, never
taken as made from a file it was not.

A shard is committed when its marker exists and the file beside it has the size the marker names. A crash
before the marker leaves a new shard uncommitted: the next run redoes it from scratch, overwriting what it
finds. A committed shard that is written again (a run that keeps its unchanged prompts' rows,
`--overwrite`, `retry-failed`) keeps its old rows until the new ones are whole: the new marker is written
first, naming the new file's hash and holding the marker it `replaces`; then the file, the files made from
it, and the marker again without what it replaced. Until then a reader hashes the file and takes the
marker whose hash it has (the old shard, or the new one), so a crash at any point leaves one or the other,
never a mix, never a row twice; a run finishes a new one left so (its batch API file, its marker). A
committed marker from before hashes were recorded cannot tell the two files apart: it is removed first,
and the shard is uncommitted until its new marker. The hash is checked whenever a file's rows are read
back (results, retry-failed, the report): a file changed after its commit is named, not read.
"""

from __future__ import annotations

import enum
import hashlib
import json
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.errors import UserError
from batchvl.inputs.stamps import stamps_match
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.writers import ResultRow, output_name, output_path, parquet_bytes
from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir


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
    output_bytes: int | None = None  # the committed Parquet file's size and hash (None: an older marker)
    output_sha256: str | None = None
    replaces: dict | None = None  # while the shard is written again: the committed marker it replaces

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


def marker_path(out: OutputDir, shard: str) -> str:
    return out.join(layout.MARKERS, output_name(shard).removesuffix(".parquet") + ".json")


def read_marker(out: OutputDir, shard: str) -> ShardMarker | None:
    """The shard's marker, or None when the shard is not committed (no marker, an unreadable one, or no
    output file of the size it names). While the shard is written again, the marker of the file that is
    there: the new one (its `replaces` still set: the rewrite's last steps are left) or the one replaced."""
    try:
        marker = ShardMarker(**json.loads(out.read_text(marker_path(out, shard))))
    except (OSError, ValueError, TypeError):
        return None  # none, one from a killed write, or another version's: the shard is redone
    path = output_path(out, shard)
    if marker.replaces is not None:
        digest = hashlib.sha256(out.read_bytes(path)).hexdigest() if out.size(path) is not None else None
        replaced = ShardMarker(**marker.replaces)
        return (
            marker
            if digest == marker.output_sha256
            else replaced
            if digest == replaced.output_sha256
            else None
        )
    size = out.size(path)
    if size is None or (marker.output_bytes is not None and size != marker.output_bytes):
        return None
    return marker


class CommitState(enum.Enum):
    """Where a shard of an output folder stands, for a config: the one answer resume, status, retry-failed,
    validate, export and the report all use."""

    MISSING = "missing"  # no marker: never run, or stopped before its commit; the next run does it
    DONE = "done"  # committed with rows of this config
    STALE = "stale"  # committed with rows of another config: refused unless overwritten
    INPUT_CHANGED = "input changed"  # committed from an input that changed since: the next run redoes it


def commit_state(
    out: OutputDir, shard: str, fingerprint: str, listed: ShardInfo | None = None
) -> tuple[CommitState, ShardMarker | None]:
    """The shard's state for the config with this fingerprint and its input as `listed` now (None, or a
    listing without a stamp: not known, as a marker written before stamps were recorded), and its marker
    where it has one."""
    state, marker, _ = commit_state_and_stamp(out, shard, fingerprint, listed)
    return state, marker


def commit_state_and_stamp(
    out: OutputDir, shard: str, fingerprint: str, listed: ShardInfo | None = None
) -> tuple[CommitState, ShardMarker | None, dict | None]:
    """`commit_state`, and the input stamp on record as it read it: for a shard with a marker and a
    `listed` stamp, None where none is recorded (for any other, None: not read)."""
    marker = read_marker(out, shard)
    if marker is None:
        return CommitState.MISSING, None, None
    known = listed is not None and listed.stamp is not None
    recorded = read_input_stamp(out, shard) if known else None
    if recorded is not None and not stamps_match(recorded, listed):
        return CommitState.INPUT_CHANGED, marker, recorded
    return (CommitState.DONE if marker.fingerprint == fingerprint else CommitState.STALE), marker, recorded


def is_committed_by(out: OutputDir, fingerprint: str, shard: str, listed: ShardInfo | None = None) -> bool:
    """Whether the shard is committed with rows of the config that has this fingerprint, from its input
    as `listed` now."""
    return commit_state(out, shard, fingerprint, listed)[0] is CommitState.DONE


def read_committed(out: OutputDir, shard: str, marker: ShardMarker) -> pa.Table:
    """The committed rows of a shard (`marker`: its marker), after checking the file is the one committed."""
    path = output_path(out, shard)
    data = out.read_bytes(path)
    if marker.output_sha256 is not None and hashlib.sha256(data).hexdigest() != marker.output_sha256:
        raise UserError(
            f"{path} changed after it was committed (its SHA-256 is not the one its marker names); remove "
            f"{marker_path(out, shard)} and rerun the job to write the shard again"
        )
    return pq.read_table(pa.BufferReader(data))


def commit_shard(
    out: OutputDir,
    shard: str,
    table: pa.Table,
    marker: ShardMarker,
    companion: Callable[[str, pa.Table], None] | None = None,
    stamp: dict | None = None,
) -> str:
    """Write the shard's table, the stamp of the input it was made from (None: leave the one recorded),
    then `companion(shard, table)` (files made from it, such as the batch API output), then its marker,
    which names the file's size and hash; returns the Parquet path. A committed
    shard stays committed, with its old rows, until the new file is whole (the module's docstring)."""
    data = parquet_bytes(table)
    marker.output_bytes, marker.output_sha256 = len(data), hashlib.sha256(data).hexdigest()
    committed = read_marker(out, shard)
    if committed is not None and committed.output_sha256 is not None:
        marker.replaces = asdict(replace(committed, replaces=None))
        _write_marker(out, marker)
    else:  # new, or an older marker without a hash: uncommitted until its new marker
        out.remove(marker_path(out, shard))
    path = output_path(out, shard)
    out.write_bytes(path, data)
    if stamp is not None:
        record_input_stamp(out, shard, stamp)
    finish_commit(out, marker, table, companion)
    return path


def finish_commit(
    out: OutputDir, marker: ShardMarker, table: pa.Table, companion: Callable[[str, pa.Table], None] | None
) -> None:
    """The last steps of a commit whose Parquet file is whole: the files made from it, then its marker
    (without the one it replaced). A run calls it again for a rewrite that stopped between them."""
    if companion is not None:
        companion(marker.shard, table)
    marker.replaces = None
    _write_marker(out, marker)


def input_stamp_path(out: OutputDir, shard: str) -> str:
    return out.join(layout.INPUT_STAMPS, output_name(shard).removesuffix(".parquet") + ".json")


def read_input_stamp(out: OutputDir, shard: str) -> dict | None:
    """The stamp of the input a committed shard was made from; None where none was recorded (a commit
    from before stamps were, or a format without them): not compared."""
    try:
        stamp = json.loads(out.read_text(input_stamp_path(out, shard)))
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def record_input_stamp(out: OutputDir, shard: str, stamp: dict) -> None:
    out.write_text(input_stamp_path(out, shard), json.dumps(stamp, sort_keys=True))


def record_marker(out: OutputDir, marker: ShardMarker) -> None:
    """Write a settled marker again with what it records now (a field markers record since it was written);
    its shard's file is untouched."""
    assert marker.replaces is None  # a rewrite's marker is settled by `finish_commit`
    _write_marker(out, marker)


def _write_marker(out: OutputDir, marker: ShardMarker) -> None:
    fields = asdict(marker)
    if fields["replaces"] is None:  # a settled marker is the one earlier versions wrote, and read
        del fields["replaces"]
    out.write_text(marker_path(out, marker.shard), json.dumps(fields, indent=2, sort_keys=True))
