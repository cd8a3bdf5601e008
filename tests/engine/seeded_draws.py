"""The rule a sampled token is drawn by (`batchvl/engine/sampling/sampler.py`), written again apart from
the engine's code, in numpy: a request's generator is Python's `random.Random` seeded with its seed, and
for each token its next `random()` is u, and the token is the first, in vocabulary order, whose
cumulative probability (float64, summed in order) exceeds u times the total.

`generate_draws_by_seed` gives transformers' `generate` that draw in place of its `torch.multinomial`, so
that a test compares the engine's sampled tokens with `generate`'s: its warpers, its logits processors
(a grammar's mask) and its order of operations, drawn by the same rule from the same seed."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import numpy as np
import torch


def inverse_cdf_draw(probs: torch.Tensor, generator: random.Random) -> int:
    """The token drawn from a (vocab,) row of probabilities by the generator's next number."""
    u = generator.random()
    cdf = np.cumsum(probs.double().cpu().numpy())
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    assert token < len(cdf) and probs[token] > 0
    return token


@contextlib.contextmanager
def generate_draws_by_seed(seed: int):
    """Within it, `torch.multinomial(probs, 1)` (what `generate(do_sample=True)` draws with) draws each row
    of `probs` by `inverse_cdf_draw` from one generator seeded with `seed`: for a batch of one, the draws of
    a request of that seed, a token each."""
    generator = random.Random(seed)

    def multinomial(probs: torch.Tensor, num_samples: int, *args, **kwargs) -> torch.Tensor:
        assert num_samples == 1 and not args and not kwargs
        return torch.tensor([[inverse_cdf_draw(row, generator)] for row in probs], device=probs.device)

    with mock.patch.object(torch, "multinomial", multinomial):
        yield
