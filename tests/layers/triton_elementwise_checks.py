"""The elementwise Triton kernels (`triton_elementwise`), run by Triton's interpreter on CPU tensors,
against the transformers modules and functions they replace, computed as transformers computes them in
the same dtype: float32 within 1e-6 relative (LayerNorm: of its rows' largest output), bf16 within one
bf16 rounding step, at Qwen2-VL-2B's widths and odd ones, with a row count no power of two.

Run in a process of their own with TRITON_INTERPRET=1 by tests/layers/test_triton_elementwise.py, and on a
GPU, compiled, by the GPU check (where the kernels round by a cast, not by the bits as interpreted):

    BATCHVL_TEST_DEVICE=cuda python -m pytest -q tests/layers/triton_elementwise_checks.py
"""

import os

import pytest
import torch
from transformers.activations import ACT2FN, QuickGELUActivation
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VLRotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_vision,
)

from batchvl.layers import triton_elementwise
from batchvl.layers.attention import KVCache
from tests.conftest import TEST_DEVICE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not TEST_DEVICE.startswith("cuda"):
    pytest.skip(
        "run by test_triton_elementwise.py under Triton's interpreter, or with BATCHVL_TEST_DEVICE=cuda",
        allow_module_level=True,
    )
DEVICE = "cpu" if INTERPRETED else TEST_DEVICE

ROWS = 37  # no power of two: the last block of rows and columns is partial
DTYPES = [torch.float32, torch.bfloat16]


