"""`parquet` input: each file is a shard, streamed batch by batch (memory does not grow with file size)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.config import InputConfig
from batchvl.errors import UserError
from batchvl.inputs.paths import match_files
from batchvl.inputs.stamps import input_stamp
from batchvl.inputs.table_rows import RowSampler, UnreadableRows
from batchvl.inputs.types import Sample, ShardEnd, ShardInfo
from batchvl.storage.remote import is_remote, open_remote

BATCH_ROWS = 256


class ParquetSource:
    def __init__(self, cfg: InputConfig):
        self.paths = cfg.paths
        self.storage_options = cfg.storage_options
        self.rows = RowSampler(cfg.image_column, cfg.key_column, cfg.root)

    def _open(self, path: str) -> pq.ParquetFile:
        # On an object store: a seekable stream of byte ranges (the footer, then one row group at a time).
        return pq.ParquetFile(open_remote(path, self.storage_options) if is_remote(path) else path)

    def list_shards(self) -> list[ShardInfo]:
        shards = []
        for path, shard_id in match_files(self.paths, (".parquet",), "Parquet files", self.storage_options):
            try:
                footer = self._open(path)  # the footer only: row count and schema
            except (pa.ArrowInvalid, OSError) as exc:
                raise UserError(f"input file '{path}' is not a readable Parquet file: {exc}") from None
            schema, stamp = footer.schema_arrow, input_stamp(path, self.storage_options)
            shards.append(
                ShardInfo(
                    shard_id,
                    path,
                    footer.metadata.num_rows,
                    columns=tuple(schema.names),
                    column_types=tuple(schema.types),
                    stamp=stamp,
                )
            )
        return shards

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        parquet = self._open(shard.path)
        self.rows.check_columns(parquet.schema_arrow.names, shard.path)
        yield from self.rows.samples(shard, _batches(parquet, shard.path), keep, os.path.dirname(shard.path))


def _batches(parquet: pq.ParquetFile, path: str) -> Iterator[pa.RecordBatch | UnreadableRows]:
    """The file's rows batch by batch, one row group at a time: the rest of a group that cannot be read (a
    damaged page: the footer says how many rows it holds) comes as `UnreadableRows`, and the next group is
    read, so that one damaged page costs its group's rows, not the shard, and not the job."""
    for group in range(parquet.num_row_groups):
        read = 0
        try:
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group]):
                read += batch.num_rows
                yield batch
        except (pa.ArrowException, OSError) as exc:
            rows = parquet.metadata.row_group(group).num_rows - read
            reason = f"row group {group} of {path} cannot be read ({type(exc).__name__}: {exc})"
            yield UnreadableRows(rows, reason)
