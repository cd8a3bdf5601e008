"""The elementwise Triton kernels (`batchvl/layers/triton_elementwise.py`) against the eager transformers
ops they would replace, per call on a CUDA device, at Qwen2-VL-2B's widths: the decoder (hidden 1,536,
intermediate 8,960, 12 query and 2 KV heads of 128) and the vision tower (embed 1,280, MLP 5,120, 16
heads of 80), at 1, 256 and 4,096 rows, and at 32,768, a 2B vision call's patches. Each op's outputs are
compared too (the largest difference and the share of equal elements), since a kernel only goes into the
engine where it pays and keeps parity. `fused_gb_per_s` is the bytes the timed fused call reads and writes
(each tensor once; the in-place rotations' copy of their input included) over its time: set against the
device's bandwidth, it says how far a kernel is from the most it could do at that size. At the largest
row count the norms and the purely elementwise kernels are timed again under other launch settings
(`SWEEP`: columns, rows and warps a program, `triton_elementwise`'s settings, read at each launch), each
row with its `launch` and its speed against the default's: the settings that pay can then become the
defaults.

    python benchmarks/fused_elementwise.py [--json out.json] [--rows 1,256,4096,32768] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import torch
from cuda_timing import per_call_us, require_cuda, write_report
from transformers.activations import ACT2FN, QuickGELUActivation
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb, apply_rotary_pos_emb_vision

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 1536, 8960, 12, 2, 128
VISION_EMBED, VISION_MLP, VISION_HEADS, VISION_HEAD_DIM = 1280, 5120, 16, 80
# launch settings timed beside the defaults at the largest row count, by op
ELEMENTWISE_LAUNCHES = (
    {"BLOCK_COLUMNS": 2048, "ELEMENTWISE_WARPS": 4},
    {"BLOCK_COLUMNS": 2048, "ELEMENTWISE_WARPS": 8},
    {"BLOCK_COLUMNS": 4096, "ELEMENTWISE_WARPS": 8},
    {"BLOCK_COLUMNS": 4096, "ELEMENTWISE_WARPS": 16},
)
NORM_LAUNCHES = (
    {"NORM_WARPS": 1},
    {"NORM_WARPS": 2},
    {"NORM_WARPS": 8},
    {"NORM_WARPS": 16},
    {"NORM_ROWS": 2},
    {"NORM_ROWS": 4},
    {"NORM_ROWS": 4, "NORM_WARPS": 8},
    {"NORM_ROWS": 8, "NORM_WARPS": 8},
)
SWEEP = {
    "silu_and_mul": ELEMENTWISE_LAUNCHES,
    "quick_gelu_bias": ELEMENTWISE_LAUNCHES,
    "rms_norm_residual": NORM_LAUNCHES,
    "layer_norm": NORM_LAUNCHES,
    "layer_norm_residual": NORM_LAUNCHES,
}


def cases(rows: int, dtype: torch.dtype, device: str = "cuda"):
    """(name, eager, fused, bytes the timed fused call moves): the two each a function of no arguments
    returning its outputs, on `device`."""
    from batchvl.layers import triton_elementwise as fused

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    norm = Qwen2RMSNorm(HIDDEN).to(device, dtype)
    norm.weight.data = randn(HIDDEN)
    hidden, residual = randn(rows, HIDDEN), randn(rows, HIDDEN)

    def eager_norm():
        summed = residual + hidden
        return norm(summed), summed

    gate_up = randn(rows, 2 * INTERMEDIATE, scale=4)
    silu = ACT2FN["silu"]

    def eager_silu():
        gate, up = gate_up.split(INTERMEDIATE, dim=-1)
        return silu(gate) * up

    qkv = randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM)
    angles = torch.rand(rows, HEAD_DIM // 2, device=device) * 1000
    cos, sin = (torch.cat([f, f], dim=-1).to(dtype) for f in (angles.cos(), angles.sin()))
    rotated = qkv.clone()

    def eager_rotary():
        query, key = (t.transpose(0, 1)[None] for t in qkv[:, : HEADS + KV_HEADS].split([HEADS, KV_HEADS], 1))
        return apply_rotary_pos_emb(query, key, cos[None], sin[None])

    def fused_rotary():  # in place: the timed calls rotate a copy again and again, as a layer would once
        rotated.copy_(qkv)
        fused.rotary_(rotated[:, : HEADS + KV_HEADS], cos, sin)
        return rotated[:, :HEADS].transpose(0, 1)[None], rotated[:, HEADS : HEADS + KV_HEADS].transpose(0, 1)[
            None
        ]

    # the rotation writing the keys and values into a cache layer too, against the rotation's kernel then
    # the cache's two copies (`KVCache.write`), as the engine ran them before: the step's rows at scattered
    # slots of a cache four times their size
    cache_layer = torch.zeros(2, KV_HEADS, 4 * rows, HEAD_DIM, device=device, dtype=dtype)
    slots = torch.randperm(4 * rows, device=device)[:rows]
    copied_cache, written_cache = cache_layer.clone(), cache_layer.clone()
    rotated_too = qkv.clone()
    qk_heads = HEADS + KV_HEADS

    def rotary_then_cache_copies():
        rotated.copy_(qkv)
        fused.rotary_(rotated[:, :qk_heads], cos, sin)
        copied_cache[0].index_copy_(1, slots, rotated[:, HEADS:qk_heads].transpose(0, 1))
        copied_cache[1].index_copy_(1, slots, rotated[:, qk_heads:].transpose(0, 1))
        return rotated[:, :qk_heads], copied_cache

    def rotary_into_cache():
        rotated_too.copy_(qkv)
        queries_and_keys, values = rotated_too[:, :qk_heads], rotated_too[:, qk_heads:]
        fused.rotary_into_cache_(queries_and_keys, values, cos, sin, written_cache, slots)
        return rotated_too[:, :qk_heads], written_cache

    patches = randn(rows, 3 * VISION_HEADS, VISION_HEAD_DIM)
    vision_angles = torch.rand(rows, VISION_HEAD_DIM // 2, device=device) * 100
    vision_cos, vision_sin = (torch.cat([f, f], dim=-1) for f in (vision_angles.cos(), vision_angles.sin()))
    vision_rotated = patches.clone()

    def eager_vision_rotary():
        query, key = patches[:, :VISION_HEADS], patches[:, VISION_HEADS : 2 * VISION_HEADS]
        return apply_rotary_pos_emb_vision(query, key, vision_cos, vision_sin)

    def fused_vision_rotary():
        vision_rotated.copy_(patches)
        fused.rotary_(vision_rotated[:, : 2 * VISION_HEADS], vision_cos, vision_sin, vision=True)
        return vision_rotated[:, :VISION_HEADS], vision_rotated[:, VISION_HEADS : 2 * VISION_HEADS]

    fc1_out, fc1_bias = randn(rows, VISION_MLP, scale=4), randn(VISION_MLP)
    quick_gelu = QuickGELUActivation()
    layer_norm = torch.nn.LayerNorm(VISION_EMBED, eps=1e-6).to(device, dtype)
    layer_norm.weight.data, layer_norm.bias.data = randn(VISION_EMBED), randn(VISION_EMBED)
    patch_rows, attended = randn(rows, VISION_EMBED, scale=3), randn(rows, VISION_EMBED)

    def eager_layer_norm_residual():
        summed = patch_rows + attended
        return layer_norm(summed), summed

    norm_parameters = (layer_norm.weight, layer_norm.bias, layer_norm.eps)
    size = torch.finfo(dtype).bits // 8
    rotary_bytes = (2 * qkv.numel() + 2 * rows * qk_heads * HEAD_DIM + 2 * rows * HEAD_DIM) * size

    return [
        (
            "rms_norm_residual",
            eager_norm,
            lambda: fused.rms_norm(hidden, norm.weight, norm.variance_epsilon, residual),
            4 * rows * HIDDEN * size,
        ),
        ("silu_and_mul", eager_silu, lambda: fused.silu_and_mul(gate_up), 3 * rows * INTERMEDIATE * size),
        ("rotary_q_k", eager_rotary, fused_rotary, rotary_bytes),
        # (its "eager" the engine's two launches before: the rotation's kernel, then the cache's copies)
        (
            "rotary_q_k_into_cache",
            rotary_then_cache_copies,
            rotary_into_cache,
            rotary_bytes + 3 * rows * KV_HEADS * HEAD_DIM * size,
        ),
        (
            "vision_rotary_q_k",
            eager_vision_rotary,
            fused_vision_rotary,
            2 * patches.numel() * size
            + rows * (4 * VISION_HEADS * VISION_HEAD_DIM * size + 2 * VISION_HEAD_DIM * 4),
        ),
        (
            "quick_gelu_bias",
            lambda: quick_gelu(fc1_out + fc1_bias),
            lambda: fused.quick_gelu(fc1_out, fc1_bias),
            2 * rows * VISION_MLP * size,
        ),
        (
            "layer_norm",
            lambda: layer_norm(patch_rows),
            lambda: fused.layer_norm(patch_rows, *norm_parameters)[0],
            2 * rows * VISION_EMBED * size,
        ),
        (
            "layer_norm_residual",
            eager_layer_norm_residual,
            lambda: fused.layer_norm(attended, *norm_parameters, patch_rows),
            4 * rows * VISION_EMBED * size,
        ),
    ]


def compared(eager, fused) -> dict:
    """The largest absolute difference between the outputs and the share of equal elements."""
    pairs = list(zip(*(out if isinstance(out, tuple) else (out,) for out in (eager(), fused())), strict=True))
    differences = [(a.float() - b.float()).abs() for a, b in pairs]
    equal = sum(int((d == 0).sum()) for d in differences) / sum(d.numel() for d in differences)
    return {"max_abs_diff": max(float(d.max()) for d in differences), "equal_share": round(equal, 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,256,4096,32768")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    require_cuda("fused_elementwise.py")

    torch.set_grad_enabled(False)  # as the engine runs the model: no autograd records on the eager ops
    dtype = getattr(torch, args.dtype)
    results = []
    row_counts = [int(r) for r in args.rows.split(",")]
    for rows in row_counts:
        for name, eager, fused, moved in cases(rows, dtype):
            parity = compared(eager, fused)
            eager_us, fused_us = per_call_us(eager, warmup=5), per_call_us(fused, warmup=5)
            speedup = round(eager_us / fused_us, 2)
            gb_per_s = round(moved / fused_us / 1e3, 1)
            results.append(
                {"op": name, "rows": rows, "eager_us": round(eager_us, 1), "fused_us": round(fused_us, 1)}
                | {"speedup": speedup, "fused_gb_per_s": gb_per_s, **parity}
            )
            print(
                f"{name:19} {rows:5} rows  eager {eager_us:8.1f} us  fused {fused_us:8.1f} us  x{speedup}"
                f"  {gb_per_s:7.1f} GB/s"
            )
            if rows == max(row_counts):
                results += launch_sweep(name, eager, fused, moved, rows, fused_us)
    write_report(args.json, args.dtype, results)


def launch_sweep(name: str, eager, fused, moved: int, rows: int, default_us: float) -> list[dict]:
    """The fused op timed under each of its `SWEEP` launch settings (set on the kernels' module and put
    back): its time, bytes a second and outputs against eager, and its speed against the defaults'."""
    from batchvl.layers import triton_elementwise

    swept = []
    for launch in SWEEP.get(name, ()):
        with mock.patch.multiple(triton_elementwise, **launch):
            parity = compared(eager, fused)
            fused_us = per_call_us(fused, warmup=5)
        gb_per_s = round(moved / fused_us / 1e3, 1)
        speedup = round(default_us / fused_us, 2)
        swept.append(
            {"op": name, "rows": rows, "launch": launch, "fused_us": round(fused_us, 1)}
            | {"speedup_over_default_launch": speedup, "fused_gb_per_s": gb_per_s, **parity}
        )
        print(f"  {name:19} {rows:5} rows  {launch}  fused {fused_us:8.1f} us  x{speedup}  {gb_per_s} GB/s")
    return swept


if __name__ == "__main__":
    main()
