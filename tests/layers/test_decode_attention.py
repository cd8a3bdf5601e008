"""The torch decode path (where the native kernel does not build, or `BATCHVL_NATIVE_KERNELS=0`): batched
decode attention equals attending each sequence alone, in float32 and bfloat16, over the head-major paged
cache."""

import pytest
import torch
import torch.nn.functional as F

import batchvl.layers.attention as attention
from batchvl.layers.attention import (
    MAX_DECODE_GROUPS,
    DecodeBatch,
    KVCache,
    PagedAttentionMetadata,
    SequenceSlice,
    decode_attention,
    length_groups,
    paged_attention,
    split_decodes,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def torch_decode_path(monkeypatch):
    monkeypatch.setattr(attention, "reads_cache_in_place", lambda layer: False)


def filled_cache(dtype, slots=500, kv_heads=2, dim=16, layers=2) -> KVCache:
    cache = KVCache.allocate(layers, slots, kv_heads, dim, dtype, "cpu")
    all_slots = torch.arange(slots)
    for layer in range(layers):
        cache.write(layer, all_slots, *torch.randn(2, kv_heads, slots, dim, dtype=dtype))
    return cache


def test_cache_write_then_gather_returns_what_was_written():
    torch.manual_seed(0)
    cache = KVCache.allocate(
        num_layers=2, num_slots=40, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu"
    )
    slots = torch.tensor([7, 3, 30, 12])
    key, value = torch.randn(3, 4, 4), torch.randn(3, 4, 4)  # (Hkv, T, D)
    cache.write(1, slots, key, value)
    order = torch.tensor([12, 7, 30])  # a different order and a subset
    k, v = cache.gather(1, cache.gather_rows(order))
    expected = [int((slots == s).nonzero()) for s in order]
    assert torch.equal(k, key[:, expected]) and torch.equal(v, value[:, expected])
    assert not torch.equal(cache.layers[0][0, :, 7], key[:, 0])  # other layers untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_equals_one_call_per_sequence(dtype):
    torch.manual_seed(0)
    heads, slots, layer = 8, 500, 1
    cache = filled_cache(dtype, slots)
    lengths = [1, 37, 120, 5]
    sequences = [SequenceSlice(i, 1, torch.randperm(slots)[:length]) for i, length in enumerate(lengths)]
    rest, decodes = split_decodes(sequences, cache, "cpu")
    (decode,) = decodes  # too few padded keys to split: one batch
    assert rest == [] and isinstance(decode, DecodeBatch) and decode.mask.shape == (4, 120)
    assert decode.key_rows.numel() == 2 * 2 * 4 * 120  # K and V of 2 heads, 4 sequences padded to 120 keys
    q = torch.randn(len(lengths), heads, 16, dtype=dtype)
    batched = decode_attention(q, *cache.gather(layer, decode.key_rows), decode, None).float()
    keys, values = cache.layers[layer].float()
    for i, seq in enumerate(sequences):
        k, v = keys[:, seq.key_slots][None], values[:, seq.key_slots][None]
        alone = F.scaled_dot_product_attention(q[i].float()[None, :, None], k, v, enable_gqa=True)[0, :, 0]
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(batched[i], alone, atol=tolerance, rtol=tolerance)


def test_prefill_chunks_and_a_lone_decode_stay_one_by_one():
    cache = filled_cache(torch.float32, slots=16)
    chunk = SequenceSlice(0, 4, torch.arange(10))
    lone = SequenceSlice(4, 1, torch.arange(3))
    full = SequenceSlice(5, 6, torch.arange(6))
    meta = PagedAttentionMetadata.build(cache, torch.arange(11), [chunk, lone, full], "cpu")
    assert meta.sequences == [chunk, lone, full] and meta.decodes == []
    # the sequences that read the cache know their rows; a chunk from position 0 reads its own inputs
    assert torch.equal(chunk.key_rows, cache.gather_rows(torch.arange(10)))
    assert lone.key_rows is not None and full.key_rows is None
    # the chunk's mask is built once for every layer; the decode and the chunk from position 0 need none
    assert torch.equal(chunk.attention_mask, chunk.causal_mask(torch.float32, CPU))
    assert lone.attention_mask is None and full.attention_mask is None


def test_a_chunk_after_its_context_attends_causally_from_its_first_query():
    chunk = SequenceSlice(0, 3, torch.arange(5))  # 2 keys of context, then its 3 queries
    inf = float("-inf")
    expected = torch.tensor([[0, 0, 0, inf, inf], [0, 0, 0, 0, inf], [0, 0, 0, 0, 0]], dtype=torch.bfloat16)
    assert torch.equal(chunk.causal_mask(torch.bfloat16, CPU), expected)
    # a decode sees every key; a chunk from position 0 is plain causal, SDPA's own
    assert SequenceSlice(0, 1, torch.arange(7)).causal_mask(torch.float32, CPU) is None
    assert SequenceSlice(0, 4, torch.arange(4)).causal_mask(torch.float32, CPU) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unwritten_cache_slots_never_reach_a_decode(dtype):
    """The cache is not zero-filled; the decode batch's padding reads slot 0, which must stay finite."""
    torch.manual_seed(0)
    cache = KVCache.allocate(
        num_layers=2, num_slots=64, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu"
    )
    for layer in cache.layers:
        assert torch.equal(layer[:, :, 0], torch.zeros_like(layer[:, :, 0]))
        layer[:, :, 1:] = float("nan")  # the worst garbage an unwritten slot could hold
    sequences = [
        SequenceSlice(0, 1, torch.tensor([5, 6, 7])),
        SequenceSlice(1, 1, torch.tensor([9])),
    ]
    for seq in sequences:  # the slots the requests wrote
        cache.write(1, seq.key_slots, *torch.randn(2, 2, len(seq.key_slots), 8, dtype=dtype))
    _, (decode,) = split_decodes(sequences, cache, "cpu")
    out = decode_attention(torch.randn(2, 4, 8, dtype=dtype), *cache.gather(1, decode.key_rows), decode, None)
    assert torch.isfinite(out).all()


def test_decodes_of_one_length_stay_one_group():
    assert length_groups([300] * 50) == [list(range(50))]


def test_two_clusters_of_lengths_split_between_them():
    lengths = [40 + i % 5 for i in range(20)] + [800 + i % 7 for i in range(20)]
    groups = length_groups(lengths)
    assert groups == [list(range(20, 40)), list(range(20))]  # the longest first, each in step order


def test_groups_cover_every_decode_once_and_stay_few():
    lengths = torch.randint(10, 2000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(200))
    assert 1 < len(groups) <= MAX_DECODE_GROUPS
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert padded < 0.75 * len(lengths) * max(lengths)  # a single batch would pad everything to the longest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_split_by_length_equal_one_call_per_sequence(dtype):
    torch.manual_seed(0)
    heads, slots, layer = 8, 3000, 0
    cache = filled_cache(dtype, slots)
    lengths = [900, 30, 850, 12, 40, 880]
    sequences = [SequenceSlice(i, 1, torch.randperm(slots)[:length]) for i, length in enumerate(lengths)]
    meta = PagedAttentionMetadata.build(cache, torch.arange(len(lengths)), sequences, "cpu")
    assert meta.sequences == [] and [d.mask.shape for d in meta.decodes] == [(3, 900), (3, 40)]
    q = torch.randn(1, heads, len(lengths), 16, dtype=dtype)
    kv = torch.randn(2, 1, 2, len(lengths), 16, dtype=dtype)
    module = torch.nn.Module()
    module.layer_idx = layer
    out, _ = paged_attention(module, q, kv[0], kv[1], None, batchvl_attention=meta)
    keys, values = cache.layers[layer].float()
    for i, seq in enumerate(sequences):
        k, v = keys[:, seq.key_slots][None], values[:, seq.key_slots][None]
        alone = F.scaled_dot_product_attention(q[:, :, i : i + 1].float(), k, v, enable_gqa=True)[0, :, 0]
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[0, i].float(), alone, atol=tolerance, rtol=tolerance)
