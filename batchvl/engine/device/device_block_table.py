"""The block manager's `BlockTable` where the decode attention reads it: on the model's device.

Kept whole on the device and brought up to date before each step with the entries written since the last
(`sync`: one small upload and one scatter), so a step's decodes pass each row's start in it instead of
their block tables: at 1,024 decodes of a few hundred tokens the tables were some 30,000 ids to join on
the host and upload every step.

Flat, with one row more than the host's, past the rest: the padding rows of a decode graph (see
`decode_graphs.py`) read their one key through its first entry, set once to the block no request owns.
"""

from __future__ import annotations

import numpy as np
import torch

from batchvl.engine.scheduling.block_table import BlockTable
from batchvl.layers.attention import uploaded


class DeviceBlockTable:
    def __init__(self, host: BlockTable, device: torch.device, padding_block: int = 0):
        rows, width = host.shape
        self.host = host
        self.width = width
        self.device = device
        self.padding_block = padding_block
        self.padding_start = rows * width  # the padding row's first entry
        self.blocks = torch.zeros(self.padding_start + width, dtype=torch.long, device=device)
        self.blocks[self.padding_start] = padding_block

    def sync(self) -> None:
        """Copy the host's entries written since the last call (queued on the device's stream: the step's
        kernels that read them come after it)."""
        indices, values = self.host.take_changes()
        if len(indices):
            indices, values = uploaded([torch.from_numpy(indices), torch.from_numpy(values)], self.device)
            self.blocks.index_copy_(0, indices, values)

    def starts(self, rows: np.ndarray) -> np.ndarray:
        """Where each of the host's `rows` begins in `blocks`."""
        return rows * self.width
