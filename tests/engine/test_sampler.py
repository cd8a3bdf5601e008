"""Choosing the next tokens of a step: greedy rows in one argmax, sampled rows each from its own
generator, in any mix; and what temperature, top-k and top-p leave to sample from, checked against
transformers' warpers as `generate` builds and orders them (an independent reference), and the tokens
drawn against generate's own draw from those warpers' scores."""

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.sampler import (
    filtered_logits,
    greedy_tokens,
    make_generator,
    rows_on_host,
    sample_token,
    sample_tokens,
)
from tests.fake_cuda import on_fake_cuda


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores `generate(do_sample=True, ...)` samples from for this (vocab,) row: its warpers, built
    and ordered as `GenerationMixin._get_logits_processor` does (temperature unless 1.0, top-k unless 0,
    top-p unless 1.0), on a (batch, vocab) tensor as in `generate`. (Importing generation.utils to build
    them would cost the file 3 s.)"""
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]


def assert_same_as_generate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Same removed tokens, same values (bit for bit: the same ops), same probabilities."""
    ours, theirs = filtered_logits(logits, params), hf_warped(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.softmax(ours, -1), torch.softmax(theirs, -1))
    return theirs


def generate_draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The token `generate` draws for this (vocab,) row with `generator`: its warped scores' softmax, one
    multinomial draw from the (batch, vocab) probabilities."""
    probs = torch.softmax(hf_warped(logits, params), -1)[None]
    return int(torch.multinomial(probs, 1, generator=generator))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(warped: torch.Tensor) -> set[int]:
    return set(torch.isfinite(warped).nonzero().flatten().tolist())


def test_a_mixed_step_picks_what_each_row_would_pick_alone():
    torch.manual_seed(0)
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3)
    other = SamplingParams(temperature=1.3, seed=4)
    params = [greedy, greedy, sampled, greedy, other]
    generators = [None if p.is_greedy else make_generator(p.seed) for p in params]
    references = {2: seeded(sampled.seed), 4: seeded(other.seed)}  # what generate draws for rows 2 and 4
    for _ in range(10):  # steps: each sampled row's draws go on from its own generator's state
        logits = torch.randn(5, 300)
        logits[1, 7] = logits[1, 250] = 50.0  # a tie: the first index wins, as in generate
        tokens = sample_tokens(logits, params, generators)
        for i in (0, 1, 3):
            assert tokens[i] == int(logits[i].argmax())
        assert tokens[1] == 7
        for i, reference in references.items():
            assert tokens[i] == generate_draw(logits[i], params[i], reference)


def test_greedy_rows_pick_what_argmax_picks_at_vocabulary_size():
    torch.manual_seed(0)
    logits = torch.randn(96, 32768)
    logits[3, 100] = logits[3, 30000] = 99.0  # ties across the row: the first index
    logits[4, 20000] = logits[4, 30000] = logits[4, 5] = 99.0
    logits[5] = float("-inf")  # nothing allowed: index 0, as argmax
    logits[6, 7] = logits[6, 9] = float("nan")  # the first NaN, as argmax
    logits[7] = 1.0
    logits[8, 32767] = 1e9
    greedy = SamplingParams()
    tokens = sample_tokens(logits, [greedy] * 96, [None] * 96)
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert tokens[3:9] == [100, 5, 0, 7, 0, 32767]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_greedy_rows_of_other_dtypes_pick_what_argmax_picks(dtype):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits[1, 3] = logits[1, 400] = 50.0
    logits[2, 9] = float("nan")
    assert greedy_tokens(logits) == torch.argmax(logits.float(), dim=-1).tolist()
    assert greedy_tokens(logits)[1:3] == [3, 9]


def test_an_all_sampled_step_needs_no_argmax(monkeypatch):
    import batchvl.engine.sampling.sampler as sampler

    monkeypatch.setattr(sampler, "greedy_tokens", lambda *a: (_ for _ in ()).throw(AssertionError("argmax")))
    sampled = SamplingParams(temperature=1.0, seed=1)
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(8))
    tokens = sample_tokens(logits, [sampled, sampled], [make_generator(1), make_generator(2)])
    assert tokens == [
        generate_draw(logits[0], sampled, seeded(1)),
        generate_draw(logits[1], sampled, seeded(2)),
    ]


@pytest.mark.parametrize("temperature", [1e-3, 0.3, 0.7, 1.0, 1.7])
def test_temperature_scales_as_generate_does(temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 2
    warped = assert_same_as_generate(logits, SamplingParams(temperature=temperature))
    assert kept(warped) == set(range(64))  # temperature alone removes nothing
    if temperature == 1e-3:  # near 0: nearly one-hot on the argmax, but still a distribution
        assert float(torch.softmax(warped, -1)[logits.argmax()]) > 0.999


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0, 2.0, -1.0])
    warped = assert_same_as_generate(logits, SamplingParams(temperature=1.0, top_k=2))
    assert kept(warped) == {0, 1, 2, 3, 6}  # k=2, but the 2nd value is shared by four tokens


@pytest.mark.parametrize("top_k", [1, 8, 100])
def test_top_k_of_one_and_of_at_least_the_vocabulary(top_k):
    logits = torch.randn(8, generator=torch.Generator().manual_seed(2))
    warped = assert_same_as_generate(logits, SamplingParams(temperature=1.0, top_k=top_k))
    assert len(kept(warped)) == min(top_k, 8)


def test_top_p_reached_exactly_keeps_only_the_tokens_that_reach_it():
    # Probabilities 1/2, 1/4, 1/8, 1/8 are exact in float32, so the first two sum to exactly 0.75.
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert torch.softmax(logits, -1).tolist() == [0.5, 0.25, 0.125, 0.125]
    warped = assert_same_as_generate(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert kept(warped) == {0, 1}


def test_top_p_boundary_through_a_tie_removes_what_generate_removes():
    # 1/2 then two tokens of 1/4: top_p=0.6 needs one of the two; which one is generate's sort order.
    assert_same_as_generate(
        torch.log(torch.tensor([0.5, 0.25, 0.25])), SamplingParams(temperature=1.0, top_p=0.6)
    )
    assert_same_as_generate(
        torch.log(torch.tensor([0.25, 0.5, 0.25])), SamplingParams(temperature=1.0, top_p=0.6)
    )


def test_top_p_equal_to_a_float_partial_sum_rounds_as_generate_does():
    # top_p set to the mass of the first few tokens: the keep/remove decision is then made by rounding,
    # and a rule that is only equal on paper (mass before a token >= top_p) disagrees on many of these.
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        vocab = int(torch.randint(2, 20, (1,), generator=g))
        logits = torch.randn(vocab, generator=g) * 2
        probs = torch.softmax(torch.sort(logits, descending=True).values, -1)
        top_p = float(probs[: int(torch.randint(1, vocab, (1,), generator=g))].double().sum())
        assert_same_as_generate(logits, SamplingParams(temperature=1.0, top_p=min(top_p, 0.999999)))


@pytest.mark.parametrize("top_p", [0.0, 1e-6, 0.05])
def test_a_tiny_top_p_keeps_only_the_most_probable_token(top_p):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(4))
    warped = assert_same_as_generate(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert kept(warped) == {int(logits.argmax())}


def test_top_p_zero_keeps_the_top_token_even_when_the_mass_sums_to_exactly_one():
    # Every cumulative mass, the last one included, is then <= 1 - 0: only "keep at least one" saves it.
    logits = torch.log(torch.tensor([0.125, 0.5, 0.25, 0.125]))
    warped = assert_same_as_generate(logits, SamplingParams(temperature=1.0, top_p=0.0))
    assert kept(warped) == {1}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 10, 0.8), (1.5, 5, 0.9), (0.3, 40, 0.95), (2.0, 0, 0.5)]
)
def test_temperature_top_k_and_top_p_together_in_generate_order(temperature, top_k, top_p):
    logits = torch.randn(100, generator=torch.Generator().manual_seed(5)) * 3
    assert_same_as_generate(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))


def test_a_seeded_draw_is_generates_draw_for_the_same_rng_state():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(6)) * 2
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9)
    for seed in range(20):
        assert sample_token(logits, params, make_generator(seed)) == generate_draw(
            logits, params, seeded(seed)
        )


def test_sampled_frequencies_follow_generates_distribution():
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    expected = torch.softmax(hf_warped(logits, params), -1).tolist()
    assert 2 <= sum(p > 0 for p in expected) < 6  # top-p removes some of what top-k left
    draws = 10_000  # ~1 s; a standard error of at most 0.005
    generator = make_generator(7)
    counts = torch.bincount(
        torch.tensor([sample_token(logits, params, generator) for _ in range(draws)]), minlength=8
    ).tolist()
    for token, (count, p) in enumerate(zip(counts, expected, strict=True)):
        if p == 0.0:
            assert count == 0, f"removed token {token} drawn {count} times"
        else:  # within 4 standard errors
            assert abs(count / draws - p) <= 4 * math.sqrt(p * (1 - p) / draws), (token, count / draws, p)


def test_filtered_logits_refuses_greedy_params():
    with pytest.raises(ValueError, match="greedy"):
        filtered_logits(torch.zeros(4), SamplingParams())


@pytest.mark.parametrize("temperature", [1e-40, 9.9e-6])
def test_a_temperature_too_small_to_divide_by_picks_the_argmax(temperature):
    # Logits over 1e-40 overflow float32 to inf (generate's warper then samples from NaN and raises):
    # below 1e-5, as in vLLM, the row is greedy, the limit of softmax(logits / t) as t falls to 0.
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(8)) * 3
    logits[1, 40] = logits[1, 200] = 20.0  # tied maxima: the first, as greedy picks it
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(3)]
    tokens = sample_tokens(logits, params, [make_generator(i) for i in range(3)])
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert tokens[1] == 40


def test_a_temperature_of_1e_5_still_samples_as_generate_does():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(9))
    assert_same_as_generate(logits, SamplingParams(temperature=1e-5))  # refused if it were greedy


def test_sampled_rows_of_cuda_logits_draw_on_the_cpu_the_tokens_cpu_logits_give():
    # A request's generator is a CPU one; PyTorch refuses it for CUDA logits (the fake CUDA tensor
    # refuses it the same way), so each sampled row is drawn from its copy on the CPU: a seed gives the
    # same tokens whichever device ran the model.
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(10)) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=i) if i % 3 else SamplingParams()
        for i in range(6)
    ]

    def generators():
        return [None if p.is_greedy else make_generator(p.seed) for p in params]

    on_cpu = sample_tokens(logits, params, generators())
    assert sample_tokens(on_fake_cuda(logits), params, generators()) == on_cpu
    row = SamplingParams(temperature=1.3, seed=5)
    assert sample_token(on_fake_cuda(logits[2]), row, make_generator(5)) == sample_token(
        logits[2], row, make_generator(5)
    )


class HostCopies(TorchFunctionMode):
    """Counts copies of tensors to the CPU (each waits for a GPU's queued work)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu or (
            func is torch.Tensor.to and torch._C._nn._parse_to(*args[1:], **kwargs)[0] == torch.device("cpu")
        ):
            self.count += 1
        return func(*args, **kwargs)


def test_a_steps_sampled_rows_leave_the_gpu_in_one_copy():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(11))
    params = [SamplingParams(temperature=0.7, seed=i) if i % 2 else SamplingParams() for i in range(6)]
    generators = [None if p.is_greedy else make_generator(p.seed) for p in params]
    copies = HostCopies()
    with copies:
        on_gpu = sample_tokens(on_fake_cuda(logits), params, generators)
    assert copies.count == 1  # the three sampled rows together, not one copy each
    generators = [None if p.is_greedy else make_generator(p.seed) for p in params]
    assert on_gpu == sample_tokens(logits, params, generators)
    with copies:
        rows = rows_on_host(on_fake_cuda(logits), [True, False, True, False, False, True])
    assert copies.count == 2 and list(rows) == [0, 2, 5]
    assert all(torch.equal(rows[i], logits[i]) and rows[i].device.type == "cpu" for i in rows)
