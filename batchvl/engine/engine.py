"""The engine loop: add requests, step until done. Each step is schedule -> encode -> forward -> sample.

Each request is one `Request` object that holds all the engine keeps about it; the scheduler's queues
are the only place unfinished requests live, and finishing one frees its shared resources and forgets it.
Bookkeeping (scheduler, block manager, encoder-cache manager) holds ints and hashes; the model runner
holds the shared tensors. A request that can never run (prompt too long for the model, or larger than
the KV cache) comes back at once as an error result instead of stalling or failing the job.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from batchvl.config import EngineConfig
from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.device.free_memory import free_cuda_bytes, total_cuda_bytes
from batchvl.engine.device.host_copy import HostCopy
from batchvl.engine.encoder_cache.cache import build_encoder_cache
from batchvl.engine.fast_paths import fast_paths_resolved
from batchvl.engine.model_runner import ModelRunner, StepLogits, kv_bytes_per_block
from batchvl.engine.overlap import InFlightPicks, placeholder
from batchvl.engine.parallel.vit_dp import DataParallelEncoder
from batchvl.engine.request import (
    EngineRequest,
    EngineResult,
    MediaSpan,
    Request,
    RequestStatus,
    ScheduledChunk,
)
from batchvl.engine.request_mix import RequestMix
from batchvl.engine.sampling.choice_scoring import ChoiceGroup, ChoiceTokenizer, StepScores
from batchvl.engine.sampling.logprobs import TokenLogprobs, keeps_logprobs, kept_logprobs, logprob_fields
from batchvl.engine.sampling.sampler import greedy_picks, make_generator, step_picks
from batchvl.engine.sampling.stopping import StopChecker
from batchvl.engine.sampling.structured_output import GrammarMatchers
from batchvl.engine.scheduling.activation_peak import step_activation_peak
from batchvl.engine.scheduling.admission import check_fits, media_spans
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.engine.scheduling.kv_budget import check_holds_blocks, kv_cache_bytes
from batchvl.engine.scheduling.scheduler import Scheduler, StepPlan
from batchvl.engine.scheduling.step_sizes import resolved_step_sizes
from batchvl.engine.stats import EngineStats
from batchvl.errors import SampleError, UserError
from batchvl.utils.memory import MB

logger = logging.getLogger(__name__)


def step_sizes_for(adapter: ModelAdapter, config: EngineConfig) -> EngineConfig:
    """`config` with its `auto` step sizes resolved for the adapter's device (see `step_sizes`); a config
    without `auto` comes back as it is, so resolving twice measures nothing twice."""
    return resolved_step_sizes(
        config,
        adapter.device,
        # the forward's activations, scaled to larger steps: not the draw's, bounded by a piece's size
        lambda probe: step_activation_peak(adapter, probe, draws=False),
        lambda: free_cuda_bytes(adapter.device),
        lambda: total_cuda_bytes(adapter.device),
    )


def picks_of(
    logits: torch.Tensor, requests: list[Request], taken: list[Request | None], mix: RequestMix
) -> torch.Tensor:
    """The next token of each request, row i of (rows, vocab) `logits` being requests[i]'s, on the device;
    the sampled rows whose log-probabilities are taken (`taken[i]`, None where not) left warped in `logits`,
    as `kept_logprobs` takes them. Where no unfinished request draws (`mix`), every row's argmax, with no
    pass over the rows; where none keeps log-probabilities, no pass for the rows to leave warped."""
    if not mix.sampled:
        return greedy_picks(logits)
    warped = {row for row, request in enumerate(taken) if keeps_logprobs(request)} if mix.logprobs else ()
    return step_picks(logits, [r.sampling for r in requests], [r.generator for r in requests], warped)


class Engine:
    num_engines = 1

    def __init__(
        self,
        adapter: ModelAdapter,
        tokenizer,
        config: EngineConfig,
        eos_token_ids: list[int],
        parallel_encoder: DataParallelEncoder | None = None,
    ):
        self.adapter = adapter
        self.config = config = fast_paths_resolved(step_sizes_for(adapter, config), adapter.device)
        self.stopping = StopChecker(tokenizer, eos_token_ids, adapter.geometry.max_model_len)
        self.grammars = GrammarMatchers(tokenizer, adapter.geometry.vocab_size, eos_token_ids)
        self.choice_tokens = ChoiceTokenizer(tokenizer, eos_token_ids)
        block_bytes = kv_bytes_per_block(adapter, config.block_size)
        check_holds_blocks(config, block_bytes, engines=1)
        kv_bytes = kv_cache_bytes(config, adapter.device, lambda: step_activation_peak(adapter, config))
        num_blocks = kv_bytes // block_bytes
        if num_blocks < 1:  # auto on CUDA: what the GPU had free held no block of this model
            raise UserError(
                f"engine.kv_cache_mb is auto, but {adapter.device} leaves {kv_bytes / MB:.3g} MiB for the KV "
                f"cache, less than one block ({block_bytes / MB:.3g} MiB); free the GPU or set "
                "engine.kv_cache_mb"
            )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.prefix_caching,
            max_running=config.max_num_seqs,
            max_tokens_per_request=adapter.geometry.max_model_len,
        )
        self.runner = ModelRunner(
            adapter,
            self.block_manager,
            parallel_encoder,
            decode_graph_rows=config.max_num_seqs if config.cuda_graphs else 0,
            vision_graph_patches=config.max_patches_per_encode if config.vision_graphs else 0,
        )
        self.encoder_cache = build_encoder_cache(
            config,
            adapter,
            lambda images: self.runner.encode(images, config.max_patches_per_encode),
        )
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.block_manager,
            config.lookahead,
            config.disable_chunked_mm_input,
            self.encoder_cache.entries,
        )
        self._stats = EngineStats()  # the engine's own counters; `stats` adds its components'
        self._rejected: list[EngineResult] = []
        self._ids = itertools.count()  # request ids, in arrival order
        self._mix = RequestMix()  # what the unfinished requests ask of a step beyond a greedy pick
        self._in_flight: InFlightPicks | None = None  # an overlapped step's picks, not yet read
        logger.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB, engine.kv_cache_mb=%s); steps of %d tokens, vision "
            "calls of %d patches",
            num_blocks,
            config.block_size,
            kv_bytes / MB,
            config.kv_cache_mb,
            config.max_num_batched_tokens,
            config.max_patches_per_encode,
        )

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, with those its components own read from them (not copied each step)."""
        encoder, cache, disk = self.runner.parallel_encoder, self.encoder_cache, self.encoder_cache.disk
        return self._stats + EngineStats(
            images_encoded=cache.images_encoded,
            patches_encoded=cache.patches_encoded,
            encode_s=cache.encode_s,
            encoder_disk_hits=disk.hits if disk else 0,
            encoder_disk_writes=disk.writes if disk else 0,
            encoder_disk_s=disk.seconds if disk else 0.0,
            forward_s=self.runner.forward_s,
            grammar_s=self.grammars.seconds,
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_cached_tokens,
            encoder_cache_evictions=cache.entries.num_evictions,
            patches_encoded_per_rank=list(encoder.patches_per_rank) if encoder is not None else [],
        )

    @property
    def num_unfinished(self) -> int:
        # an overlapped step's scored choices are answered when it is read, a step after their requests end
        scores_in_flight = self._in_flight is not None and self._in_flight.scores is not None
        return self.scheduler.num_unfinished + len(self._rejected) + scores_in_flight

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted (rejected ones until the next step hands them back)."""
        return len(self.scheduler.waiting) + len(self._rejected)

    @property
    def wants_requests(self) -> bool:
        """Whether the look-ahead window the scheduler admits from (`engine.lookahead` requests not yet
        admitted) has room: the caller adds requests while it has, and steps once it is full."""
        return self.num_waiting < self.config.lookahead

    def close(self) -> None:
        """Nothing runs beside the caller: each step runs in its `step` call."""

    def add_request(self, item: EngineRequest) -> None:
        """Queue a request, or a scored-choices prompt as one scoring request per choice; a request that
        can never run comes back from the next step as an error result."""
        try:
            spans = media_spans(item.prompt_token_ids, item.images, self.adapter.placeholder_token_ids)
            requests = self._requests_of(item, spans)
            for request in requests:
                check_fits(
                    request.num_prompt_tokens,
                    request.max_new_tokens,
                    spans,
                    max_model_len=self.adapter.geometry.max_model_len,
                    kv_capacity_tokens=self.block_manager.capacity_tokens,
                    config=self.config,
                )
        except SampleError as exc:
            self._rejected.append(
                EngineResult(item.tag, num_prompt_tokens=len(item.prompt_token_ids), error=exc)
            )
            return
        self._stats.images_total += len(item.images)
        media = {img.content_hash: img for img in item.images}
        for request in requests:
            request.media = media
            request.positions = self.runner.prompt_positions(request.prompt_token_ids, item.images)
            if item.constraint is not None and request.choice is None:
                request.grammar = self.grammars.matcher(item.constraint)
            self.stopping.prepare(request)
            self.scheduler.add(request)
            self._mix.count(request)
            self._stats.prompt_tokens += request.num_prompt_tokens

    def _requests_of(self, item: EngineRequest, spans: list[MediaSpan]) -> list[Request]:
        """The request that generates `item`'s answer, or its choice group's scoring requests."""
        if item.scored_choices is not None:
            group = ChoiceGroup(item, self.choice_tokens(item.scored_choices), self.stopping.tokenizer)
            return group.make_requests(self._ids, spans)
        sampling = item.sampling
        request = Request(
            next(self._ids),
            list(item.prompt_token_ids),
            spans,
            sampling,
            priority=item.priority,
            tag=item.tag,
            generator=None if sampling.is_greedy else make_generator(sampling.seed),
            logprobs=TokenLogprobs() if sampling.wants_logprobs else None,
        )
        return [request]

    def check_integrity(self) -> None:
        """Assert the KV-block and encoder-cache bookkeeping agree with the unfinished requests (tests run
        it after every step; it walks every block, so the engine itself does not)."""
        requests = self.scheduler.requests
        self.block_manager.check_integrity(requests)
        live = {request.request_id for request in requests}
        self.encoder_cache.check_integrity(live, self.scheduler.pending_freed)
        assert self._mix == RequestMix.of(requests), (self._mix, RequestMix.of(requests))

    def step(self) -> list[EngineResult]:
        """Run one step (schedule, run, postprocess); returns the requests that finished or were rejected.
        With `engine.overlap` (see `overlap.py`), the step is launched before the previous step's picks are
        read, and a request finishes a step later."""
        results, self._rejected = self._rejected, []
        plan = self.scheduler.schedule()
        self.encoder_cache.drop(plan.freed)
        if not plan.chunks:
            return results + self._read_in_flight()
        self._encode(plan, wait=not self.config.overlap)
        if self.config.overlap:
            return results + self._overlapped(plan.chunks)
        logits = self.runner.execute(plan.chunks, self.encoder_cache.embeddings)
        self.scheduler.commit(plan.chunks)
        return results + self._postprocess(plan.chunks, logits)

    def _overlapped(self, chunks: list[ScheduledChunk]) -> list[EngineResult]:
        """Launch the step with the previous step's picks fed on the device, then read those picks, then
        mask this step's constrained rows and leave its picks in flight (see `overlap.py`)."""
        previous = self._in_flight
        logits = self.runner.execute(
            chunks,
            self.encoder_cache.embeddings,
            # (a step in flight may have scored choices alone: no picks to feed)
            picks_in_flight=previous.picks if previous is not None and previous.requests else None,
            wait=False,
        )
        # The previous picks are read first: a grammar's mask for this step follows the token they give it
        # (filled on the host while the device runs the forward), and they are written before this step's
        # chunks are committed, since the blocks that commit publishes to the prefix cache hold them.
        ended = self._stopped(previous.read()) if previous is not None else []
        scored = previous.scored() if previous is not None else []
        sampling = [chunk.request for chunk in chunks if chunk.samples_next_token]
        # a request those picks end has a row here whose pick is dropped: its grammar masks nothing more,
        # and its log-probabilities are not taken (None)
        taken = sampling
        if ended:
            ending = {request.request_id for request, _ in ended}
            taken = [None if request.request_id in ending else request for request in sampling]
        mix = self._mix
        if mix.grammars:
            self.grammars.mask(logits.sampled, [None if r is None else r.grammar for r in taken])
        picks = picks_of(logits.sampled, sampling, taken, mix)
        host = HostCopy(picks)
        keep, logprobs = kept_logprobs(logits.sampled, taken, picks) if mix.logprobs else ([], None)
        scores = StepScores(chunks if mix.scored else [], logits.scored)
        self.scheduler.commit(chunks)
        self._count_step(chunks)
        finished = [self._finish(request, reason) for request, reason in ended] + scored
        self._free_scored(scores)
        if ended:  # a request they finished has a pick one past its end here: dropped
            rows = [
                row for row, request in enumerate(sampling) if request.status is not RequestStatus.FINISHED
            ]
            requests = [sampling[row] for row in rows]
        else:
            requests, rows = sampling, range(len(sampling))
        for request, row in zip(requests, rows, strict=True):
            request.output_token_ids.append(placeholder(row))
        logprob_requests = [sampling[row] for row in keep]
        scores_in_flight = scores if scores.chunks else None
        in_flight = InFlightPicks(requests, rows, picks, host, logprob_requests, logprobs, scores_in_flight)
        self._in_flight = in_flight if requests or scores_in_flight is not None else None
        return finished

    def _read_in_flight(self) -> list[EngineResult]:
        """Read the picks in flight, if any, and finish the requests they end."""
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            return []
        ended = self._stopped(previous.read())
        return [self._finish(request, reason) for request, reason in ended] + previous.scored()

    def _stopped(self, requests: list[Request]) -> list[tuple[Request, str]]:
        """The requests whose newest token ends them, with why, in their order."""
        self._stats.output_tokens += len(requests)
        if not self._mix.grammars:  # (the stop rules alone, asked only of the requests they may end)
            return self.stopping.ended(requests)
        reasons = [(request, self._finish_reason(request)) for request in requests]
        return [(request, reason) for request, reason in reasons if reason is not None]

    def _finish_reason(self, request: Request) -> str | None:
        """Why the request's newest token ends it, if it does, once its grammar (if any) has taken it: a
        grammar that took an end-of-sequence token allows nothing more; then the stop rules."""
        if request.grammar is not None:  # (most requests have none: no calls for them)
            self.grammars.accept(request.grammar, request.output_token_ids[-1])
            if self.grammars.is_terminated(request.grammar):
                return "stop"
        return self.stopping.finish_reason(request)

    def _encode(self, plan: StepPlan, wait: bool) -> None:
        """Bring the plan's images that are not in memory from the disk cache or the vision tower (waiting
        for its kernels where `wait`)."""
        self._stats.encoder_cache_hits += plan.num_cache_hits
        if plan.to_encode:
            images = [request.media[content_hash] for request, content_hash in plan.to_encode]
            self.scheduler.encoded(self.encoder_cache.fetch(images, wait))

    def _postprocess(self, chunks: list[ScheduledChunk], step_logits: StepLogits) -> list[EngineResult]:
        """Count the step, sample the next token of each request whose chunk reached its end, score the
        scoring requests' chunks, and finish the requests that are done."""
        self._count_step(chunks)
        return self._sample(chunks, step_logits.sampled) + self._score(chunks, step_logits.scored)

    def _count_step(self, chunks: list[ScheduledChunk]) -> None:
        self._stats.steps += 1
        self._stats.prefill_tokens_computed += sum(
            chunk.num_tokens for chunk in chunks if not chunk.is_generated
        )

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[EngineResult]:
        """Pick the next token of each request whose chunk reached its end, read the picks and the
        log-probabilities kept (computed on the device, as an overlapped step does), and finish the requests
        that are done."""
        sampling = [chunk.request for chunk in chunks if chunk.samples_next_token]
        mix = self._mix
        if mix.grammars:
            self.grammars.mask(logits, [request.grammar for request in sampling])
        picks = picks_of(logits, sampling, sampling, mix)
        keep, logprobs = kept_logprobs(logits, sampling, picks) if mix.logprobs else ([], None)
        tokens = picks.tolist()
        if logprobs is not None:
            for row, (chosen, top) in zip(keep, logprobs.read(), strict=True):
                sampling[row].logprobs.append(chosen, top, sampling[row].sampling)
        for request, token in zip(sampling, tokens, strict=True):
            request.output_token_ids.append(token)
        return [self._finish(request, reason) for request, reason in self._stopped(sampling)]

    def _score(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[EngineResult]:
        """Hand each scoring request's chunk its rows' log-probabilities (a row per scored position, in
        chunk order) to its choice group; a request is done when its chunk reaches its end, and the group's
        result comes with its last request's."""
        scores = StepScores(chunks if self._mix.scored else [], logits)
        self._free_scored(scores)
        return scores.collect()

    def _free_scored(self, scores: StepScores) -> None:
        """Finish the scoring requests whose chunk reached their end: their group holds what they scored."""
        for chunk in scores.chunks:
            if chunk.reaches_end:
                self._forget(chunk.request)

    def _forget(self, request: Request) -> None:
        """Finish a request: frees its KV blocks and images; nothing else holds it."""
        self.scheduler.finish(request)
        self._mix.count(request, -1)

    def _finish(self, request: Request, reason: str) -> EngineResult:
        self._forget(request)
        return EngineResult(
            tag=request.tag,
            output_token_ids=list(request.output_token_ids),
            text=self.stopping.text_of(request),
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            is_complete=self.grammars.is_complete(request.grammar),
            latency_s=time.perf_counter() - request.start_time,
            **logprob_fields(request.logprobs, request.sampling, self.stopping.tokenizer),
        )
