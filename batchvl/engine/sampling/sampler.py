"""Next-token choice: greedy, or temperature / top-k / top-p with a per-request seeded generator, for all
of a step's rows at once on the logits' device.

A temperature below `SAMPLING_EPS` (1e-5) is greedy: dividing logits by it would overflow to inf.

The filtering is transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper`,
applied in `generate`'s order and computed the same way, op for op: what a row samples from must equal
what `generate` samples from, and a rule that is only mathematically equal differs at the top-p boundary
(float rounding) and on ties.

The draw itself is the inverse of that distribution's CDF at a uniform number u: the first token, in
vocabulary order, whose cumulative probability exceeds u times the total. u comes from the request's own
generator, seeded by its `seed`, one draw a token: a sampled output then depends on its seed alone, not on
which other requests shared its batch, nor on the device, nor on whether steps overlap. It is not the token
`generate` draws for the same seed: `generate`'s `torch.multinomial` takes a whole vocabulary of
exponential variates from the generator for each token (2.4 ms a token at a 152k vocabulary on a CPU), which
no GPU can reproduce; drawn so, each sampled token was a copy of its row to the host and a filter and draw
there (2.4 ms with a temperature alone, 13.5 ms with top-p, on a 2-core CPU: `benchmarks/sampling.py`), and
a job with one sampled request ran its steps serially. The draw needs only
u from the host, so that a sampled step, like a greedy one, leaves its picks on the device.
"""

from __future__ import annotations

import random
from collections.abc import Collection

import torch

from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers.attention import uploaded
from batchvl.utils.int_tensors import int64_tensor

DRAW_BITS = 53  # u = draw / 2**53: every float64 multiple of 2**-53 in [0, 1), as likely as each other
# The logits a draw takes at once (rows times vocabulary), whose sort (top-p), float64 CDF and masks take 26
# bytes a logit beside the step's logits (12 without top-p; measured on a CPU): on a CPU 2**23 (55 rows at
# Qwen2-VL's 151,936 tokens, 220 MB); on a GPU 2**25 (220 rows, 870 MB: 5 pieces of some 25 ops for 1,024
# rows where 19 would launch 475), which the KV budget keeps free (the largest step's probe draws its rows so)
SAMPLED_ELEMENTS = 2**23
GPU_SAMPLED_ELEMENTS = 2**25


@torch.inference_mode()  # (the logits are the forward's: written in place where rows are left warped)
def step_picks(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[random.Random | None],
    warped_rows: Collection[int] = (),
) -> torch.Tensor:
    """Each row's next token as an int64 tensor on the logits' device, for (rows, vocab) float32 logits:
    the argmax for a greedy row (`greedy_picks`), for a row that samples a draw from its warped distribution
    (`draw_sampled`) at the next number of its generator (`generators[i]`, None for a greedy row). Nothing
    is read back: an overlapped step feeds the picks to the next step's forward on the device. The sampled
    rows among `warped_rows` are left as they were drawn from: their `filtered_logits` written over their
    logits, which their log-probabilities are then taken of (`logprobs.py`) without filtering them again."""
    sampled = [row for row, p in enumerate(params) if not p.is_greedy]
    if sampled and len(sampled) == len(params):  # (a step that samples every row makes no argmax)
        picks = logits.new_empty(len(params), dtype=torch.long)
    else:
        picks = greedy_picks(logits)
    if sampled:
        draws = [draw_bits(generators[row]) for row in sampled]
        draw_sampled(logits, picks, sampled, [params[row] for row in sampled], draws, warped_rows)
    return picks


def draw_bits(generator: random.Random) -> int:
    """The next draw of a request's generator, one a token: DRAW_BITS random bits, as the integer its
    `random()` is a multiple of 2**-53 by (exactly)."""
    return int(generator.random() * 2**DRAW_BITS)


