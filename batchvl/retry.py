"""`batchvl retry-failed`: rerun only the error rows of committed shards and merge them back.

The job's own config decides which shards are its (their markers must match it); `--set` overrides
apply to the retry only (a larger `preprocess.max_pixels`, a longer `preprocess.timeout_s`...). Each
shard's retried rows replace its error rows in one atomic rewrite of the shard's file, in input order;
the marker keeps the job's fingerprint and records the retry. Prompts and input settings may not be
overridden: the rows would no longer belong to the shard they replace.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchvl.config import JobConfig, changed_keys, config_to_dict, output_defining_config
from batchvl.errors import UserError
from batchvl.io.commit import read_marker, write_marker
from batchvl.io.types import ShardInfo
from batchvl.io.writers import output_path, rows_to_table, write_table_atomic
from batchvl.job import JobRunner, RunSummary, ShardProgress
from batchvl.models.loader import LoadedModel
from batchvl.plan import JobPlan
from batchvl.tasks import TaskSlice

logger = logging.getLogger(__name__)


def _refuse_changed_rows(job: JobConfig, retry: JobConfig) -> None:
    changed = changed_keys(config_to_dict(job), config_to_dict(retry))
    fixed = [k for k in changed if k.startswith(("prompts", "input.")) or k == "output.dir"]
    if fixed:
        raise UserError(
            f"retry-failed reruns the job's own rows, so --set may not change {', '.join(fixed)}; "
            "to change them run the job into a new output.dir"
        )


class RetryRunner(JobRunner):
    enforce_error_budget = False  # its rows are all former errors; the budget is the job's

    def __init__(
        self,
        job: JobConfig,
        retry: JobConfig,
        overrides: list[str],
        loaded: LoadedModel | None = None,
        show_progress: bool = True,
        task: TaskSlice | None = None,
    ):
        _refuse_changed_rows(job, retry)
        super().__init__(retry, loaded, show_progress, task)
        self.planning_config = job
        self.job_output_defining = output_defining_config(job)
        self.overrides = overrides
        self.stats.mode = "retry-failed"
        self.prompt_order = {prompt.name: i for i, prompt in enumerate(job.prompts)}
        self.not_committed = 0

    def _pending_shards(self, plan: JobPlan) -> list[ShardInfo]:
        """Committed shards with error rows; selects exactly those rows."""
        self.selection = {}
        for shard in plan.shards:
            marker = read_marker(self.out_dir, shard.shard)
            if marker is None:
                self.not_committed += 1
                continue
            if marker.config != self.job_output_defining:
                keys = ", ".join(changed_keys(marker.config, self.job_output_defining))
                raise UserError(
                    f"{shard.shard} in {self.out_dir} was written by a different config (changed: {keys}); "
                    "retry-failed only retries rows of the job file as it is"
                )
            if marker.errors:
                self.selection[shard.shard] = self._failed_rows(shard.shard)
        if self.not_committed:
            logger.warning(
                "%d shard(s) are not committed yet; `batchvl run` finishes them", self.not_committed
            )
        return [s for s in plan.shards if self.selection.get(s.shard)]

    def _committed_meanwhile(self):
        return None  # a retry's shards are committed by definition: it rewrites them

    def _failed_rows(self, shard: str) -> dict[int, frozenset[int]]:
        table = pq.read_table(output_path(self.out_dir, shard), columns=["sample_index", "prompt", "status"])
        failed: dict[int, set[int]] = {}
        for row in table.filter(pc.not_equal(table["status"], "ok")).to_pylist():
            failed.setdefault(row["sample_index"], set()).add(self.prompt_order[row["prompt"]])
        return {index: frozenset(prompts) for index, prompts in failed.items()}

    def _commit(self, shard: ShardProgress) -> str:
        """Replace the shard's retried rows, rewrite it atomically, then update its marker."""
        path = output_path(self.out_dir, shard.info.shard)
        old = pq.read_table(path)
        retried = rows_to_table(shard.rows, {})
        replaced = {(row.sample_index, row.prompt) for row in shard.rows}
        keep = [
            (index, prompt) not in replaced
            for index, prompt in zip(old["sample_index"].to_pylist(), old["prompt"].to_pylist(), strict=True)
        ]
        merged = pa.concat_tables([old.filter(pa.array(keep)), retried], promote_options="permissive")
        order = sorted(
            range(merged.num_rows),
            key=lambda i: (merged["sample_index"][i].as_py(), self.prompt_order[merged["prompt"][i].as_py()]),
        )
        columns = old.column_names + [c for c in merged.column_names if c not in old.column_names]
        merged = merged.take(order).select(columns).replace_schema_metadata(old.schema.metadata)
        write_table_atomic(path, merged)

        marker = read_marker(self.out_dir, shard.info.shard)
        assert marker is not None  # selected shards are committed
        marker.count(
            [
                (row["status"], row["error_type"])
                for row in merged.select(["status", "error_type"]).to_pylist()
            ]
        )
        marker.retries.append(
            {
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "overrides": self.overrides,
                "rows_retried": len(shard.rows),
                "rows_fixed": sum(row.status == "ok" for row in shard.rows),
            }
        )
        write_marker(self.out_dir, marker)
        return path


def retry_failed(
    job: JobConfig,
    retry: JobConfig,
    overrides: list[str],
    loaded: LoadedModel | None = None,
    show_progress: bool = True,
    task: TaskSlice | None = None,
) -> RunSummary:
    runner = RetryRunner(job, retry, overrides, loaded, show_progress, task)
    summary = runner.run()
    summary.stats["shards_not_committed"] = runner.not_committed
    return summary
