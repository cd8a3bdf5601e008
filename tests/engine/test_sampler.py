"""Choosing the next tokens of a step: greedy rows in one argmax, sampled rows each from its own
generator, in any mix."""

import torch

from batchvl.engine.request import SamplingParams
from batchvl.engine.sampler import make_generator, sample_token, sample_tokens


def test_a_mixed_step_picks_what_each_row_would_pick_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[1, 7] = logits[1, 250] = 50.0  # a tie: the first index wins, as in generate
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3)
    other = SamplingParams(temperature=1.3, seed=4)
    params = [greedy, greedy, sampled, greedy, other]
    generators = [None if p.is_greedy else make_generator(p.seed) for p in params]
    tokens = sample_tokens(logits, params, generators)

    for i in (0, 1, 3):
        assert tokens[i] == int(logits[i].argmax())
    assert tokens[1] == 7
    assert tokens[2] == sample_token(logits[2], sampled, make_generator(sampled.seed))
    assert tokens[4] == sample_token(logits[4], other, make_generator(other.seed))


def test_an_all_sampled_step_needs_no_argmax(monkeypatch):
    monkeypatch.setattr(torch, "argmax", lambda *a, **k: (_ for _ in ()).throw(AssertionError("argmax")))
    sampled = SamplingParams(temperature=1.0, seed=1)
    tokens = sample_tokens(torch.randn(2, 10), [sampled, sampled], [make_generator(1), make_generator(2)])
    assert len(tokens) == 2 and all(0 <= t < 10 for t in tokens)
