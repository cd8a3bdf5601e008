"""Which committed rows a job keeps when it runs over shards written with other prompts.

A row is defined by what defines every row (model, backend, input, preprocessing: a change there is
refused, `resume.py`) and by its own prompt's definition (the sampling it takes included), with those of
the prompts it uses. So over a shard committed with other prompts, an unchanged prompt keeps its
committed rows as they are (not run again); a changed or added prompt runs, and so does every follow-up
that uses one (its input changes); a prompt no longer in the job loses its rows when the shard is
committed again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from batchvl.config import split_definition
from batchvl.outputs.commit import ShardMarker, read_committed, read_marker
from batchvl.outputs.writers import RESULT_SCHEMA, ResultRow
from batchvl.pipeline.ledger import SelectedRows
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.preprocess.prompts import template_fields
from batchvl.storage.output_dir import OutputDir


@dataclass(frozen=True)
class PromptReuse:
    """A committed shard's rows against the job's prompts."""

    kept: frozenset[int]  # the job's prompts whose committed rows stay
    run: frozenset[int]  # changed and added prompts, and the follow-ups that use them
    dropped: tuple[str, ...]  # committed prompts the job no longer has: their rows go
    samples: int  # the shard's committed samples (each has one row per committed prompt)


def prompt_reuse(graph: PromptGraph, defining: dict, marker: ShardMarker) -> PromptReuse:
    """The reuse of a shard committed with `marker` by a job whose output-defining config is `defining`
    (with the same job-wide part as the marker's)."""
    _, new = split_definition(defining)
    old = committed_prompts(marker)
    run: set[int] = set()
    for index, name in enumerate(graph.names):  # in order: a prompt uses earlier prompts only
        if (
            new[name] != old.get(name)
            or graph.uses[index] & run
            or _used_a_removed_prompt(new[name], new, old)
        ):
            run.add(index)
    kept = frozenset(range(len(graph.names))) - run
    dropped = tuple(name for name in old if name not in new)
    return PromptReuse(kept, frozenset(run), dropped, committed_samples(marker))


def _used_a_removed_prompt(prompt: dict, new: dict[str, dict], old: dict[str, dict]) -> bool:
    """Whether the prompt's text inserted the output of a prompt the job no longer has: the same `{name}`
    now inserts the sample's field of that name, so its rows change though its own definition did not."""
    return any(name in old and name not in new for name in template_fields(prompt["text"]))


def committed_prompts(marker: ShardMarker) -> dict[str, dict]:
    """The definitions of the prompts that wrote a committed shard, by name."""
    return split_definition(marker.config)[1]


def committed_samples(marker: ShardMarker) -> int:
    """A committed shard's samples: each has one row per prompt of the config that wrote it."""
    return marker.rows // len(committed_prompts(marker))


class RowsToRun(Mapping[int, SelectedRows]):
    """Per committed sample of a shard to commit again: the prompts to run (the same for every sample),
    and the committed rows of the kept prompts they use (a follow-up of an unchanged prompt is rendered
    with its committed output, as it would be had both run now). Those rows are read from the shard's
    file when its first sample asks for them, not for every shard at planning, and go with the shard
    once it is committed (the ledger lets go of its selection)."""

    def __init__(self, out: OutputDir, shard: str, reuse: PromptReuse, graph: PromptGraph):
        self.out, self.shard, self.reuse = out, shard, reuse
        self.used = {graph.names[i]: i for i in graph.with_what_they_use(reuse.run) - reuse.run}
        # Every sample of a committed shard has its rows, so its indices are 0 .. samples - 1; with no
        # prompt to run (rows only dropped or reordered) no sample is read, and the shard is committed again.
        self.samples = range(reuse.samples if reuse.run else 0)
        self._rows: dict[int, dict[int, ResultRow]] | None = None

    def __getitem__(self, index: int) -> SelectedRows:
        if index not in self.samples:
            raise KeyError(index)
        if self._rows is None:
            self._rows = self._read_used_rows()
        return SelectedRows(self.reuse.run, self._rows.get(index, {}))

    def __iter__(self) -> Iterator[int]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def _read_used_rows(self) -> dict[int, dict[int, ResultRow]]:
        rows: dict[int, dict[int, ResultRow]] = {}
        if not self.used:
            return rows
        marker = read_marker(self.out, self.shard)
        assert marker is not None  # planned from it, and claimed: nobody else commits it
        table = read_committed(self.out, self.shard, marker)
        inputs = table.filter(pc.is_in(table["prompt"], pa.array(list(self.used), pa.string())))
        for row in inputs.select(RESULT_SCHEMA.names).to_pylist():
            prompt = self.used[row["prompt"]]
            rows.setdefault(row["sample_index"], {})[prompt] = ResultRow(**row, prompt_index=prompt)
        return rows
