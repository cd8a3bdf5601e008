"""The shard ledger: the bookkeeping of a run's shards, apart from the loop that feeds and steps.

Per shard: which rows it is to produce (every (sample, prompt), or a selection, as a retry of failed
rows has, with the committed rows its follow-ups use), the rows done, and whether it is committed or
skipped (another run has it); the samples still in the engine are the sample flow's (`sample_flow.py`).
A shard is complete once every row it is to produce has its outcome: the ledger says which shards are
(`complete_shards`), the runner commits them through its commit strategy after it has handled a step's
results or an input item, never inside that loop, and tells the ledger (`mark_committed`), which frees
the rows. The ledger holds only plain data; a selection of a shard's rows to run again may read the
committed rows they use when first asked (`prompt_reuse.RowsToRun`), and is let go at commit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from batchvl.inputs.types import ShardInfo
from batchvl.outputs.writers import ResultRow


@dataclass(frozen=True)
class SelectedRows:
    """A sample's rows to produce, and the committed rows of the prompts they use, which are not run
    again: a follow-up is rendered with their outputs, as it was the first time."""

    prompts: frozenset[int]
    used: dict[int, ResultRow] = field(default_factory=dict)  # prompt index -> its committed row


# shard -> sample index -> its rows to produce (a shard not in it: every (sample, prompt))
Selection = dict[str, Mapping[int, SelectedRows]]


def samples_read(info: ShardInfo, selection: Selection | None) -> int | None:
    """How many samples of the shard a run with `selection` reads: the selected ones, or all of its rows
    (None: known only by reading it)."""
    selected = None if selection is None else selection.get(info.shard)
    return info.num_rows if selected is None else len(selected)


class CommitStrategy(Protocol):
    """Writes a complete shard's rows (a new file, or merged into the committed one); returns where."""

    # whether the commit records the stamp of the input the rows were made from, with its content's digest
    # (`inputs/stamps.py`), which the run then reads beside the job's thread (`ContentStamps`)
    records_input_stamp: bool

    def __call__(self, info: ShardInfo, rows: list[ResultRow]) -> str: ...


@dataclass
class ShardState:
    info: ShardInfo
    position: int  # in this run's shard order: its requests' admission priority
    rows: list[ResultRow] = field(default_factory=list)
    expected_rows: int | None = None  # known once the whole shard has been read
    committed: bool = False
    skipped: bool = False

    @property
    def is_open(self) -> bool:
        return not (self.committed or self.skipped)


class ShardLedger:
    def __init__(self, shards: list[ShardInfo], selection: Selection | None, num_prompts: int):
        self.shards = {info.shard: ShardState(info, position) for position, info in enumerate(shards)}
        self.selection = selection
        self.num_prompts = num_prompts

    def position(self, shard: str) -> int:
        return self.shards[shard].position

    def _selected(self, shard: str) -> Mapping[int, SelectedRows] | None:
        """The shard's selected rows per sample (None: every (sample, prompt))."""
        return None if self.selection is None else self.selection.get(shard)

    def prompts_of(self, shard: str, sample_index: int) -> list[int]:
        """The prompts to run for a sample: all of them, or those selected for it."""
        selected = self._selected(shard)
        if selected is None:
            return list(range(self.num_prompts))
        return sorted(selected[sample_index].prompts)

    def used_rows_of(self, shard: str, sample_index: int) -> dict[int, ResultRow]:
        """The committed rows that a sample's selected follow-ups use instead of running those prompts."""
        selected = self._selected(shard)
        return {} if selected is None else selected[sample_index].used

    def samples_of(self, info: ShardInfo) -> int | None:
        """How many samples of the shard this run reads (None: known only by reading it)."""
        return samples_read(info, self.selection)

    def wanted(self) -> dict[str, frozenset[int]] | None:
        """Per shard, the only sample indices to read (None, or a shard not in it: all)."""
        if self.selection is None:
            return None
        return {shard: frozenset(samples) for shard, samples in self.selection.items()}

    def end_of_shard(self, shard: str, num_samples: int) -> None:
        """The reader has gone through the whole shard, which holds `num_samples` samples."""
        selected = self._selected(shard)
        if selected is None:
            expected = num_samples * self.num_prompts
        else:
            expected = sum(len(rows.prompts) for index, rows in selected.items() if index < num_samples)
        self.shards[shard].expected_rows = expected

    def skip(self, shard: str) -> None:
        self.shards[shard].skipped = True

    def add_row(self, shard: str, row: ResultRow) -> None:
        self.shards[shard].rows.append(row)

    def complete_shards(self) -> list[ShardState]:
        """The open shards whose every row has its outcome: to be committed."""
        return [
            state
            for state in self.shards.values()
            if state.is_open and state.expected_rows is not None and len(state.rows) >= state.expected_rows
        ]

    def mark_committed(self, shard: str) -> None:
        state = self.shards[shard]
        state.committed = True
        state.rows = []  # written; free the memory
        if self.selection is not None and shard in self.selection:
            self.selection[shard] = {}  # and the committed rows its follow-ups used

    def open_shards(self) -> Iterator[str]:
        return (name for name, state in self.shards.items() if state.is_open)

    @property
    def num_committed(self) -> int:
        return sum(state.committed for state in self.shards.values())

    @property
    def num_skipped(self) -> int:
        return sum(state.skipped for state in self.shards.values())

    @property
    def rows_not_committed(self) -> int:
        """Rows done in shards that are not committed (a stop leaves them for the next run)."""
        return sum(len(state.rows) for state in self.shards.values() if not state.committed)
