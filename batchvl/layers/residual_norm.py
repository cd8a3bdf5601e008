"""A decoder layer's residual add fused into the norm after its attention (`engine.fused_kernels`, CUDA).

transformers' pre-norm decoder layers (every family's text decoder) compute

    h = residual + self_attn(input_layernorm(residual))
    out = h + mlp(post_attention_layernorm(h))

Eager, the add before the second norm writes h and the norm reads it again: a kernel and a pass over the
step's activations of its own. The fused forward hands the attention's output and the residual to the
norm's kernel (`triton_elementwise.rms_norm` with a residual), which adds them, keeps the sum for the MLP's
residual add and normalizes it, in one pass and with the layer's roundings (the sum rounded to the
activations' dtype before the norm reads it).

The add after the MLP stays the layer's: its sum leaves the layer, and transformers' own loop of layers
hands it to the next layer's input norm (Qwen3-VL adds deepstack features to it in between), so fusing it
into that norm would mean replacing each family's loop.
"""

from __future__ import annotations

import functools

import torch

from batchvl.layers.triton_modules import TritonRMSNorm

# transformers 5.17-5.24's decoder layers computing the two lines above, with their hidden states first
# and everything else by keyword, passed on to `self_attn` as it is
PRE_NORM_DECODER_LAYERS = (
    "Qwen2VLDecoderLayer",
    "Qwen2_5_VLDecoderLayer",
    "Qwen3VLTextDecoderLayer",
    "LlamaDecoderLayer",
    "Qwen2DecoderLayer",
    "MistralDecoderLayer",
)


def add_and_norm_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """The layer's forward with the residual add before its second norm done by the norm's kernel."""
    residual = hidden_states
    hidden_states, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
    hidden_states, residual = layer.post_attention_layernorm.add_and_norm(hidden_states, residual)
    return residual + layer.mlp(hidden_states)


def fuse_residual_norms(model: torch.nn.Module) -> int:
    """Give each pre-norm decoder layer whose second norm is the Triton RMSNorm the fused forward; returns
    how many layers took it."""
    layers = [
        module
        for module in model.modules()
        if type(module).__name__ in PRE_NORM_DECODER_LAYERS
        and isinstance(module.post_attention_layernorm, TritonRMSNorm)
    ]
    for layer in layers:
        # the instance's own forward: nn.Module's call finds it before the class's, and the layer keeps
        # every attribute transformers' loop of layers may read
        layer.forward = functools.partial(add_and_norm_forward, layer)
    return len(layers)
