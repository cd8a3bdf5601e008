"""One scheduler step: a token budget shared by running requests and new prefills.

Continuous batching and chunked prefill are one loop (vLLM v1 / nano-vllm style): each request asks for
`min(tokens it has not computed, budget left)`. Running requests go first, oldest first; then waiting
requests are admitted while the budget, `max_num_seqs` and free KV blocks allow. When a running request
needs a block and none is free, the newest running request is preempted (its blocks freed, recomputed
later from its prompt and the tokens it already produced), so the job never fails for lack of KV space.

Admission order (see `_admission_order`): the waiting requests form a look-ahead window, admitted by
priority (the job's shard order: the oldest open shard first, so shards complete and commit in order),
then cheapest image first so that encode batches and prefill chunks are alike in size; prompts of one
sample share their images and so stay next to each other. Nothing waits forever: a request passed over by
`lookahead` later admissions goes first. With prefix caching, a request whose next prefix block is
being computed right now by a running request waits for it instead of computing it a second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchvl.engine.encoder_cache.bookkeeping import EncoderCacheManager
from batchvl.engine.request import Request, RequestStatus, ScheduledChunk
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.engine.scheduling.prefix_cache import extend_block_hashes


@dataclass
class StepPlan:
    """What one step is to do, as plain data the runner carries out: drop the embeddings named in `freed`
    (evicted since the last plan), encode the images in `to_encode` (not cached; (a request that holds
    it, content hash) in first-use order), then run `chunks` through the model."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    to_encode: list[tuple[Request, str]] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    num_cache_hits: int = 0  # image uses this step served by the encoder cache


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        lookahead: int = 64,
        disable_chunked_mm_input: bool = False,
        encoder_cache: EncoderCacheManager | None = None,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.lookahead = lookahead
        self.disable_chunked_mm_input = disable_chunked_mm_input
        # Which images each request holds, and what eviction freed since the last plan.
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCacheManager(0)
        self._freed: list[str] = []
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_admitted = 0
        self.num_prefix_cached_tokens = 0  # tokens admitted requests took from the prefix cache

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.admitted_before = self.num_admitted
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def requests(self) -> list[Request]:
        """Every unfinished request: the waiting, then the running."""
        return self.waiting + self.running

    def schedule(self) -> StepPlan:
        """This step's chunks, the images they need that are not cached, and what to drop first."""
        plan = StepPlan(self._schedule_chunks())
        plan.freed, self._freed = self._freed, []
        missing: set[str] = set()
        for chunk in plan.chunks:
            request = chunk.request
            if chunk.is_generated:
                continue  # no media
            for span in request.images_overlapping(chunk.start, chunk.end):
                if self.encoder_cache.holds(request.request_id, span.content_hash):
                    continue
                if (
                    self.encoder_cache.acquire(request.request_id, span.content_hash)
                    or span.content_hash in missing
                ):
                    plan.num_cache_hits += 1
                else:
                    missing.add(span.content_hash)
                    plan.to_encode.append((request, span.content_hash))
        return plan

    def encoded(self, sizes: dict[str, int]) -> None:
        """The runner encoded these (held) images: record them, bytes per content hash."""
        for content_hash, num_bytes in sizes.items():
            self._freed += self.encoder_cache.insert(content_hash, num_bytes)

    def _schedule_chunks(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False

        block_size = self.block_manager.block_size
        # (the list itself, which a preemption shortens, and the append, looked up once a step, not once a
        # decode)
        running, add_chunk = self.running, chunks.append
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            # A decode (one token left to compute: most of a step) cuts no image, so its size needs no look.
            # (The request's properties spelled out here and below: at 1,024 decodes a step, their calls
            # were a fifth of the schedule.)
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            computed = request.num_computed_tokens
            num_new = 1 if num_tokens - computed == 1 else self._chunk_size(request, budget)
            if num_new == 0:  # its next image does not fit in what is left of the budget
                index += 1
                continue
            # Most decodes have room in their last block: nothing to allocate, nobody to preempt (checked
            # once, where a step of hundreds of decodes spent microseconds each asking twice).
            if computed + num_new > len(request.block_ids) * block_size:  # no room left in its blocks
                while not self.block_manager.can_allocate(request, num_new):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    break
                self.block_manager.allocate(request, num_new)
            add_chunk(ScheduledChunk(request, computed, num_new, num_tokens))
            budget -= num_new
            index += 1

        # A step that had to preempt admits nobody new: the freed blocks go to the requests already running.
        if preempted or not self.waiting:
            return chunks
        being_computed = self._prefix_hashes_being_computed()
        for request in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            cached = self._usable_cached_prefix(request)
            if being_computed and self._next_block_hash(request, cached) in being_computed:
                continue  # a running request is computing this prefix now; reuse it once it is cached
            num_computed = len(cached) * self.block_manager.block_size
            num_new = self._chunk_size(request, budget, num_computed)
            if num_new == 0:
                continue
            if not self.block_manager.can_admit(request, cached, num_new):
                break
            self.block_manager.admit(request, cached, num_new)
            self.num_prefix_cached_tokens += num_computed
            self.waiting.remove(request)
            self.num_admitted += 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
            if being_computed is not None:
                being_computed.update(self._uncomputed_prompt_hashes(request))
        return chunks

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """Record that the chunks' K/V are now in the cache (and publish the blocks they filled); a
        request lets go of the images whose every placeholder run is now in the KV cache."""
        manager = self.block_manager
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            # (most chunks fill no block: asked here, not in a call per chunk)
            if manager.enable_prefix_caching and chunk.end // manager.block_size > request.num_offered_blocks:
                manager.register_full_blocks(request)
            if chunk.is_generated:
                continue  # its images were let go when its prompt was computed
            held = self.encoder_cache.held_by(request.request_id)
            if not held:
                continue
            still_needed = {span.content_hash for span in request.images if span.end > chunk.end}
            for content_hash in held - still_needed:
                self._freed += self.encoder_cache.release(request.request_id, content_hash)

    def finish(self, request: Request) -> None:
        # A request is finished running, or waiting where an overlapped step's pick ends it after the
        # schedule that preempted it
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        request.status = RequestStatus.FINISHED
        self.block_manager.free(request)
        self._freed += self.encoder_cache.release_request(request.request_id)

    @property
    def pending_freed(self) -> list[str]:
        """Embeddings evicted since the last plan, which the runner still holds."""
        return list(self._freed)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        self._freed += self.encoder_cache.release_request(request.request_id)  # re-acquired when readmitted
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        request.admitted_before = self.num_admitted
        self.waiting.append(request)
        self.num_preemptions += 1

    def _admission_order(self) -> list[Request]:
        """Preempted requests first (they were admitted before), then overdue ones, then by priority and
        cheapest image."""

        def key(request: Request) -> tuple[int, int, int, int]:
            if request.num_preemptions:
                return (0, 0, 0, request.request_id)
            if self.lookahead <= 1 or self.num_admitted - request.admitted_before >= self.lookahead:
                return (1, 0, 0, request.request_id)
            cost = sum(span.length for span in request.images)
            return (2, request.priority, cost, request.request_id)

        return sorted(self.waiting, key=key)

    def _chunk_size(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        start = request.num_computed_tokens if num_computed is None else num_computed
        num_new = min(request.num_tokens - start, budget)
        if self.disable_chunked_mm_input:
            end = start + num_new
            for span in request.images_overlapping(start, end):
                if span.end > end:  # the chunk would cut this image: stop before it
                    return max(0, span.offset - start)
        return num_new

    def _usable_cached_prefix(self, request: Request) -> list[int]:
        cached = self.block_manager.cached_prefix(request)
        if self.disable_chunked_mm_input:
            # The cached prefix must not end inside an image either, or the image would be split.
            size = self.block_manager.block_size
            while cached and any(span.offset < len(cached) * size < span.end for span in request.images):
                cached.pop()
        return cached

    def _prefix_hashes_being_computed(self) -> set[int] | None:
        """Hashes of prompt blocks that running requests have yet to compute (None: no prefix caching)."""
        if not self.block_manager.enable_prefix_caching:
            return None
        hashes: set[int] = set()
        for request in self.running:
            hashes.update(self._uncomputed_prompt_hashes(request))
        return hashes

    def _uncomputed_prompt_hashes(self, request: Request) -> list[int]:
        if request.is_prefill_done:
            return []
        size = self.block_manager.block_size
        prompt_blocks = extend_block_hashes(request, size, request.num_prompt_tokens // size)
        return prompt_blocks[request.num_computed_tokens // size :]

    def _next_block_hash(self, request: Request, cached: list[int]) -> int | None:
        if len(cached) >= request.num_cacheable_tokens // self.block_manager.block_size:
            return None  # nothing more could come from the cache
        return self.block_manager.first_uncached_hash(request, len(cached))