def draw_sampled(
    logits: torch.Tensor,
    picks: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    draws: list[int],
    warped_rows: Collection[int] = (),
) -> None:
    """Write into `picks` the token of each of `rows` (its params and draw beside it): the first token whose
    cumulative probability, summed in float64 in vocabulary order over the softmax of its
    `filtered_logits`, exceeds u times the total, u = draw / 2**DRAW_BITS; and over the logits of those of
    `rows` in `warped_rows`, their `filtered_logits`. Rows with the same warpers go together,
    SAMPLED_ELEMENTS logits at a time (GPU_SAMPLED_ELEMENTS on a GPU)."""
    vocab = logits.shape[-1]
    at_once = max(1, (GPU_SAMPLED_ELEMENTS if logits.is_cuda else SAMPLED_ELEMENTS) // vocab)
    pieces = [
        members[start : start + at_once]
        for members in by_warpers(params).values()
        for start in range(0, len(members), at_once)
    ]
    # per piece, where its warped rows are in it and in the logits
    warped = [[(at, rows[i]) for at, i in enumerate(piece) if rows[i] in warped_rows] for piece in pieces]
    # every piece's rows, draws and warped rows in one copy to the device
    uploads = uploaded(
        [int64_tensor([rows[i] for i in piece]) for piece in pieces]
        + [int64_tensor([draws[i] for i in piece]) for piece in pieces]
        + [int64_tensor([at for at, _ in kept]) for kept in warped]
        + [int64_tensor([row for _, row in kept]) for kept in warped],
        logits.device,
    )
    count = len(pieces)
    indices, bits_of, positions, targets = (uploads[n * count : (n + 1) * count] for n in range(4))
    for p, piece in enumerate(pieces):
        index, bits = indices[p], bits_of[p]
        filtered = filtered_logits(logits.index_select(0, index), params[piece[0]])
        probs = torch.softmax(filtered, dim=-1)
        cdf = probs.double().cumsum_(dim=-1)
        target = bits.double().mul_(2.0**-DRAW_BITS).mul_(cdf[:, -1])
        tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
        # u times the total rounds up to the total about once in 2**53 draws: the search then lands past the
        # last token kept, and the most probable token stands in (a removed token is never drawn)
        kept = probs.gather(1, tokens[:, None]).squeeze(1) > 0
        picks.index_copy_(0, index, torch.where(kept, tokens, probs.argmax(dim=-1)))
        if warped[p]:
            logits.index_copy_(0, targets[p], filtered.index_select(0, positions[p]))


def by_warpers(params: list[SamplingParams]) -> dict[tuple, list[int]]:
    """The indices of the params that sample, by their warpers (temperature, top-k, top-p): rows with the
    same ones are filtered in one call."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not p.is_greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    return groups


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax as an int64 tensor on the logits' device, as `torch.argmax` picks it: the first of
    tied maxima, the first NaN where there is one. On the CPU numpy's argmax, which picks the same index:
    torch's CPU argmax and `max(dim)` reduce without vectors, and at 256 rows of a 32,768-token vocabulary
    took 16-25 ms a decode step, numpy's 3.4 ms (one thread; 0.04 ms against 0.5-0.8 ms at 1,024 tokens).
    On a GPU, torch's `max(dim)`."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return torch.max(logits, dim=-1).indices


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampled-from logits of a (..., vocab) float32 row: temperature, then top-k, then top-p (as
    `generate` orders them), -inf where a token is removed. Sampling params only: greedy has no
    temperature to divide by."""
    if params.is_greedy:
        raise ValueError("filtered_logits is for sampling; greedy takes the argmax of the raw logits")
    # generate skips temperature 1.0; dividing by 1.0 is exact, so always dividing gives the same logits.
    logits = logits / params.temperature
    if params.top_k > 0:
        # Remove what is below the k-th value: tokens tied with it all stay, so more than k may remain.
        top_k = min(params.top_k, logits.shape[-1])
        logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1, None], float("-inf"))
    if params.top_p < 1.0:
        # Ascending sort, remove the low tail whose cumulative mass is <= 1 - top_p, always keep the most
        # probable token. The mass *before* each token in a descending sort reaching top_p is the same
        # rule on paper, but it rounds differently when top_p equals a partial sum, and it breaks ties
        # at the boundary the other way (a stable ascending sort removes the lower index first).
        sorted_logits, sorted_indices = torch.sort(logits, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative_probs <= (1 - float(params.top_p))
        sorted_remove[..., -1:] = False
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def make_generator(seed: int) -> random.Random:
    """A request's own generator, on the host whatever the model's device: it gives the request's draws
    (`draw_bits`), a number a token, which cross to the device with the step's other small uploads.
    Python's Mersenne Twister, whose `random()` gives the same numbers for a seed in every Python version:
    a draw costs 0.12 us here, a torch generator's 1.6 us (1.6 ms a step of 1,024 sampled rows)."""
    return random.Random(seed)
