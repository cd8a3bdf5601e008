"""Decode attention on CUDA, in Triton, one program per (sequence, KV head) for all the query heads that
share that KV head: each key and value is read from the cache once per KV head, not once per query head (a
6-7x cut in KV traffic for Qwen2-VL-2B's 12/2 heads and 7B's 28/4), and the group's scores are a
(group, dims) x (dims, keys) product on tensor cores for bf16/fp16 caches.

Few long sequences would leave most of a GPU idle with one program each, so a sequence's keys can be split
over several programs (flash-decoding): each split keeps its own running max, sum and weighted values, and a
second kernel merges the splits of every query head. Float32 caches keep exact float32 products
(`input_precision="ieee"`), so their outputs stay the reference model's within summation order.
"""

from __future__ import annotations

import functools

import torch

from batchvl.layers.row_buckets import power_of_two_at_least

BLOCK_KEYS = 64  # keys per block of the online softmax
# The split kernel's warps and software-pipelining stages a program (Triton's defaults). On an H200 it read
# the KV cache at 1.9-2.9 TB/s of the 4.8 at 256 sequences (docs/benchmarks.md): `benchmarks/
# decode_attention.py` times other settings beside these and `BLOCK_KEYS`, all read at each launch.
DECODE_WARPS = 4
DECODE_STAGES = 3
# Products and sums contracted into fused multiply-adds, as Triton compiles them by default up to 3.9: named
# at each launch, since Triton 3.10 turns that default off (the kernels' outputs would move by a rounding)
CONTRACTED = {"enable_fp_fusion": True}
LEAST_DOT_ROWS = 16  # the fewest rows a Triton dot takes: a group of fewer query heads is padded to it
# Split a sequence's keys only while there are fewer programs than this (a few per SM of an H100/H200, 132),
# and never into splits of fewer keys than MIN_SPLIT_KEYS, whose merge would cost more than it saves
BUSY_PROGRAMS = 512
MIN_SPLIT_KEYS = 256
MOST_SPLITS = 16


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Triton 3.2 compiles a kernel with its module's globals only (see triton_attention._kernels)
    globals()["tl"] = tl

    @triton.jit
    def split_kernel(
        out, part_acc, part_best, part_total, query, kv, rows, pages, starts, lengths, scale, page_size,
        stride_ot, stride_oh, stride_qh, stride_qt, stride_kv, stride_kh, stride_ks,
        GROUP: tl.constexpr, GROUP_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        sequence = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(rows + sequence)
        start = tl.load(starts + sequence)
        length = tl.load(lengths + sequence)
        members = tl.arange(0, GROUP_PADDED)
        in_group = members < GROUP
        heads = kv_head * GROUP + members
        dims = tl.arange(0, BLOCK_D)
        in_dims = dims < HEAD_DIM
        q_at = heads[:, None] * stride_qh + row * stride_qt + dims[None, :]
        q = tl.load(query + q_at, mask=in_group[:, None] & in_dims[None, :], other=0.0)
        keys = kv + kv_head * stride_kh
        values = keys + stride_kv
        # splits begin on block boundaries, so a split's blocks are whole but for the sequence's last
        split_keys = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        begin = split * split_keys
        end = tl.minimum(begin + split_keys, length)
        best = tl.full((GROUP_PADDED,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PADDED,), tl.float32)
        acc = tl.zeros((GROUP_PADDED, BLOCK_D), tl.float32)
        for first in range(begin, end, BLOCK_N):
            offsets = first + tl.arange(0, BLOCK_N)
            present = offsets < end
            page = tl.load(pages + start + offsets // page_size, mask=present, other=0).to(tl.int64)
            slot = page * page_size + offsets % page_size
            # keys as (dims, keys): the group's scores are one product on the tensor cores
            k_at = slot[None, :] * stride_ks + dims[:, None]
            k = tl.load(keys + k_at, mask=in_dims[:, None] & present[None, :], other=0.0)
            scores = tl.dot(q, k, input_precision=PRECISION) * scale
            scores = tl.where(present[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            shrink = tl.exp(best - new_best)
            v_at = slot[:, None] * stride_ks + dims[None, :]
            v = tl.load(values + v_at, mask=present[:, None] & in_dims[None, :], other=0.0)
            total = total * shrink + tl.sum(weights, axis=1)
            acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        if SPLITS == 1:
            result = (acc / total[:, None]).to(out.dtype.element_ty)
            out_at = row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(out + out_at, result, mask=in_group[:, None] & in_dims[None, :])
        else:
            # unnormalised, with the split's max and sum: a split past the sequence's end (no keys) merges
            # as weight 0 instead of 0/0
            part = (sequence * GROUP * tl.num_programs(1) + heads) * SPLITS + split
            tl.store(part_best + part, best, mask=in_group)
            tl.store(part_total + part, total, mask=in_group)
            acc_at = part[:, None] * BLOCK_D + dims[None, :]
            tl.store(part_acc + acc_at, acc, mask=in_group[:, None])

    @triton.jit
    def merge_kernel(
        out, part_acc, part_best, part_total, rows, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        sequence = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.load(rows + sequence)
        splits = (sequence * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
        dims = tl.arange(0, BLOCK_D)
        best = tl.load(part_best + splits)
        total = tl.load(part_total + splits)
        acc = tl.load(part_acc + splits[:, None] * BLOCK_D + dims[None, :])
        overall = tl.max(best, axis=0)  # finite: the first split holds the sequence's first key
        weights = tl.exp(best - overall)
        merged = tl.sum(acc * weights[:, None], axis=0) / tl.sum(total * weights, axis=0)
        tl.store(
            out + row * stride_ot + head * stride_oh + dims,
            merged.to(out.dtype.element_ty),
            mask=dims < HEAD_DIM,
        )

    return split_kernel, merge_kernel


def split_count(sequences: int, kv_heads: int, mean_keys: float) -> int:
    """Programs per (sequence, KV head): 1 while the step's sequences fill the GPU, else the power of two
    that comes nearest BUSY_PROGRAMS without splits shorter than MIN_SPLIT_KEYS keys on average."""
    splits = 1
    while (
        splits < MOST_SPLITS
        and sequences * kv_heads * splits < BUSY_PROGRAMS
        and mean_keys / (2 * splits) >= MIN_SPLIT_KEYS
    ):
        splits *= 2
    return splits


def grouped_decode_attention(
    out, query, kv, rows, pages, starts, lengths, scale: float, page_size: int, splits: int | None = None
) -> None:
    """`triton_attention.paged_decode_attention`'s call, one program per (sequence, KV head, split).
    `splits` (a power of two) where given, else `split_count`'s from the mean keys a sequence holds, known
    on the host from its pages (reading the lengths would wait for the device)."""
    split_kernel, merge_kernel = _kernels()
    heads, _, head_dim = query.shape
    kv_heads = kv.shape[1]
    group = heads // kv_heads
    sequences = len(rows)
    if splits is None:
        splits = split_count(sequences, kv_heads, len(pages) * page_size / max(sequences, 1))
    block_d = max(16, power_of_two_at_least(head_dim))
    if splits == 1:
        part_acc = part_best = part_total = out  # unused: the one split writes `out`
    else:
        part_best = torch.empty(sequences * heads * splits, device=out.device, dtype=torch.float32)
        part_total = torch.empty_like(part_best)
        part_acc = torch.empty(sequences * heads * splits, block_d, device=out.device, dtype=torch.float32)
    split_kernel[(sequences, kv_heads, splits)](
        out, part_acc, part_best, part_total, query, kv, rows, pages, starts, lengths, scale, page_size,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1), kv.stride(0), kv.stride(1),
        kv.stride(2),
        GROUP=group, GROUP_PADDED=max(LEAST_DOT_ROWS, power_of_two_at_least(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=BLOCK_KEYS, SPLITS=splits,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, **CONTRACTED,
    )  # fmt: skip
    if splits > 1:
        merge_kernel[(sequences, heads)](
            out, part_acc, part_best, part_total, rows, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits, **CONTRACTED,
        )  # fmt: skip
