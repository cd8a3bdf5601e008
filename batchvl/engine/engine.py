"""The engine loop: add requests, step until done. Each step is schedule -> encode -> forward -> sample.

Bookkeeping (scheduler, block manager, encoder-cache manager) holds ints and hashes; the model runner
holds the tensors. A request that can never run (prompt too long for the model, or larger than the KV
cache) comes back at once as an error result instead of stalling or failing the job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from batchvl.config import EngineConfig
from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.block_manager import BlockManager
from batchvl.engine.encoder_cache import EncoderCacheManager
from batchvl.engine.model_runner import ModelRunner, kv_bytes_per_block
from batchvl.engine.request import MediaSpan, Request, SamplingParams, ScheduledChunk
from batchvl.engine.sampler import make_generator, sample_tokens
from batchvl.engine.scheduler import Scheduler, StepPlan
from batchvl.engine.vit_dp import DataParallelEncoder
from batchvl.errors import SampleError, UserError
from batchvl.preprocess.media import PreparedMedia

logger = logging.getLogger(__name__)

MB = 1 << 20
STOP_WINDOW_SLACK = 8  # tokens decoded beyond the longest stop string's length (see _ends_in_stop_string)


@dataclass
class EngineRequest:
    """What the engine needs for one (sample, prompt); `tag` is the caller's, returned untouched."""

    prompt_token_ids: list[int]
    images: list[PreparedMedia]
    sampling: SamplingParams
    tag: Any = None
    # Lower is admitted first from the look-ahead window. The job passes its shard's position, so shards
    # finish in input order as far as possible and a stop loses at most the shards in flight.
    priority: int = 0


@dataclass
class EngineResult:
    tag: Any
    output_token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    error: SampleError | None = None
    latency_s: float = 0.0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class EngineStats:
    images_total: int = 0
    images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_evictions: int = 0
    patches_encoded: int = 0
    patches_encoded_per_rank: list[int] = field(default_factory=list)  # under ViT data parallelism
    encode_s: float = 0.0
    forward_s: float = 0.0  # in the language model's packed forward (with logits)
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not computed
    steps: int = 0
    preemptions: int = 0


