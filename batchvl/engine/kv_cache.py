"""Paged KV-cache bookkeeping: fixed-size blocks from a free list, a block table per request.

Only ints live here (`slots` turns a block table into an index tensor for the runner); the
model runner owns the K/V tensors and addresses them by slot (`block_id * block_size + offset`).
"""

from __future__ import annotations

import torch

from batchvl.engine.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed blocks are reused first. Their memory is warm in the CPU cache,
        # and blocks never needed are never touched, so resident memory follows the working set instead
        # of creeping up to the whole (lazily zeroed) pool as a FIFO would make it.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow the request's block table to hold its computed tokens plus `num_new_tokens`."""
        num_blocks = self.num_new_blocks(request, num_new_tokens)
        if num_blocks > len(self._free):
            raise RuntimeError("allocate() called without can_allocate()")
        request.block_ids.extend(self._free.pop() for _ in range(num_blocks))

    def free(self, request: Request) -> None:
        self._free.extend(request.block_ids)
        request.block_ids = []

    def slots(self, request: Request, end: int) -> torch.Tensor:
        """Cache slots of the request's token positions [0, end), as a long tensor."""
        size = self.block_size
        positions = torch.arange(end)
        table = torch.tensor(request.block_ids[: blocks_needed(end, size)], dtype=torch.long)
        return table[positions // size] * size + positions % size
