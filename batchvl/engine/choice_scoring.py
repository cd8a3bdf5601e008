"""Scored choices: a `choices` prompt answered by scoring every choice instead of generating one.

A choice's score is the sum of the log-probabilities of its tokens followed by the end-of-sequence token,
given the prompt (teacher forcing). The engine runs one scoring request per choice, the prompt then the
choice's tokens, keeping the logits of the positions that predict the choice's tokens. The prefix cache
shares the prompt's full blocks among a prompt's choices (the scheduler lets the others wait while the
first computes them), so N choices cost about N short prefills rather than N generations.

The answer is the most probable choice (the first of equals); its tokens stand as the output tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from batchvl.engine.logprobs import TokenLogprobs
from batchvl.engine.request import EngineResult


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


@dataclass
class ChoiceGroup:
    """The scoring requests of one prompt's choices, and the log-probabilities computed so far: per choice,
    one value per scored token (a recompute after preemption writes the same positions again)."""

    tag: Any
    choices: tuple[str, ...]
    token_ids: list[list[int]]
    num_prompt_tokens: int
    top_logprobs: int = 0  # also keep this many most likely tokens at each scored position
    pending: set[int] = field(default_factory=set)  # request ids of the choices still being scored
    start_time: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.logprobs = [torch.zeros(len(ids), dtype=torch.float64) for ids in self.token_ids]
        self.top: list[list[list[tuple[int, float]]]] = [[[] for _ in ids] for ids in self.token_ids]

    def record(self, choice: int, first_position: int, logits: torch.Tensor, targets: list[int]) -> None:
        """Record the log-probabilities of `targets` under the logits rows of consecutive positions from
        `first_position` (0 is the position that predicts the choice's first token)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        end = first_position + len(targets)
        self.logprobs[choice][first_position:end] = logprobs[torch.arange(len(targets)), targets]
        if self.top_logprobs:
            values, ids = torch.topk(logprobs, min(self.top_logprobs, logprobs.shape[-1]))
            self.top[choice][first_position:end] = [
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
            ]

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
        return TokenLogprobs(self.logprobs[best].tolist(), self.top[best] if self.top_logprobs else [])

    def result(self) -> EngineResult:
        best = self.best
        return EngineResult(
            tag=self.tag,
            output_token_ids=list(self.token_ids[best]),
            text=self.choices[best],
            finish_reason="stop",
            num_prompt_tokens=self.num_prompt_tokens,
            latency_s=time.perf_counter() - self.start_time,
            choice_logprobs=self.scores,
        )
