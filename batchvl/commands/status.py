"""`batchvl status`: what a job's output folder holds, task by task, and what to rerun.

Reads only the input listing, the completion markers and the per-run stats files, so it is cheap on
a job of hundreds of shards and safe to run while tasks are writing. Per prompt, it says how many rows a
run would keep as committed and how many it would compute (`resume.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field

from batchvl.commands.slurm import array_expression, read_array_job
from batchvl.config import JobConfig, output_definition
from batchvl.inputs.folder import missing_members
from batchvl.inputs.sources import job_source
from batchvl.outputs.run_stats import read_run_stats
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.resume import RowCounts, shard_plan
from batchvl.pipeline.tasks import TaskSlice, parse_task_slice, shards_of_task
from batchvl.storage.output_dir import OutputDir
from batchvl.utils.stats import processing_seconds


@dataclass
class TaskStatus:
    index: int
    shards: int = 0
    done: int = 0
    stale: int = 0  # committed by a config that changes every row: a rerun refuses until --overwrite
    other_prompts: int = 0  # committed with other prompts: a run keeps the unchanged prompts' rows
    input_changed: int = 0  # committed from an input file that changed since: a run redoes them whole
    samples_per_s: float | None = None  # over every run of the task that did work
    output_tokens_per_s: float | None = None
    last_run: str | None = None  # the latest stats file's name

    @property
    def pending(self) -> int:
        return self.shards - self.done


@dataclass
class JobStatus:
    out_dir: str
    num_tasks: int
    tasks: list[TaskStatus]
    rows_ok: int = 0
    rows_error: int = 0
    rows_skipped: int = 0
    errors_by_type: Counter = field(default_factory=Counter)
    script: str | None = None  # the array's sbatch script, when `batchvl slurm` wrote one
    files_gone: int = 0  # `folder` input: files of recorded shards no longer in the folder
    rows_per_prompt: dict[str, RowCounts] = field(default_factory=dict)  # what a run would reuse, compute

    @property
    def shards_total(self) -> int:
        return sum(t.shards for t in self.tasks)

    @property
    def shards_done(self) -> int:
        return sum(t.done for t in self.tasks)

    @property
    def missing_tasks(self) -> list[int]:
        return [t.index for t in self.tasks if t.pending]


def job_status(cfg: JobConfig, num_tasks: int | None = None) -> JobStatus:
    out = OutputDir.of(cfg.output)
    array = read_array_job(out)
    stats = _runs_per_task(out)
    if num_tasks is None:
        num_tasks = array.num_tasks if array else max((n for n, _ in stats), default=1)
    defining, fingerprint = output_definition(cfg)
    graph = PromptGraph.of(cfg.prompts)
    listing = job_source(cfg).list_shards()
    status = JobStatus(out.url, num_tasks, [], script=array.script_path if array else None)
    status.rows_per_prompt = dict.fromkeys(graph.names, RowCounts())
    if cfg.input.format == "folder":
        status.files_gone = sum(missing_members(shard) for shard in listing)
    for index in range(num_tasks):
        shards = shards_of_task(listing, TaskSlice(index, num_tasks))
        plan = shard_plan(out, shards, defining, fingerprint, False, graph)
        task = TaskStatus(
            index, len(shards), len(plan.done), len(plan.stale), len(plan.reuse), len(plan.input_changed)
        )
        for marker in plan.done.values():
            status.rows_ok += marker.ok
            status.rows_error += marker.errors
            status.rows_skipped += marker.skipped
            status.errors_by_type.update(marker.errors_by_type)
        for name, counts in plan.rows_per_prompt(graph.names).items():
            status.rows_per_prompt[name] += counts
        runs = stats.get((num_tasks, index))
        if runs is not None and runs.processing_s > 0:
            task.samples_per_s = round(runs.samples / runs.processing_s, 3)
            task.output_tokens_per_s = round(runs.output_tokens / runs.processing_s, 3)
            task.last_run = runs.last_run
        status.tasks.append(task)
    return status


@dataclass
class TaskRuns:
    """A task's runs that did work, added up: a task stopped and rerun is one task."""

    last_run: str = ""  # the newest stats file's name
    samples: int = 0
    output_tokens: int = 0
    processing_s: float = 0.0

    def add(self, name: str, run: dict) -> None:
        self.last_run = name
        self.samples += run.get("samples", 0)
        self.output_tokens += run.get("output_tokens", 0)
        self.processing_s += processing_seconds(run)


