"""The elementwise passes of a decoder layer and a vision block on CUDA, each one Triton kernel: RMSNorm
and LayerNorm, each with the residual add before it, SiLU(gate) * up, rotary embedding of queries and
keys, and QuickGELU with its bias.

Eager, transformers' RMSNorm is seven or eight kernels, rotary five to seven per tensor, QuickGELU three:
each reads and writes the whole activation again. These kernels read their inputs once and write their
outputs once. Each rounds where transformers' module rounds in the input's dtype (an intermediate
rounded to bf16 is rounded here too), so bf16 outputs are the module's but for the order of a row's sums
and the last bit of exp and rsqrt; float32 ones differ by about one float32 rounding step.

The engine runs them on CUDA with `engine.fused_kernels` (`fused_kernels` swaps them in). They are tested
on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1, tests/layers/triton_elementwise_checks.py),
by the same checks compiled on a GPU (where a bf16 rounding is a cast, not bit arithmetic), and timed
against the eager ops by benchmarks/fused_elementwise.py on a GPU, which decides whether they pay.

They are compiled without contracting a product and a sum into one fused multiply-add
(`enable_fp_fusion=False`): eager, the product and the sum are two kernels, each rounded.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from batchvl.layers.row_buckets import power_of_two_at_least

# How the kernels are launched (Triton's defaults: four warps a program). On an H200 the LayerNorm and
# QuickGELU kernels moved some 2.4-2.5 TB/s at a vision call's 32,768 rows, where torch's own elementwise
# kernels moved 4.4 (docs/benchmarks.md): `benchmarks/fused_elementwise.py` times other settings beside
# these, read at each launch, so that the ones that pay can take their place.
BLOCK_COLUMNS = 1024  # columns per program of the purely elementwise kernels
ELEMENTWISE_WARPS = 4  # their warps per program
NORM_WARPS = 4  # warps a program of the norms
# rows a program of the norms, each normalized on its own: a row of a vision call's 1,280 columns is 2.5 KB
# for a program to read, and more rows a program may hide more of its reductions' latency (timed beside one)
NORM_ROWS = 1
EAGER_ROUNDING = {"enable_fp_fusion": False}  # a launch's compile option (ignored by the interpreter)


def casts_round() -> bool:
    """Whether the kernels' casts to bf16 round to nearest: compiled for a GPU they do, Triton's
    interpreter (TRITON_INTERPRET=1, read as Triton reads it when a kernel is defined) truncates."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    CASTS_ROUND = tl.constexpr(casts_round())

    @triton.jit
    def rounded(x, dtype: tl.constexpr):
        """float32 x rounded to `dtype` (to nearest, ties to even) and held in float32. On a GPU by a
        cast, one conversion instruction; under Triton's interpreter, which truncates a cast to bf16,
        bf16 by its bits (five integer operations: QuickGELU rounds four times an element, and its
        kernel is bound by its arithmetic more than by its bytes)."""
        if dtype == tl.bfloat16 and not CASTS_ROUND:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    # Triton 3.2 compiles a kernel with only its module's globals in scope (see triton_attention): the
    # kernels find `tl`, `rounded` and `CASTS_ROUND` there.
    globals().update(tl=tl, rounded=rounded, CASTS_ROUND=CASTS_ROUND)

    @triton.jit
    def rms_norm_kernel(
        out, new_residual, x, residual, weight, eps, rows, width,
        stride_o, stride_n, stride_x, stride_r,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        # ROWS rows a program, each normalized on its own (`NORM_ROWS`)
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        inside = (row < rows) & (cols < width)
        h = tl.load(x + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            # the decoder's `residual + hidden_states`, rounded to their dtype before the norm reads it
            r = tl.load(residual + row * stride_r + cols, mask=inside, other=0.0)
            h = rounded(h.to(tl.float32) + r.to(tl.float32), x.dtype.element_ty)
            tl.store(new_residual + row * stride_n + cols, h.to(x.dtype.element_ty), mask=inside)
        h = h.to(tl.float32)
        variance = tl.sum(h * h, axis=1)[:, None] / width
        # transformers rounds the normalized row to the input's dtype, then multiplies by the weight
        normed = rounded(h * tl.rsqrt(variance + eps), x.dtype.element_ty)
        w = tl.load(weight + cols, mask=cols < width, other=0.0).to(tl.float32)
        product = rounded(w * normed, out.dtype.element_ty)
        tl.store(out + row * stride_o + cols, product.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def silu_and_mul_kernel(out, gate_up, width, stride_o, stride_g, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        gate = tl.load(gate_up + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * stride_g + width + cols, mask=inside, other=0.0).to(tl.float32)
        # torch's SiLU, x / (1 + exp(-x)) in float32, rounded before the product as `act_fn(gate) * up`
        dtype = out.dtype.element_ty
        activated = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
        tl.store(out + row * stride_o + cols, rounded(activated * up, dtype).to(dtype), mask=inside)

    @triton.jit
    def quick_gelu_kernel(
        out, x, bias, width, stride_o, stride_x, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        dtype = out.dtype.element_ty
        h = tl.load(x + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h = rounded(h + tl.load(bias + cols, mask=inside, other=0.0).to(tl.float32), dtype)
        # `h * sigmoid(1.702 * h)`: three eager ops, each rounded to the dtype
        scaled = rounded(h * 1.702, dtype)
        gate = rounded(1.0 / (1.0 + tl.exp(-scaled)), dtype)
        tl.store(out + row * stride_o + cols, rounded(h * gate, dtype).to(dtype), mask=inside)

    @triton.jit
    def layer_norm_kernel(
        out, new_residual, x, residual, weight, bias, eps, rows, width,
        stride_o, stride_n, stride_x, stride_r,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        in_row = cols < width
        inside = (row < rows) & in_row
        h = tl.load(x + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # a vision block's `hidden_states + attn(...)`, rounded to their dtype before the norm reads it
            r = tl.load(residual + row * stride_r + cols, mask=inside, other=0.0)
            h = rounded(h + r.to(tl.float32), x.dtype.element_ty)
            tl.store(new_residual + row * stride_n + cols, h.to(x.dtype.element_ty), mask=inside)
        mean = tl.sum(h, axis=1)[:, None] / width
        centered = tl.where(in_row, h - mean, 0.0)
        variance = tl.sum(centered * centered, axis=1)[:, None] / width  # two passes: no cancellation
        w = tl.load(weight + cols, mask=in_row, other=0.0).to(tl.float32)
        b = tl.load(bias + cols, mask=in_row, other=0.0).to(tl.float32)
        # torch's LayerNorm computes in float32 and rounds once, the output
        y = centered * tl.rsqrt(variance + eps) * w + b
        tl.store(
            out + row * stride_o + cols,
            rounded(y, out.dtype.element_ty).to(out.dtype.element_ty),
            mask=inside,
        )

    @triton.jit
    def rotary_kernel(
        x, cos, sin, heads, stride_xr, stride_xh, stride_cr, stride_sr,
        cache, slots, values, slot_rows, first_key, stride_vr, stride_vh, stride_ch,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_STEPS: tl.constexpr,
        INTO_CACHE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        in_dims = dims < HALF
        dtype = x.dtype.element_ty
        c1 = tl.load(cos + row * stride_cr + dims, mask=in_dims, other=0.0)
        c2 = tl.load(cos + row * stride_cr + HALF + dims, mask=in_dims, other=0.0)
        s1 = tl.load(sin + row * stride_sr + dims, mask=in_dims, other=0.0)
        s2 = tl.load(sin + row * stride_sr + HALF + dims, mask=in_dims, other=0.0)
        c1, c2 = c1.to(tl.float32)[None, :], c2.to(tl.float32)[None, :]
        s1, s2 = s1.to(tl.float32)[None, :], s2.to(tl.float32)[None, :]
        if ROUND_STEPS:  # the text model's cos and sin are in the activations' dtype
            c1, c2, s1, s2 = rounded(c1, dtype), rounded(c2, dtype), rounded(s1, dtype), rounded(s2, dtype)
        heads_at = tl.arange(0, BLOCK_H)
        first = x + row * stride_xr + heads_at[:, None] * stride_xh + dims[None, :]
        both = (heads_at < heads)[:, None] & in_dims[None, :]
        x1 = tl.load(first, mask=both, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=both, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): per half, x1 * c1 - x2 * s1 and
        # x2 * c2 + x1 * s2 (a negation is exact)
        if ROUND_STEPS:  # apply_rotary_pos_emb: each product and the sum rounded to the dtype
            o1 = rounded(rounded(x1 * c1, dtype) - rounded(x2 * s1, dtype), dtype)
            o2 = rounded(rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype), dtype)
        else:  # apply_rotary_pos_emb_vision: float32 throughout
            o1 = rounded(x1 * c1 - x2 * s1, dtype)
            o2 = rounded(x2 * c2 + x1 * s2, dtype)
        tl.store(first, o1.to(dtype), mask=both)
        tl.store(first + HALF, o2.to(dtype), mask=both)
        if INTO_CACHE:
            # this row's rotated keys (x's heads from `first_key` on) and its values, at its slot of a cache
            # layer (2, kv heads, slots, head dim): the bits a copy of the rotated keys and the values into
            # the cache writes. Rows past `slot_rows` pad the step: they write nothing.
            slot = tl.load(slots + tl.minimum(row, slot_rows - 1)).to(tl.int64)  # (a padding row's: unused)
            at_slot = slot * (2 * HALF) + dims[None, :]
            kv_heads = heads - first_key
            key = (heads_at - first_key).to(tl.int64)  # (a layer of a large cache passes 2**31 elements)
            # (whether the row writes, as a vector: Triton's interpreter takes no scalar in a mask)
            writes = (heads_at * 0 + row) < slot_rows
            is_key = (writes & (heads_at >= first_key) & (heads_at < heads))[:, None] & in_dims[None, :]
            at_key = cache + key[:, None] * stride_ch + at_slot
            tl.store(at_key, o1.to(dtype), mask=is_key)
            tl.store(at_key + HALF, o2.to(dtype), mask=is_key)
            # (the values in a tile of the keys' shape, its rows past the KV heads masked: a tile of the KV
            # heads alone would hold an element a thread, read and written one at a time)
            value_heads = heads_at.to(tl.int64)
            is_value = (writes & (heads_at < kv_heads))[:, None] & in_dims[None, :]
            source = values + row * stride_vr + value_heads[:, None] * stride_vh + dims[None, :]
            at_value = cache + (kv_heads + value_heads)[:, None] * stride_ch + at_slot
            tl.store(at_value, tl.load(source, mask=is_value), mask=is_value)
            tl.store(at_value + HALF, tl.load(source + HALF, mask=is_value), mask=is_value)

    return SimpleNamespace(
        rms_norm=rms_norm_kernel,
        silu_and_mul=silu_and_mul_kernel,
        quick_gelu=quick_gelu_kernel,
        layer_norm=layer_norm_kernel,
        rotary=rotary_kernel,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last dim) with unit column stride, a view where it can be."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(x's rows as a kernel reads them, how many, the stride between them): x itself where it is
    contiguous, else `_rows(x)`. The norms and activations are launched for every layer of a step: each view
    made and undone around their kernel (the rows' view, then the outputs' views back to x's shape) cost a
    couple of microseconds of the host's time a launch, a third of a norm's launch beside Triton's own."""
    width = x.shape[-1]
    if x.is_contiguous():
        return x, x.numel() // width, width
    rows = _rows(x)
    return rows, rows.shape[0], rows.stride(0)


def _like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor of x's shape in `dtype`, its rows `x.shape[-1]` apart."""
    if dtype == x.dtype:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm (Qwen2RMSNorm and its copies) of `x + residual`, or of x where there is no
    residual: (the normalized rows, x + residual for the next residual add, or x), each of x's shape. The
    output's dtype is the module's, x's and the weight's promoted."""
    rows, count, stride = _row_layout(x)
    width = x.shape[-1]
    out = _like(x, torch.promote_types(x.dtype, weight.dtype))
    summed, other, other_stride = x, rows, stride
    if residual is not None:
        summed = _like(x, x.dtype)
        other, _, other_stride = _row_layout(residual)
    _kernels().rms_norm[(-(-count // NORM_ROWS),)](
        out, summed, rows, other, weight, eps, count, width, width, width, stride, other_stride,
        HAS_RESIDUAL=residual is not None, BLOCK=power_of_two_at_least(width), ROWS=NORM_ROWS,
        num_warps=NORM_WARPS, **EAGER_ROUNDING,
    )  # fmt: skip
    return out, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused gate/up projection's output (..., 2 * I), gate first: (..., I)."""
    rows, count, stride = _row_layout(gate_up)
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], width))
    grid = (count, -(-width // BLOCK_COLUMNS))
    _kernels().silu_and_mul[grid](
        out, rows, width, width, stride,
        BLOCK=BLOCK_COLUMNS, num_warps=ELEMENTWISE_WARPS, **EAGER_ROUNDING,
    )  # fmt: skip
    return out


def quick_gelu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' QuickGELUActivation of `x + bias` (or of x): the activation of a linear layer run
    without its bias. In bf16 that rounds the matmul's output before the bias is added, where a linear
    layer with its bias rounds once: keep the bias in the layer (and none here) for its exact outputs."""
    rows, count, stride = _row_layout(x)
    width = x.shape[-1]
    out = _like(x, x.dtype)
    grid = (count, -(-width // BLOCK_COLUMNS))
    _kernels().quick_gelu[grid](
        out, rows, bias if bias is not None else rows, width, width, stride,
        HAS_BIAS=bias is not None, BLOCK=BLOCK_COLUMNS, num_warps=ELEMENTWISE_WARPS, **EAGER_ROUNDING,
    )  # fmt: skip
    return out


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.LayerNorm over the last dimension, with its weight and bias, in x's dtype, of `x + residual`
    or of x where there is no residual: (the normalized rows, x + residual for the next residual add, or
    x), each of x's shape."""
    rows, count, stride = _row_layout(x)
    width = x.shape[-1]
    out = _like(x, x.dtype)
    summed, other, other_stride = x, rows, stride
    if residual is not None:
        summed = _like(x, x.dtype)
        other, _, other_stride = _row_layout(residual)
    _kernels().layer_norm[(-(-count // NORM_ROWS),)](
        out, summed, rows, other, weight, bias, eps, count, width, width, width, stride, other_stride,
        HAS_RESIDUAL=residual is not None, BLOCK=power_of_two_at_least(width), ROWS=NORM_ROWS,
        num_warps=NORM_WARPS, **EAGER_ROUNDING,
    )  # fmt: skip
    return out, summed


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, vision: bool = False) -> torch.Tensor:
    """Rotates x (rows, heads, head dim) in place by one cos/sin row (rows, head dim) per row, shared by
    its heads, and returns it. Queries and keys next to each other in a fused q/k/v output (the engine's
    layout) are one x, rotated in one call. As `apply_rotary_pos_emb` (cos and sin rounded to x's dtype,
    each product and the sum rounded), or with `vision` as `apply_rotary_pos_emb_vision` (float32
    throughout, rounded once)."""
    rows, heads, head_dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary_ needs unit strides along the head dimension")
    half = head_dim // 2
    _kernels().rotary[(rows,)](
        x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        x, x, x, 0, 0, 0, 0, 0,  # (no cache written)
        HALF=half, BLOCK_H=power_of_two_at_least(heads), BLOCK_D=power_of_two_at_least(half),
        ROUND_STEPS=not vision, INTO_CACHE=False, **EAGER_ROUNDING,
    )  # fmt: skip
    return x


def rotary_into_cache_(
    x: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`rotary_` of a decoder layer's queries and keys x (rows, heads + kv heads, head dim), as the text
    model rotates them, that also writes the rotated keys and the `values` (rows, kv heads, head dim) of
    the first len(slots) rows at their `slots` of a cache layer (2, kv heads, cache slots, head dim), as
    `attention.KVCache.write` writes them: the cache's two copies in the same kernel, where they were two
    launches a layer."""
    rows, heads, head_dim = x.shape
    kv_heads = values.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    if x.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("rotary_into_cache_ needs unit strides along the head dimension")
    if not cache.is_contiguous() or cache.shape != (2, kv_heads, cache.shape[2], head_dim):
        raise ValueError("rotary_into_cache_ writes a contiguous cache layer (2, kv heads, slots, head dim)")
    if not len(slots):  # (nothing to write: the slots' first would be read)
        return rotary_(x, cos, sin)
    half = head_dim // 2
    _kernels().rotary[(rows,)](
        x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        cache, slots, values, len(slots), heads - kv_heads, values.stride(0), values.stride(1),
        cache.stride(1),
        HALF=half, BLOCK_H=power_of_two_at_least(heads), BLOCK_D=power_of_two_at_least(half),
        ROUND_STEPS=True, INTO_CACHE=True, **EAGER_ROUNDING,
    )  # fmt: skip
    return x
