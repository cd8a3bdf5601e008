"""How a request samples its tokens: a prompt's `sampling` section, as the engine takes it."""

from __future__ import annotations

from dataclasses import dataclass

# A temperature below this samples greedily, as vLLM does (its _SAMPLING_EPS): logits divided by a tiny
# temperature overflow float32 to inf, and their softmax is NaN; greedy is the limit they tend to.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # record each generated token's log-probability
    top_logprobs: int = 0  # and this many most likely tokens at each position

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
