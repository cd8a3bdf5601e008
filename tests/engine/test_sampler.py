"""Choosing the next tokens of a step: greedy rows in one argmax, sampled rows each by its own generator,
in any mix, on the logits' device without reading anything back; what temperature, top-k and top-p leave
to sample from, checked against transformers' warpers as `generate` builds and orders them (an independent
reference); and the tokens drawn, against the draw rule written apart in numpy (`seeded_draws.py`) over
those warpers' probabilities, and against their frequencies."""

import math
import random
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchvl.engine.sampling import sampler
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.sampler import SAMPLED_ELEMENTS, filtered_logits, make_generator, step_picks
from tests.conftest import TEST_DEVICE
from tests.engine.seeded_draws import inverse_cdf_draw
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


def reference_draw(logits: torch.Tensor, params: SamplingParams, generator: random.Random) -> int:
    """The token drawn for this (vocab,) row by `generator`'s next number: generate's warped scores'
    softmax, drawn from by the rule written apart (`inverse_cdf_draw`)."""
    return inverse_cdf_draw(torch.softmax(hf_warped(logits, params), -1), generator)


def picks(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    return step_picks(logits, params, generators).tolist()


def generators_of(params: list[SamplingParams]) -> list:
    return [None if p.is_greedy else make_generator(p.seed) for p in params]


def seeded(seed: int) -> random.Random:
    """The reference's generator for a seed, made apart from `make_generator`."""
    return random.Random(seed)


def kept(warped: torch.Tensor) -> set[int]:
    return set(torch.isfinite(warped).nonzero().flatten().tolist())


def test_a_mixed_step_picks_what_each_row_would_pick_alone():
    torch.manual_seed(0)
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3)
    other = SamplingParams(temperature=1.3, seed=4)
    params = [greedy, greedy, sampled, greedy, other]
    generators = generators_of(params)
    references = {2: seeded(sampled.seed), 4: seeded(other.seed)}  # the rule's draws for rows 2 and 4
    for _ in range(10):  # steps: each sampled row's draws go on from its own generator's state
        logits = torch.randn(5, 300)
        logits[1, 7] = logits[1, 250] = 50.0  # a tie: the first index wins, as in generate
        tokens = picks(logits, params, generators)
        for i in (0, 1, 3):
            assert tokens[i] == int(logits[i].argmax())
        assert tokens[1] == 7
        for i, reference in references.items():
            assert tokens[i] == reference_draw(logits[i], params[i], reference)


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
    tokens = picks(logits, [greedy] * 96, [None] * 96)
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert tokens[3:9] == [100, 5, 0, 7, 0, 32767]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_greedy_rows_of_other_dtypes_pick_what_argmax_picks(dtype):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits[1, 3] = logits[1, 400] = 50.0
    logits[2, 9] = float("nan")
    tokens = picks(logits, [SamplingParams()] * 8, [None] * 8)
    assert tokens == torch.argmax(logits.float(), dim=-1).tolist()
    assert tokens[1:3] == [3, 9]


def test_an_all_sampled_step_needs_no_argmax(monkeypatch):
    monkeypatch.setattr(sampler, "greedy_picks", lambda *a: (_ for _ in ()).throw(AssertionError("argmax")))
    sampled = SamplingParams(temperature=1.0, seed=1)
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(8))
    tokens = picks(logits, [sampled, sampled], [make_generator(1), make_generator(2)])
    assert tokens == [
        reference_draw(logits[0], sampled, seeded(1)),
        reference_draw(logits[1], sampled, seeded(2)),
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


@pytest.mark.parametrize(
    ("vocab", "params"),
    [
        (200, SamplingParams(temperature=0.9, top_k=50, top_p=0.9)),
        (151936, SamplingParams(temperature=1.0)),  # Qwen2-VL's vocabulary, all of it kept
    ],
)
def test_a_seeded_draw_is_the_rules_draw_from_generates_distribution(vocab, params):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 2
    for seed in range(20):
        assert picks(logits[None], [params], [make_generator(seed)]) == [
            reference_draw(logits, params, seeded(seed))
        ]


def test_rows_beyond_what_a_draw_takes_at_once_draw_as_alone():
    """A step's sampled rows go SAMPLED_ELEMENTS logits at a time, and rows of other warpers apart: each row
    still gets its own draw, whichever piece it is in."""
    vocab = 4096
    rows = 2 * SAMPLED_ELEMENTS // vocab + 5  # three pieces of the first warpers
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(12)) * 3
    params = [
        SamplingParams(temperature=0.7, seed=i)
        if i % 7
        else SamplingParams(temperature=1.1, top_p=0.8, seed=i)
        for i in range(rows)
    ]
    tokens = picks(logits, params, generators_of(params))
    assert tokens == [reference_draw(logits[i], p, seeded(p.seed)) for i, p in enumerate(params)]


def test_sampled_frequencies_follow_generates_distribution():
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    expected = torch.softmax(hf_warped(logits, params), -1).tolist()
    assert 2 <= sum(p > 0 for p in expected) < 6  # top-p removes some of what top-k left
    draws = 10_000  # ~1 s; a standard error of at most 0.005
    generator = make_generator(7)
    counts = torch.bincount(
        torch.tensor([picks(logits[None], [params], [generator])[0] for _ in range(draws)]), minlength=8
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
    tokens = picks(logits, params, [make_generator(i) for i in range(3)])
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert tokens[1] == 40


def test_a_temperature_of_1e_5_still_samples_as_generate_does():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(9))
    assert_same_as_generate(logits, SamplingParams(temperature=1e-5))  # refused if it were greedy


