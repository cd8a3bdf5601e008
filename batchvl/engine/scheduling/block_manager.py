"""Paged KV-cache bookkeeping: fixed-size blocks from a free list, a block table per request, and a
prefix cache of full blocks keyed by their chain hash (see `prefix_cache.py`).

Only ints live here, and each request's slots (`slots`: its block table as an int64 array for the runner,
kept and grown as blocks are added); the model runner owns the K/V tensors and addresses them by slot
(`block_id * block_size + offset`).

A block is shared by every request whose prefix hashes to it (a reference count per block). When its
last user lets go, a block holding a hashed prefix is not wiped: it waits in an LRU and is handed out
again on a hash match, or reused for new tokens only when no plain free block is left.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from batchvl.engine.request import Request
from batchvl.engine.scheduling.prefix_cache import extend_block_hashes

_NOTHING = np.empty(0, dtype=np.int64)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A stack: the most recently freed blocks are reused first. Their memory is warm in the CPU cache,
        # and blocks never needed are never touched, so resident memory follows the working set instead
        # of creeping up to the whole (lazily zeroed) pool as a FIFO would make it.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks that still hold a hashed prefix, least recently used first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        # Per request id: how many of its blocks are kept as arrays, its block table and their slots as int64
        # (each with room to grow). A block table only grows until `free` empties it, so a step adds the
        # slots of new blocks alone, where recomputing every context token's slot of every request cost
        # 18 ms per step at 256 decodes of 600 tokens.
        self._tables: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

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
        self._tables.pop(request.request_id, None)
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
    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks hold `num_new_tokens` more (asked for every decode of every step)."""
        return request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size

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
        for _ in range(num_blocks):
            block = self._take_free_block()
            self._refs[block] = 1
            request.block_ids.append(block)

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
        self._tables.pop(request.request_id, None)

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

    def key_layout(self, request: Request, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Where the request's token positions [0, end) lie in the cache: their slots, and the blocks that
        hold them (its block table's first blocks), both int64 numpy views of arrays kept for the request:
        read them, never write them. numpy, where a step asks for every sequence's: slicing and growing a
        torch tensor cost 3-5 us a call, 1 ms a step at 256 decodes."""
        size = self.block_size
        needed = blocks_needed(end, size)
        kept = self._tables.get(request.request_id)  # (no default arrays made on every call: most calls hit)
        expanded, blocks, slots = kept if kept is not None else (0, _NOTHING, _NOTHING)
        if expanded < needed:
            if len(blocks) < needed:  # room for twice the blocks: a request grows a block at a time
                blocks = grown(blocks, 2 * needed, expanded)
                slots = grown(slots, 2 * needed * size, expanded * size)
            new_blocks = np.array(request.block_ids[expanded:needed], dtype=np.int64)
            blocks[expanded:needed] = new_blocks
            slots[expanded * size : needed * size] = (new_blocks[:, None] * size + np.arange(size)).ravel()
            self._tables[request.request_id] = (needed, blocks, slots)
        return slots[:end], blocks[:needed]


def grown(values: np.ndarray, size: int, kept: int) -> np.ndarray:
    """An int64 array of `size` whose first `kept` values are `values'`."""
    larger = np.empty(size, dtype=np.int64)
    larger[:kept] = values[:kept]
    return larger
