"""Labels as a table people read: one row per sample, a typed column per prompt.

The committed rows are one per (sample, prompt), with every output as text. The label table turns them
around: per sample its shard, key and index, then for each prompt its value, `<prompt>_status`, and for
a scored choices prompt `<prompt>_probs` (a probability per choice). A JSON-schema prompt's value is typed
from its schema (object -> struct, array -> list, string and enum -> string, integer -> int64, number ->
double, boolean -> bool, null -> null; a property the schema does not require, or whose schema allows
null, is nullable; a part the schema leaves open, such as an object without `properties`, an `anyOf` or
a `true` subschema, holds its JSON text); every other prompt's value is its text. A row that is not `ok`
has a null value. Prompt names cannot clash with these columns (`config._check_column_names`).

A schema types the column, not the values: a number part that holds a value its Arrow type cannot (an
integer beyond int64) holds JSON text instead, and the table's metadata says so (`NOTES_KEY`).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from batchvl.config import JobConfig, PromptConfig, output_definition
from batchvl.errors import UserError
from batchvl.inputs.sources import job_source
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.results import ShardOutput, committed_outputs, results_table
from batchvl.pipeline.constraints import scored_choices
from batchvl.pipeline.resume import plan_shards
from batchvl.storage.output_dir import OutputDir

SCALARS = {
    "string": pa.string(),
    "integer": pa.int64(),
    "number": pa.float64(),
    "boolean": pa.bool_(),
    "null": pa.null(),
}
NOTES_KEY = b"batchvl_notes"  # the table's metadata: a JSON list of what the column types could not hold


def arrow_type(schema: dict | bool) -> pa.DataType:
    """The Arrow type of values that follow a JSON schema (see the module's docstring)."""
    kind = _kind(schema)
    if kind == "object" and schema.get("properties"):
        required = set(schema.get("required", ()))
        return pa.struct(
            [
                pa.field(name, arrow_type(sub), nullable=name not in required or _admits_null(sub))
                for name, sub in schema["properties"].items()
            ]
        )
    if kind == "array" and isinstance(schema.get("items"), dict):
        return pa.list_(arrow_type(schema["items"]))
    return SCALARS.get(kind, pa.string())  # open-ended parts: their JSON text


def _kind(schema: dict | bool) -> str | None:
    """The schema's one JSON type: its `type` (in a list, "null" counts only alone), or the type all its
    `enum` / `const` values share (null again counting only alone). A boolean schema has none."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        return _one_kind(schema["type"] if isinstance(schema["type"], list) else [schema["type"]])
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return _one_kind([_json_kind(value) for value in values])


def _one_kind(kinds: list) -> str | None:
    others = set(kinds) - {"null"}
    if not others:
        return "null" if kinds else None
    return others.pop() if len(others) == 1 else None


def _admits_null(schema: dict | bool) -> bool:
    """Whether a value following the schema may be null: a required property is non-nullable only when
    its schema rules null out."""
    if not isinstance(schema, dict):
        return True
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return "null" in kinds
    if "enum" in schema:
        return None in schema["enum"]
    return schema["const"] is None if "const" in schema else True


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "json"


def _fits(value: Any, dtype: pa.DataType) -> bool:
    """Whether a number column of `dtype` holds the JSON number `value` (or null)."""
    try:
        pa.scalar(arrow_value(value, dtype), dtype)
    except (pa.ArrowInvalid, OverflowError):
        return False
    return True


def holding_type(dtype: pa.DataType, values: list, path: str, notes: list[str]) -> pa.DataType:
    """`dtype` with each number part that cannot hold one of `values` (an integer beyond int64) made
    text (its JSON), so such a value is kept; each such part adds a line to `notes`."""
    if pa.types.is_struct(dtype):
        fields = []
        for field in dtype:
            held = [value.get(field.name) for value in values if isinstance(value, dict)]
            fields.append(field.with_type(holding_type(field.type, held, f"{path}.{field.name}", notes)))
        return pa.struct(fields)
    if pa.types.is_list(dtype):
        items = [item for value in values if isinstance(value, list) for item in value]
        return pa.list_(
            dtype.value_field.with_type(holding_type(dtype.value_type, items, f"{path}[]", notes))
        )
    if pa.types.is_int64(dtype) or pa.types.is_float64(dtype):
        beyond = next((value for value in values if not _fits(value, dtype)), None)
        if beyond is not None:
            notes.append(f"{path}: {str(beyond)[:40]} does not fit {dtype}; the column holds JSON text")
            return pa.string()
    return dtype


def arrow_value(value: Any, dtype: pa.DataType) -> Any:
    """A parsed JSON value shaped for `dtype`: a struct's missing properties are null, its extra ones are
    dropped, and a value held as text is its JSON text."""
    if value is None:
        return None
    if pa.types.is_struct(dtype):
        if not isinstance(value, dict):
            return None
        return {dtype.field(i).name: arrow_value(value.get(dtype.field(i).name), dtype.field(i).type)
                for i in range(dtype.num_fields)}  # fmt: skip
    if pa.types.is_list(dtype):
        return [arrow_value(item, dtype.value_type) for item in value] if isinstance(value, list) else None
    if pa.types.is_string(dtype):
        return value if isinstance(value, str) else json.dumps(value)
    if pa.types.is_int64(dtype) and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON Schema counts 2.0 as an integer
    if pa.types.is_float64(dtype) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # Arrow converts an int to a double only within int64
    return value


def value_type(prompt: PromptConfig) -> pa.DataType:
    return arrow_type(prompt.json_schema) if prompt.json_schema is not None else pa.string()


def labels_table(cfg: JobConfig, rows: pa.Table) -> pa.Table:
    """The label table of a job's committed rows (`io.results.results_table`), samples in row order."""
    samples: dict[tuple[str, int], dict] = {}
    names = [prompt.name for prompt in cfg.prompts]
    has_probs = "choice_probs" in rows.column_names
    for row in rows.to_pylist():
        sample = samples.setdefault(
            (row["shard"], row["sample_index"]),
            {"shard": row["shard"], "key": row["key"], "sample_index": row["sample_index"]},
        )
        name = row["prompt"]
        if name not in names:
            continue  # a prompt the job no longer has
        prompt = cfg.prompts[names.index(name)]
        sample[f"{name}_status"] = row["status"]
        if row["status"] != "ok":
            continue
        sample[name] = json.loads(row["text"]) if prompt.json_schema is not None else row["text"]
        if has_probs and row["choice_probs"] is not None:
            sample[f"{name}_probs"] = dict(row["choice_probs"])
    fields = [
        pa.field("shard", pa.string()),
        pa.field("key", pa.string()),
        pa.field("sample_index", pa.int64()),
    ]
    notes: list[str] = []
    for prompt in cfg.prompts:
        values = [sample.get(prompt.name) for sample in samples.values()]
        dtype = holding_type(value_type(prompt), values, prompt.name, notes)
        fields += [pa.field(prompt.name, dtype), pa.field(f"{prompt.name}_status", pa.string())]
        if scored_choices(prompt):
            probs = pa.struct([pa.field(choice, pa.float64(), nullable=False) for choice in prompt.choices])
            fields.append(pa.field(f"{prompt.name}_probs", probs))
    columns = [
        pa.array([arrow_value(sample.get(f.name), f.type) for sample in samples.values()], f.type)
        for f in fields
    ]
    metadata = {NOTES_KEY: json.dumps(notes)} if notes else None
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata))