def test_a_step_on_a_gpu_reads_nothing_back_and_picks_what_the_cpu_picks(monkeypatch):
    """A seed gives the same tokens whichever device ran the model (for the same logits), a step's draws
    cross to the device in one copy, and its picks stay there: an overlapped step feeds them to the next
    forward."""
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(10)) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=i) if i % 3 else SamplingParams()
        for i in range(6)
    ]
    params[4] = replace(params[4], top_k=0)  # other warpers: a piece of their own, in the same copy
    uploads = []

    def fake_upload(tensors, device):
        uploads.append(device)
        return [on_fake_cuda(tensor) for tensor in tensors]

    monkeypatch.setattr(sampler, "uploaded", fake_upload)
    copies = HostCopies()
    with copies:
        on_gpu = step_picks(on_fake_cuda(logits), params, generators_of(params))
    assert copies.count == 0 and on_gpu.device.type == "cuda"
    assert uploads == [torch.device("cuda", 0)]
    assert on_gpu.tolist() == picks(logits, params, generators_of(params))


class HostCopies(TorchFunctionMode):
    """Counts copies of tensors to the CPU (each waits for a GPU's queued work)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item) or (
            func is torch.Tensor.to and torch._C._nn._parse_to(*args[1:], **kwargs)[0] == torch.device("cpu")
        ):
            self.count += 1
        return func(*args, **kwargs)


def test_a_draw_at_the_top_of_the_range_never_picks_a_removed_token(monkeypatch):
    """u times the total may round up to the total (about once in 2**53 draws): the search then lands past
    the last token kept, on a removed one, and the most probable token stands in."""
    monkeypatch.setattr(sampler, "draw_bits", lambda generator: 2**sampler.DRAW_BITS)  # u = 1
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0, -1.0, -2.0]])
    tokens = picks(logits, [SamplingParams(temperature=1.0, top_k=3)], [make_generator(0)])
    assert tokens == [1]


def test_a_seed_draws_the_same_tokens_on_the_test_device_as_on_the_cpu():
    """On a GPU (BATCHVL_TEST_DEVICE=cuda) its softmax, sort and float64 sums round otherwise than the
    CPU's: a draw differs only where u falls within that rounding (some 1e-7 of the total) of a token's
    boundary, about once in millions of draws. On the CPU the two runs are one path."""
    logits = torch.randn(64, 151936, generator=torch.Generator().manual_seed(13)) * 2
    params = [
        SamplingParams(temperature=0.8, seed=i)
        if i % 2
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i)
        for i in range(64)
    ]
    on_device = step_picks(logits.to(TEST_DEVICE), params, generators_of(params))
    assert on_device.device.type == torch.device(TEST_DEVICE).type
    assert on_device.tolist() == picks(logits, params, generators_of(params))


def test_a_gpu_draws_more_rows_at_once_than_a_cpu(monkeypatch):
    monkeypatch.setattr(sampler, "SAMPLED_ELEMENTS", 1000)
    monkeypatch.setattr(sampler, "GPU_SAMPLED_ELEMENTS", 4000)
    monkeypatch.setattr(sampler, "uploaded", lambda tensors, device: [on_fake_cuda(t) for t in tensors])
    filtered = []
    filter_rows = sampler.filtered_logits
    monkeypatch.setattr(
        sampler, "filtered_logits", lambda rows, p: filtered.append(len(rows)) or filter_rows(rows, p)
    )
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(14))
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(16)]
    on_cpu = picks(logits, params, generators_of(params))
    assert filtered == [2] * 8  # 1,000 logits at a time: two rows of 500
    filtered.clear()
    assert step_picks(on_fake_cuda(logits), params, generators_of(params)).tolist() == on_cpu
    assert filtered == [8] * 2


def test_rows_asked_for_are_left_as_they_were_drawn_from_and_the_others_as_they_were():
    """A sampled row whose log-probabilities are kept is left warped by its draw (its filtered logits over
    its own), so that they are not filtered a second time; the other rows are untouched and every pick is
    the one made without it."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(7)) * 3
    top_p, temperature = SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.3)
    params = [top_p, SamplingParams(), top_p, temperature]
    expected = {row: filtered_logits(logits[row], params[row]) for row in (0, 2, 3)}
    untouched = logits.clone()
    picks = step_picks(untouched.clone(), params, generators_of(params)).tolist()
    warped = logits.clone()
    # row 2 is the second of its warpers' rows: its filtered row is found by its place among them
    assert step_picks(warped, params, generators_of(params), warped_rows={1, 2, 3}).tolist() == picks
    assert torch.equal(warped[2], expected[2]) and torch.equal(warped[3], expected[3])
    assert torch.equal(warped[1], untouched[1])  # greedy: its logits are what it picked from
    assert torch.equal(warped[0], untouched[0])  # sampled, but not asked for
    assert not torch.equal(expected[0], untouched[0])  # (top-p removes tokens: a warp would show)
