"""Labels as a table people read: one row per sample, a typed column per prompt.

The committed rows are one per (sample, prompt), with every output as text. The label table turns them
around: per sample its shard, key and index, then for each prompt its value, `<prompt>_status`, and for
a scored choices prompt `<prompt>_probs` (a probability per choice). A JSON-schema prompt's value is typed
from its schema (object -> struct, array -> list, string and enum -> string, integer -> int64, number ->
double, boolean -> bool; a property the schema does not require is nullable; a part the schema leaves
open, such as an object without `properties` or an `anyOf`, holds its JSON text); every other prompt's
value is its text. A row that is not `ok` has a null value.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from batchvl.config import JobConfig, PromptConfig
from batchvl.constraints import scored_choices
from batchvl.io.output_dir import OutputDir
from batchvl.io.results import committed_outputs, results_table
from batchvl.io.sources import job_source

SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


def arrow_type(schema: dict) -> pa.DataType:
    """The Arrow type of values that follow a JSON schema (see the module's docstring)."""
    kind = _kind(schema)
    if kind == "object" and schema.get("properties"):
        required = set(schema.get("required", ()))
        return pa.struct(
            [
                pa.field(name, arrow_type(sub), nullable=name not in required)
                for name, sub in schema["properties"].items()
            ]
        )
    if kind == "array" and isinstance(schema.get("items"), dict):
        return pa.list_(arrow_type(schema["items"]))
    return SCALARS.get(kind, pa.string())  # open-ended parts: their JSON text


def _kind(schema: dict) -> str | None:
    """The schema's one JSON type: its `type` (a list with "null" counts as the other entry), or the type
    all its `enum` / `const` values share."""
    kind = schema.get("type")
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        kind = others[0] if len(others) == 1 else None
    if kind is not None:
        return kind
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    kinds = {_json_kind(value) for value in values}
    return kinds.pop() if len(kinds) == 1 else None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "json"


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
    for prompt in cfg.prompts:
        fields += [pa.field(prompt.name, value_type(prompt)), pa.field(f"{prompt.name}_status", pa.string())]
        if scored_choices(prompt):
            probs = pa.struct([pa.field(choice, pa.float64(), nullable=False) for choice in prompt.choices])
            fields.append(pa.field(f"{prompt.name}_probs", probs))
    columns = [
        pa.array([arrow_value(sample.get(f.name), f.type) for sample in samples.values()], f.type)
        for f in fields
    ]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def job_labels(cfg: JobConfig) -> pa.Table:
    """The label table of the job's committed shards."""
    return labels_table(cfg, job_rows(cfg))


def job_rows(cfg: JobConfig) -> pa.Table:
    """The job's committed rows, one per (sample, prompt), in input order."""
    return results_table(committed_outputs(OutputDir.of(cfg.output), job_source(cfg).list_shards()))
