"""Which of a task's shards to run: resume is the default, a changed config is refused or reused.

A shard with a marker from the same output-defining config is done and skipped. One without a marker
(never run, or killed before its commit) is redone from scratch. One whose marker names another config:
- where only prompts differ (a prompt's definition holds the sampling it takes, so a changed `sampling`
  is a change of the prompts it applies to) and the job's prompt graph is given (a run, validate,
  status), it is run again for its changed and added prompts only and committed again with the committed
  rows of its unchanged prompts (`prompt_reuse.py`);
- otherwise (a change that defines every row: model, the checkpoint's files, backend, input,
  preprocessing; or a reader of results, which needs rows of exactly this config) it would mix outputs of
  two configs in one folder: refused, with the changed keys and the two ways out, unless `--overwrite`
  asks to recompute everything.
A shard committed from an input file that has changed since (another stamp, `inputs/stamps.py`) is run
again whole, none of its rows kept: they describe another file's samples under the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchvl.config import (
    as_recorded_by,
    changed_keys,
    definition_fingerprint,
    describe_change,
    split_definition,
)
from batchvl.errors import UserError
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.commit import CommitState, ShardMarker, commit_state_and_stamp
from batchvl.outputs.writers import output_path
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.prompt_reuse import PromptReuse, committed_samples, prompt_reuse
from batchvl.storage import layout
from batchvl.storage.output_dir import LocalDir, OutputDir
from batchvl.storage.reads_at_once import each_at_once

PROMPTS_CHANGED = "prompts"  # a stale shard's change that a run updates (readers of results refuse it)


@dataclass(frozen=True)
class RowCounts:
    """Of one prompt over a task's shards: rows a run keeps as committed, and rows it runs (None: some
    shard's sample count is known only by reading it)."""

    reuse: int = 0
    compute: int | None = 0

    def __add__(self, other: RowCounts) -> RowCounts:
        total = None if self.compute is None or other.compute is None else self.compute + other.compute
        return RowCounts(self.reuse + other.reuse, total)

    def describe(self) -> str:
        compute = "unknown until read" if self.compute is None else self.compute
        return f"{self.reuse} row(s) reused, {compute} to compute"


@dataclass(frozen=True)
class ShardPlan:
    shards: list[ShardInfo]  # the task's shards
    pending: list[ShardInfo]  # to run now
    reuse: dict[str, PromptReuse] = field(default_factory=dict)  # pending shards that keep committed rows
    done: dict[str, ShardMarker] = field(default_factory=dict)  # committed shards of this config
    stale: list[ShardInfo] = field(default_factory=list)  # committed by a config that changes every row
    changed: tuple[str, ...] = ()  # the keys that differ in the stale shards' configs
    input_changed: list[ShardInfo] = field(default_factory=list)  # pending: their input changed since
    # the input stamp each done shard's commit recorded, as the plan read it (None: none recorded); only
    # for shards listed with a stamp
    recorded_stamps: dict[str, dict | None] = field(default_factory=dict)

    @property
    def num_done(self) -> int:
        return len(self.shards) - len(self.pending)

    def rows_kept(self) -> int:
        """The committed rows of unchanged prompts that the shards written again keep."""
        return sum(len(reuse.kept) * reuse.samples for reuse in self.reuse.values())

    def rows_dropped(self) -> dict[str, int]:
        """Per prompt no longer in the job, its committed rows that the shards written again drop."""
        dropped: dict[str, int] = {}
        for reuse in self.reuse.values():
            for name in reuse.dropped:
                dropped[name] = dropped.get(name, 0) + reuse.samples
        return dropped

    def rows_per_prompt(self, names: tuple[str, ...]) -> dict[str, RowCounts]:
        """Per prompt of the job, the rows of its task's shards a run would keep and would run."""
        reuse, compute = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
        for shard in self.pending:
            kept = self.reuse.get(shard.shard)
            for index, name in enumerate(names):
                if kept is not None and index in kept.kept:
                    reuse[name] += kept.samples
                else:  # a shard run whole has one row per sample and prompt
                    samples = shard.num_rows if kept is None else kept.samples
                    total = compute[name]
                    compute[name] = None if samples is None or total is None else total + samples
        for marker in self.done.values():
            for name in names:
                reuse[name] += committed_samples(marker)
        return {name: RowCounts(reuse[name], compute[name]) for name in names}


