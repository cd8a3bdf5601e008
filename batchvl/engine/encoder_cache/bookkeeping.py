"""Encoder-cache bookkeeping keyed by image content hash: which requests hold each entry, plus an LRU of
entries nobody holds.

A request holds an image from the step that first schedules a chunk touching it until every placeholder
run of that image is in the KV cache (or the request finishes or is preempted: `release_request` lets go
of all it holds, in one place). A held entry is never evicted, so a running prefill never re-encodes;
held entries may push the cache over budget. Once nobody holds an entry it moves to an LRU and is
evicted only when the byte budget is exceeded. Only hashes and sizes live here: the model runner owns
the embedding tensors and drops those the `evicted` lists name.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._bytes: dict[str, int] = {}
        # Who holds what, both ways, by request id: the entries' reference counts, kept whole here (like the
        # block manager's) rather than spread over the requests; a request lets go in one call.
        self._holders: dict[str, set[int]] = {}  # content hash -> ids of the requests that hold it
        self._held: dict[int, set[str]] = {}  # request id -> the hashes it holds
        self._freeable: OrderedDict[str, None] = OrderedDict()
        self.used_bytes = 0
        self.num_evictions = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._bytes

    @property
    def cached_hashes(self) -> set[str]:
        return set(self._bytes)

    def holds(self, request_id: int, content_hash: str) -> bool:
        return content_hash in self._held.get(request_id, ())

    def held_by(self, request_id: int) -> set[str]:
        return set(self._held.get(request_id, ()))

    def acquire(self, request_id: int, content_hash: str) -> bool:
        """The request holds the entry from now on; True if it is cached (a hit), else it must be encoded
        and `insert`ed."""
        self._holders.setdefault(content_hash, set()).add(request_id)
        self._held.setdefault(request_id, set()).add(content_hash)
        if content_hash in self._bytes:
            self._freeable.pop(content_hash, None)
            return True
        return False

    def insert(self, content_hash: str, num_bytes: int) -> list[str]:
        """Record a freshly encoded (held) entry; returns the hashes evicted to make room."""
        self._bytes[content_hash] = num_bytes
        self.used_bytes += num_bytes
        return self._evict_over_budget()

    def release(self, request_id: int, content_hash: str) -> list[str]:
        """The request lets go of one entry; returns the hashes evicted as a result."""
        self._held[request_id].discard(content_hash)
        if not self._held[request_id]:
            del self._held[request_id]
        holders = self._holders[content_hash]
        holders.discard(request_id)
        if holders:
            return []
        del self._holders[content_hash]
        if content_hash in self._bytes:
            self._freeable[content_hash] = None
        return self._evict_over_budget()

    def release_request(self, request_id: int) -> list[str]:
        """The request lets go of everything it holds (it finished, or was preempted)."""
        evicted = []
        for content_hash in sorted(self.held_by(request_id)):
            evicted += self.release(request_id, content_hash)
        return evicted

    def check_integrity(self, live_requests: set[int]) -> None:
        """Assert the bookkeeping is whole: holders and held are each other's inverse and name only live
        requests, the byte count is the entries' sum, and an entry is freeable exactly when it is cached
        and nobody holds it."""
        pairs = {(h, r) for h, requests in self._holders.items() for r in requests}
        assert pairs == {(h, r) for r, hashes in self._held.items() for h in hashes}, (
            "holders and held differ"
        )
        assert all(requests for requests in self._holders.values()), "an entry held by nobody"
        assert set(self._held) <= live_requests, "a finished or unknown request still holds entries"
        assert self.used_bytes == sum(self._bytes.values()), "used bytes differ from the entries' sizes"
        unheld = [h for h in self._bytes if h not in self._holders]
        assert sorted(self._freeable) == sorted(unheld), "freeable entries differ from the unheld ones"

    def _evict_over_budget(self) -> list[str]:
        evicted = []
        while self.used_bytes > self.capacity_bytes and self._freeable:
            content_hash, _ = self._freeable.popitem(last=False)
            self.used_bytes -= self._bytes.pop(content_hash)
            evicted.append(content_hash)
        self.num_evictions += len(evicted)
        return evicted
