"""Attention in bf16 on CPU: where the native bf16 kernel runs it (the vision towers, and the prefill
chunks through `attention.py`), and the vision towers' blocked-matmul fallback elsewhere.

Where the CPU has AVX512-BF16 dot products (and no AMX), batchvl's native kernel runs it
(`native/bf16_attention.cpp`): 260-290 GFLOP/s on sequences of 256-1,024 patches on a 2-core AMD EPYC,
against 100-145 for torch's fused kernel and 110-180 for the blocked matmuls below
(`benchmarks/native_kernels.py`). Elsewhere in bf16, two batched matmuls per block of queries:

torch's fused CPU attention kernel runs its inner products in float32 on CPUs without AMX: in bf16 it
reached about 150 GFLOP/s where bf16 matmuls reach about 400. Two bf16 matmuls around a softmax, over
blocks of queries small enough that the block's scores stay in cache, ran 1.3-1.5x faster on vision
sequences of 256-2048 patches, and the vision tower's embeddings stayed as close to the float32 model's
as with the fused kernel. With AMX it is the other way round: the fused kernel runs on the tiles and was
2.5-4x faster than the blocked matmuls on sequences of 400-1,100 patches (2 threads), so there the
vision tower keeps torch's kernel.

The arithmetic is transformers' own eager attention in bf16: scores from a bf16 matmul, softmax
computed in float32 and rounded to bf16, then a bf16 matmul with the values. float32 never comes here:
it keeps torch's kernel, which is what the reference model runs.
"""

from __future__ import annotations

import torch

from batchvl.layers.cpu_features import has_amx
from batchvl.layers.native_kernels import bf16_attention_takes, native_ops, runs_natively

# Scores held per block of queries: 8 MB in bf16, within the last-level cache.
SCORE_BLOCK_ELEMENTS = 4 * 2**20
MIN_QUERY_BLOCK = 32  # fewer query rows per matmul and the per-call overhead shows


def use_native_attention(query: torch.Tensor) -> bool:
    """Whether `native_attention` takes this query: bf16 on a CPU with bf16 dot products and without AMX,
    a head size the kernel is compiled for."""
    return (
        query.dtype == torch.bfloat16
        and bf16_attention_takes(query.shape[-1])
        and runs_natively(query)
        and native_ops().bf16_dot_products()
        and not has_amx()
    )


def native_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Non-causal attention of the sequences packed in (T, H, D) query/key/value (head dimension
    contiguous, any other strides), sequence s being rows cu_seqlens[s]..cu_seqlens[s + 1]; returns
    (T, H, D)."""
    out = torch.empty(query.shape, dtype=query.dtype)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    native_ops().varlen_attention(out, query, key, value, cu_seqlens.to(torch.long), scale)
    return out


def use_blocked_attention(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype == torch.bfloat16 and not has_amx()


def blocked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Non-causal attention of (B, H, N, D) query/key/value, no mask; returns (B, N, H, D)."""
    batch, heads, length, dim = query.shape
    scaled = query * (dim**-0.5 if scaling is None else scaling)
    keys_t = key.transpose(-1, -2)
    out = query.new_empty((batch, length, heads, dim))
    block = max(MIN_QUERY_BLOCK, SCORE_BLOCK_ELEMENTS // (batch * heads * length))
    for start in range(0, length, block):
        rows = slice(start, start + block)
        weights = torch.softmax(torch.matmul(scaled[:, :, rows], keys_t), dim=-1)
        out[:, rows] = torch.matmul(weights, value).transpose(1, 2)
    return out
