"""Qwen3-VL's text attention as `FusedQKVAttention`: one q/k/v layer, the stock per-head q/k RMSNorms, one
rotation of queries and keys; against transformers' Qwen3VLTextAttention on the same input and weights."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextAttention

from batchvl.layers import fused_projections
from batchvl.layers.fused_projections import FusedQKVAttention
from batchvl.layers.rms_norm import NativeRMSNorm, use_native_rms_norms

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, ROWS = 4, 2, 16, 48, 11
CAUSAL_ATTENTION_NAME = "causal_sdpa_for_tests"


def causal_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """What both modules hand their rotated queries and keys to: plain causal attention over the step, in
    the layout the attention functions take and give ((1, H, T, D) in, (1, T, H, D) out)."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def stock_attention(dtype: torch.dtype) -> Qwen3VLTextAttention:
    """transformers' module with random weights, q_norm's and k_norm's different from each other and from
    ones, so that a norm dropped or the two swapped shows."""
    config = Qwen3VLTextConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
    )
    AttentionInterface.register(CAUSAL_ATTENTION_NAME, causal_attention)
    config._attn_implementation = CAUSAL_ATTENTION_NAME
    torch.manual_seed(0)
    stock = Qwen3VLTextAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for linear in (stock.q_proj, stock.k_proj, stock.v_proj, stock.o_proj):
            linear.weight.normal_(0, HIDDEN**-0.5)
        stock.q_norm.weight.uniform_(0.5, 1.5)
        stock.k_norm.weight.uniform_(-2.0, -1.0)
    return stock.to(dtype)


def step_inputs(dtype: torch.dtype):
    """Hidden states (1, T, hidden) and the decoder's cos/sin (1, T, D) at scattered positions."""
    torch.manual_seed(1)
    hidden = (torch.randn(1, ROWS, HIDDEN) * 2).to(dtype)
    angles = torch.rand(ROWS, HEAD_DIM // 2) * 40
    cos, sin = (torch.cat([f, f], -1)[None].to(dtype) for f in (angles.cos(), angles.sin()))
    return hidden, (cos, sin)


def attention_output(module: torch.nn.Module, hidden, position_embeddings) -> torch.Tensor:
    with torch.inference_mode():
        if isinstance(module, FusedQKVAttention):
            return module(hidden, position_embeddings)[0]
        return module(hidden, position_embeddings, attention_mask=None)[0]


@pytest.fixture(autouse=True)
def causal_instead_of_paged(monkeypatch):
    """The fused module calls the engine's paged attention by name: the same causal attention here."""
    monkeypatch.setattr(fused_projections, "paged_attention", causal_attention)


def test_the_fused_module_keeps_the_stock_norms_and_fuses_the_projections():
    stock = stock_attention(torch.float32)
    fused = FusedQKVAttention(stock)
    assert fused.q_norm is stock.q_norm and fused.k_norm is stock.k_norm
    assert fused.qkv_proj.out_features == (HEADS + 2 * KV_HEADS) * HEAD_DIM


@pytest.mark.parametrize("native_norms", [False, True], ids=["stock-norms", "native-norms"])
def test_float32_equals_transformers(native_norms):
    stock = stock_attention(torch.float32)
    hidden, position_embeddings = step_inputs(torch.float32)
    expected = attention_output(stock, hidden, position_embeddings)
    fused = torch.nn.Sequential(FusedQKVAttention(stock))  # a parent, for the loader's RMSNorm swap
    if native_norms:
        if use_native_rms_norms(fused) != 2:
            pytest.skip("the native kernels do not build here")
        assert isinstance(fused[0].q_norm, NativeRMSNorm) and isinstance(fused[0].k_norm, NativeRMSNorm)
    got = attention_output(fused[0], hidden, position_embeddings)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_bf16_is_as_close_to_float32_as_transformers_bf16():
    hidden, position_embeddings = step_inputs(torch.float32)
    exact = attention_output(stock_attention(torch.float32), hidden, position_embeddings).double()
    stock = stock_attention(torch.bfloat16)
    bf16_inputs = hidden.bfloat16(), tuple(t.bfloat16() for t in position_embeddings)
    stock_out = attention_output(stock, *bf16_inputs)
    fused_out = attention_output(FusedQKVAttention(stock), *bf16_inputs)
    assert fused_out.dtype == stock_out.dtype == torch.bfloat16

    def error(out):
        return float((out.double() - exact).norm() / exact.norm())

    assert error(fused_out) < 1.25 * error(stock_out) + 1e-3, (error(fused_out), error(stock_out))
    # and next to the stock bf16 module's output: a few bf16 rounding steps at most
    torch.testing.assert_close(fused_out, stock_out, rtol=2**-5, atol=2**-5)
