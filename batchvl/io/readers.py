"""Parquet input: list shards, stream samples batch by batch (memory does not grow with file size)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.errors import SampleError, UserError
from batchvl.io.types import MediaRef, Sample, ShardInfo


def list_shards(patterns: Sequence[str]) -> list[ShardInfo]:
    files: set[str] = set()
    for pattern in patterns:
        matched = [
            p for p in glob.glob(pattern, recursive=True) if p.endswith(".parquet") and os.path.isfile(p)
        ]
        if not matched:
            raise UserError(f"input.paths: no Parquet files match '{pattern}'; check the path or glob")
        files.update(os.path.abspath(p) for p in matched)
    paths = sorted(files)
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    shards = []
    for path in paths:
        try:
            num_rows = pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise UserError(f"input file '{path}' is not a readable Parquet file: {exc}") from None
        shards.append(ShardInfo(Path(os.path.relpath(path, common)).as_posix(), path, num_rows))
    return shards


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


class ParquetReader:
    def __init__(self, image_column: str, key_column: str | None, root: str | None, batch_rows: int = 256):
        self.image_column = image_column
        self.key_column = key_column
        self.root = root
        self.batch_rows = batch_rows

    def iter_shard(self, shard: ShardInfo) -> Iterator[Sample]:
        parquet = pq.ParquetFile(shard.path)
        columns = parquet.schema_arrow.names
        for column, option in (
            (self.image_column, "input.image_column"),
            (self.key_column, "input.key_column"),
        ):
            if column is not None and column not in columns:
                raise UserError(
                    f"{option}: column '{column}' not in {shard.path}; available: {', '.join(columns)}"
                )
        root = os.path.realpath(self.root or os.path.dirname(shard.path))
        index = 0
        for batch in parquet.iter_batches(batch_size=self.batch_rows):
            for row in batch.to_pylist():
                yield self._sample(shard, index, row, root)
                index += 1

    def _sample(self, shard: ShardInfo, index: int, row: dict[str, Any], root: str) -> Sample:
        key = str(row[self.key_column]) if self.key_column else str(index)
        fields = {
            k: v for k, v in row.items() if k not in (self.image_column, self.key_column) and _is_scalar(v)
        }
        sample = Sample(shard.shard, index, key, [], fields)
        cell = row[self.image_column]
        cells = cell if isinstance(cell, list) else [cell]
        try:
            sample.images = [self._media(c, root) for c in cells]
            if not sample.images:
                raise SampleError("missing_image", f"row has no image in column '{self.image_column}'")
        except SampleError as exc:
            sample.error = exc
        return sample

    def _media(self, cell: Any, root: str) -> MediaRef:
        if isinstance(cell, dict):  # the Hugging Face Image feature: {bytes, path}
            if cell.get("bytes"):
                return MediaRef(cell["bytes"], None)
            cell = cell.get("path")
        if isinstance(cell, bytes) and cell:
            return MediaRef(cell, None)
        if isinstance(cell, str) and cell:
            return MediaRef(None, self._checked_path(cell, root))
        raise SampleError("missing_image", f"row has no image in column '{self.image_column}'")

    def _checked_path(self, path: str, root: str) -> str:
        """Resolve a relative path under root; refuse absolute paths and anything escaping root."""
        resolved = os.path.realpath(os.path.join(root, path))
        if os.path.isabs(path) or os.path.commonpath([resolved, root]) != root:
            raise SampleError(
                "path_outside_root", f"image path '{path}' resolves outside input.root '{root}'"
            )
        if not os.path.isfile(resolved):
            raise SampleError("file_not_found", f"image file not found: {resolved}")
        return resolved
