"""What a marker and a prompt's definition must hold for resume to be right, checked without a model:
the sampling keys that reach a scored prompt's rows, a rewrite's marker against the file that is there,
and a settled marker's file size."""

import hashlib
import json
from dataclasses import asdict

import pyarrow as pa
import pytest

from batchvl.config import job_config_from_dict, output_definition, split_definition
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.commit import (
    CommitState,
    ShardMarker,
    commit_shard,
    commit_state,
    marker_path,
    read_marker,
)
from batchvl.outputs.writers import output_path, parquet_bytes
from batchvl.storage.output_dir import LocalDir

SHARD = "part-0.parquet"


def scored_definition(tmp_path, **sampling) -> dict:
    cfg = job_config_from_dict(
        {
            "model": {"path": str(tmp_path / "no-model")},
            "input": {"paths": [str(tmp_path / "*.parquet")]},
            "prompts": [{"name": "kind", "text": "Photo or drawing?", "choices": ["photo", "drawing"]}],
            "sampling": sampling,
            "output": {"dir": str(tmp_path / "out")},
        }
    )
    return split_definition(output_definition(cfg)[0])[1]["kind"]


@pytest.mark.parametrize(
    "key_value", [("logprobs", True), ("top_logprobs", 3), ("max_new_tokens_field", "limit")]
)
def test_a_scored_prompt_is_defined_by_the_sampling_that_adds_columns(tmp_path, key_value):
    key, value = key_value
    assert scored_definition(tmp_path, **{key: value}) != scored_definition(tmp_path)
    assert scored_definition(tmp_path, temperature=0.7) == scored_definition(tmp_path)  # it samples nothing


def committed(tmp_path) -> tuple[LocalDir, ShardMarker]:
    out = LocalDir(str(tmp_path / "out"))
    marker = ShardMarker.for_rows(SHARD, [], {"a": 1}, "fp", task=None)
    commit_shard(out, SHARD, pa.table({"x": [1, 2]}), marker)
    return out, marker


def test_a_rewrite_whose_file_matches_neither_hash_leaves_the_shard_uncommitted(tmp_path):
    out, old = committed(tmp_path)
    new_data, other = parquet_bytes(pa.table({"x": [3]})), parquet_bytes(pa.table({"x": [4, 5, 6]}))
    new = ShardMarker.for_rows(SHARD, [], {"a": 1}, "fp", task=None)
    new.output_bytes, new.output_sha256 = len(new_data), hashlib.sha256(new_data).hexdigest()
    new.replaces = asdict(old)
    out.write_text(marker_path(out, SHARD), json.dumps(asdict(new)))
    assert read_marker(out, SHARD).output_sha256 == old.output_sha256  # the old file is still there
    out.write_bytes(output_path(out, SHARD), new_data)
    assert read_marker(out, SHARD).output_sha256 == new.output_sha256
    out.write_bytes(output_path(out, SHARD), other)  # neither: not the old shard, nor the new one
    assert read_marker(out, SHARD) is None
    assert commit_state(out, SHARD, "fp")[0] is CommitState.MISSING


def test_a_file_of_another_size_than_its_marker_names_is_not_committed(tmp_path):
    out, _ = committed(tmp_path)
    assert commit_state(out, SHARD, "fp")[0] is CommitState.DONE
    path = output_path(out, SHARD)
    out.write_bytes(path, out.read_bytes(path)[:-1])  # cut short
    assert read_marker(out, SHARD) is None
    assert commit_state(out, SHARD, "fp")[0] is CommitState.MISSING


def test_a_shard_made_from_an_input_of_another_stamp_is_input_changed(tmp_path):
    out = LocalDir(str(tmp_path / "out"))
    marker = ShardMarker.for_rows(SHARD, [], {"a": 1}, "fp", task=None)
    stamp = {"size": 1, "mtime_ns": 2, "ino": 3, "ctime_ns": 4}
    commit_shard(out, SHARD, pa.table({"x": [1]}), marker, stamp=stamp)

    def listed(**changed) -> ShardInfo:
        return ShardInfo(SHARD, str(tmp_path / "gone.parquet"), None, stamp={**stamp, **changed})

    assert commit_state(out, SHARD, "fp", listed())[0] is CommitState.DONE
    assert commit_state(out, SHARD, "fp", listed(mtime_ns=3))[0] is CommitState.INPUT_CHANGED
    # the same size and times but another inode, and no digest recorded to read the file against
    assert commit_state(out, SHARD, "fp", listed(ino=5))[0] is CommitState.INPUT_CHANGED
    assert commit_state(out, SHARD, "fp")[0] is CommitState.DONE  # a stamp not known: not compared
