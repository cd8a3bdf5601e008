"""Parquet output: one file per input shard, its rows in input order."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.errors import RowStatus
from batchvl.storage.output_dir import OutputDir

RESULT_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("sample_index", pa.int64()),
        ("prompt", pa.string()),
        ("text", pa.string()),
        ("status", pa.string()),
        ("error_type", pa.string()),
        ("error_message", pa.string()),
        ("num_prompt_tokens", pa.int64()),
        ("num_output_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("num_images", pa.int64()),
        ("latency_s", pa.float64()),
    ]
)


TOP_LOGPROB = pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
# Columns a job writes only when its config asks for them (`output_columns` of the job), after the fixed
# ones, in this order.
OPTIONAL_COLUMNS = {
    "mean_logprob": pa.float64(),
    "min_logprob": pa.float64(),
    "top_logprobs": pa.list_(pa.list_(TOP_LOGPROB)),  # per output token, the most likely tokens
    "choice_probs": pa.map_(pa.string(), pa.float64()),  # a scored choices prompt: choice -> probability
}


@dataclass
class ResultRow:
    key: str
    sample_index: int
    prompt: str
    prompt_index: int  # orders rows within a sample; not written
    text: str | None
    status: RowStatus
    error_type: str | None
    error_message: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    num_images: int
    latency_s: float | None
    fields: dict[str, Any] = field(default_factory=dict)
    optional: dict[str, Any] = field(default_factory=dict)  # values of OPTIONAL_COLUMNS (absent: null)


INPUT_SUFFIXES = (".parquet", ".tar.gz", ".tgz", ".tar", ".arrow", ".jsonl")


def output_name(shard: str) -> str:
    """The output file of a shard, relative to output.dir: its id with the input suffix replaced by
    .parquet."""
    stem = next((shard[: -len(s)] for s in INPUT_SUFFIXES if shard.endswith(s)), shard)
    return f"{stem}.parquet"


def output_path(out: OutputDir, shard: str) -> str:
    return out.join(output_name(shard))


def rows_to_table(
    rows: list[ResultRow], metadata: dict[str, str], optional: tuple[str, ...] = ()
) -> pa.Table:
    """The shard's table: the fixed columns, the `optional` columns the job writes, the input's fields."""
    rows = sorted(rows, key=lambda r: (r.sample_index, r.prompt_index))
    columns = {name: [getattr(r, name) for r in rows] for name in RESULT_SCHEMA.names}
    table = pa.Table.from_pydict(columns, schema=RESULT_SCHEMA)
    for name in (name for name in OPTIONAL_COLUMNS if name in optional):
        table = table.append_column(
            pa.field(name, OPTIONAL_COLUMNS[name]),
            pa.array([r.optional.get(name) for r in rows], OPTIONAL_COLUMNS[name]),
        )
    field_names: list[str] = []
    for row in rows:
        field_names.extend(name for name in row.fields if name not in field_names)
    for name, column in pass_through_columns(field_names).items():
        table = table.append_column(column, pass_through_array([r.fields.get(name) for r in rows]))
    return table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})


def pass_through_columns(field_names: list[str]) -> dict[str, str]:
    """Each input field's column: its own name, or where a result column has that name, the name prefixed
    with `input_`, again until no column has it (an input with both `status` and `input_status` columns
    keeps `input_status` and gets `input_input_status`): a file with two columns of one name is one that
    nothing reads back."""
    reserved = set(RESULT_SCHEMA.names) | set(OPTIONAL_COLUMNS)
    taken = reserved | set(field_names)
    columns = {}
    for name in field_names:
        column = name
        if name in reserved:
            column = input_column_name(name, taken)
            taken.add(column)
        columns[name] = column
    return columns


def input_column_name(name: str, taken: Collection[str]) -> str:
    """An input field's name where a result column has it: `input_<name>`, prefixed again while a name in
    `taken` has it."""
    column = f"input_{name}"
    while column in taken:
        column = f"input_{column}"
    return column


def pass_through_array(values: list[Any]) -> pa.Array:
    """An input field's values as one column; values of no one Arrow type (1 and "high" in one WebDataset
    json field, an int past 64 bits) as JSON text, so that a shard's commit never fails on them."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return json_text_array(values)


def json_text_array(values: list[Any]) -> pa.Array:
    """Each value as its JSON text (nulls stay null): how a column of no one type is kept."""
    return pa.array(
        [None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in values], pa.string()
    )


def parquet_bytes(table: pa.Table) -> bytes:
    """The table as a Parquet file's bytes (written whole by an OutputDir, and hashed by its marker)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()
