"""One scheduler step: a token budget shared by running requests and new prefills.

Continuous batching and chunked prefill are one loop (vLLM v1 / nano-vllm style): each request asks for
`min(tokens it has not computed, budget left)`. Running requests go first, oldest first; then waiting
requests are admitted while the budget, `max_num_seqs` and free KV blocks allow. When a running request
needs a block and none is free, the newest running request is preempted (its blocks freed, recomputed
later from its prompt and the tokens it already produced), so the job never fails for lack of KV space.
"""

from __future__ import annotations

from collections import deque

from batchvl.engine.kv_cache import BlockManager
from batchvl.engine.request import Request, RequestStatus, ScheduledChunk


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self.block_manager.allocate(request, num_new)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
            index += 1

        # A step that had to preempt admits nobody new: the freed blocks go to the requests already running.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(request, num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(request, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return chunks

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """Record that the chunks' K/V are now in the cache."""
        for chunk in chunks:
            chunk.request.num_computed_tokens = chunk.end

    def finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.running.remove(request)
        self.block_manager.free(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