def _runs_per_task(out: OutputDir) -> dict[tuple[int, int], TaskRuns]:
    """(N, task index) -> the runs of that task that did work, from `_batchvl/stats`, oldest first."""
    runs: dict[tuple[int, int], TaskRuns] = {}
    for run in read_run_stats(out):
        if not run.get("samples") or run.get("mode", "run") != "run":
            continue  # a rerun that found everything done, or a retry of a few rows, says nothing about speed
        task = parse_task_slice(run.get("task") or "0/1")
        runs.setdefault((task.count, task.index), TaskRuns()).add(run["file"], run)
    return runs


def status_json(status: JobStatus) -> str:
    """The status as JSON (`status --json`). `errors_by_type` is a Counter, which `dataclasses.asdict`
    would rebuild from its (type, count) pairs as keys; it goes as the plain mapping it is."""
    fields = dataclasses.asdict(dataclasses.replace(status, errors_by_type=Counter()))
    fields["errors_by_type"] = dict(status.errors_by_type)
    return json.dumps({**fields, "missing_tasks": status.missing_tasks}, indent=2)


def format_status(status: JobStatus, job_file: str) -> str:
    lines = [
        f"output: {status.out_dir}",
        f"shards: {status.shards_done} of {status.shards_total} done, "
        f"{status.shards_total - status.shards_done} pending",
        f"rows: {status.rows_ok} ok, {status.rows_error} error"
        + (f", {status.rows_skipped} skipped" if status.rows_skipped else "")
        + (
            " (" + ", ".join(f"{k} {v}" for k, v in status.errors_by_type.most_common()) + ")"
            if status.errors_by_type
            else ""
        ),
    ]
    if status.files_gone:
        lines.append(
            f"{status.files_gone} input file(s) of recorded shards are gone from the folder (removed or "
            "renamed); committed rows of them stay, and a renamed file is captioned as a new one"
        )
    stale = sum(t.stale for t in status.tasks)
    if stale:
        lines.append(
            f"{stale} shard(s) were written by a different config; rerun with --overwrite to redo them"
        )
    input_changed = sum(t.input_changed for t in status.tasks)
    if input_changed:
        lines.append(
            f"{input_changed} shard(s) were committed from input files that changed since; a run redoes "
            "them whole"
        )
    other_prompts = sum(t.other_prompts for t in status.tasks)
    if other_prompts:
        lines.append(
            f"{other_prompts} shard(s) were written with other prompts or sampling; a run keeps the rows "
            "of the unchanged prompts and computes the rest"
        )
    lines.append("per prompt, what a run would do:")
    lines.extend(f"  {name}: {counts.describe()}" for name, counts in status.rows_per_prompt.items())
    lines.append(f"tasks: {status.num_tasks}")
    lines.append(f"  {'task':>5} {'shards':>6} {'done':>5} {'pending':>7} {'samples/s':>9} {'out tok/s':>9}")
    for t in status.tasks:
        speed = (
            f"{t.samples_per_s:>9.2f} {t.output_tokens_per_s:>9.1f}"
            if t.samples_per_s
            else f"{'-':>9} {'-':>9}"
        )
        lines.append(f"  {t.index:>5} {t.shards:>6} {t.done:>5} {t.pending:>7} {speed}")
    missing = status.missing_tasks
    if not missing:
        lines.append("complete: every shard is committed")
    elif status.script:
        lines.append(f"rerun missing tasks: sbatch --array={array_expression(missing)} {status.script}")
    elif status.num_tasks == 1:
        lines.append(f"rerun: batchvl run {job_file}")
    else:
        lines.append(
            f"rerun missing tasks ({array_expression(missing)}): "
            f"batchvl run {job_file} --shard I/{status.num_tasks}"
        )
    return "\n".join(lines)
