"""Paged attention for the language model on CUDA, in Triton: straight from the KV cache, no gather, no
padding and no dense mask.

The same two calls as the native CPU kernels (`native_kernels`), over the same metadata: a step's decodes
(one query each, over the cache pages of their keys listed one sequence after the other) and its prefill
chunks (each chunk's queries at the last positions of its keys, causal, over a (chunks, keys) table of cache
slots). On CUDA the torch path gathered every decode's keys into padded groups and attended each prefill
chunk with a masked SDPA call, in every layer of every step; PyTorch 2.11 images with Triton but no
flash-attn are what GPU machines commonly have.

Scores, softmax and sums are in float32 (an online softmax over blocks of keys), whatever the cache's dtype;
products of float32 inputs are exact float32 (`input_precision="ieee"`), not TF32, so float32 outputs stay
those of the reference model within summation order. A bf16/fp16 cache's products run on tensor cores in
its own dtype with float32 sums. Decodes of grouped KV heads go to `triton_grouped_decode` (each KV head
read once for its group); the per-head decode kernel here is for models whose every query head has its own.
Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU tensors: that is how they are tested
on machines without a GPU.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from batchvl.layers.row_buckets import power_of_two_at_least
from batchvl.layers.triton_grouped_decode import CONTRACTED, grouped_decode_attention

logger = logging.getLogger(__name__)

BLOCK_KEYS = 64  # keys per block of the online softmax
BLOCK_QUERIES = 16  # a float32 prefill program's queries (the least a Triton dot takes)
# a bf16/fp16 prefill program's queries: tiles of 64 queries x 64 keys on tensor cores, each key block
# read once for 4x the queries
BLOCK_QUERIES_16BIT = 64


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Compiling, Triton 3.2 (torch 2.6's) looks a kernel's names up in its module's globals only, not in
    # this function: there `tl` was undefined, the kernels failed to build and a GPU stayed on torch's path.
    globals()["tl"] = tl

    @triton.jit
    def decode_kernel(
        out, query, kv, rows, pages, starts, lengths, scale, page_size,
        stride_ot, stride_oh, stride_qh, stride_qt, stride_kv, stride_kh, stride_ks,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        sequence = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        row = tl.load(rows + sequence)
        start = tl.load(starts + sequence)
        length = tl.load(lengths + sequence)
        dims = tl.arange(0, BLOCK_D)
        in_dims = dims < HEAD_DIM
        q = tl.load(query + head * stride_qh + row * stride_qt + dims, mask=in_dims, other=0.0).to(tl.float32)
        keys = kv + kv_head * stride_kh
        values = keys + stride_kv
        # one-element vectors, not Python floats: a loop-carried value keeps one type in compiled Triton
        best = tl.full((1,), float("-inf"), tl.float32)
        total = tl.zeros((1,), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for first in range(0, length, BLOCK_N):
            offsets = first + tl.arange(0, BLOCK_N)
            present = offsets < length
            page = tl.load(pages + start + offsets // page_size, mask=present, other=0).to(tl.int64)
            slot = page * page_size + offsets % page_size
            where = slot[:, None] * stride_ks + dims[None, :]
            both = present[:, None] & in_dims[None, :]
            k = tl.load(keys + where, mask=both, other=0.0).to(tl.float32)
            scores = tl.where(present, tl.sum(q[None, :] * k, axis=1) * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            weights = tl.exp(scores - new_best)
            shrink = tl.exp(best - new_best)
            v = tl.load(values + where, mask=both, other=0.0).to(tl.float32)
            total = total * shrink + tl.sum(weights, axis=0)
            acc = acc * shrink + tl.sum(weights[:, None] * v, axis=0)
            best = new_best
        result = (acc / total).to(out.dtype.element_ty)
        tl.store(out + row * stride_ot + head * stride_oh + dims, result, mask=in_dims)

    @triton.jit
    def prefill_kernel(
        out, query, kv, starts, counts, slots, lengths, scale,
        stride_ot, stride_oh, stride_qh, stride_qt, stride_kv, stride_kh, stride_ks, stride_sb,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        chunk = tl.program_id(0)
        head = tl.program_id(1)
        block = tl.program_id(2)
        kv_head = head // GROUP
        count = tl.load(counts + chunk)
        if block * BLOCK_M < count:
            first_row = tl.load(starts + chunk)
            length = tl.load(lengths + chunk)
            context = length - count  # keys before the chunk's first query
            picks = block * BLOCK_M + tl.arange(0, BLOCK_M)
            in_chunk = picks < count
            dims = tl.arange(0, BLOCK_D)
            in_dims = dims < HEAD_DIM
            q_at = head * stride_qh + (first_row + picks)[:, None] * stride_qt + dims[None, :]
            # q, k and v stay in the cache's dtype: bf16/fp16 products on tensor cores, float32 sums
            q = tl.load(query + q_at, mask=in_chunk[:, None] & in_dims[None, :], other=0.0)
            positions = context + picks  # each query sees the keys at or before its position
            keys = kv + kv_head * stride_kh
            values = keys + stride_kv
            best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            total = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            last = tl.minimum(length, context + (block + 1) * BLOCK_M)
            for first in range(0, last, BLOCK_N):
                offsets = first + tl.arange(0, BLOCK_N)
                present = offsets < length
                slot = tl.load(slots + chunk * stride_sb + offsets, mask=present, other=0).to(tl.int64)
                where = slot[:, None] * stride_ks + dims[None, :]
                both = present[:, None] & in_dims[None, :]
                k = tl.load(keys + where, mask=both, other=0.0)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                seen = present[None, :] & (offsets[None, :] <= positions[:, None])
                scores = tl.where(seen, scores, float("-inf"))
                new_best = tl.maximum(best, tl.max(scores, axis=1))
                weights = tl.exp(scores - new_best[:, None])
                shrink = tl.exp(best - new_best)
                v = tl.load(values + where, mask=both, other=0.0)
                total = total * shrink + tl.sum(weights, axis=1)
                acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
                best = new_best
            result = (acc / total[:, None]).to(out.dtype.element_ty)
            out_at = (first_row + picks)[:, None] * stride_ot + head * stride_oh + dims[None, :]
            tl.store(out + out_at, result, mask=in_chunk[:, None] & in_dims[None, :])

    return decode_kernel, prefill_kernel


def takes(tensor: torch.Tensor) -> bool:
    """Whether these kernels run for a cache layer: on CUDA where Triton imports and the kernels pass a
    small check on that device (or on any device under Triton's interpreter, as the tests run them)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return tensor.is_cuda and _works_on(tensor.device, tensor.dtype)


@functools.cache
def _works_on(device: torch.device, dtype: torch.dtype) -> bool:
    """One decode and one prefill chunk through the kernels, against torch's attention: a Triton that
    cannot build them for this GPU, or builds them wrong, leaves the engine on torch's path (said once)
    instead of failing every step."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        kv = torch.randn(2, 1, 8, 16, device=device, generator=generator).to(dtype)
        query = torch.randn(2, 3, 16, device=device, generator=generator).to(dtype)
        out = torch.zeros(3, 2, 16, device=device, dtype=dtype)
        slots = torch.tensor([[4, 5, 2]], device=device)

        def ints(*values):
            return torch.tensor(values, device=device)

        chunk = (ints(0), ints(2), slots, ints(3))  # first row, queries, key slots, keys
        paged_prefill_attention(out, query, kv, *chunk, 0.25, 2)
        pages = ints(2, 1)  # pages of two slots: the same slots
        paged_decode_attention(out, query, kv, ints(2), pages, ints(0), ints(3), 0.25, 2)
        # rows 0 and 1: the chunk's queries, at positions 1 and 2 after one key of context; row 2: the decode
        keys, values = (kv[i][:, slots[0]].float() for i in (0, 1))
        seen = torch.arange(3, device=device)[None, :] <= torch.tensor([1, 2, 2], device=device)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query.float(), keys, values, attn_mask=seen, scale=0.25, enable_gqa=True
        ).transpose(0, 1)
        actual = out.float()
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        if not torch.allclose(actual, expected, atol=tolerance, rtol=0):
            raise RuntimeError("the kernels' check differs from torch's attention")
    except Exception as exc:  # a Triton or driver that cannot run them: torch's path still works
        logger.warning(
            "the language model's attention runs on torch's path: Triton's kernels failed (%s)", exc
        )
        return False
    return True


def _block_dims(head_dim: int) -> int:
    return max(16, power_of_two_at_least(head_dim))


def decode_kernel_name(heads: int, kv_heads: int) -> str:
    """The decode kernel a model's heads get: "grouped" (each KV head read once for its query heads) where
    query heads share KV heads, else "per_head" (a group of one would pad the grouped kernel's product
    16-fold for no saved read)."""
    return "grouped" if heads > kv_heads else "per_head"


def paged_decode_attention(
    out, query, kv, rows, pages, starts, lengths, scale: float, page_size: int, splits: int | None = None
) -> None:
    """`out` (T, H, D) at each decode's row: its query's attention over its cached keys. `query` (H, T, D)
    with contiguous heads; `kv` one cache layer (2, Hkv, slots, D); `rows`, `starts`, `lengths` (B,) and
    `pages` the sequences' cache pages of `page_size` slots one after the other (see
    `attention.InPlaceDecodes`); `splits`: the grouped kernel's, where the caller fixes them."""
    heads = query.shape[0]
    if decode_kernel_name(heads, kv.shape[1]) == "grouped":
        grouped_decode_attention(out, query, kv, rows, pages, starts, lengths, scale, page_size, splits)
    else:
        per_head_decode_attention(out, query, kv, rows, pages, starts, lengths, scale, page_size)


