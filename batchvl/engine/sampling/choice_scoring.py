"""Scored choices: a `choices` prompt answered by scoring every choice instead of generating one.

A choice's score is the sum of the log-probabilities of its tokens followed by the end-of-sequence token,
given the prompt (teacher forcing). A prompt's `ChoiceGroup` is all the engine asks: it makes one scoring
request per choice, the prompt then the choice's tokens, collects the logits of the positions that predict
the choice's tokens (the runner computes those, see `ScheduledChunk.scored_positions`), and builds the
result once every choice is scored. The prefix cache shares the prompt's full blocks among a prompt's
choices (the scheduler lets the others wait while the first computes them), so N choices cost about N
short prefills rather than N generations.

The answer is the most probable choice (the first of equals); its tokens stand as the output tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from batchvl.engine.request import EngineRequest, EngineResult, MediaSpan, Request, ScheduledChunk
from batchvl.engine.sampling.logprobs import RowLogprobs, TokenLogprobs, TopTokens, logprob_fields
from batchvl.layers.attention import uploaded
from batchvl.utils.int_tensors import int64_tensor


class ChoiceTokenizer:
    """Token ids of choices, each followed by the end-of-sequence token; a prompt's choices are tokenized
    once per engine."""

    def __init__(self, tokenizer, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        own_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = own_eos if own_eos is not None else eos_token_ids[0]
        self._cache: dict[tuple[str, ...], list[list[int]]] = {}

    def __call__(self, choices: tuple[str, ...]) -> list[list[int]]:
        if choices not in self._cache:
            self._cache[choices] = [
                list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_token_id]
                for text in choices
            ]
        return self._cache[choices]


@dataclass(eq=False)
class ChoiceGroup:
    """One scored-choices request: the scoring requests of its choices, the log-probabilities they have
    computed so far (per choice, one value per scored token; a recompute after preemption writes the same
    positions again), and the result once every choice is scored."""

    item: EngineRequest
    token_ids: list[list[int]]  # per choice, its tokens and the end-of-sequence token
    tokenizer: Any = None  # decodes the most likely tokens for `top_logprobs`
    start_time: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.logprobs = [torch.zeros(len(ids), dtype=torch.float64) for ids in self.token_ids]
        self.top: list[list[list[tuple[int, float]]]] = [[[] for _ in ids] for ids in self.token_ids]
        self._choice_of: dict[int, int] = {}  # request id -> the choice it scores
        self._pending: set[int] = set()  # ids of the requests still scoring

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.item.prompt_token_ids)

    def make_requests(self, ids: Iterator[int], spans: list[MediaSpan]) -> list[Request]:
        """Its scoring requests, one per choice (the prompt, then the choice's tokens), numbered from
        `ids`; each generates nothing and ends when its tokens are computed."""
        item = self.item
        requests = [
            Request(
                next(ids),
                item.prompt_token_ids + choice,
                spans,
                item.sampling,
                priority=item.priority,
                score_from=self.num_prompt_tokens,
                choice=self,
                tag=item.tag,
            )
            for choice in self.token_ids
        ]
        self._choice_of = {request.request_id: index for index, request in enumerate(requests)}
        self._pending = set(self._choice_of)
        return requests

    def collect(self, chunk: ScheduledChunk, rows: list[tuple[float, TopTokens]]) -> EngineResult | None:
        """Record what a step computed for a chunk of one of its requests (per position of
        `chunk.scored_positions`, its token's log-probability and the most likely tokens, see
        `RowLogprobs`); returns the group's result once its last request has reached its end."""
        request = chunk.request
        positions = chunk.scored_positions
        if positions:
            first = positions.start - (self.num_prompt_tokens - 1)
            self.record(self._choice_of[request.request_id], first, rows)
        if not chunk.reaches_end:
            return None
        self._pending.remove(request.request_id)
        if self._pending:
            return None
        sampling = self.item.sampling
        record = self.best_token_logprobs() if sampling.wants_logprobs else None
        return dataclasses.replace(self.result(), **logprob_fields(record, sampling, self.tokenizer))

    def record(self, choice: int, first_position: int, rows: list[tuple[float, TopTokens]]) -> None:
        """Record the rows of consecutive positions from `first_position` (0 is the position that predicts
        the choice's first token)."""
        end = first_position + len(rows)
        self.logprobs[choice][first_position:end] = torch.tensor([chosen for chosen, _ in rows])
        top_logprobs = self.item.sampling.top_logprobs
        if top_logprobs:
            self.top[choice][first_position:end] = [top[:top_logprobs] for _, top in rows]

    @property
    def scores(self) -> list[float]:
        return [float(values.sum()) for values in self.logprobs]

    @property
    def best(self) -> int:
        scores = self.scores
        return max(range(len(scores)), key=scores.__getitem__)

    def best_token_logprobs(self) -> TokenLogprobs:
        """The most probable choice's tokens' log-probabilities, and the most likely tokens there."""
        best = self.best
        return TokenLogprobs(
            self.logprobs[best].tolist(), self.top[best] if self.item.sampling.top_logprobs else []
        )

    def result(self) -> EngineResult:
        """The answer without log-probabilities of its tokens: the most probable choice, every score."""
        best = self.best
        return EngineResult(
            tag=self.item.tag,
            output_token_ids=list(self.token_ids[best]),
            text=self.item.scored_choices[best],
            finish_reason="stop",
            num_prompt_tokens=self.num_prompt_tokens,
            latency_s=time.perf_counter() - self.start_time,
            choice_logprobs=self.scores,
        )


class StepScores:
    """A step's chunks of scoring requests, and the log-probabilities of the tokens they score (each
    position's next token), computed on the device for all of them at once (`RowLogprobs`); `collect` hands
    each chunk's group its rows: a serial step at once, an overlapped one when it reads its picks."""

    def __init__(self, chunks: list[ScheduledChunk], logits: torch.Tensor):
        """`logits`: a row per scored position of the chunks of scoring requests, in chunk order (see
        `StepLogits.scored`)."""
        self.chunks = [chunk for chunk in chunks if chunk.request.choice is not None]
        targets = []
        for chunk in self.chunks:
            positions = chunk.scored_positions
            targets += chunk.request.token_ids(positions.start + 1, positions.stop + 1)
        self._rows = None  # chunks before their scored positions (a long prompt's first chunks) have none
        if targets:
            top = max(chunk.request.sampling.top_logprobs for chunk in self.chunks)
            (on_device,) = uploaded([int64_tensor(targets)], logits.device)
            self._rows = RowLogprobs(logits, on_device, top)

    def collect(self) -> list[EngineResult]:
        """The results of the groups whose last request these chunks ended."""
        rows = self._rows.read() if self._rows is not None else []
        results, offset = [], 0
        for chunk in self.chunks:
            count = len(chunk.scored_positions)
            result = chunk.request.choice.collect(chunk, rows[offset : offset + count])
            offset += count
            if result is not None:
                results.append(result)
        return results
