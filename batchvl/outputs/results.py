"""Reading a job's results back: the committed output shards of its input shards, in input order."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from batchvl.inputs.types import ShardInfo
from batchvl.outputs.commit import ShardMarker, read_committed, read_marker
from batchvl.outputs.writers import RESULT_SCHEMA, input_column_name, json_text_array, output_path
from batchvl.storage.output_dir import OutputDir


@dataclass(frozen=True)
class ShardOutput:
    out: OutputDir
    shard: ShardInfo
    marker: ShardMarker

    @property
    def path(self) -> str:
        """The committed Parquet file."""
        return output_path(self.out, self.shard.shard)

    def read(self) -> pa.Table:
        return read_committed(self.out, self.shard.shard, self.marker)


def committed_outputs(out: OutputDir, shards: list[ShardInfo]) -> list[ShardOutput]:
    """Those of `shards` that are committed in `out` (output file and marker), in the given order."""
    outputs = []
    for shard in shards:
        marker = read_marker(out, shard.shard)
        if marker is not None:
            outputs.append(ShardOutput(out, shard, marker))
    return outputs


def results_table(outputs: list[ShardOutput]) -> pa.Table:
    """Every row of the committed outputs, in order, with a first column `shard` naming its shard.

    Shards' pass-through columns may differ; a column a shard lacks is null in its rows."""
    tables = []
    for output in outputs:
        table = output.read().replace_schema_metadata(None)
        if "shard" in table.column_names:  # a pass-through input column: prefixed, as the writer prefixes
            table = table.rename_columns(
                [input_column_name(c, table.column_names) if c == "shard" else c for c in table.column_names]
            )
        tables.append(
            table.add_column(0, "shard", pa.array([output.shard.shard] * table.num_rows, pa.string()))
        )
    if not tables:
        return RESULT_SCHEMA.empty_table().add_column(0, "shard", pa.array([], pa.string()))
    return pa.concat_tables(with_shared_types(tables), promote_options="permissive")


def with_shared_types(tables: list[pa.Table]) -> list[pa.Table]:
    """The tables with each pass-through column that has types no one type holds (int64 in one shard,
    string in another) as JSON text in all of them, as a shard's own writer keeps such a column; the
    types that widen (int64 and double) are left to the concatenation."""
    types: dict[str, set[pa.DataType]] = {}
    for table in tables:
        for column in table.schema:
            types.setdefault(column.name, set()).add(column.type)
    clashing = {name for name, found in types.items() if len(found) > 1 and not _widens(name, found)}
    if not clashing:
        return tables
    return [_as_json_text(table, clashing) for table in tables]


def _widens(name: str, types: set[pa.DataType]) -> bool:
    try:
        pa.unify_schemas([pa.schema([(name, t)]) for t in types], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False
    return True


def _as_json_text(table: pa.Table, names: set[str]) -> pa.Table:
    for name in names & set(table.column_names):
        text = json_text_array(table.column(name).to_pylist())
        table = table.set_column(table.column_names.index(name), name, text)
    return table
