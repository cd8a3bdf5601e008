"""Table rows (Parquet, Arrow) -> samples: shared by the `parquet` and `hf_dataset` inputs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchvl.errors import SampleError, UserError
from batchvl.inputs.data_urls import data_url_bytes, is_data_url
from batchvl.inputs.download import is_url, split_url
from batchvl.inputs.paths import resolve_under_root
from batchvl.inputs.types import VIDEO_EXTENSIONS, MediaRef, Sample, ShardEnd, ShardInfo, is_scalar

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnreadableRows:
    """In place of a batch: `num_rows` rows of the shard that could not be read, and why."""

    num_rows: int
    reason: str


class RowSampler:
    """Turns the rows of one shard into samples; the media column holds bytes, a {bytes, path} struct
    (the Hugging Face Image feature), a path under the root, an http(s) or object-store URL, a base64
    `data:` URL, or a list of these."""

    def __init__(self, image_column: str, key_column: str | None, root: str | None):
        self.image_column = image_column
        self.key_column = key_column
        self.root = root

    def check_columns(self, columns: list[str], where: str) -> None:
        for column, option in (
            (self.image_column, "input.image_column"),
            (self.key_column, "input.key_column"),
        ):
            if column is not None and column not in columns:
                raise UserError(
                    f"{option}: column '{column}' not in {where}; available: {', '.join(columns)}"
                )

    def samples(
        self,
        shard: ShardInfo,
        batches: Iterator[pa.RecordBatch | UnreadableRows],
        keep: Callable[[int], bool],
        default_root: str,
    ) -> Iterator[Sample | ShardEnd]:
        root = os.path.realpath(self.root or default_root)
        start = 0
        for batch in batches:
            if isinstance(batch, UnreadableRows):  # an error row each, keyed by its index (no key was read)
                for index in range(start, start + batch.num_rows):
                    if keep(index):
                        error = SampleError("unreadable_rows", batch.reason)
                        yield Sample(shard.shard, index, str(index), [], error=error)
                start += batch.num_rows
                continue
            # Only this worker's rows become Python objects; the others stay in Arrow memory.
            mine = [i for i in range(batch.num_rows) if keep(start + i)]
            if mine:
                rows = batch.take(pa.array(mine, type=pa.int64())).to_pylist()
                for i, row in zip(mine, rows, strict=True):
                    yield self.sample(shard.shard, start + i, row, root)
            start += batch.num_rows
        yield ShardEnd(shard.shard, start)

    def sample(self, shard: str, index: int, row: dict[str, Any], root: str) -> Sample:
        # A null key (or no key column) is the row index: never the text 'None'.
        key_value = row[self.key_column] if self.key_column else None
        key = str(index) if key_value is None else str(key_value)
        fields = {
            k: v for k, v in row.items() if k not in (self.image_column, self.key_column) and is_scalar(v)
        }
        sample = Sample(shard, index, key, [], fields)
        cell = row[self.image_column]
        cells = cell if isinstance(cell, list) else [cell]
        try:
            sample.images = [self.media(c, root) for c in cells]
            if not sample.images:
                raise SampleError("missing_image", f"row has no image in column '{self.image_column}'")
        except SampleError as exc:
            sample.error = exc
        except Exception as exc:  # bad input must never end the job; keep the traceback for debugging
            logger.debug("reading the media of %s/%s failed", shard, key, exc_info=True)
            sample.error = SampleError("preprocess_error", f"media cell: {type(exc).__name__}: {exc}")
        return sample

    def media(self, cell: Any, root: str) -> MediaRef:
        if isinstance(cell, dict):  # the Hugging Face Image feature: {bytes, path}
            if cell.get("bytes") is not None:
                return MediaRef(cell["bytes"], None)
            cell = cell.get("path")
        if isinstance(cell, bytes):  # empty bytes too: that is a broken image, not a missing one
            return MediaRef(cell, None)
        if isinstance(cell, str) and cell:
            if is_data_url(cell):  # the image itself, as an openai_batch line may give it
                try:
                    return MediaRef(data_url_bytes(cell), None)
                except ValueError as exc:
                    raise SampleError("image_decode_error", f"media cell {cell[:40]!r}...: {exc}") from None
            if is_url(cell):  # fetched by the preprocessing worker
                path = split_url(cell)[0].path.lower()
                return MediaRef(None, None, "video" if path.endswith(VIDEO_EXTENSIONS) else "image", cell)
            if "://" in cell:
                raise SampleError(
                    "url_not_allowed",
                    f"media URL {cell[:80]!r}: only http(s) and object-store (s3://, gs://, az://) URLs are "
                    "fetched; other media cells are paths under input.root",
                )
            kind = "video" if cell.lower().endswith(VIDEO_EXTENSIONS) else "image"
            return MediaRef(None, resolve_under_root(cell, root), kind)
        if cell is None or cell in ("", {}, []):
            raise SampleError("missing_image", f"row has no image in column '{self.image_column}'")
        # an array kept as nested lists of numbers, a number: data, but nothing that names an image
        raise SampleError(
            "unsupported_media",
            f"column '{self.image_column}' holds a {_kind_of(cell)}, not an image: it takes image bytes, "
            "a {bytes, path} struct (datasets' Image feature: cast an array column to it), a path or a URL",
        )


def _kind_of(cell: Any) -> str:
    """A media cell's kind, as its refusal names it: 'list of ints', 'dict with keys a, b', 'value of type
    float'."""
    if isinstance(cell, list):
        return f"list of {type(cell[0]).__name__}s"
    if isinstance(cell, dict):
        return f"dict with keys {', '.join(map(str, cell))}"
    return f"value of type {type(cell).__name__}"
