"""Encoder-cache bookkeeping keyed by image content hash: reference counts plus an LRU of free entries.

An entry referenced by a request that still has unprefilled placeholder tokens of that image is pinned;
once no request references it, it moves to an LRU and is evicted only when the byte budget is exceeded.
Pinned entries may push the cache over budget: a running prefill never re-encodes because of eviction.
The model runner owns the embedding tensors; `evicted` tells it which to drop.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._bytes: dict[str, int] = {}
        self._refs: dict[str, int] = {}
        self._freeable: OrderedDict[str, None] = OrderedDict()
        self.used_bytes = 0
        self.num_evictions = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._bytes

    @property
    def cached_hashes(self) -> set[str]:
        return set(self._bytes)

    def acquire(self, content_hash: str) -> bool:
        """Pin an entry for one more user; returns True if it is cached (a hit), else the caller encodes."""
        self._refs[content_hash] = self._refs.get(content_hash, 0) + 1
        if content_hash in self._bytes:
            self._freeable.pop(content_hash, None)
            return True
        return False

    def insert(self, content_hash: str, num_bytes: int) -> list[str]:
        """Record a freshly encoded (pinned) entry; returns the hashes evicted to make room."""
        self._bytes[content_hash] = num_bytes
        self.used_bytes += num_bytes
        return self._evict_over_budget()

    def release(self, content_hash: str) -> list[str]:
        """Drop one user's pin; returns the hashes evicted as a result."""
        refs = self._refs[content_hash] - 1
        if refs > 0:
            self._refs[content_hash] = refs
            return []
        del self._refs[content_hash]
        if content_hash in self._bytes:
            self._freeable[content_hash] = None
        return self._evict_over_budget()

    def check_integrity(self, pins: dict[str, int]) -> None:
        """Assert the bookkeeping is whole, given how many requests pin each hash: the reference counts
        are those pins, the byte count is the entries' sum, and an entry is freeable exactly when it is
        cached and unpinned."""
        assert self._refs == {h: n for h, n in pins.items() if n}, "pins differ from the reference counts"
        assert self.used_bytes == sum(self._bytes.values()), "used bytes differ from the entries' sizes"
        unpinned = [h for h in self._bytes if h not in self._refs]
        assert sorted(self._freeable) == sorted(unpinned), "freeable entries differ from the unpinned ones"

    def _evict_over_budget(self) -> list[str]:
        evicted = []
        while self.used_bytes > self.capacity_bytes and self._freeable:
            content_hash, _ = self._freeable.popitem(last=False)
            self.used_bytes -= self._bytes.pop(content_hash)
            evicted.append(content_hash)
        self.num_evictions += len(evicted)
        return evicted
