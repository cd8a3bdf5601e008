"""Log-probabilities of the tokens a request generated, for `sampling.logprobs` and `top_logprobs`.

Each is taken from the distribution the token was chosen from: the logits after the request's constraint
mask and, when sampling, after temperature, top-k and top-p, normalized with log-softmax. That is what
transformers' `compute_transition_scores(..., normalize_logits=True)` gives from `generate`'s scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchvl.engine.device.host_copy import HostCopy
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers.attention import uploaded
from batchvl.utils.int_tensors import int64_tensor

# (token id, log-probability) of the most likely tokens at a position, the most likely first
TopTokens = list[tuple[int, float]]


@dataclass
class TokenLogprobs:
    """One request's record: per generated token, its log-probability and the most likely tokens."""

    chosen: list[float] = field(default_factory=list)
    top: list[TopTokens] = field(default_factory=list)

    def append(self, chosen: float, top: TopTokens, params: SamplingParams) -> None:
        self.chosen.append(chosen)
        if params.top_logprobs:
            self.top.append(top[: params.top_logprobs])


class RowLogprobs:
    """Per logits row, the log-probability of a given token and the `top` most likely tokens, computed on
    the logits' device for all rows at once and read to the host without waiting for the device's other
    work (`HostCopy`): a serial step reads them at once, an overlapped one when it reads its picks. Each
    request's most likely tokens are the first of the step's largest `top`: `torch.topk` returns them
    largest first."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, top: int):
        """`logits` (rows, vocab) float32 and `tokens` (rows,) int64 on the same device."""
        logprobs = torch.log_softmax(logits, dim=-1)
        self.top = min(top, logprobs.shape[-1])
        chosen = logprobs.gather(-1, tokens[:, None])
        values, ids = torch.topk(logprobs, self.top)
        # one float32 tensor, one copy: token ids are exact in float32 below 2**24
        self._host = HostCopy(torch.cat([chosen, values, ids.to(logprobs.dtype)], dim=-1))

    def read(self) -> list[tuple[float, TopTokens]]:
        """Per row, (the token's log-probability, the most likely tokens), once the device has computed
        them."""
        top = self.top
        return [
            (row[0], list(zip(map(int, row[1 + top :]), row[1 : 1 + top], strict=True)))
            for row in self._host.tolist()
        ]


def keeps_logprobs(request) -> bool:
    """Whether a request (or None, one not taken) keeps its tokens' log-probabilities."""
    return request is not None and request.logprobs is not None


def kept_logprobs(
    logits: torch.Tensor, requests: list, tokens: torch.Tensor
) -> tuple[list[int], RowLogprobs | None]:
    """The rows of (rows, vocab) `logits` whose request keeps its tokens' log-probabilities (`requests[i]`
    is row i's; None: not taken), and those rows' `RowLogprobs` for their tokens in `tokens` (an int64
    tensor over all the rows, on the logits' device), as many most likely tokens as the most asked for.
    `logits` as the step's picks left them (`sampler.step_picks` with these rows as its `warped_rows`): a
    sampled row warped, a greedy one as the model gave it."""
    rows = [row for row, request in enumerate(requests) if keeps_logprobs(request)]
    if not rows:
        return rows, None
    top = max(requests[row].sampling.top_logprobs for row in rows)
    (index,) = uploaded([int64_tensor(rows)], logits.device)
    chosen = tokens.index_select(0, index)
    return rows, RowLogprobs(logits.index_select(0, index), chosen, top)


def logprob_fields(record: TokenLogprobs | None, params: SamplingParams, tokenizer) -> dict:
    """An `EngineResult`'s log-probability fields from a request's record (none if it kept none): the
    most likely tokens as (text, token id, log-probability)."""
    if record is None:
        return {}
    top = None
    if params.top_logprobs:
        top = [[(tokenizer.decode([t]), t, value) for t, value in position] for position in record.top]
    return {"token_logprobs": record.chosen, "top_logprobs": top}
