"""`batchvl retry-failed`: rerun only the error rows of committed shards and merge them back.

The job's own config decides which shards are its (their markers must match it, as for a run); `--set`
overrides apply to the retry only (a larger `preprocess.max_pixels`, a longer `preprocess.timeout_s`...).
The work is the committed shards with error rows, and per shard exactly those rows; each shard's retried
rows replace its error rows in one atomic rewrite (`commits.MergeIntoShard`), so an ok row is never
replaced. A retried follow-up is rendered with the committed outputs it uses (only those that are errors
run again), so it sees the inputs it saw the first time. Prompts and input settings may not be
overridden: the rows would no longer belong to the shard they replace.
"""

from __future__ import annotations

import functools
import logging

import pyarrow as pa
import pyarrow.compute as pc

from batchvl.commands.labels import ran_output_dir
from batchvl.config import JobConfig, changed_keys, config_to_dict
from batchvl.errors import UserError
from batchvl.models.loader import LoadedModel
from batchvl.outputs.commit import CommitState, commit_state, read_committed
from batchvl.outputs.writers import RESULT_SCHEMA, ResultRow
from batchvl.pipeline.commit_strategies import MergeIntoShard
from batchvl.pipeline.ending import RunSummary
from batchvl.pipeline.ledger import SelectedRows
from batchvl.pipeline.plan import Work, plan_job
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.runner import JobRunner
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import OutputDir
from batchvl.storage.reads_at_once import each_at_once

logger = logging.getLogger(__name__)


def _refuse_changed_rows(job: JobConfig, retry: JobConfig) -> None:
    changed = changed_keys(config_to_dict(job), config_to_dict(retry))
    fixed = [k for k in changed if k.startswith(("prompts", "input.")) or k == "output.dir"]
    if fixed:
        raise UserError(
            f"retry-failed reruns the job's own rows, so --set may not change {', '.join(fixed)}; "
            "to change them run the job into a new output.dir"
        )


def retry_work(job: JobConfig, task: TaskSlice | None, model_loaded: bool = False) -> Work:
    """The task's committed shards with error rows, each with exactly those (sample, prompt) rows.
    Planning refuses shards written by another config, as a run does."""
    plan = plan_job(job, task, record=True, model_loaded=model_loaded)
    graph = plan.graph
    selection = {}
    not_committed = 0
    states = each_at_once(
        lambda shard: commit_state(plan.out, shard.shard, plan.fingerprint, shard),
        plan.shards,
        plan.out.reads_at_once,
    )
    for shard, (state, marker) in zip(plan.shards, states, strict=True):
        if state is not CommitState.DONE:  # or committed with other prompts: `run` updates it first
            not_committed += 1
        elif marker.errors:
            selection[shard.shard] = _failed_rows(read_committed(plan.out, shard.shard, marker), graph)
    if not_committed:
        logger.warning("%d shard(s) are not committed yet; `batchvl run` finishes them", not_committed)
    shards = [s for s in plan.shards if s.shard in selection]
    notes = {"shards_not_committed": not_committed}
    return Work(plan, shards, selection, notes=notes)


def _failed_rows(table: pa.Table, graph: PromptGraph) -> dict[int, SelectedRows]:
    """Per sample of a shard's `table` with error rows: those rows' prompts, and the committed rows of the
    prompts they use, directly or through another (a prompt whose own input failed is an error row itself,
    so a failed input runs again and an ok or skipped one is used as committed)."""
    errors = table.filter(pc.equal(table["status"], "error")).select(["sample_index", "prompt"])
    failed: dict[int, set[int]] = {}
    for row in errors.to_pylist():
        failed.setdefault(row["sample_index"], set()).add(graph.names.index(row["prompt"]))
    used = {
        index: graph.with_what_they_use(frozenset(prompts)) - prompts for index, prompts in failed.items()
    }
    rows: dict[int, dict[int, ResultRow]] = {index: {} for index in failed}
    samples = table.filter(pc.is_in(table["sample_index"], pa.array(list(failed), pa.int64())))
    for row in samples.select(RESULT_SCHEMA.names).to_pylist():
        prompt = graph.names.index(row["prompt"])
        if prompt in used[row["sample_index"]]:
            rows[row["sample_index"]][prompt] = ResultRow(**row, prompt_index=prompt)
    return {index: SelectedRows(frozenset(prompts), rows[index]) for index, prompts in failed.items()}


def retry_failed(
    job: JobConfig,
    retry: JobConfig,
    overrides: list[str],
    loaded: LoadedModel | None = None,
    show_progress: bool = True,
    task: TaskSlice | None = None,
) -> RunSummary:
    _refuse_changed_rows(job, retry)
    ran_output_dir(job)  # a job never run has no rows to retry: said before anything is written
    runner = JobRunner(
        retry,
        loaded,
        show_progress,
        task,
        work=functools.partial(retry_work, job, task, loaded is not None),
        commit=MergeIntoShard(job, OutputDir.of(job.output), overrides),
        mode="retry-failed",  # its rows are all former errors: the error budget is the job's
    )
    return runner.run()
