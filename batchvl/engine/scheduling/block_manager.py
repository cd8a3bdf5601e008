"""Paged KV-cache bookkeeping: fixed-size blocks from a free list, a block table per request, and a
prefix cache of full blocks keyed by their chain hash (see `prefix_cache.py`).

Only ints live here: each request's block ids, the same as a row of the running requests' `BlockTable`
(what the runner reads), and each request's slots as an int64 array, kept and grown as blocks are added;
the model runner owns the K/V tensors and addresses them by slot (`block_id * block_size + offset`).

A block is shared by every request whose prefix hashes to it (a reference count per block). When its
last user lets go, a block holding a hashed prefix is not wiped: it waits in an LRU and is handed out
again on a hash match, or reused for new tokens only when no plain free block is left.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from batchvl.engine.request import Request
from batchvl.engine.scheduling.block_table import BlockTable
from batchvl.engine.scheduling.prefix_cache import extend_block_hashes

_NOTHING = np.empty(0, dtype=np.int64)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        max_running: int | None = None,
        max_tokens_per_request: int | None = None,
    ):
        """`max_running`: the most requests that hold blocks at once (the scheduler's `max_num_seqs`);
        `max_tokens_per_request`: the most tokens a request holds (the model's length). Each bounds the
        block table (see `BlockTable`); None: as many as the cache has blocks."""
        if num_blocks <= 0:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A request that holds blocks holds one of its own at least (its tokens past a cached prefix), so
        # no more requests than blocks hold any; nor does one hold more blocks than the cache has.
        rows = min(num_blocks, max_running or num_blocks)
        width = min(
            num_blocks,
            blocks_needed(max_tokens_per_request, block_size) if max_tokens_per_request else num_blocks,
        )
        self.table = BlockTable(rows, width, block_size)
        # A stack: the most recently freed blocks are reused first. Their memory is warm in the CPU cache,
        # and blocks never needed are never touched, so resident memory follows the working set instead
        # of creeping up to the whole (lazily zeroed) pool as a FIFO would make it.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks that still hold a hashed prefix, least recently used first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        # Per request id: how many of its blocks' slots are kept, and those slots as int64 (with room to
        # grow). A block table only grows until `free` empties it, so a step adds the slots of new blocks
        # alone, where recomputing every context token's slot of every request cost 18 ms per step at 256
        # decodes of 600 tokens.
        self._slots: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # --- prefix cache -------------------------------------------------------------------------------
    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of a request that has nothing computed yet.

        The first token whose logits the request needs is always left to compute."""
        if not self.enable_prefix_caching or request.block_ids:
            return []
        limit = request.num_cacheable_tokens // self.block_size
        blocks = []
        for block_hash in extend_block_hashes(request, self.block_size, limit):
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def first_uncached_hash(self, request: Request, num_cached_blocks: int) -> int | None:
        """The hash of the request's first prompt block past its cached prefix, if it has one."""
        hashes = extend_block_hashes(request, self.block_size, num_cached_blocks + 1)
        return hashes[num_cached_blocks] if len(hashes) > num_cached_blocks else None

    def can_admit(self, request: Request, cached: list[int], num_new_tokens: int) -> bool:
        reviving = sum(1 for block in cached if self._refs[block] == 0)  # these leave the free pool
        needed = blocks_needed(len(cached) * self.block_size + num_new_tokens, self.block_size) - len(cached)
        return needed <= self.num_free_blocks - reviving

    def admit(self, request: Request, cached: list[int], num_new_tokens: int) -> None:
        """Give a waiting request its cached prefix blocks, then room for `num_new_tokens` more."""
        for block in cached:
            if self._refs[block] == 0:
                del self._free_cached[block]
            self._refs[block] += 1
        request.block_ids = list(cached)
        request.num_offered_blocks = len(cached)  # they come from the prefix cache: published already
        self._slots.pop(request.request_id, None)
        self._give_row(request)
        self.table.write(request.table_row, 0, request.block_ids)
        request.num_computed_tokens = len(cached) * self.block_size
        self.allocate(request, num_new_tokens)

    def register_full_blocks(self, request: Request) -> None:
        """Publish the hashes of the request's blocks that its computed tokens have filled since the last
        call. Each block is offered once, when it fills: walking every full block of every request at every
        step cost 2 ms a step at 256 decodes of 600 tokens. A block whose hash another block already holds
        stays unpublished (its tokens are cached there)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        offered = request.num_offered_blocks
        if num_full <= offered:
            return
        hashes = extend_block_hashes(request, self.block_size, num_full)
        for block, block_hash in zip(request.block_ids[offered:num_full], hashes[offered:], strict=True):
            if block_hash not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[block_hash] = block
                self._hash_of_block[block] = block_hash
        request.num_offered_blocks = num_full

    # --- allocation ---------------------------------------------------------------------------------
    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow the request's block table to hold its computed tokens plus `num_new_tokens`."""
        num_blocks = self.num_new_blocks(request, num_new_tokens)
        if num_blocks > self.num_free_blocks:
            raise RuntimeError("allocate() called without can_allocate()")
        self._give_row(request)
        first = len(request.block_ids)
        for _ in range(num_blocks):
            block = self._take_free_block()
            self._refs[block] = 1
            request.block_ids.append(block)
        self.table.write(request.table_row, first, request.block_ids[first:])

    def _give_row(self, request: Request) -> None:
        """A block table row for a request that has none."""
        if request.table_row < 0:
            request.table_row = self.table.take_row()

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._free_cached.popitem(last=False)  # evict the least recently used cached prefix
        del self._block_of_hash[self._hash_of_block.pop(block)]
        return block

    def free(self, request: Request) -> None:
        # Last blocks first, so that within a request the tail of a prefix is evicted before its head.
        for block in reversed(request.block_ids):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of_block:
                self._free_cached[block] = None
            else:
                self._free.append(block)
        request.block_ids = []
        request.num_offered_blocks = 0
        self._slots.pop(request.request_id, None)
        if request.table_row >= 0:  # (a request freed while waiting, after a preemption freed it, has none)
            self.table.give_back(request.table_row)
            request.table_row = -1

    def check_integrity(self, requests: list[Request]) -> None:
        """Assert the bookkeeping is whole, given every request that holds blocks: each block is free,
        free with a cached prefix, or referenced, exactly once; reference counts equal the block tables'
        uses; the hash maps are each other's inverse and name only blocks that are in use or cached."""
        free, free_cached = self._free, list(self._free_cached)
        referenced = [block for block in range(self.num_blocks) if self._refs[block] > 0]
        everything = free + free_cached + referenced
        assert sorted(everything) == list(range(self.num_blocks)), "a block is lost or counted twice"
        uses = [0] * self.num_blocks
        for request in requests:
            for block in request.block_ids:
                uses[block] += 1
        assert uses == self._refs, "reference counts differ from the block tables"
        assert {b: h for h, b in self._block_of_hash.items()} == self._hash_of_block, "hash maps disagree"
        assert all(block in self._hash_of_block for block in free_cached), "a cached free block lost its hash"
        assert not set(free) & set(self._hash_of_block), "a plain free block still has a hash"
        holding = [request for request in requests if request.block_ids]
        rows = [request.table_row for request in holding]
        assert all(row >= 0 for row in rows) and len(set(rows)) == len(rows), "a block table row is shared"
        assert self.table.rows_in_use() == len(rows), "a block table row is lost"
        for request in holding:
            table_row = self.table.blocks[request.table_row, : len(request.block_ids)]
            assert table_row.tolist() == request.block_ids, "the block table differs from a request's blocks"

    def key_layout(self, request: Request, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Where the request's token positions [0, end) lie in the cache: their slots, and the blocks that
        hold them (its block table's first blocks), both int64 numpy views of arrays kept for the request:
        read them, never write them. numpy, where a step asks for every sequence's: slicing and growing a
        torch tensor cost 3-5 us a call, 1 ms a step at 256 decodes."""
        size = self.block_size
        needed = blocks_needed(end, size)
        blocks = self.table.blocks[request.table_row, :needed]
        kept = self._slots.get(request.request_id)  # (no default array made on every call: most calls hit)
        expanded, slots = kept if kept is not None else (0, _NOTHING)
        if expanded < needed:
            if len(slots) < needed * size:  # room for twice the blocks: a request grows a block at a time
                slots = grown(slots, 2 * needed * size, expanded * size)
            new_blocks = blocks[expanded:needed]
            slots[expanded * size : needed * size] = (new_blocks[:, None] * size + np.arange(size)).ravel()
            self._slots[request.request_id] = (needed, slots)
        return slots[:end], blocks


def grown(values: np.ndarray, size: int, kept: int) -> np.ndarray:
    """An int64 array of `size` whose first `kept` values are `values'`."""
    larger = np.empty(size, dtype=np.int64)
    larger[:kept] = values[:kept]
    return larger
