"""How a complete shard is committed: written as a new file (a run), or merged into the committed file
(a retry of its failed rows). Both commit through `outputs/commit.py`: the Parquet file first, whole, then the
marker that makes the shard done."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from batchvl.config import JobConfig, config_to_dict
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.batch_output import model_name, write_batch_output
from batchvl.outputs.commit import ShardMarker, commit_shard, read_committed, read_marker
from batchvl.outputs.writers import OPTIONAL_COLUMNS, ResultRow, rows_to_table
from batchvl.pipeline.constraints import scored_choices
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import OutputDir
from batchvl.utils.secrets import MASK, masked_args, url_without_userinfo
from batchvl.utils.stats import RunStats
from batchvl.version import __version__


def stored_config(cfg: JobConfig) -> dict:
    """The job config as each output file records it, without credentials: storage options' values, a
    server URL's user info, the values of secret-looking arguments of a server's launch command."""
    stored = config_to_dict(cfg)
    for section in ("input", "output"):
        options = stored[section]["storage_options"]
        stored[section]["storage_options"] = dict.fromkeys(options, MASK)
    server = stored["engine"]["server"]
    if server["url"] is not None:
        server["url"] = url_without_userinfo(server["url"])
    if server["launch"] is not None:
        server["launch"] = shlex.join(masked_args(shlex.split(server["launch"])))
    server["launch_args"] = masked_args(server["launch_args"])
    return stored


def companion_files(cfg: JobConfig, out: OutputDir) -> Callable[[str, pa.Table], None] | None:
    """What the job writes beside each committed Parquet file, from its table (before the shard's marker)."""
    if cfg.output.format != "openai_batch":
        return None
    model = model_name(cfg.model.path)

    def write(shard: str, table: pa.Table) -> None:
        write_batch_output(out, shard, table, model, int(time.time()))

    return write


def optional_columns(cfg: JobConfig) -> tuple[str, ...]:
    """The optional result columns this job's config asks for (of any prompt: the others' rows hold nulls)."""
    columns = ("mean_logprob", "min_logprob") if any(s.logprobs for s in cfg.prompt_samplings) else ()
    columns += ("top_logprobs",) if any(s.top_logprobs for s in cfg.prompt_samplings) else ()
    return columns + (("choice_probs",) if any(scored_choices(p) for p in cfg.prompts) else ())


class WriteShard:
    """A run's commit: the shard's rows as its output file, and a marker naming the config that wrote it.
    A shard committed before with other prompts (in `kept`: the names of its prompts whose committed rows
    stay) is committed again with those rows as they are, byte for byte, beside the new ones; the rows
    of its other prompts go (a changed prompt's are replaced, a removed prompt's dropped), and so do the
    optional columns the job no longer writes (no kept row has a value there: a kept prompt's definition,
    which says what those columns hold, is unchanged). `stats` counts the rows kept and dropped."""

    records_input_stamp = True  # every row made from the input as listed now: its stamp recorded with them

    def __init__(
        self,
        cfg: JobConfig,
        out: OutputDir,
        task: TaskSlice | None,
        output_defining: dict,
        fingerprint: str,
        kept: dict[str, frozenset[str]] | None = None,
        stats: RunStats | None = None,
    ):
        self.out = out
        self.stats = stats if stats is not None else RunStats()
        self.output_defining = output_defining
        self.fingerprint = fingerprint
        self.task = str(task) if task else None
        self.kept = kept or {}
        self.prompt_order = {prompt.name: i for i, prompt in enumerate(cfg.prompts)}
        self.optional = optional_columns(cfg)
        self.companion = companion_files(cfg, out)
        self.metadata = {
            "batchvl_version": __version__,
            "model_path": cfg.model.path,
            "config_fingerprint": self.fingerprint,
            "job_config": json.dumps(stored_config(cfg), sort_keys=True),
        }

    def __call__(self, info: ShardInfo, rows: list[ResultRow]) -> str:
        marker = ShardMarker.for_rows(
            info.shard,
            rows,
            self.output_defining,
            self.fingerprint,
            task=self.task,
            batchvl_version=__version__,
        )
        table = rows_to_table(rows, self.metadata, self.optional)
        if info.shard in self.kept:
            committed = read_marker(self.out, info.shard)
            assert committed is not None  # planned from its marker, and claimed: nobody else commits it
            old = read_committed(self.out, info.shard, committed)
            keep = pc.is_in(old["prompt"], pa.array(sorted(self.kept[info.shard]), pa.string()))
            self._count_kept_and_dropped(old, keep)
            unwritten = [c for c in OPTIONAL_COLUMNS if c in old.column_names and c not in self.optional]
            table = in_input_order(old.filter(keep).drop_columns(unwritten), table, self.prompt_order)
            table = table.replace_schema_metadata(self.metadata)  # this config's, as the rest of the file
            count_rows(marker, table)
            marker.retries = committed.retries  # of rows it may keep
        return commit_shard(self.out, info.shard, table, marker, self.companion, info.stamp)

    def _count_kept_and_dropped(self, old: pa.Table, keep: pa.ChunkedArray) -> None:
        """Count the committed rows kept, and those of prompts the job no longer has (by prompt)."""
        self.stats.rows_kept += pc.sum(keep).as_py() or 0
        for prompt in old["prompt"].to_pylist():
            if prompt not in self.prompt_order:
                self.stats.rows_dropped[prompt] += 1


def in_input_order(old: pa.Table, new: pa.Table, prompt_order: dict[str, int]) -> pa.Table:
    """Committed rows and new ones as one shard's table: by sample, then in the job's prompt order; the
    committed file's columns first, then any the new rows add (a column one side lacks is null there)."""
    merged = pa.concat_tables([old, new], promote_options="permissive")
    samples, prompts = merged["sample_index"].to_pylist(), merged["prompt"].to_pylist()
    order = sorted(range(merged.num_rows), key=lambda i: (samples[i], prompt_order[prompts[i]]))
    columns = old.column_names + [c for c in merged.column_names if c not in old.column_names]
    return merged.take(order).select(columns)


def count_rows(marker: ShardMarker, table: pa.Table) -> None:
    """Set the marker's row counts from a shard's table."""
    statuses = table.select(["status", "error_type"]).to_pylist()
    marker.count([(row["status"], row["error_type"]) for row in statuses])


class MergeIntoShard:
    """A retry's commit: the retried rows replace theirs in the committed file, rewritten whole in input
    order; the marker keeps the job's config, recounts the rows and records the retry."""

    # most rows kept were made from the input the stamp on record names: it stays (a retry plans only
    # shards whose input is unchanged), and the run reads no digest
    records_input_stamp = False

    def __init__(self, job: JobConfig, out: OutputDir, overrides: list[str]):
        self.out = out
        self.overrides = overrides
        self.prompt_order = {prompt.name: i for i, prompt in enumerate(job.prompts)}
        self.optional = optional_columns(job)
        self.companion = companion_files(job, out)

    def __call__(self, info: ShardInfo, rows: list[ResultRow]) -> str:
        marker = read_marker(self.out, info.shard)
        assert marker is not None  # a retry selects committed shards only
        old = read_committed(self.out, info.shard, marker)
        replaced = {(row.sample_index, row.prompt) for row in rows}
        keep = [
            (index, prompt) not in replaced
            for index, prompt in zip(old["sample_index"].to_pylist(), old["prompt"].to_pylist(), strict=True)
        ]
        merged = in_input_order(
            old.filter(pa.array(keep)), rows_to_table(rows, {}, self.optional), self.prompt_order
        ).replace_schema_metadata(old.schema.metadata)
        count_rows(marker, merged)
        marker.retries.append(
            {
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "overrides": self.overrides,
                "rows_retried": len(rows),
                "rows_fixed": sum(row.status == "ok" for row in rows),
            }
        )
        return commit_shard(self.out, info.shard, merged, marker, self.companion)
