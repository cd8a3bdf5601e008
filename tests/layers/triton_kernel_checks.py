"""The language model's Triton attention (CUDA's paged kernels), run by Triton's interpreter on CPU tensors:
decodes and prefill chunks straight from scattered cache slots equal torch's attention over the same keys
gathered, in float32 and bfloat16, with grouped KV heads, sequences of one key to several blocks, chunks
from position 0 and after a context; and the engine with these kernels equals `generate`.

The interpreter must be on before Triton is first imported in the process, so these checks run in a
process of their own with TRITON_INTERPRET=1 (tests/layers/test_triton_attention.py starts it)."""

import os

import pytest
import torch
import torch.nn.functional as F

import batchvl.layers.attention as attention
from batchvl.config import EngineConfig
from batchvl.layers import triton_attention
from tests.engine.reference import assert_matches_reference
from tests.engine.test_parity import cases, reference, run_engine  # noqa: F401 (fixtures)
from tests.layers.interpreter import widen_bfloat16_dots

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_attention.py, under Triton's interpreter", allow_module_level=True)

widen_bfloat16_dots()  # bf16 products on tensor cores, as a GPU computes them

HEADS, KV_HEADS = 4, 2


def cache_with(lengths: list[int], head_dim: int, dtype, seed: int):
    """A cache layer (2, Hkv, slots, D) of random K/V and each sequence's slots, scattered in it."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    kv = torch.randn(2, KV_HEADS, total + 7, head_dim, generator=generator).to(dtype)
    order = torch.randperm(total + 7, generator=generator)[:total]
    return kv, list(order.split(lengths))


def paged_cache_with(lengths: list[int], head_dim: int, dtype, seed: int, page_size: int):
    """A cache layer of random K/V in pages of `page_size` slots, each sequence's pages in random order:
    the layer, each sequence's pages, and the slots of its keys."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-length // page_size) for length in lengths]
    kv = torch.randn(2, KV_HEADS, (sum(counts) + 3) * page_size, head_dim, generator=generator).to(dtype)
    pages = list(torch.randperm(sum(counts) + 3, generator=generator)[: sum(counts)].split(counts))
    slots = [
        (own[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:length]
        for own, length in zip(pages, lengths, strict=True)
    ]
    return kv, pages, slots


def gathered_attention(
    query: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """(H, Q, D) queries at the last Q positions of the keys at `slots`, causal, in float32."""
    keys, values = (kv[i][:, slots].float() for i in (0, 1))
    count = query.shape[1]
    context = len(slots) - count
    allowed = torch.arange(len(slots))[None, :] <= (context + torch.arange(count))[:, None]
    return F.scaled_dot_product_attention(
        query.float(), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,page_size", [(16, 1), (80, 1), (16, 16), (80, 3)])
def test_decodes_attend_their_paged_keys_as_torch_attends_them_gathered(dtype, head_dim, page_size):
    """Pages of one slot (scattered slots) and of several, the last of a sequence part-filled."""
    lengths = [1, 5, 64, 65, 200]  # one key, part of a block, a block, a block and one, several
    kv, pages, slots = paged_cache_with(lengths, head_dim, dtype, seed=head_dim, page_size=page_size)
    rows = torch.tensor([3, 0, 6, 1, 4])  # each decode's row of the packed step
    query = torch.randn(HEADS, 8, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full((8, HEADS, head_dim), float("nan"), dtype=dtype)
    starts = torch.tensor([0, *torch.tensor([len(own) for own in pages]).cumsum(0)[:-1].tolist()])
    scale = head_dim**-0.5
    triton_attention.paged_decode_attention(
        out, query, kv, rows, torch.cat(pages), starts, torch.tensor(lengths), scale, page_size
    )
    for row, own in zip(rows.tolist(), slots, strict=True):
        want = gathered_attention(query[:, row : row + 1], kv, own, scale)[:, 0]
        torch.testing.assert_close(out[row].float(), want, rtol=0, atol=TOLERANCE[dtype])
    untouched = [r for r in range(8) if r not in rows.tolist()]
    assert out[untouched].isnan().all()  # rows of other tokens are left to the prefill path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_attend_causally_over_their_context_and_themselves(dtype):
    head_dim = 32
    # queries per chunk: several blocks of queries, one, exactly a block; and two whose last key is one past
    # a block of 64 keys (65 and 129 in all), which a key loop ending one block early would miss
    counts = [37, 1, 16, 20, 1, 9]
    contexts = [0, 70, 5, 130, 64, 120]  # keys before each chunk
    lengths = [c + n for c, n in zip(contexts, counts, strict=True)]
    kv, slots = cache_with(lengths, head_dim, dtype, seed=3)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0)[:-1].tolist()])
    rows = sum(counts)
    query = torch.randn(HEADS, rows, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = torch.zeros((rows, HEADS, head_dim), dtype=dtype)
    table = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
    scale = 0.3
    triton_attention.paged_prefill_attention(
        out, query, kv, starts, torch.tensor(counts), table, torch.tensor(lengths), scale, max(counts)
    )
    for start, count, own in zip(starts.tolist(), counts, slots, strict=True):
        want = gathered_attention(query[:, start : start + count], kv, own, scale).transpose(0, 1)
        torch.testing.assert_close(out[start : start + count].float(), want, rtol=0, atol=TOLERANCE[dtype])


def test_the_engine_with_the_triton_kernels_equals_generate(loaded_fp32, cases, monkeypatch):  # noqa: F811
    monkeypatch.setattr(attention, "runs_natively", lambda tensor: False)  # the CPU cache takes Triton's
    limits = EngineConfig(max_num_batched_tokens=37, max_num_seqs=8)
    engine, observed = run_engine(loaded_fp32, cases, limits)
    cache = engine.runner.kv_cache
    assert cache.decodes_in_place and cache.prefills_in_place
    assert attention.paged_kernels(cache.layers[0]) is triton_attention
    for case in cases:
        assert_matches_reference(observed[case.tag], case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_before_use_passes_the_kernels_and_refuses_broken_ones(dtype, monkeypatch):
    assert triton_attention._works_on.__wrapped__(torch.device("cpu"), dtype)
    monkeypatch.setattr(triton_attention, "BLOCK_KEYS", 1)  # still right, in blocks of one key
    assert triton_attention._works_on.__wrapped__(torch.device("cpu"), dtype)
    # a decode kernel that attends one key less than it should: refused, torch's path kept
    decode = triton_attention.paged_decode_attention
    monkeypatch.setattr(
        triton_attention,
        "paged_decode_attention",
        lambda out, query, kv, rows, pages, starts, lengths, scale, page_size: decode(
            out, query, kv, rows, pages, starts, lengths - 1, scale, page_size
        ),
    )
    assert not triton_attention._works_on.__wrapped__(torch.device("cpu"), dtype)
