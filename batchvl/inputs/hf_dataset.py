"""`hf_dataset` input: a `datasets` dataset saved with `save_to_disk` (a Dataset or a DatasetDict).

Each Arrow file of the dataset is a shard. Files are memory-mapped by `datasets` and read batch by
batch; an `Image` column is stored as {bytes, path} structs, which the row sampler understands.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from batchvl.config import InputConfig
from batchvl.errors import UserError
from batchvl.inputs.paths import glob_base, has_glob, relative_id
from batchvl.inputs.stamps import input_stamp
from batchvl.inputs.table_rows import RowSampler
from batchvl.inputs.types import Sample, ShardEnd, ShardInfo

BATCH_ROWS = 256


def dataset_arrow_files(folder: str) -> list[str]:
    """The Arrow files of a saved Dataset, or of every split of a saved DatasetDict, in order."""
    folder_path = Path(folder)
    if (folder_path / "dataset_dict.json").is_file():
        splits = json.loads((folder_path / "dataset_dict.json").read_text())["splits"]
        return [f for split in splits for f in dataset_arrow_files(str(folder_path / split))]
    state = folder_path / "state.json"
    if not state.is_file():
        raise UserError(
            f"input.paths: '{folder}' is not a dataset saved with `save_to_disk` (no state.json or "
            "dataset_dict.json); use input.format parquet for Parquet files"
        )
    return [str(folder_path / f["filename"]) for f in json.loads(state.read_text())["_data_files"]]


class HFDatasetSource:
    def __init__(self, cfg: InputConfig):
        self.paths = cfg.paths
        self.rows = RowSampler(cfg.image_column, cfg.key_column, cfg.root)

    def list_shards(self) -> list[ShardInfo]:
        """Each Arrow file, named relative to the folder the pattern names: the dataset folder itself for a
        plain path, the part before the first wildcard for a glob over several datasets."""
        import datasets

        found: dict[str, str] = {}
        for pattern in self.paths:
            folders = sorted(p for p in glob.glob(pattern) if os.path.isdir(p))
            if not folders:
                raise UserError(f"input.paths: no dataset folder matches '{pattern}'; check the path or glob")
            base = glob_base(pattern) if has_glob(pattern) else pattern
            for folder in folders:
                for path in dataset_arrow_files(os.path.abspath(folder)):
                    found.setdefault(path, relative_id(path, base))
        shards = []
        for path, shard_id in sorted(found.items(), key=lambda item: item[1]):
            try:  # memory-mapped: row count and columns without reading
                table = datasets.Dataset.from_file(path)
            except (pa.ArrowInvalid, OSError) as exc:  # truncated or not Arrow: the user's to replace
                raise UserError(f"input file '{path}' is not a readable Arrow file: {exc}") from None
            schema, stamp = table.data.schema, input_stamp(path, {})  # a local folder
            shards.append(
                ShardInfo(
                    shard_id,
                    path,
                    table.num_rows,
                    columns=tuple(schema.names),
                    column_types=tuple(schema.types),
                    stamp=stamp,
                )
            )
        return shards

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        import datasets

        table = datasets.Dataset.from_file(shard.path).data.table
        self.rows.check_columns(table.column_names, shard.path)
        batches = iter(table.to_batches(max_chunksize=BATCH_ROWS))
        yield from self.rows.samples(shard, batches, keep, os.path.dirname(shard.path))
