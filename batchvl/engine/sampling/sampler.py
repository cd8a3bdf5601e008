"""Next-token choice: greedy, or temperature / top-k / top-p with a per-request seeded generator.

A temperature below `SAMPLING_EPS` (1e-5) is greedy: dividing logits by it would overflow to inf.

Each request draws from its own generator, so a sampled output does not depend on which other requests
shared its batch.

The filtering is transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper`,
applied in `generate`'s order and computed the same way, op for op: outputs must equal `generate`'s, and
a rule that is only mathematically equal differs at the top-p boundary (float rounding) and on ties.
"""

from __future__ import annotations

import torch

from batchvl.engine.sampling.params import SamplingParams


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    host_rows: dict[int, torch.Tensor] | None = None,
    drawn: list[bool] | None = None,
) -> list[int]:
    """One token per row of (rows, vocab) float32 logits. Greedy rows share one argmax call (see
    `greedy_tokens`): one per row cost about 35 us each, a millisecond or more per decode step. Sampled
    rows are drawn from their copies on the CPU: `host_rows` where the caller made them (see
    `rows_on_host`), else made here. `drawn`: which rows sample at a temperature, where the caller has it."""
    if not params:
        return []
    if drawn is None:
        drawn = [not p.is_greedy for p in params]
    if not any(drawn):
        return greedy_tokens(logits)  # (most steps: no call per row)
    greedy = greedy_tokens(logits) if not all(drawn) else []
    if host_rows is None:
        host_rows = rows_on_host(logits, drawn)
    return [
        sample_token(host_rows[i], p, generator) if draws else greedy[i]
        for i, (p, generator, draws) in enumerate(zip(params, generators, drawn, strict=True))
    ]


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as `torch.argmax` picks it: the first of tied maxima, the first NaN where there is
    one. On the CPU numpy's argmax, which picks the same index: torch's CPU argmax and `max(dim)` reduce
    without vectors, and at 256 rows of a 32,768-token vocabulary took 16-25 ms a decode step, numpy's 3.4 ms
    (one thread; 0.04 ms against 0.5-0.8 ms at 1,024 tokens). On a GPU, torch's `max(dim)`."""
    return greedy_picks(logits).tolist()


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """`greedy_tokens` as an int64 tensor on the logits' device: an overlapped step feeds it to the next
    step's forward without reading it to the host first."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return torch.max(logits, dim=-1).indices


def rows_on_host(logits: torch.Tensor, wanted: list[bool]) -> dict[int, torch.Tensor]:
    """The wanted rows of (rows, vocab) logits on the CPU, by row: from a GPU in one copy for all of them
    (a copy per row waits for the device each time: a sync per sampled row every step); on the CPU the rows
    themselves."""
    indices = [i for i, want in enumerate(wanted) if want]
    if logits.device.type == "cpu" or not indices:
        return {i: logits[i] for i in indices}
    return dict(zip(indices, logits[indices].cpu(), strict=True))


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from a (vocab,) float32 logits row (sampling params; greedy rows take the step's
    shared argmax in `sample_tokens`).

    The row is filtered and drawn from on its generator's device, the CPU (`make_generator`): PyTorch
    refuses a CPU generator for CUDA logits, and drawing on the CPU gives a seed the same tokens whatever
    device ran the model (one row of the vocabulary copied per sampled request)."""
    if generator is not None and logits.device != generator.device:
        logits = logits.to(generator.device)
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


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


def make_generator(seed: int) -> torch.Generator:
    """A request's own generator, on the CPU whatever the model's device (see `sample_token`)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
