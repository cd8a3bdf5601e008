"""RMSNorm and a gated MLP's SiLU and product on the native kernels give transformers' outputs: bf16 within
one rounding step of the stock modules, float32 within a few float32 rounding steps. The rotary embedding
gives the bits of transformers' `apply_rotary_pos_emb` in both."""

import importlib

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from batchvl.layers.fused_projections import GatedMLP, native_silu_and_mul
from batchvl.layers.native_kernels import native_ops
from batchvl.layers.rms_norm import STOCK_RMS_NORMS, NativeRMSNorm, use_native_rms_norms
from batchvl.layers.rotary import apply_rotary_rows

MODULES = {
    "Qwen2RMSNorm": "qwen2",
    "Qwen2VLRMSNorm": "qwen2_vl",
    "Qwen2_5_VLRMSNorm": "qwen2_5_vl",
    "Qwen3VLTextRMSNorm": "qwen3_vl",
    "LlamaRMSNorm": "llama",
    "Idefics3RMSNorm": "idefics3",
}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if native_ops() is None:
        pytest.skip("the native kernels did not build (needs a C++ compiler and ninja)")


def stock_norm(name: str, size: int, dtype) -> torch.nn.Module:
    module = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    norm = getattr(module, name)(size, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size))
    return norm.to(dtype)


def tolerance(dtype) -> dict:
    # bf16: a float32 sum of squares in another order can move a value across a rounding boundary, one bf16
    # step (2^-8 relative), and the weight's product another; float32: a few rounding steps.
    return {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}


def test_every_listed_norm_is_tested():
    assert set(MODULES) == set(STOCK_RMS_NORMS)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", STOCK_RMS_NORMS)
def test_native_rms_norm_equals_the_stock_module(name, dtype):
    torch.manual_seed(0)
    for shape in [(40, 512), (1, 7, 100), (3, 4, 16), (2048, 64)]:
        stock = stock_norm(name, shape[-1], dtype)
        x = (torch.randn(shape) * 3).to(dtype)
        torch.testing.assert_close(NativeRMSNorm(stock)(x), stock(x), **tolerance(dtype))
    # a strided input (Qwen3-VL normalizes a view of q per head) and a dtype the weight does not have
    stock = stock_norm(name, 32, dtype)
    x = torch.randn(5, 64).to(dtype)[:, ::2]
    torch.testing.assert_close(NativeRMSNorm(stock)(x), stock(x), **tolerance(dtype))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    x = torch.randn(5, 32).to(other)
    out = NativeRMSNorm(stock)(x)
    assert out.dtype == stock(x).dtype and torch.equal(out, stock(x))


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_add_and_norm_give_the_sum_and_its_norm(dtype):
    """The sum is torch's `residual + hidden_states` bit for bit (rounded to the dtype where the layer's add
    rounds it), and its norm the native norm's of that sum, bit for bit: the kernel normalizes what it
    stored. Strided rows, and a residual of another dtype (the eager add's promotion), too."""
    torch.manual_seed(0)
    norm = NativeRMSNorm(stock_norm("Qwen2RMSNorm", 100, dtype))
    for shape in [(1, 13, 100), (40, 100), (1, 1, 100)]:
        hidden, residual = (torch.randn(shape) * 4).to(dtype), (torch.randn(shape) * 4).to(dtype)
        out, summed = norm.add_and_norm(hidden, residual)
        assert summed.shape == out.shape == hidden.shape
        assert torch.equal(summed, residual + hidden)
        assert torch.equal(out, norm(residual + hidden))
    wide = torch.randn(9, 200).to(dtype)
    hidden, residual = wide[:, ::2], wide[:, 1::2]
    out, summed = norm.add_and_norm(hidden, residual)
    assert torch.equal(summed, residual + hidden) and torch.equal(out, norm(residual + hidden))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    hidden, residual = torch.randn(3, 100).to(dtype), torch.randn(3, 100).to(other)
    out, summed = norm.add_and_norm(hidden, residual)
    assert torch.equal(summed, residual + hidden) and torch.equal(out, norm(residual + hidden))


