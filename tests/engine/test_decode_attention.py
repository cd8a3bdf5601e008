"""The batched decode attention equals attending each sequence alone, in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F

from batchvl.engine.attention import DecodeBatch, KVCache, SequenceSlice, decode_attention, split_decodes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_equals_one_call_per_sequence(dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 8, 2, 16, 500
    k_cache = torch.randn(slots, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn(slots, kv_heads, dim, dtype=dtype)
    lengths = [1, 37, 120, 5]
    sequences = [
        SequenceSlice(i, 1, torch.randperm(slots)[:length], None) for i, length in enumerate(lengths)
    ]
    rest, decode = split_decodes(sequences, "cpu")
    assert rest == [] and isinstance(decode, DecodeBatch) and decode.key_slots.shape == (4, 120)
    q = torch.randn(len(lengths), heads, dim, dtype=dtype)
    batched = decode_attention(q, k_cache, v_cache, decode, None).float()
    for i, seq in enumerate(sequences):
        k = k_cache[seq.key_slots].float().transpose(0, 1)[None]
        v = v_cache[seq.key_slots].float().transpose(0, 1)[None]
        alone = F.scaled_dot_product_attention(q[i].float()[None, :, None], k, v, enable_gqa=True)[0, :, 0]
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(batched[i], alone, atol=tolerance, rtol=tolerance)


def test_prefill_chunks_and_a_lone_decode_stay_one_by_one():
    chunk = SequenceSlice(0, 4, torch.arange(10), torch.ones(4, 10, dtype=torch.bool))
    lone = SequenceSlice(4, 1, torch.arange(3), None)
    assert split_decodes([chunk, lone], "cpu") == ([chunk, lone], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unwritten_cache_slots_never_reach_a_decode(dtype):
    """The cache is not zero-filled; the decode batch's padding reads slot 0, which must stay finite."""
    torch.manual_seed(0)
    cache = KVCache.allocate(
        num_layers=2, num_slots=64, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu"
    )
    for tensor in (*cache.keys, *cache.values):
        assert torch.equal(tensor[0], torch.zeros_like(tensor[0]))
        tensor[1:] = float("nan")  # the worst garbage an unwritten slot could hold
    k_cache, v_cache = cache.keys[1], cache.values[1]
    sequences = [
        SequenceSlice(0, 1, torch.tensor([5, 6, 7]), None),
        SequenceSlice(1, 1, torch.tensor([9]), None),
    ]
    for seq in sequences:  # the slots the requests wrote
        k_cache[seq.key_slots] = torch.randn(len(seq.key_slots), 2, 8, dtype=dtype)
        v_cache[seq.key_slots] = torch.randn(len(seq.key_slots), 2, 8, dtype=dtype)
    _, decode = split_decodes(sequences, "cpu")
    out = decode_attention(torch.randn(2, 4, 8, dtype=dtype), k_cache, v_cache, decode, None)
    assert torch.isfinite(out).all()
