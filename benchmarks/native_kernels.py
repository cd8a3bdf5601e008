"""The native kernels against the torch ops they replace, per call, at the throughput benchmark's shapes
(the `small` model: 8 query and 2 KV heads of 64, hidden 512, intermediate 1,408):

- decode attention of 40 sequences over 100-400 cached keys each, scattered in the paged cache: the
  native kernel (`InPlaceDecodes`) against the gather into padded length groups and torch's attention;
- RMSNorm of 40 rows (a decode step): `NativeRMSNorm` against transformers' `Qwen2RMSNorm`;
- SiLU and product of 40 rows of a fused gate/up output: `silu_and_mul` against `F.silu(gate).mul_(up)`.

    python benchmarks/native_kernels.py [--json benchmarks/results/native_kernels.json] [--dtypes float32]
"""

from __future__ import annotations

import batchvl  # noqa: F401  (its OpenMP and oneDNN defaults apply only if set before torch loads)

# isort: split
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from workloads import markdown_table

from batchvl.layers.attention import (
    KVCache,
    PagedAttentionMetadata,
    SequenceSlice,
    paged_attention,
    split_decodes,
)
from batchvl.layers.cpu_features import has_amx
from batchvl.layers.native_kernels import native_ops
from batchvl.layers.rms_norm import NativeRMSNorm

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, DECODES = 8, 2, 64, 512, 1408, 40


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
            for name, pair, calls in [
                ("decode attention", decode_attention_pair, 200),
                ("RMSNorm", rms_norm_pair, 2000),
                ("SiLU and product", silu_and_mul_pair, 2000),
            ]:
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
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
