"""The native decode attention (`batchvl/layers/native/paged_decode_attention.cpp`) equals attending each
sequence alone with torch, read straight from the paged cache, for every head size it is built for, query
groups from one head to more than it attends together, float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F

from batchvl.layers.attention import (
    InPlaceDecodes,
    KVCache,
    PagedAttentionMetadata,
    SequenceSlice,
    paged_attention,
)
from batchvl.layers.native_kernels import HEAD_DIMS, native_ops


@pytest.fixture(scope="module")
def kernel():
    built = native_ops()
    if built is None:
        pytest.skip("the native decode attention did not build (needs a C++ compiler and ninja)")
    return built


def filled_cache(dtype, slots, kv_heads, dim) -> KVCache:
    cache = KVCache.allocate(1, slots, kv_heads, dim, dtype, "cpu")
    cache.write(0, torch.arange(slots), *torch.randn(2, kv_heads, slots, dim, dtype=dtype))
    return cache


def expected_output(query, cache: KVCache, sequences, scale) -> torch.Tensor:
    """Each sequence alone through torch's attention, in float64: (B, H, D)."""
    keys, values = cache.layers[0].double()
    out = []
    for seq in sequences:
        q = query[:, seq.query_start].double()[None, :, None]  # (1, H, 1, D)
        k, v = keys[:, seq.key_slots][None], values[:, seq.key_slots][None]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def tolerance(dtype) -> dict:
    # float32: rounding of float32 sums over a few hundred keys; bfloat16: the output's own rounding (8 bits).
    return {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize(
    "kv_heads,heads", [(2, 2), (2, 8), (1, 6), (2, 40)], ids=["mha", "gqa4", "gqa6", "gqa20"]
)
def test_equals_each_sequence_alone(kernel, dtype, dim, kv_heads, heads):
    generator = torch.Generator().manual_seed(dim + heads)
    torch.manual_seed(dim + heads)
    slots = 700
    cache = filled_cache(dtype, slots, kv_heads, dim)
    lengths = [1, 17, 300, 5, 64, 233]
    rows = [3, 0, 6, 1, 7, 4]  # the queries' rows in the packed step, out of order; rows 2 and 5 are others'
    sequences = [
        SequenceSlice(row, 1, torch.randperm(slots, generator=generator)[:length])
        for row, length in zip(rows, lengths, strict=True)
    ]
    # (H, T, D) with the strides transformers' (1, T, H, D) -> (1, H, T, D) transpose leaves
    query = torch.randn(1, 8, heads, dim, dtype=dtype).transpose(1, 2)[0]
    out = torch.full((8, heads, dim), 7.0, dtype=dtype)
    scale = dim**-0.5
    InPlaceDecodes.build(sequences, torch.device("cpu")).attend(out, query, cache.layers[0], scale)
    expected = expected_output(query, cache, sequences, scale)
    torch.testing.assert_close(out[rows].double(), expected, **tolerance(dtype))
    assert torch.equal(out[[2, 5]], torch.full((2, heads, dim), 7.0, dtype=dtype))  # others' rows untouched


def test_reads_only_each_sequence_own_slots(kernel):
    """Slots outside a sequence's list (its padding past its length included) are never read."""
    torch.manual_seed(0)
    cache = filled_cache(torch.float32, 64, 2, 16)
    cache.layers[0][:, :, 32:] = float("nan")
    sequences = [
        SequenceSlice(0, 1, torch.tensor([5, 9, 1])),
        SequenceSlice(1, 1, torch.tensor([30])),
    ]
    decodes = InPlaceDecodes.build(sequences, torch.device("cpu"))
    assert decodes.pages.tolist() == [5, 9, 1, 30] and decodes.starts.tolist() == [0, 3]
    assert decodes.page_size == 1  # no block tables: the slots are the pages
    decodes.pages = torch.cat([decodes.pages, torch.tensor([40, 41])])  # pages past the last list: garbage
    query = torch.randn(4, 2, 16)
    out = torch.empty(2, 4, 16)
    decodes.attend(out, query, cache.layers[0], 0.25)
    assert torch.isfinite(out).all()
    expected = expected_output(query, cache, sequences, 0.25)
    torch.testing.assert_close(out.double(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_reads_the_keys_through_a_block_table(kernel, dtype, block_size):
    """With a block table (the engine's: a row per request, a sequence's pages from its row's start), the
    kernel reads key k at block k // size, offset k % size; the last block part-filled, the rest of the
    cache and of the table's rows unread (NaN keys, out-of-range blocks)."""
    generator = torch.Generator().manual_seed(block_size)
    torch.manual_seed(block_size)
    num_blocks, heads, kv_heads, dim, width = 64, 8, 2, 64, 40
    cache = filled_cache(dtype, num_blocks * block_size, kv_heads, dim)
    lengths = [1, block_size, block_size + 1, 97, 150]
    counts = [-(-n // block_size) for n in lengths]
    tables = torch.randperm(num_blocks, generator=generator)[: sum(counts)].split(counts)
    table = torch.full((len(lengths) + 2, width), 10**9)  # unused rows and columns: no block there
    table_rows = [3, 0, 6, 1, 5]
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    sequences = []
    for query_row, (table_row, blocks, length) in enumerate(zip(table_rows, tables, lengths, strict=True)):
        table[table_row, : len(blocks)] = blocks
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
        used[slots] = True
        sequences.append(SequenceSlice(query_row, 1, slots))
    cache.layers[0][:, :, ~used] = float("nan")
    decodes = InPlaceDecodes(
        torch.arange(len(lengths)),
        table.reshape(-1),
        torch.tensor(table_rows) * width,
        torch.tensor(lengths),
        block_size,
    )
    query = torch.randn(heads, len(lengths), dim, dtype=dtype)
    out = torch.empty(len(lengths), heads, dim, dtype=dtype)
    decodes.attend(out, query, cache.layers[0], dim**-0.5)
    expected = expected_output(query, cache, sequences, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))


def test_a_step_of_decodes_and_a_prefill_chunk_through_paged_attention(kernel):
    """The decodes go to the kernel, the chunk to torch's attention; each equals attending alone."""
    torch.manual_seed(0)
    dim, heads, kv_heads, slots = 64, 8, 2, 900
    cache = KVCache.allocate(2, slots, kv_heads, dim, torch.float32, "cpu")
    for layer in range(2):
        cache.write(layer, torch.arange(slots), *torch.randn(2, kv_heads, slots, dim))
    chunk_slots = torch.arange(600, 610)
    decodes = [SequenceSlice(i, 1, torch.randperm(500)[: 40 * (i + 1)]) for i in range(3)]
    chunk = SequenceSlice(3, 4, chunk_slots)  # 6 keys of context
    step_slots = torch.cat([torch.stack([seq.key_slots[-1] for seq in decodes]), chunk_slots[6:]])
    meta = PagedAttentionMetadata.build(cache, step_slots, [decodes[0], chunk, *decodes[1:]], "cpu")
    assert meta.sequences == [chunk] and meta.decodes == []
    assert meta.in_place_decodes.lengths.tolist() == [40, 80, 120]
    query = torch.randn(1, heads, 7, dim)
    key, value = torch.randn(2, 1, kv_heads, 7, dim)
    module = torch.nn.Module()
    module.layer_idx = 1
    out, _ = paged_attention(module, query, key, value, None, batchvl_attention=meta)
    keys, values = cache.layers[1]  # after the step wrote its K/V
    causal_after_six = torch.ones(4, 10, dtype=torch.bool).tril(6)  # query i sees keys 0..6+i
    for seq, mask in [*((d, None) for d in decodes), (chunk, causal_after_six)]:
        rows = slice(seq.query_start, seq.query_start + seq.num_queries)
        k, v = keys[:, seq.key_slots][None], values[:, seq.key_slots][None]
        alone = F.scaled_dot_product_attention(query[:, :, rows], k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out[0, rows], alone[0].transpose(0, 1), **tolerance(torch.float32))


def test_refuses_a_head_size_it_is_not_built_for(kernel):
    cache = filled_cache(torch.float32, 8, 1, 48)
    decodes = InPlaceDecodes.build([SequenceSlice(0, 1, torch.tensor([1, 2]))], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="head size 48"):
        decodes.attend(torch.empty(1, 1, 48), torch.randn(1, 1, 48), cache.layers[0], 1.0)