def table_notes(table: pa.Table) -> list[str]:
    """What the label table's column types could not hold, and how it was kept instead."""
    return json.loads((table.schema.metadata or {}).get(NOTES_KEY, b"[]"))


def job_labels(cfg: JobConfig) -> pa.Table:
    """The label table of the job's committed shards."""
    return labels_table(cfg, job_rows(cfg))


def job_rows(cfg: JobConfig) -> pa.Table:
    """The job's committed rows, one per (sample, prompt), in input order."""
    return results_table(current_outputs(cfg, OutputDir.of(cfg.output), job_source(cfg).list_shards()))


def current_outputs(cfg: JobConfig, out: OutputDir, shards: list[ShardInfo]) -> list[ShardOutput]:
    """The committed outputs of `shards`, refused as `run` refuses them (one line naming the changed
    keys) when any was written by another config: its rows are not what this config would make, and
    this config's types and prompts do not describe them."""
    defining, fingerprint = output_definition(cfg)
    plan_shards(out, shards, defining, fingerprint, overwrite=False, clean=False)
    return committed_outputs(out, shards)


def ran_output_dir(cfg: JobConfig) -> OutputDir:
    """The job's output folder, refused when it does not exist (the job never ran there)."""
    out = OutputDir.of(cfg.output)
    if not out.exists():
        raise UserError(
            f"output.dir {cfg.output.dir} does not exist: run the job first (batchvl run), or point "
            "output.dir at the folder it wrote"
        )
    return out
