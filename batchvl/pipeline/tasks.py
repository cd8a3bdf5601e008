"""Splitting a job's input shards into N tasks: `--shard I/N`, or a Slurm array task's environment.

Each task gets a deterministic slice: shards are ordered by id and dealt out by greedy
longest-processing-time on their row counts (shard counts when a format cannot tell rows without
reading), so tasks finish at about the same time. For any N every shard belongs to exactly one task.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from batchvl.errors import UserError
from batchvl.inputs.types import ShardInfo
from batchvl.utils.balance import lpt_assignment
from batchvl.utils.environment import env_int


@dataclass(frozen=True)
class TaskSlice:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_task_slice(text: str) -> TaskSlice:
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise UserError(f"--shard expects I/N (task I of N, counted from 0), got '{text}'")
    index, count = int(match[1]), int(match[2])
    if count < 1 or index >= count:
        raise UserError(f"--shard {text}: I must be in 0..N-1 and N at least 1")
    return TaskSlice(index, count)


def slurm_task_slice(env: Mapping[str, str] = os.environ) -> TaskSlice | None:
    """The slice of a Slurm array task, from SLURM_ARRAY_TASK_ID / _COUNT (or _MIN / _MAX / _STEP).

    Only a contiguous array (0-6, 1-7, 0-12:2) tells N; a rerun of some tasks (--array=3,5) does not,
    so it is refused with the fix: pass --shard, as the script `batchvl slurm` writes does.
    """
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    fix = "it is Slurm's, for an array task: pass --shard I/N to run task I of N instead"

    def number(name: str, default: int) -> int:
        return env_int(name, default, fix, env)

    task_id = number("SLURM_ARRAY_TASK_ID", 0)
    low = number("SLURM_ARRAY_TASK_MIN", 0)
    step = number("SLURM_ARRAY_TASK_STEP", 1) or 1
    count = number("SLURM_ARRAY_TASK_COUNT", 0)
    if "SLURM_ARRAY_TASK_MAX" in env:
        span = (number("SLURM_ARRAY_TASK_MAX", 0) - low) // step + 1
        count = count or span
        contiguous = count == span
    else:
        contiguous = count > 0
    if not contiguous or (task_id - low) % step:
        raise UserError(
            f"this Slurm array (task {task_id}, {count} task(s) from {low}) is not a contiguous range, so "
            "it does not tell how the input is split; pass --shard ${SLURM_ARRAY_TASK_ID}/N with the job's N"
        )
    index = (task_id - low) // step
    if not 0 <= index < count:
        raise UserError(
            f"Slurm array task {task_id} is outside its array ({count} task(s) from {low}, step {step}); "
            "pass --shard I/N to run task I of N"
        )
    return TaskSlice(index, count)


def shards_of_task(shards: list[ShardInfo], task: TaskSlice | None) -> list[ShardInfo]:
    """This task's shards, in shard id order."""
    ordered = sorted(shards, key=lambda s: s.shard)
    if task is None or task.count == 1:
        return ordered
    return [ordered[i] for i in sorted(task_assignment(ordered, task.count)[task.index])]


def task_assignment(ordered: list[ShardInfo], count: int) -> list[list[int]]:
    """Indices into `ordered` per task."""
    rows = [s.num_rows for s in ordered]
    costs = rows if None not in rows else [1] * len(ordered)
    return lpt_assignment([max(int(c), 1) for c in costs], count)
