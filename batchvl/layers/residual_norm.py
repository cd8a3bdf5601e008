"""A layer's residual add fused into the norm after its attention (`engine.fused_kernels`, CUDA): decoder
layers, vision encoder layers and the Qwen-VL vision blocks.

Each of them is pre-norm, and computes

    h = residual + attention(first_norm(residual))
    out = h + mlp(second_norm(h))

Eager, the add before the second norm writes h and the norm reads it again: a kernel and a pass over the
step's activations of its own. The fused forward hands the attention's output and the residual to the
norm's kernel (`triton_elementwise.rms_norm` or `layer_norm` with a residual), which adds them, keeps the
sum for the MLP's residual add and normalizes it, in one pass and with the layer's roundings (the sum
rounded to the activations' dtype before the norm reads it).

The add after the MLP stays the layer's here: its sum leaves the layer. For the language model the engine
runs the loop of layers itself (`decoder_stack`) and hands that add to the next norm too; a decoder layer
then runs its parts from that loop, not this forward, which serves a text model the loop does not take.
The vision towers' loops stay transformers' (Qwen3-VL's keeps deepstack features of some blocks, CLIP's
each layer's output for LLaVA's choice of layer).

On an H200, a Qwen2-VL-2B vision call of 32,768 patches spent 3.7 of its 99.5 ms of kernels in the adds
before the second norms and 4.6 in its LayerNorms (`vision_call`'s kernels with the other kernels fused):
an add reads two tensors and writes one, the norm reads and writes one, and fused they read two and write
two, a fifth of those bytes fewer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from batchvl.layers.triton_modules import TritonLayerNorm, TritonRMSNorm


@dataclass(frozen=True)
class PreNormLayer:
    """Where a kind of layer keeps its parts, what its loop of layers passes it by position after the hidden
    states, and whether its attention answers (output, weights), as transformers' text and encoder
    attentions do, or its output alone."""

    attention: str
    first_norm: str
    second_norm: str
    positional: tuple[str, ...]
    attention_returns_tuple: bool


DECODER = PreNormLayer("self_attn", "input_layernorm", "post_attention_layernorm", (), True)
ENCODER = PreNormLayer("self_attn", "layer_norm1", "layer_norm2", ("attention_mask",), True)
QWEN_VISION_BLOCK = PreNormLayer("attn", "norm1", "norm2", ("cu_seqlens", "position_embeddings"), False)

# transformers 5.17-5.24's layers computing the two lines above, everything but their hidden states
# passed on to the attention by keyword, as their own forwards pass it
PRE_NORM_LAYERS = {
    "Qwen2VLDecoderLayer": DECODER,
    "Qwen2_5_VLDecoderLayer": DECODER,
    "Qwen3VLTextDecoderLayer": DECODER,
    "LlamaDecoderLayer": DECODER,
    "Qwen2DecoderLayer": DECODER,
    "MistralDecoderLayer": DECODER,
    "CLIPEncoderLayer": ENCODER,
    "SiglipEncoderLayer": ENCODER,
    "Idefics3EncoderLayer": ENCODER,
    "SmolVLMEncoderLayer": ENCODER,
    "Qwen2VLVisionBlock": QWEN_VISION_BLOCK,
    "Qwen2_5_VLVisionBlock": QWEN_VISION_BLOCK,
    "Qwen3VLVisionBlock": QWEN_VISION_BLOCK,
}
FUSED_NORMS = (TritonRMSNorm, TritonLayerNorm)  # the norms whose kernel adds a residual (`add_and_norm`)


def add_and_norm_forward(
    layer: torch.nn.Module, kind: PreNormLayer, hidden_states: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """The layer's forward with the residual add before its second norm done by the norm's kernel."""
    if len(args) > len(kind.positional):
        name, most = type(layer).__name__, len(kind.positional)
        raise TypeError(f"{name} takes {most} arguments by position after its hidden states")
    kwargs.update(zip(kind.positional, args, strict=False))
    residual = hidden_states
    attended = getattr(layer, kind.attention)(
        hidden_states=getattr(layer, kind.first_norm)(hidden_states), **kwargs
    )
    if kind.attention_returns_tuple:
        attended = attended[0]
    hidden_states, residual = getattr(layer, kind.second_norm).add_and_norm(attended, residual)
    return residual + layer.mlp(hidden_states)


def fused_residual_norm(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The norm that adds the layer's residual, where the layer runs the fused forward."""
    forward = vars(layer).get("forward")
    if getattr(forward, "func", None) is not add_and_norm_forward:
        return None
    return getattr(layer, forward.args[1].second_norm)


def fuse_residual_norms(model: torch.nn.Module) -> int:
    """Give each pre-norm layer whose second norm is a Triton norm the fused forward; returns how many
    layers took it."""
    layers = [
        (module, PRE_NORM_LAYERS[type(module).__name__])
        for module in model.modules()
        if type(module).__name__ in PRE_NORM_LAYERS
    ]
    fused = 0
    for layer, kind in layers:
        if isinstance(getattr(layer, kind.second_norm), FUSED_NORMS):
            # the instance's own forward: nn.Module's call finds it before the class's, and the layer keeps
            # every attribute transformers' loop of layers may read
            layer.forward = functools.partial(add_and_norm_forward, layer, kind)
            fused += 1
    return fused
