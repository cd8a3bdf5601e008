"""Reading a job's results back: the committed output shards of its input shards, in input order."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.config import JobConfig
from batchvl.io.commit import read_marker
from batchvl.io.sources import make_source
from batchvl.io.types import ShardInfo
from batchvl.io.writers import RESULT_SCHEMA, output_path


@dataclass(frozen=True)
class ShardOutput:
    shard: ShardInfo
    path: str  # the committed Parquet file


def committed_outputs(cfg: JobConfig) -> list[ShardOutput]:
    """The job's input shards that are committed (output file and marker), in shard order."""
    outputs = []
    for shard in make_source(cfg.input).list_shards():
        path = output_path(cfg.output.dir, shard.shard)
        if read_marker(cfg.output.dir, shard.shard) is not None and os.path.isfile(path):
            outputs.append(ShardOutput(shard, path))
    return outputs


def iter_output_tables(cfg: JobConfig) -> Iterator[tuple[ShardOutput, pa.Table]]:
    for output in committed_outputs(cfg):
        yield output, pq.read_table(output.path).replace_schema_metadata(None)


def concat_outputs(tables: list[pa.Table]) -> pa.Table:
    """One table from shard tables whose pass-through columns may differ (missing ones become null)."""
    return pa.concat_tables(tables, promote_options="default")


def results_table(cfg: JobConfig) -> pa.Table:
    """Every committed row of the job in input order, with a first column `shard` naming its shard."""
    tables = []
    for output, table in iter_output_tables(cfg):
        if "shard" in table.column_names:  # a pass-through input column: prefixed, as for the others
            table = table.rename_columns(["input_shard" if c == "shard" else c for c in table.column_names])
        tables.append(
            table.add_column(0, "shard", pa.array([output.shard.shard] * table.num_rows, pa.string()))
        )
    if not tables:
        return RESULT_SCHEMA.empty_table().add_column(0, "shard", pa.array([], pa.string()))
    return concat_outputs(tables)