def shard_plan(
    out: OutputDir,
    shards: list[ShardInfo],
    output_defining: dict,
    fingerprint: str,
    overwrite: bool,
    graph: PromptGraph | None,
) -> ShardPlan:
    """Where each shard stands for the job. `graph`: the job's prompts, to reuse the rows of unchanged
    prompts; without it (reading results) a shard of any other config is stale."""
    pending, stale = [], []
    reuse: dict[str, PromptReuse] = {}
    done: dict[str, ShardMarker] = {}
    changed: set[str] = set()
    input_changed = []
    recorded_stamps: dict[str, dict | None] = {}
    states = each_at_once(
        lambda shard: commit_state_and_stamp(out, shard.shard, fingerprint, shard), shards, out.reads_at_once
    )
    for shard, (state, marker, recorded) in zip(shards, states, strict=True):
        if state is CommitState.STALE and _recorded_before_identity(marker, output_defining):
            state = CommitState.DONE
        if state is CommitState.INPUT_CHANGED:
            pending.append(shard)
            input_changed.append(shard)
        elif state is CommitState.MISSING or overwrite:
            pending.append(shard)
        elif state is CommitState.DONE:
            done[shard.shard] = marker
            if shard.stamp is not None:
                recorded_stamps[shard.shard] = recorded
        elif every_row := _job_wide_changes(marker, output_defining):
            stale.append(shard)  # named by the keys that refuse it, not the prompts
            changed.update(every_row)
        elif graph is None:  # a reader of results: a run brings the prompts' rows up to date
            stale.append(shard)
            changed.add(PROMPTS_CHANGED)
        else:
            pending.append(shard)
            reuse[shard.shard] = prompt_reuse(graph, output_defining, marker)
    return ShardPlan(
        shards, pending, reuse, done, stale, tuple(sorted(changed)), input_changed, recorded_stamps
    )


def plan_shards(
    out: OutputDir,
    shards: list[ShardInfo],
    output_defining: dict,
    fingerprint: str,
    overwrite: bool,
    clean: bool = True,
    graph: PromptGraph | None = None,
) -> ShardPlan:
    """The shard plan of a run (or a reader of results, without `graph`), refusing stale shards.
    `clean`: also remove temp files left by killed runs on this host (a run does; a preflight looks)."""
    plan = shard_plan(out, shards, output_defining, fingerprint, overwrite, graph)
    if plan.stale and plan.changed == (PROMPTS_CHANGED,):
        raise UserError(
            f"{out.url} holds {len(plan.stale)} shard(s) written with other prompts or sampling; run the job "
            "to update them (the rows of unchanged prompts are kept), or set output.dir to a new folder"
        )
    if plan.input_changed and graph is None:  # a reader of results: the rows are of the files replaced
        raise UserError(
            f"{out.url} holds {len(plan.input_changed)} shard(s) committed from input files that changed "
            "since; run the job to redo them, or set output.dir to a new folder"
        )
    if plan.stale:
        keys = ", ".join(map(describe_change, plan.changed)) or "the output-defining config"
        raise UserError(
            f"{out.url} holds {len(plan.stale)} shard(s) written with a different config (changed: {keys}); "
            "rerun with --overwrite to recompute them, or set output.dir to a new folder"
        )
    if clean and isinstance(out, LocalDir):  # an object store has no temp files
        for shard in shards:
            out.remove_stale_temps(output_path(out, shard.shard))
        out.remove_stale_temps(out.join(layout.CARD_FILE))  # the dataset card is rewritten at each commit
    return plan


def _job_wide_changes(marker: ShardMarker, output_defining: dict) -> list[str]:
    """The changed keys that define every row (all but the prompts and the sampling they take)."""
    recorded = as_recorded_by(output_defining, marker.config)
    return changed_keys(split_definition(marker.config)[0], split_definition(recorded)[0])


def _recorded_before_identity(marker: ShardMarker, output_defining: dict) -> bool:
    """Whether a marker of another fingerprint holds this config as written before the checkpoint's
    identity was recorded: the shard is committed by it (`as_recorded_by`)."""
    recorded = as_recorded_by(output_defining, marker.config)
    return recorded is not output_defining and marker.fingerprint == definition_fingerprint(recorded)
