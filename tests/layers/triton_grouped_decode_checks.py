"""The grouped decode kernel (one program per sequence and KV head, its keys split or not) and the bf16/fp16
tensor-core prefill, run by Triton's interpreter on CPU tensors against torch's attention over the same keys
gathered: Qwen2-VL-2B's and 7B's head groups (6 and 7) and others, head sizes 64, 80 and 128, pages of one
slot and of 16, sequences of one key, of a block and one, across splits and past them.

The interpreter must be on before Triton is first imported, so these checks run in a process of their own
(tests/layers/test_triton_grouped_decode.py starts it)."""

import os

import pytest
import torch

from batchvl.layers import triton_attention, triton_grouped_decode
from tests.layers.interpreter import widen_bfloat16_dots
from tests.layers.triton_kernel_checks import gathered_attention

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_grouped_decode.py, under Triton's interpreter", allow_module_level=True)

widen_bfloat16_dots()

# float32: the same products, summed in another order; bfloat16: its weights and output rounded to 8 bits
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# one key (the other splits empty), part of a block, a block and one, several blocks over several splits
LENGTHS = [1, 5, 65, 300]


def paged_decodes(group: int, kv_heads: int, head_dim: int, page_size: int, dtype, seed: int):
    """A cache layer in pages of `page_size` slots, each sequence's pages in random order, the step's queries
    (H, rows, D) and the decodes' arguments: rows, pages, starts, lengths; and each sequence's slots."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-length // page_size) for length in LENGTHS]
    kv = torch.randn(2, kv_heads, (sum(counts) + 3) * page_size, head_dim, generator=generator).to(dtype)
    pages = list(torch.randperm(sum(counts) + 3, generator=generator)[: sum(counts)].split(counts))
    slots = [
        (own[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:length]
        for own, length in zip(pages, LENGTHS, strict=True)
    ]
    query = torch.randn(group * kv_heads, 6, head_dim, generator=generator).to(dtype)
    rows = torch.tensor([4, 0, 2, 5])  # each decode's row of the packed step
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0)[:-1].tolist()])
    arguments = (rows, torch.cat(pages), starts, torch.tensor(LENGTHS))
    return kv, query, arguments, slots


def assert_attends_as_torch(out, query, kv, rows, slots, scale, dtype):
    for row, own in zip(rows.tolist(), slots, strict=True):
        want = gathered_attention(query[:, row : row + 1], kv, own, scale)[:, 0]
        torch.testing.assert_close(out[row].float(), want, rtol=0, atol=TOLERANCE[dtype])
    untouched = [r for r in range(out.shape[0]) if r not in rows.tolist()]
    assert out[untouched].isnan().all()  # rows of other tokens are left to the prefill path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "group,kv_heads,head_dim,page_size,splits",
    [
        (6, 2, 128, 16, 1),  # Qwen2-VL-2B's heads, one program a sequence's keys
        (6, 2, 128, 1, 4),  # the same over four splits (the one-key sequence's last three empty)
        (7, 1, 80, 16, 8),  # 7B's group of 7 (of its 28/4), more splits than the longest has blocks
        (2, 2, 64, 1, 2),
        (1, 3, 64, 16, 2),  # a group of one, padded to a dot's 16 rows like the others
    ],
)
def test_grouped_decodes_attend_their_paged_keys_as_torch_attends_them_gathered(
    dtype, group, kv_heads, head_dim, page_size, splits
):
    kv, query, arguments, slots = paged_decodes(group, kv_heads, head_dim, page_size, dtype, seed=head_dim)
    out = torch.full((6, group * kv_heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    triton_grouped_decode.grouped_decode_attention(out, query, kv, *arguments, scale, page_size, splits)
    assert_attends_as_torch(out, query, kv, arguments[0], slots, scale, dtype)


@pytest.mark.parametrize("block_keys", [32, 128])
def test_grouped_decodes_with_other_key_blocks_attend_as_torch(block_keys, monkeypatch):
    # the launch settings `benchmarks/decode_attention.py` times beside the defaults: 65 and 300 keys end in
    # a partial block at each, over two splits
    monkeypatch.setattr(triton_grouped_decode, "BLOCK_KEYS", block_keys)
    kv, query, arguments, slots = paged_decodes(6, 2, 128, 16, torch.bfloat16, seed=block_keys)
    out = torch.full((6, 12, 128), float("nan"), dtype=torch.bfloat16)
    triton_grouped_decode.grouped_decode_attention(out, query, kv, *arguments, 128**-0.5, 16, 2)
    assert_attends_as_torch(out, query, kv, arguments[0], slots, 128**-0.5, torch.bfloat16)


@pytest.mark.parametrize("group,kernel", [(6, "grouped"), (1, "per_head")])
def test_the_engine_s_decode_call_takes_the_kernel_of_its_heads(group, kernel, monkeypatch):
    """Through `paged_decode_attention` (its splits chosen from the pages): grouped heads go to the grouped
    kernel, one query head a KV head to the per-head one, and both attend right."""
    called = []
    for name in ("grouped_decode_attention", "per_head_decode_attention"):
        chosen = getattr(triton_attention, name)
        monkeypatch.setattr(
            triton_attention, name, lambda *a, chosen=chosen, name=name: called.append(name) or chosen(*a)
        )
    kv, query, arguments, slots = paged_decodes(group, 2, 80, 16, torch.float32, seed=5)
    out = torch.full((6, group * 2, 80), float("nan"))
    triton_attention.paged_decode_attention(out, query, kv, *arguments, 0.1, 16)
    assert called == [f"{kernel}_decode_attention"]
    assert_attends_as_torch(out, query, kv, arguments[0], slots, 0.1, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_attend_causally_across_blocks_of_queries(dtype):
    """Chunks longer than a bf16 program's 64 queries and a float32 one's 16, at 2B's heads and head size:
    the tile boundaries fall inside chunks, and the causal edge inside a tile."""
    group, kv_heads, head_dim = 6, 2, 128
    counts = [130, 1, 64]
    contexts = [0, 70, 9]
    lengths = [c + n for c, n in zip(contexts, counts, strict=True)]
    generator = torch.Generator().manual_seed(4)
    kv = torch.randn(2, kv_heads, sum(lengths) + 5, head_dim, generator=generator).to(dtype)
    slots = list(torch.randperm(sum(lengths) + 5, generator=generator)[: sum(lengths)].split(lengths))
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0)[:-1].tolist()])
    query = torch.randn(group * kv_heads, sum(counts), head_dim, generator=generator).to(dtype)
    out = torch.zeros((sum(counts), group * kv_heads, head_dim), dtype=dtype)
    table = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
    triton_attention.paged_prefill_attention(
        out, query, kv, starts, torch.tensor(counts), table, torch.tensor(lengths), 0.09, max(counts)
    )
    for start, count, own in zip(starts.tolist(), counts, slots, strict=True):
        want = gathered_attention(query[:, start : start + count], kv, own, 0.09).transpose(0, 1)
        torch.testing.assert_close(out[start : start + count].float(), want, rtol=0, atol=TOLERANCE[dtype])
