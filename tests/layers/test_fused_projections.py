"""Fused q/k/v and gate/up projections, and the rotary embedding they use: transformers' outputs."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

from batchvl.layers.fused_projections import FusedQKVAttention, GatedMLP, fused_linear
from batchvl.layers.native_kernels import native_ops
from batchvl.layers.rms_norm import NativeRMSNorm
from batchvl.layers.rotary import apply_rotary


def test_a_fused_linear_gives_its_parts_outputs_side_by_side():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(32, n) for n in (48, 16, 16)]
    fused = fused_linear(*parts)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), torch.cat([m(x) for m in parts], dim=-1), rtol=0, atol=1e-6)
    assert fused.bias is not None and fused.weight.shape == (80, 32)
    assert fused_linear(torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False)).bias is None


@torch.inference_mode()
def test_a_gated_mlp_equals_the_stock_one():
    torch.manual_seed(0)
    stock = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu"))
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(GatedMLP(stock)(x), stock(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_gives_the_bits_of_transformers(dtype):
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 9, 16).to(dtype), torch.randn(1, 2, 9, 16).to(dtype)
    cos, sin = torch.randn(1, 9, 16).to(dtype), torch.randn(1, 9, 16).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(apply_rotary(q, cos[:, None], sin[:, None]), want_q)
    assert torch.equal(apply_rotary(k, cos[:, None], sin[:, None]), want_k)


def test_the_loader_fuses_the_decoders_projections(loaded_fp32):
    for layer in loaded_fp32.adapter.language_model.layers:
        assert type(layer.self_attn) is FusedQKVAttention
        assert type(layer.mlp) is GatedMLP


def test_the_loader_fuses_qwen3_vls_text_attention_around_its_native_q_k_norms(family_models):
    _, loaded = family_models("qwen3_vl")
    model = loaded.adapter.model
    assert not [m for m in model.modules() if type(m).__name__ == "Qwen3VLTextAttention"]
    layers = loaded.adapter.language_model.layers
    norm_kind = NativeRMSNorm if native_ops() is not None else Qwen3VLTextRMSNorm
    for layer in layers:
        assert type(layer.self_attn) is FusedQKVAttention
        # swapped after the fusion, inside the fused module: the same RMSNorm as every other norm
        assert type(layer.self_attn.q_norm) is norm_kind and type(layer.self_attn.k_norm) is norm_kind