@dataclass
class _Live:
    """Per-request state the engine keeps besides the scheduler's counters."""

    request: Request
    tag: Any
    images: dict[str, PreparedMedia]
    generator: torch.Generator | None
    start_time: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(
        self,
        adapter: ModelAdapter,
        tokenizer,
        config: EngineConfig,
        eos_token_ids: list[int],
        parallel_encoder: DataParallelEncoder | None = None,
    ):
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        num_blocks = int(config.kv_cache_mb * MB) // kv_bytes_per_block(adapter, config.block_size)
        if num_blocks < 1:
            raise UserError(f"engine.kv_cache_mb={config.kv_cache_mb} holds no KV block; raise it")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_caching)
        self.encoder_cache = EncoderCacheManager(int(config.encoder_cache_mb * MB))
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.block_manager,
            config.lookahead,
            config.disable_chunked_mm_input,
            self.encoder_cache,
        )
        self.runner = ModelRunner(adapter, num_blocks, config.block_size, parallel_encoder)
        self._stats = EngineStats()  # the engine's own counters; `stats` adds its components'
        self._live: dict[int, _Live] = {}
        self._rejected: list[EngineResult] = []
        self._next_id = 0
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, config.block_size)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, with those its components own read from them (not copied each step)."""
        encoder = self.runner.parallel_encoder
        return replace(
            self._stats,
            forward_s=self.runner.forward_s,
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_cached_tokens,
            encoder_cache_evictions=self.encoder_cache.num_evictions,
            patches_encoded_per_rank=list(encoder.patches_per_rank) if encoder is not None else [],
        )

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished + len(self._rejected)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet: the look-ahead window the scheduler picks from."""
        return len(self.scheduler.waiting) + len(self._rejected)

    def add_request(self, item: EngineRequest) -> None:
        try:
            spans = self._image_spans(item)
            self._check_fits(item, spans)
        except SampleError as exc:
            self._rejected.append(
                EngineResult(item.tag, num_prompt_tokens=len(item.prompt_token_ids), error=exc)
            )
            return
        request = Request(
            self._next_id, list(item.prompt_token_ids), spans, item.sampling, priority=item.priority
        )
        self._next_id += 1
        generator = None if item.sampling.is_greedy else make_generator(item.sampling.seed)
        images = {img.content_hash: img for img in item.images}
        self._live[request.request_id] = _Live(request, item.tag, images, generator)
        self.runner.add_request(request.request_id, request.prompt_token_ids, item.images)
        self.scheduler.add(request)
        self._stats.images_total += len(item.images)
        self._stats.prompt_tokens += request.num_prompt_tokens

    def check_integrity(self) -> None:
        """Assert the KV-block and encoder-cache bookkeeping agree with the live requests (tests run it
        after every step; it walks every block, so the engine itself does not)."""
        self.block_manager.check_integrity([live.request for live in self._live.values()])
        self.encoder_cache.check_integrity(set(self._live))
        kept = self.encoder_cache.cached_hashes | set(self.scheduler.pending_freed)
        assert set(self.runner.embeddings) == kept, "the runner's embeddings differ from the cache's entries"

    def step(self) -> list[EngineResult]:
        """Run one step (schedule, run, postprocess); returns the requests that finished or were rejected."""
        results, self._rejected = self._rejected, []
        plan = self.scheduler.schedule()
        self.runner.drop_embeddings(plan.freed)
        if not plan.chunks:
            return results
        self._encode(plan)
        logits = self.runner.execute(plan.chunks, self.block_manager)
        self.scheduler.commit(plan.chunks)
        return results + self._postprocess(plan.chunks, logits)

    def _encode(self, plan: StepPlan) -> None:
        """Encode the plan's images that are not cached, in batches grouped by patch count."""
        self._stats.encoder_cache_hits += plan.num_cache_hits
        if not plan.to_encode:
            return
        images = [self._live[request_id].images[content_hash] for request_id, content_hash in plan.to_encode]
        started = time.perf_counter()
        sizes = self.runner.encode(images, self.config.max_patches_per_encode)
        self._stats.encode_s += time.perf_counter() - started
        self._stats.images_encoded += len(images)
        self._stats.patches_encoded += sum(image.num_patches for image in images)
        self.scheduler.encoded(sizes)

    def _postprocess(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[EngineResult]:
        """Count the step, sample the next token of each request whose chunk reached its end, and finish
        the requests that are done."""
        self._stats.steps += 1
        self._stats.prefill_tokens_computed += sum(
            chunk.num_tokens for chunk in chunks if chunk.start < chunk.request.num_prompt_tokens
        )
        sampling = [self._live[chunk.request.request_id] for chunk in chunks if chunk.samples_next_token]
        tokens = sample_tokens(
            logits, [live.request.sampling for live in sampling], [live.generator for live in sampling]
        )
        finished = []
        for live, token in zip(sampling, tokens, strict=True):
            live.request.output_token_ids.append(token)
            self._stats.output_tokens += 1
            reason = self._finish_reason(live.request)
            if reason is not None:
                finished.append(self._finish(live, reason))
        return finished

    def _image_spans(self, item: EngineRequest) -> list[MediaSpan]:
        """Each image (or video) takes the next `num_tokens` placeholder tokens of its kind, in prompt order;
        they form one run or several (tiles, frames), each filled by the next rows of its embedding."""
        ids = np.asarray(item.prompt_token_ids)
        placeholders = {
            kind: np.flatnonzero(ids == token) for kind, token in self.adapter.placeholder_token_ids.items()
        }
        taken = dict.fromkeys(placeholders, 0)
        none = np.empty(0, dtype=np.int64)  # a kind the model has no placeholder for
        spans = []
        for img in item.images:
            first = taken.get(img.kind, 0)
            positions = placeholders.get(img.kind, none)[first : first + img.num_tokens]
            if len(positions) < img.num_tokens:
                raise self._placeholder_mismatch(item, placeholders)
            taken[img.kind] = first + img.num_tokens
            run_starts = np.flatnonzero(np.diff(positions, prepend=-2) != 1)
            run_ends = np.append(run_starts[1:], len(positions))
            spans += [
                MediaSpan(int(positions[lo]), int(hi - lo), img.content_hash, int(lo))
                for lo, hi in zip(run_starts, run_ends, strict=True)
            ]
        if any(taken[kind] != len(found) for kind, found in placeholders.items()):
            raise self._placeholder_mismatch(item, placeholders)
        return sorted(spans, key=lambda span: span.offset)

    @staticmethod
    def _placeholder_mismatch(item: EngineRequest, placeholders: dict[str, np.ndarray]) -> SampleError:
        found = {kind: len(positions) for kind, positions in placeholders.items()}
        wanted = [(img.kind, img.num_tokens) for img in item.images]
        return SampleError(
            "prompt_mismatch", f"prompt has placeholder tokens {found} for media (kind, tokens) {wanted}"
        )

    def _check_fits(self, item: EngineRequest, spans: list[MediaSpan]) -> None:
        num_prompt = len(item.prompt_token_ids)
        max_len = self.adapter.geometry.max_model_len
        if num_prompt >= max_len:
            raise SampleError(
                "context_too_long",
                f"prompt has {num_prompt} tokens with its images but the model's context is {max_len}; "
                "lower preprocess.max_pixels or shorten the prompt",
            )
        needed = min(num_prompt + item.sampling.max_new_tokens, max_len)
        if needed > self.block_manager.capacity_tokens:
            raise SampleError(
                "kv_cache_too_small",
                f"request needs {needed} tokens of KV cache but engine.kv_cache_mb holds "
                f"{self.block_manager.capacity_tokens}; raise engine.kv_cache_mb",
            )
        budget = self.config.max_num_batched_tokens
        largest = max((span.length for span in spans), default=0)
        if self.config.disable_chunked_mm_input and largest > budget:
            raise SampleError(
                "image_exceeds_chunk",
                f"an image takes {largest} tokens, more than one step's "
                f"engine.max_num_batched_tokens={budget}, and engine.disable_chunked_mm_input keeps an image "
                "in one chunk; raise max_num_batched_tokens or lower preprocess.max_pixels",
            )

    def _finish_reason(self, request: Request) -> str | None:
        params = request.sampling
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._ends_in_stop_string(request):
            return "stop"
        if request.num_output_tokens >= params.max_new_tokens:
            return "length"
        if request.num_tokens >= self.adapter.geometry.max_model_len:
            return "length"
        return None

    def _ends_in_stop_string(self, request: Request) -> bool:
        """Whether the newest token completed a stop string. Only a window of the latest tokens is decoded,
        not the whole output every step: a stop string completed earlier would have ended the request
        then. The window holds a token per character of the longest stop string (a token decodes to at
        least one character but for special tokens and split characters), and slack for those."""
        window = max(len(stop) for stop in request.sampling.stop) + STOP_WINDOW_SLACK
        tail = self.tokenizer.decode(request.output_token_ids[-window:], skip_special_tokens=True)
        return any(stop and stop in tail for stop in request.sampling.stop)

    def _stop_string_index(self, request: Request) -> int | None:
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        found = [text.find(stop) for stop in request.sampling.stop if stop and stop in text]
        return min(found) if found else None

    def _finish(self, live: _Live, reason: str) -> EngineResult:
        request = live.request
        self.scheduler.finish(request)  # frees its KV blocks and lets go of its images
        self.runner.remove_request(request.request_id)
        del self._live[request.request_id]
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        if request.sampling.stop:
            cut = self._stop_string_index(request)
            if cut is not None:
                text = text[:cut]
        return EngineResult(
            tag=live.tag,
            output_token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            latency_s=time.perf_counter() - live.start_time,
        )
