"""Reading a job's results back: the committed output shards of its input shards, in input order."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.io.commit import read_marker
from batchvl.io.types import ShardInfo
from batchvl.io.writers import RESULT_SCHEMA, output_path


@dataclass(frozen=True)
class ShardOutput:
    shard: ShardInfo
    path: str  # the committed Parquet file


def committed_outputs(out_dir: str, shards: list[ShardInfo]) -> list[ShardOutput]:
    """Those of `shards` that are committed in out_dir (output file and marker), in the given order."""
    outputs = []
    for shard in shards:
        path = output_path(out_dir, shard.shard)
        if read_marker(out_dir, shard.shard) is not None and os.path.isfile(path):
            outputs.append(ShardOutput(shard, path))
    return outputs


def results_table(outputs: list[ShardOutput]) -> pa.Table:
    """Every row of the committed outputs, in order, with a first column `shard` naming its shard.

    Shards' pass-through columns may differ; a column a shard lacks is null in its rows."""
    tables = []
    for output in outputs:
        table = pq.read_table(output.path).replace_schema_metadata(None)
        if "shard" in table.column_names:  # a pass-through input column: prefixed, as for the others
            table = table.rename_columns(["input_shard" if c == "shard" else c for c in table.column_names])
        tables.append(
            table.add_column(0, "shard", pa.array([output.shard.shard] * table.num_rows, pa.string()))
        )
    if not tables:
        return RESULT_SCHEMA.empty_table().add_column(0, "shard", pa.array([], pa.string()))
    return pa.concat_tables(tables, promote_options="default")
