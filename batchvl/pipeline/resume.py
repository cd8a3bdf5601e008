"""Which of a task's shards to run: resume is the default, a changed config is refused.

A shard with a marker from the same output-defining config is done and skipped. One without a marker
(never run, or killed before its commit) is redone from scratch. One whose marker names another config
would mix outputs of two configs in one folder: refused, with the changed keys and the two ways out,
unless `--overwrite` asks to recompute everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchvl.config import changed_keys
from batchvl.errors import UserError
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.commit import CommitState, commit_state
from batchvl.outputs.writers import output_path
from batchvl.storage.output_dir import LocalDir, OutputDir


@dataclass(frozen=True)
class ShardPlan:
    shards: list[ShardInfo]  # the task's shards
    pending: list[ShardInfo]  # to run now

    @property
    def num_done(self) -> int:
        return len(self.shards) - len(self.pending)


def plan_shards(
    out: OutputDir,
    shards: list[ShardInfo],
    output_defining: dict,
    fingerprint: str,
    overwrite: bool,
    clean: bool = True,
) -> ShardPlan:
    """`clean`: also remove temp files left by killed runs on this host (a run does; a preflight looks)."""
    pending, stale = [], []
    changed: set[str] = set()
    for shard in shards:
        state, marker = commit_state(out, shard.shard, fingerprint)
        if state is CommitState.MISSING or overwrite:
            pending.append(shard)
        elif state is CommitState.STALE:
            stale.append(shard)
            changed.update(changed_keys(marker.config, output_defining))
    if stale:
        keys = ", ".join(sorted(changed)) or "the output-defining config"
        raise UserError(
            f"{out.url} holds {len(stale)} shard(s) written with a different config (changed: {keys}); "
            "rerun with --overwrite to recompute them, or set output.dir to a new folder"
        )
    if clean and isinstance(out, LocalDir):  # an object store has no temp files
        for shard in shards:
            out.remove_stale_temps(output_path(out, shard.shard))
    return ShardPlan(shards, pending)
