"""The engine's requests: one object per running request, holding all the engine keeps about it.

A request is one (sample, prompt). Its progress is two counters: `num_computed_tokens` (tokens whose K/V
are in the cache) and the chunk the scheduler gives it this step. Prefill, chunked prefill, decode and
recompute after preemption are the same state machine over these counters.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.structured_output import OutputConstraint
from batchvl.errors import SampleError
from batchvl.preprocess.media import PreparedMedia

if TYPE_CHECKING:
    import torch


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class MediaSpan:
    """One run of an image's placeholder tokens in the prompt, and which embedding rows fill it.

    An image is one run for most families; tiled images (a run per tile) and Qwen3-VL videos (a run per
    frame, timestamps between) are several, each taking the next rows of the image's embedding."""

    offset: int  # index of the first placeholder token of the run in the prompt
    length: int  # number of placeholder tokens in the run
    content_hash: str
    row_offset: int = 0  # the image embedding's row that fills the run's first token

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class RequestPositions:
    prompt: torch.Tensor  # (axes, num_prompt_tokens)
    delta: int  # generated token i (0-based over prompt + output) sits at position i + delta


@dataclass(eq=False)  # one object per request: compared by identity, never field by field
class Request:
    """One running request, from `Engine.add_request` until it finishes: finishing it frees its KV blocks
    and encoder-cache holds (shared, counted by their managers) and forgets this object.

    The scheduler, block manager and prefix cache read only the bookkeeping fields (ints, token ids,
    spans, hashes); the rest is what the engine and the runner need to run it and to answer."""

    request_id: int
    prompt_token_ids: list[int]
    images: list[MediaSpan]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    table_row: int = -1  # its row of the running requests' BlockTable while it holds blocks, else -1
    # Chain hashes of its full blocks, for prefix caching (kept: a waiting request is matched every step).
    block_hashes: list[int] = field(default_factory=list)
    # How many of its leading blocks the prefix cache has been offered: each once, when its tokens are
    # computed (see BlockManager.register_full_blocks).
    num_offered_blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    priority: int = 0  # lower is admitted first among the waiting (the job passes its shard's position)
    # The scheduler's admission count when the request last joined the waiting queue: a request passed
    # over by `lookahead` admissions since then goes first.
    admitted_before: int = 0
    # A scoring request (one choice of a scored `choices` prompt) generates nothing: the logits at
    # positions score_from - 1 .. num_tokens - 2 score its tokens from `score_from` on, and it ends when
    # its prompt is computed. `choice` is the ChoiceGroup that made it and collects those logits (typed
    # Any, as `logprobs` below, because the module that defines its type imports this one).
    score_from: int | None = None
    choice: Any = None

    # --- what running it and answering need ---------------------------------------------------------
    tag: Any = None  # the caller's, returned untouched
    media: dict[str, PreparedMedia] = field(default_factory=dict)  # its images by content hash, to encode
    # Its prompt's positions (a small CPU tensor; the runner's large tensors, the KV cache and image
    # embeddings, are shared between requests and stay in the runner, keyed by slot and content hash)
    positions: RequestPositions | None = None
    generator: random.Random | None = None  # a sampling request's own seeded generator (`make_generator`)
    logprobs: Any = None  # its TokenLogprobs record, when it asked for its tokens' log-probabilities
    grammar: Any = None  # the xgrammar matcher of its output constraint (see `GrammarMatchers`)
    # What the stop rules ask of each new token (`StopChecker.prepare`): the tokens that end it, and the most
    # tokens it may generate
    stop_ids: frozenset[int] = frozenset()
    output_limit: int = 0
    start_time: float = field(default_factory=time.perf_counter)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_cacheable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: all before the first position whose
        logits the request needs (its last token, or for a scoring request the one before its choice)."""
        return (self.num_tokens if self.score_from is None else self.score_from) - 1

    @property
    def max_new_tokens(self) -> int:
        """The most tokens it may generate: a scoring request generates none."""
        return self.sampling.max_new_tokens if self.score_from is None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) over prompt + output."""
        num_prompt = self.num_prompt_tokens
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def images_overlapping(self, start: int, end: int) -> list[MediaSpan]:
        return [span for span in self.images if span.offset < end and span.end > start]


class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start`, computed this step.

    What a step asks of a chunk many times per request (its end, whether it reaches the request's last
    known token, whether it samples, whether it lies past the prompt) is computed once when it is
    scheduled, not in a property per use: at hundreds of decodes a step, those properties' chains of calls
    cost a millisecond a step. They describe the chunk as scheduled, before the step appends its sampled
    token to the request."""

    __slots__ = ("request", "start", "num_tokens", "end", "reaches_end", "samples_next_token", "is_generated")

    def __init__(self, request: Request, start: int, num_tokens: int, request_tokens: int | None = None):
        """`request_tokens`: the request's `num_tokens`, where the caller has it."""
        self.request = request
        self.start = start
        self.num_tokens = num_tokens
        self.end = start + num_tokens
        self.reaches_end = self.end == (request.num_tokens if request_tokens is None else request_tokens)
        # Only a chunk that reaches the last known token yields logits worth sampling from.
        self.samples_next_token = self.reaches_end and request.score_from is None
        # Only generated tokens (a decode, mostly): media lie in the prompt, so such a chunk has none
        self.is_generated = start >= len(request.prompt_token_ids)

    def __repr__(self) -> str:
        return f"ScheduledChunk({self.request.request_id}, start={self.start}, num_tokens={self.num_tokens})"

    @property
    def scored_positions(self) -> range:
        """The chunk's positions whose logits score a scoring request's next token (teacher forcing)."""
        first = self.request.score_from
        if first is None:
            return range(0)
        return range(max(self.start, first - 1), min(self.end, self.request.num_tokens - 1))


@dataclass
class EngineRequest:
    """What the engine is given for one (sample, prompt); `tag` is the caller's, returned untouched."""

    prompt_token_ids: list[int]
    images: list[PreparedMedia]
    sampling: SamplingParams
    tag: Any = None
    # Lower is admitted first from the look-ahead window. The job passes its shard's position, so shards
    # finish in input order as far as possible and a stop loses at most the shards in flight.
    priority: int = 0
    constraint: OutputConstraint | None = None  # what the output must match (None: free text)
    # Answer by scoring these strings (each followed by the end-of-sequence token) instead of generating
    scored_choices: tuple[str, ...] | None = None
    # The prompt as chat messages (media parts as URLs), for a server backend, which renders them itself;
    # then `prompt_token_ids` is empty and `images` are the media's URLs
    messages: tuple[dict, ...] | None = None


@dataclass
class EngineResult:
    """What the engine gives back for one request: its output, or the error that kept it from running."""

    tag: Any
    output_token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    error: SampleError | None = None
    # False where the output ended (its token limit, a stop) before it was a whole match of its constraint:
    # the row code makes that an error, the engine only says it
    is_complete: bool = True
    latency_s: float = 0.0
    # With SamplingParams.logprobs / top_logprobs: per output token its log-probability, and the most
    # likely tokens there as (text, token id, log-probability)
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[str, int, float]]] | None = None
    # A scored-choices request: each choice's log-probability given the prompt (its tokens and the
    # end-of-sequence token); `text` is the most probable choice and `output_token_ids` its tokens
    choice_logprobs: list[float] | None = None
    # The count of output tokens: len(output_token_ids) unless given (a server reports its count in
    # `usage`, not always the ids)
    num_output_tokens: int | None = None

    def __post_init__(self):
        if self.num_output_tokens is None:
            self.num_output_tokens = len(self.output_token_ids)
