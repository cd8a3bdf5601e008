"""Splitting input shards into tasks: exact partitions for any N, balance, and Slurm's environment."""

import random

import pytest

from batchvl.errors import UserError
from batchvl.inputs.types import ShardInfo
from batchvl.pipeline.tasks import TaskSlice, parse_task_slice, shards_of_task, slurm_task_slice


def shards(rows):
    return [ShardInfo(f"part-{i:03d}.parquet", f"/in/part-{i:03d}.parquet", n) for i, n in enumerate(rows)]


@pytest.mark.parametrize("count", [1, 2, 3, 7])
@pytest.mark.parametrize("rows", [[100] * 10, [5, 900, 30, 30, 410, 7, 64, 64, 1, 250, 999], [None] * 9])
def test_every_shard_belongs_to_exactly_one_task(count, rows):
    listing = shards(rows)
    slices = [shards_of_task(listing, TaskSlice(i, count)) for i in range(count)]
    names = [s.shard for part in slices for s in part]
    assert sorted(names) == sorted(s.shard for s in listing) and len(names) == len(set(names))
    # deterministic: the listing order does not matter
    shuffled = random.Random(count).sample(listing, len(listing))
    assert [shards_of_task(shuffled, TaskSlice(i, count)) for i in range(count)] == slices


def test_tasks_are_balanced_by_rows_or_by_shard_count():
    rows = [5, 900, 30, 30, 410, 7, 64, 64, 1, 250, 999]
    loads = [sum(s.num_rows for s in shards_of_task(shards(rows), TaskSlice(i, 3))) for i in range(3)]
    # largest first to the least loaded: 999 -> t0, 900 -> t1, then every other shard fits under 900 on t2
    assert sorted(loads) == [410 + 250 + 64 + 64 + 30 + 30 + 7 + 5 + 1, 900, 999]
    counts = [len(shards_of_task(shards([None] * 10), TaskSlice(i, 3))) for i in range(3)]
    assert counts == [4, 3, 3]
    assert shards_of_task(shards([3]), TaskSlice(5, 7)) == []  # more tasks than shards: some idle


def test_parse_task_slice():
    assert parse_task_slice("2/7") == TaskSlice(2, 7) and str(TaskSlice(2, 7)) == "2/7"
    for bad in ("7/7", "1", "a/b", "0/0", "-1/3"):
        with pytest.raises(UserError, match="--shard"):
            parse_task_slice(bad)


def test_slurm_array_environment():
    env = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "7", "SLURM_ARRAY_TASK_MIN": "0"}
    assert slurm_task_slice(env) == TaskSlice(4, 7)
    assert slurm_task_slice(
        {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "7"}
    ) == (TaskSlice(2, 7))
    stepped = {
        "SLURM_ARRAY_TASK_ID": "4",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_MAX": "6",
        "SLURM_ARRAY_TASK_STEP": "2",
        "SLURM_ARRAY_TASK_COUNT": "4",
    }
    assert slurm_task_slice(stepped) == TaskSlice(2, 4)
    assert slurm_task_slice({}) is None
    # a rerun of some tasks (--array=3,5) does not tell N
    rerun = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "5"}
    with pytest.raises(UserError, match=r"pass --shard \$\{SLURM_ARRAY_TASK_ID\}/N"):
        slurm_task_slice({**rerun, "SLURM_ARRAY_TASK_COUNT": "2"})
