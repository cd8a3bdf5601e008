"""Parquet output: one file per input shard, written atomically (temp file, fsync, rename)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

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
    status: str
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


def output_path(out_dir: str, shard: str) -> str:
    """The output file of a shard: its id with the input suffix replaced by .parquet."""
    stem = next((shard[: -len(s)] for s in INPUT_SUFFIXES if shard.endswith(s)), shard)
    return os.path.join(out_dir, f"{stem}.parquet")


TEMP_INFIX = ".tmp-"  # temp files: .<name>.tmp-<host>-<pid>, hidden, never matching *.parquet


def remove_stale_temps(path: str) -> None:
    """Remove temp files of `path` left by killed runs on this host (their pid is gone)."""
    folder, name = os.path.split(path)
    prefix = f".{name}{TEMP_INFIX}{socket.gethostname()}-"
    if not os.path.isdir(folder):
        return
    for entry in os.listdir(folder):
        pid = entry.removeprefix(prefix)
        if entry.startswith(prefix) and pid.isdigit() and not _pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, entry))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}{TEMP_INFIX}{socket.gethostname()}-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
    for name in field_names:
        column = f"input_{name}" if name in RESULT_SCHEMA.names or name in OPTIONAL_COLUMNS else name
        table = table.append_column(column, pa.array([r.fields.get(name) for r in rows]))
    return table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})


def write_shard(
    out_dir: str, shard: str, rows: list[ResultRow], metadata: dict[str, str], optional: tuple[str, ...] = ()
) -> str:
    path = output_path(out_dir, shard)
    write_table_atomic(path, rows_to_table(rows, metadata, optional))
    return path


def write_table_atomic(path: str, table: pa.Table) -> None:
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def write_json_atomic(path: str, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def write_text_atomic(path: str, text: str) -> None:
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def create_text_exclusive(path: str, text: str) -> bool:
    """Create `path` holding `text` unless it exists; False when another process created it first. The
    file appears whole or not at all (written to a temp name, then hard-linked, which fails if `path`
    exists), so a reader never sees it half written."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(temp)