def random(*shape, dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def bf16_steps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in bf16 rounding steps at the expected value's magnitude."""
    _, exponent = torch.frexp(expected.float())
    step = torch.ldexp(torch.ones_like(expected, dtype=torch.float32), exponent - 8)
    return ((actual.float() - expected.float()).abs() / step).max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """float32: within 1e-6 of each value (or of `scale`, per row); bf16: within one rounding step."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.bfloat16:
        assert bf16_steps(actual, expected) <= 1
    else:
        allowed = 1e-6 * (expected.abs() if scale is None else scale)
        assert ((actual - expected).abs() <= allowed).all(), (actual - expected).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 80])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_with_the_residual_add_equals_the_decoders(dtype, width, with_residual):
    norm = Qwen2RMSNorm(width, eps=1e-6)
    norm.weight.data = random(width, dtype=dtype, seed=1)
    hidden = random(ROWS, width, dtype=dtype, seed=2)
    residual = random(ROWS, width, dtype=dtype, seed=3) if with_residual else None
    out, new_residual = triton_elementwise.rms_norm(hidden, norm.weight, norm.variance_epsilon, residual)
    expected_residual = residual + hidden if with_residual else hidden  # the decoder layer's add
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, norm(expected_residual))


def test_rms_norm_of_bf16_rows_with_a_float32_weight_is_float32_as_the_modules():
    norm = Qwen2RMSNorm(80)
    norm.weight.data = random(80, dtype=torch.float32, seed=1)
    hidden = random(ROWS, 80, dtype=torch.bfloat16, seed=2)
    out, _ = triton_elementwise.rms_norm(hidden, norm.weight, norm.variance_epsilon)
    assert_close(out, norm(hidden))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8960, 80])
def test_silu_and_mul_equals_the_mlps_activation_times_up(dtype, width):
    gate_up = random(ROWS, 2 * width, dtype=dtype, seed=4) * 4
    gate, up = gate_up.split(width, dim=-1)
    assert_close(triton_elementwise.silu_and_mul(gate_up), ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [5120, 80])
@pytest.mark.parametrize("with_bias", [True, False])
def test_quick_gelu_with_its_bias_equals_transformers(dtype, width, with_bias):
    x = random(ROWS, width, dtype=dtype, seed=5) * 4
    bias = random(width, dtype=dtype, seed=6) if with_bias else None
    expected = QuickGELUActivation()(x + bias if with_bias else x)
    assert_close(triton_elementwise.quick_gelu(x, bias), expected)


@pytest.mark.parametrize("block_columns", [2048, 4096])
def test_the_elementwise_kernels_with_wider_programs_equal_transformers(block_columns, monkeypatch):
    # the launch settings `benchmarks/fused_elementwise.py` times beside the defaults: 5,120 and 8,960
    # columns end in a partial program at each
    monkeypatch.setattr(triton_elementwise, "BLOCK_COLUMNS", block_columns)
    x = random(ROWS, 5120, dtype=torch.bfloat16, seed=5) * 4
    assert_close(triton_elementwise.quick_gelu(x), QuickGELUActivation()(x))
    gate_up = random(ROWS, 2 * 8960, dtype=torch.bfloat16, seed=4) * 4
    gate, up = gate_up.split(8960, dim=-1)
    assert_close(triton_elementwise.silu_and_mul(gate_up), ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1280, 80])
@pytest.mark.parametrize("with_residual", [True, False])
def test_layer_norm_with_the_residual_add_equals_torchs(dtype, width, with_residual):
    norm = torch.nn.LayerNorm(width, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data = random(width, dtype=dtype, seed=7)
    norm.bias.data = random(width, dtype=dtype, seed=8)
    x = random(ROWS, width, dtype=dtype, seed=9) * 3 + 1  # off-centre rows
    residual = random(ROWS, width, dtype=dtype, seed=10) if with_residual else None
    out, new_residual = triton_elementwise.layer_norm(x, norm.weight, norm.bias, norm.eps, residual)
    expected_residual = x + residual if with_residual else x  # the vision block's add
    assert torch.equal(new_residual, expected_residual)
    expected = norm(expected_residual)
    assert_close(out, expected, scale=expected.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norms_and_activations_take_rows_wherever_they_lie_and_answer_in_their_shape(dtype):
    """Inputs as the layers hand them: a step's (1, T, width) hidden states, contiguous, read where they
    are; rows of a wider tensor (a fused projection's slice: rows `3 * width` apart), and (T, heads, D)
    heads of one (Qwen3-VL's q/k norms: copied to rows first). Each output has its input's shape."""
    width = 80
    wide = random(ROWS, 3 * width, dtype=dtype, seed=20) * 3 + 1
    inputs = [
        random(1, ROWS, width, dtype=dtype, seed=21) * 3 + 1,
        wide[:, width : 2 * width],
        wide.view(ROWS, 3, width)[:, :2],
    ]
    residuals = [random(*x.shape, dtype=dtype, seed=22) for x in inputs]
    rms = Qwen2RMSNorm(width, eps=1e-6)
    rms.weight.data = random(width, dtype=dtype, seed=23) + 1
    layer = torch.nn.LayerNorm(width, eps=1e-6).to(DEVICE, dtype)
    layer.weight.data = random(width, dtype=dtype, seed=24)
    layer.bias.data = random(width, dtype=dtype, seed=25)
    for x, residual in zip(inputs, residuals, strict=True):
        summed = residual + x
        out, kept = triton_elementwise.rms_norm(x, rms.weight, rms.variance_epsilon, residual)
        assert out.shape == kept.shape == x.shape and torch.equal(kept, summed)
        assert_close(out, rms(summed))
        out, kept = triton_elementwise.rms_norm(x, rms.weight, rms.variance_epsilon)
        assert torch.equal(kept, x)
        assert_close(out, rms(x))
        out, kept = triton_elementwise.layer_norm(x, layer.weight, layer.bias, layer.eps, residual)
        assert out.shape == x.shape and torch.equal(kept, summed)
        expected = layer(summed)
        assert_close(out, expected, scale=expected.abs().amax(-1, keepdim=True))
        activated = triton_elementwise.quick_gelu(x)
        assert activated.shape == x.shape
        assert_close(activated, QuickGELUActivation()(x))
        gate, up = x.split(width // 2, dim=-1)  # x as a gate/up projection's output
        product = triton_elementwise.silu_and_mul(x)
        assert product.shape == (*x.shape[:-1], width // 2)
        assert_close(product, ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_rows", [4, 8])
def test_the_norms_with_several_rows_a_program_equal_transformers(dtype, norm_rows, monkeypatch):
    """The launch settings `benchmarks/fused_elementwise.py` times beside one row a program: each row still
    normalized on its own, and 37 rows end in a partial program."""
    monkeypatch.setattr(triton_elementwise, "NORM_ROWS", norm_rows)
    rms = Qwen2RMSNorm(1536, eps=1e-6)
    rms.weight.data = random(1536, dtype=dtype, seed=1)
    hidden, residual = (random(ROWS, 1536, dtype=dtype, seed=seed) * (1 + seed) for seed in (2, 3))
    out, summed = triton_elementwise.rms_norm(hidden, rms.weight, rms.variance_epsilon, residual)
    assert torch.equal(summed, residual + hidden)
    assert_close(out, rms(residual + hidden))
    layer = torch.nn.LayerNorm(1280, eps=1e-6).to(DEVICE, dtype)
    layer.weight.data, layer.bias.data = random(1280, dtype=dtype, seed=7), random(1280, dtype=dtype, seed=8)
    x = random(ROWS, 1280, dtype=dtype, seed=9) * torch.arange(1, ROWS + 1, device=DEVICE)[:, None].to(dtype)
    out, _ = triton_elementwise.layer_norm(x, layer.weight, layer.bias, layer.eps)
    expected = layer(x)
    assert_close(out, expected, scale=expected.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,section", [(12, 2, 128, [16, 24, 24]), (5, 1, 80, [8, 16, 16])]
)
def test_rotary_of_queries_and_keys_equals_the_text_models(dtype, heads, kv_heads, head_dim, section):
    """Queries and keys next to each other in a fused q/k/v output, rotated in one call, with the cos and
    sin of Qwen2-VL's M-RoPE (three position rows, the sections picked) as its rotary module gives them;
    the values are left alone."""
    config = Qwen2VLTextConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
    )
    positions = torch.randint(0, 3000, (3, 1, ROWS), generator=torch.Generator().manual_seed(10)).to(DEVICE)
    qkv = random(ROWS, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=11)
    cos, sin = Qwen2VLRotaryEmbedding(config).to(DEVICE)(qkv, positions)  # (1, rows, head dim) in qkv's dtype
    query, key = (
        part.transpose(0, 1)[None] for part in qkv[:, : heads + kv_heads].split([heads, kv_heads], 1)
    )
    expected_query, expected_key = apply_rotary_pos_emb(query, key, cos, sin)
    rotated = qkv.clone()
    triton_elementwise.rotary_(rotated[:, : heads + kv_heads], cos[0], sin[0])
    assert_close(rotated[:, :heads].transpose(0, 1)[None], expected_query)
    assert_close(rotated[:, heads : heads + kv_heads].transpose(0, 1)[None], expected_key)
    assert torch.equal(rotated[:, heads + kv_heads :], qkv[:, heads + kv_heads :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(16, 80), (3, 64)])
def test_rotary_of_the_vision_tower_equals_its_float32_rotation(dtype, heads, head_dim):
    angles = random(ROWS, head_dim // 2, dtype=torch.float32, seed=12) * 50
    cos, sin = (torch.cat([f, f], dim=-1) for f in (angles.cos(), angles.sin()))  # float32, as the tower's
    qkv = random(ROWS, 3 * heads, head_dim, dtype=dtype, seed=13)
    expected_query, expected_key = apply_rotary_pos_emb_vision(
        qkv[:, :heads], qkv[:, heads : 2 * heads], cos, sin
    )
    rotated = qkv.clone()
    triton_elementwise.rotary_(rotated[:, : 2 * heads], cos, sin, vision=True)
    assert_close(rotated[:, :heads], expected_query)
    assert_close(rotated[:, heads : 2 * heads], expected_key)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (7, 3, 80)])
def test_rotary_into_the_cache_writes_the_bits_of_the_rotation_then_the_caches_copies(
    dtype, heads, kv_heads, head_dim
):
    """A decoder layer's rotation that also writes its keys and values into the cache: its queries and keys
    those of `rotary_`, and the cache that of `KVCache.write` of the rotated keys and the values, at the
    step's scattered slots; the rows past the slots (a step's padding) write nothing."""
    qkv = random(ROWS, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=30)
    angles = random(ROWS, head_dim // 2, dtype=torch.float32, seed=31) * 50
    cos, sin = (torch.cat([f, f], dim=-1).to(dtype) for f in (angles.cos(), angles.sin()))
    cache_slots = 3 * ROWS
    layer = random(2, kv_heads, cache_slots, head_dim, dtype=dtype, seed=32)
    written = ROWS - 5  # the step's last rows pad it
    slots = torch.randperm(cache_slots, generator=torch.Generator().manual_seed(33))[:written].to(DEVICE)
    expected_qkv, expected_layer = qkv.clone(), layer.clone()
    triton_elementwise.rotary_(expected_qkv[:, : heads + kv_heads], cos, sin)
    cache = KVCache([expected_layer])
    keys, values = (part[:written].transpose(0, 1) for part in expected_qkv[:, heads:].split(kv_heads, 1))
    cache.write(0, slots, keys, values)
    rotated = triton_elementwise.rotary_into_cache_(
        qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :], cos, sin, layer, slots
    )
    assert rotated.data_ptr() == qkv.data_ptr()  # in place, as `rotary_`
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(layer, expected_layer)
    assert not torch.equal(layer, random(2, kv_heads, cache_slots, head_dim, dtype=dtype, seed=32))
