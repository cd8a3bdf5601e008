"""Log-probabilities of the tokens a request generated, for `sampling.logprobs` and `top_logprobs`.

Each is taken from the distribution the token was chosen from: the logits after the request's constraint
mask and, when sampling, after temperature, top-k and top-p, normalized with log-softmax. That is what
transformers' `compute_transition_scores(..., normalize_logits=True)` gives from `generate`'s scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.sampler import filtered_logits


@dataclass
class TokenLogprobs:
    """One request's record: per generated token, its log-probability and the most likely tokens."""

    chosen: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # (token id, log-probability)

    def add(self, logits: torch.Tensor, params: SamplingParams, token: int) -> None:
        """Record the token chosen from a (vocab,) float32 logits row (already masked by a constraint)."""
        scores = logits if params.is_greedy else filtered_logits(logits, params)
        logprobs = torch.log_softmax(scores, dim=-1)
        self.chosen.append(float(logprobs[token]))
        if params.top_logprobs:
            values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[-1]))
            self.top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))


def logprob_fields(record: TokenLogprobs | None, params: SamplingParams, tokenizer) -> dict:
    """An `EngineResult`'s log-probability fields from a request's record (none if it kept none): the
    most likely tokens as (text, token id, log-probability)."""
    if record is None:
        return {}
    top = None
    if params.top_logprobs:
        top = [[(tokenizer.decode([t]), t, value) for t, value in position] for position in record.top]
    return {"token_logprobs": record.chosen, "top_logprobs": top}
