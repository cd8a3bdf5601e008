"""Every running request's block table as one row of a fixed (rows, width) int64 array.

A step's decodes need, per request, where its newest token goes and which blocks hold its keys. Asked of
each request's own list, that was a call and a few numpy slices per decode, most of a step's host work at
hundreds of decodes; asked of one array, it is a few vectorized lookups over the step's rows (see
`ModelRunner.execute`). The array has a row for each request that can run at once, given when it is
admitted and taken back when it leaves, and a column for each block a request can hold.

The runner keeps a copy on the device (`DeviceBlockTable`) that a step's decode attention reads where it
lies: the entries written since its last copy are logged here (`take_changes`), so that a step uploads
the few blocks requests gained, not the table. A row given back is not cleared: a row is read only up to
its request's length.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, rows: int, width: int, block_size: int):
        self.blocks = np.zeros((rows, width), dtype=np.int64)
        self.width = width
        self.block_size = block_size
        self._free_rows = list(range(rows - 1, -1, -1))  # the lowest first
        # flat index -> block, of the entries written since `take_changes` (the last write of each)
        self._changed: dict[int, int] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape

    def take_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("more requests hold blocks than the block table has rows")
        return self._free_rows.pop()

    def give_back(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, first: int, blocks: list[int]) -> None:
        """Set the row's entries from column `first` on to `blocks`."""
        if not blocks:
            return
        if first + len(blocks) > self.width:
            raise RuntimeError("a request holds more blocks than the block table has columns")
        self.blocks[row, first : first + len(blocks)] = blocks
        start = row * self.width + first
        self._changed.update(zip(range(start, start + len(blocks)), blocks, strict=True))

    def take_changes(self) -> tuple[np.ndarray, np.ndarray]:
        """The flat indices and blocks of the entries written since the last call, each index once with its
        last block (a device's scatter of repeated indices keeps any one of their values)."""
        changed, self._changed = self._changed, {}
        indices = np.fromiter(changed.keys(), dtype=np.int64, count=len(changed))
        return indices, np.fromiter(changed.values(), dtype=np.int64, count=len(changed))

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The cache slots of tokens given by their requests' rows and their positions in them."""
        size = self.block_size
        return self.blocks[rows, positions // size] * size + positions % size

    def rows_in_use(self) -> int:
        return len(self.blocks) - len(self._free_rows)
