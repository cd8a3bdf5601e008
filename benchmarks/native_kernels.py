"""The native kernels against the torch ops they replace, per call, at the throughput benchmark's shapes
(the `small` model: 8 query and 2 KV heads of 64, hidden 512, intermediate 1,408):

- decode attention of 40 sequences over 100-400 cached keys each, scattered in the paged cache: the
  native kernel (`InPlaceDecodes`) against the gather into padded length groups and torch's attention;
- RMSNorm of 40 rows (a decode step): `NativeRMSNorm` against transformers' `Qwen2RMSNorm`;
- SiLU and product of 40 rows of a fused gate/up output: `silu_and_mul` against `F.silu(gate).mul_(up)`;
- in bf16 where the CPU has AVX512-BF16 dot products: the vision tower's attention over six images of 16
  to 960 patches (8 heads of 64) in one call, against torch's fused kernel and the blocked bf16 matmuls
  per image; and a step's prefill attention (eight chunks of 6-120 queries, half after a cached context)
  straight from the paged cache, against the gather and torch's attention per chunk.

    python benchmarks/native_kernels.py [--json benchmarks/results/native_kernels.json] [--dtypes float32]
"""

from __future__ import annotations

import batchvl  # noqa: F401  (its OpenMP and oneDNN defaults apply only if set before torch loads)

# isort: split
import argparse
import itertools
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from workloads import markdown_table, write_json

from batchvl.layers.attention import (
    KVCache,
    PagedAttentionMetadata,
    SequenceSlice,
    paged_attention,
    split_decodes,
)
from batchvl.layers.cpu_attention import blocked_attention, native_attention, use_native_attention
from batchvl.layers.cpu_features import has_amx
from batchvl.layers.native_kernels import native_ops
from batchvl.layers.rms_norm import NativeRMSNorm

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, DECODES = 8, 2, 64, 512, 1408, 40
IMAGE_PATCHES = [960, 576, 400, 256, 64, 16]
PREFILLS = [(0, 120), (100, 20), (0, 90), (90, 16), (0, 60), (60, 12), (0, 30), (30, 6)]  # (cached, chunk)