@torch.inference_mode()
def test_bf16_rows_are_mostly_bitwise_the_stock_module():
    """The roundings are the module's: only values at a rounding boundary can differ."""
    torch.manual_seed(0)
    stock = stock_norm("Qwen2RMSNorm", 512, torch.bfloat16)
    x = torch.randn(256, 512).to(torch.bfloat16)
    same = NativeRMSNorm(stock)(x) == stock(x)
    assert same.float().mean() > 0.999


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_silu_gated_mlp_on_the_native_kernel_equals_the_stock_one(dtype):
    torch.manual_seed(0)
    for intermediate in (64, 1408, 100):
        stock = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=intermediate, hidden_act="silu")).to(
            dtype
        )
        fused = GatedMLP(stock)
        assert fused.silu_and_mul is native_silu_and_mul
        x = (torch.randn(3, 7, 32) * 2).to(dtype)
        torch.testing.assert_close(fused(x), stock(x), **tolerance(dtype))


def test_other_activations_and_devices_keep_torch_ops():
    gelu = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="gelu_pytorch_tanh"))
    assert GatedMLP(gelu).silu_and_mul is None
    half = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu")).half()
    assert GatedMLP(half).silu_and_mul is None


def test_the_loader_uses_the_native_norms_and_silu(loaded_fp32):
    model = loaded_fp32.adapter.model
    names = {type(m).__name__ for m in model.modules()}
    assert "NativeRMSNorm" in names and not names & set(STOCK_RMS_NORMS)
    assert all(
        layer.mlp.silu_and_mul is native_silu_and_mul for layer in loaded_fp32.adapter.language_model.layers
    )


def test_only_cpu_float_norms_are_replaced():
    model = torch.nn.ModuleDict(
        {
            "kept": stock_norm("LlamaRMSNorm", 8, torch.float16),
            "replaced": stock_norm("LlamaRMSNorm", 8, torch.float32),
            "other": torch.nn.LayerNorm(8),
        }
    )
    assert use_native_rms_norms(model) == 1
    assert type(model["replaced"]) is NativeRMSNorm and type(model["kept"]).__name__ == "LlamaRMSNorm"


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_rotary_gives_the_bits_of_transformers_rotary(dtype):
    """Queries and keys as the fused projection's output leaves them (a strided view of q, k and v), head
    sizes whose half is and is not a whole number of vectors."""
    torch.manual_seed(0)
    for rows, heads, dim in [(37, 10, 64), (5, 3, 80), (300, 2, 16)]:
        qkv = (torch.randn(rows, heads + 2, dim) * 3).to(dtype)
        cos, sin = torch.randn(2, rows, dim).to(dtype)
        native = apply_rotary_rows(qkv[:, :heads], cos, sin)
        assert native.shape == (rows, heads, dim) and native.is_contiguous()
        # transformers' rotation of (rows, heads, dim) queries with one cos/sin row per row of them
        want, _ = apply_rotary_pos_emb(qkv[:, :heads], qkv[:, :heads], cos, sin, unsqueeze_dim=1)
        assert torch.equal(native, want)


@torch.inference_mode()
def test_float32_cos_and_sin_of_bf16_rows_are_rounded_as_a_copy_to_bf16_would_round_them():
    """A vision tower's cos and sin are float32 for its bf16 queries and keys: the kernel rounds each value
    as it reads it, to the bits of rotating with cos and sin copied to bf16 first."""
    torch.manual_seed(0)
    for rows, heads, dim in [(37, 10, 64), (5, 3, 80)]:
        x = (torch.randn(rows, heads, dim) * 3).to(torch.bfloat16)
        angles = torch.rand(rows, dim) * 6.3 + 1e-3  # values that bf16 rounds, unlike whole numbers
        cos, sin = angles.cos(), angles.sin()
        native = apply_rotary_rows(x, cos, sin)
        want, _ = apply_rotary_pos_emb(x, x, cos.bfloat16(), sin.bfloat16(), unsqueeze_dim=1)
        assert native.dtype == torch.bfloat16 and torch.equal(native, want)