def per_head_decode_attention(
    out, query, kv, rows, pages, starts, lengths, scale: float, page_size: int
) -> None:
    """`paged_decode_attention`'s call, one program per (sequence, query head)."""
    decode_kernel, _ = _kernels()
    heads, _, head_dim = query.shape
    decode_kernel[(len(rows), heads)](
        out, query, kv, rows, pages, starts, lengths, scale, page_size,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1), kv.stride(0), kv.stride(1),
        kv.stride(2),
        GROUP=heads // kv.shape[1], HEAD_DIM=head_dim, BLOCK_D=_block_dims(head_dim), BLOCK_N=BLOCK_KEYS,
        **CONTRACTED,
    )  # fmt: skip


def paged_prefill_attention(
    out, query, kv, starts, counts, slots, lengths, scale: float, most_queries: int
) -> None:
    """`out` (T, H, D) at each chunk's rows: its queries' causal attention over the chunk's keys and its
    context's. `starts` (B,) the chunks' first rows, `counts` (B,) their queries, `slots` (B, L) the cache
    slots of their keys in order, `lengths` (B,) how many (see `attention.InPlacePrefills`);
    `most_queries`, the largest count, from the host (reading it from the device would wait for it)."""
    _, prefill_kernel = _kernels()
    heads, _, head_dim = query.shape
    block_m = BLOCK_QUERIES if query.dtype == torch.float32 else BLOCK_QUERIES_16BIT
    grid = (len(starts), heads, -(-most_queries // block_m))
    prefill_kernel[grid](
        out, query, kv, starts, counts, slots, lengths, scale,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1), kv.stride(0), kv.stride(1),
        kv.stride(2), slots.stride(0),
        GROUP=heads // kv.shape[1], HEAD_DIM=head_dim, BLOCK_D=_block_dims(head_dim), BLOCK_M=block_m,
        BLOCK_N=BLOCK_KEYS, PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **CONTRACTED,
    )  # fmt: skip