def per_call_ms(fn, calls: int) -> float:
    """The best of five rounds of `calls` calls, per call."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def decode_attention_pair(dtype) -> tuple:
    generator = torch.Generator().manual_seed(0)
    slots = 20_000
    cache = KVCache.allocate(1, slots, KV_HEADS, HEAD_DIM, dtype, "cpu")
    cache.write(
        0, torch.arange(slots), *torch.randn(2, KV_HEADS, slots, HEAD_DIM, generator=generator).to(dtype)
    )
    lengths = torch.randint(100, 400, (DECODES,), generator=generator).tolist()
    order = torch.randperm(slots, generator=generator)
    starts = [sum(lengths[:i]) for i in range(DECODES)]
    sequences = [
        SequenceSlice(i, 1, order[start : start + length].sort().values, None)
        for i, (start, length) in enumerate(zip(starts, lengths, strict=True))
    ]
    query = torch.randn(1, HEADS, DECODES, HEAD_DIM, generator=generator).to(dtype)
    key = torch.randn(1, KV_HEADS, DECODES, HEAD_DIM, generator=generator).to(dtype)
    module = torch.nn.Module()
    module.layer_idx = 0
    step_slots = torch.arange(DECODES)
    native = PagedAttentionMetadata.build(cache, step_slots, sequences, "cpu")
    assert native.in_place_decodes is not None
    gathered = PagedAttentionMetadata(cache, step_slots, *split_decodes(sequences, cache, "cpu"))
    return (
        lambda: paged_attention(module, query, key, key, None, batchvl_attention=native),
        lambda: paged_attention(module, query, key, key, None, batchvl_attention=gathered),
        f"{DECODES} decodes, {sum(lengths):,} cached keys",
    )


def rms_norm_pair(dtype) -> tuple:
    stock = Qwen2RMSNorm(HIDDEN).to(dtype)
    native = NativeRMSNorm(stock)
    x = torch.randn(DECODES, HIDDEN).to(dtype)
    return lambda: native(x), lambda: stock(x), f"{DECODES} x {HIDDEN}"


def silu_and_mul_pair(dtype) -> tuple:
    gate_up = torch.randn(DECODES, 2 * INTERMEDIATE).to(dtype)
    out = torch.empty(DECODES, INTERMEDIATE, dtype=dtype)
    gate, up = gate_up.split(INTERMEDIATE, dim=-1)
    return (
        lambda: native_ops().silu_and_mul(out, gate_up),
        lambda: F.silu(gate).mul_(up),
        f"{DECODES} x 2 x {INTERMEDIATE:,}",
    )


def vision_images(dtype):
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(IMAGE_PATCHES), 3, HEADS, HEAD_DIM, generator=generator).to(dtype)
    cu_seqlens = torch.tensor([0, *torch.tensor(IMAGE_PATCHES).cumsum(0).tolist()])
    return qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens


def vision_pair(per_image, label: str):
    """The native kernel on all images in one call, against `per_image` on each image's (1, H, N, D)."""

    def pair(dtype) -> tuple:
        q, k, v, cu_seqlens = vision_images(dtype)
        images = [
            [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            for a, b in itertools.pairwise(cu_seqlens.tolist())
        ]
        return (
            lambda: native_attention(q, k, v, cu_seqlens, None),
            lambda: [per_image(*image) for image in images],
            f"{len(IMAGE_PATCHES)} images, {sum(IMAGE_PATCHES):,} patches; {label}",
        )

    return pair


def prefill_attention_pair(dtype) -> tuple:
    generator = torch.Generator().manual_seed(0)
    slots = 4000
    caches = []
    for in_place in (True, False):
        cache = KVCache.allocate(1, slots, KV_HEADS, HEAD_DIM, dtype, "cpu")
        cache.write(0, torch.arange(slots), *torch.randn(2, KV_HEADS, slots, HEAD_DIM).to(dtype))
        cache.prefills_in_place = in_place
        caches.append(cache)
    order = torch.randperm(slots - 1, generator=generator) + 1
    lengths = [cached + chunk for cached, chunk in PREFILLS]
    key_slots = [
        order[first : first + n]
        for first, n in zip(itertools.accumulate([0, *lengths]), lengths, strict=False)
    ]
    rows = list(itertools.accumulate([0, *(chunk for _, chunk in PREFILLS)]))
    sequences = [
        SequenceSlice(first, chunk, keys)
        for first, (_, chunk), keys in zip(rows, PREFILLS, key_slots, strict=False)
    ]
    step_slots = torch.cat([keys[cached:] for (cached, _), keys in zip(PREFILLS, key_slots, strict=True)])
    row, used = rows[-1], sum(lengths)
    query = torch.randn(1, HEADS, row, HEAD_DIM, generator=generator).to(dtype)
    key = torch.randn(1, KV_HEADS, row, HEAD_DIM, generator=generator).to(dtype)
    module = torch.nn.Module()
    module.layer_idx = 0
    native, gathered = (PagedAttentionMetadata.build(cache, step_slots, sequences, "cpu") for cache in caches)
    assert native.in_place_prefills is not None and gathered.in_place_prefills is None
    return (
        lambda: paged_attention(module, query, key, key, None, batchvl_attention=native),
        lambda: paged_attention(module, query, key, key, None, batchvl_attention=gathered),
        f"{len(PREFILLS)} chunks, {row} queries, {used:,} keys",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if native_ops() is None:
        raise SystemExit("the native kernels did not build here (a C++ compiler is needed)")
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            pairs = [
                ("decode attention", decode_attention_pair, 200),
                ("RMSNorm", rms_norm_pair, 2000),
                ("SiLU and product", silu_and_mul_pair, 2000),
            ]
            if use_native_attention(torch.zeros(1, HEAD_DIM, dtype=dtype)):
                pairs += [
                    (
                        "vision attention",
                        vision_pair(F.scaled_dot_product_attention, "torch's fused kernel"),
                        20,
                    ),
                    (
                        "vision attention",
                        vision_pair(lambda *qkv: blocked_attention(*qkv, None), "blocked matmuls"),
                        20,
                    ),
                    ("prefill attention", prefill_attention_pair, 200),
                ]
            for name, pair, calls in pairs:
                native, torch_ops, shape = pair(dtype)
                native_ms, torch_ms = per_call_ms(native, calls), per_call_ms(torch_ops, calls)
                rows.append(
                    {
                        "op": name,
                        "dtype": dtype_name,
                        "shape": shape,
                        "native ms": round(native_ms, 4),
                        "torch ops ms": round(torch_ms, 4),
                        "speed-up": f"x{torch_ms / native_ms:.2f}",
                    }
                )
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"{torch.get_num_threads()} threads, CPU capability {capability}, AMX {has_amx()}\n")
    print(markdown_table(rows))
    if args.json:
        report = {
            "threads": torch.get_num_threads(),
            "cpu_capability": capability,
            "cpu_amx": has_amx(),
            "rows": rows,
        }
        write_json(args.json, report)


if __name__ == "__main__":
    main()
