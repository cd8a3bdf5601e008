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

The add after the MLP leaves the layer: its sum is the next layer's input, which that layer's first norm
reads again. A vision layer followed by another in its list, whose first norm is a Triton one, hands that
add to it ahead (`TritonNorm.add_ahead`): the norm's kernel makes the sum and its norm in one pass, the layer
returns the sum, and the next layer's call of its first norm on that very sum takes the output kept. The
loop of layers stays transformers' (Qwen3-VL's tower keeps deepstack features of some blocks, CLIP's each
layer's output for LLaVA's choice of layer): it sees the sums it always did, and where it hands the next
layer anything else, that norm normalizes what it is given. The last layer's add stays its own. For the
language model the engine runs the loop of layers itself (`decoder_stack`) and hands the adds to the norms
there; a decoder layer then runs its parts from that loop, not this forward, which serves a text model the
loop does not take.

On an H200, a Qwen2-VL-2B vision call of 32,768 patches spent 3.7 of its 99.5 ms of kernels in its 64
residual adds and 4.6 in its 65 LayerNorms (`vision_call`'s kernels with the other kernels fused): an add
reads two tensors and writes one, the norm reads and writes one, and fused they read two and write two, a
fifth of those bytes fewer and a launch fewer. Both adds of each block but the last are now fused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from batchvl.layers.triton_modules import TritonNorm


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


def add_and_norm_forward(
    layer: torch.nn.Module,
    kind: PreNormLayer,
    successor: TritonNorm | None,
    hidden_states: torch.Tensor,
    *args,
    **kwargs,
) -> torch.Tensor:
    """The layer's forward with the residual add before its second norm done by the norm's kernel, and the
    add that ends it by the kernel of the norm that reads its output next (`successor`), where it has one."""
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
    if successor is None:
        return residual + layer.mlp(hidden_states)
    return successor.add_ahead(layer.mlp(hidden_states), residual)


def fused_residual_norm(layer: torch.nn.Module) -> TritonNorm | None:
    """The norm that adds the layer's residual, where the layer runs the fused forward."""
    arguments = _fused_arguments(layer)
    return None if arguments is None else getattr(layer, arguments[1].second_norm)


def fused_successor(layer: torch.nn.Module) -> TritonNorm | None:
    """The norm the layer's fused forward hands its closing add to, if any."""
    arguments = _fused_arguments(layer)
    return None if arguments is None else arguments[2]


def _fused_arguments(layer: torch.nn.Module) -> tuple | None:
    """What the layer's fused forward is bound to (layer, kind, successor); None for another forward."""
    forward = vars(layer).get("forward")
    return forward.args if getattr(forward, "func", None) is add_and_norm_forward else None


def fuse_residual_norms(model: torch.nn.Module) -> int:
    """Give each pre-norm layer whose second norm is a Triton norm the fused forward; a vision layer hands
    its closing add to the next layer's first norm where that layer follows it in a list and that norm is a
    Triton norm. Returns how many layers took the fused forward."""
    fused = 0
    for layer, kind, following in pre_norm_layers(model):
        if isinstance(getattr(layer, kind.second_norm), TritonNorm):
            successor = None
            # (a decoder layer's closing add: the engine's loop of layers hands it on, `decoder_stack`)
            if following is not None and kind is not DECODER:
                norm = getattr(following, PRE_NORM_LAYERS[type(following).__name__].first_norm)
                successor = norm if isinstance(norm, TritonNorm) else None
            # the instance's own forward: nn.Module's call finds it before the class's, and the layer keeps
            # every attribute transformers' loop of layers may read
            layer.forward = functools.partial(add_and_norm_forward, layer, kind, successor)
            fused += 1
    return fused


def pre_norm_layers(
    model: torch.nn.Module,
) -> list[tuple[torch.nn.Module, PreNormLayer, torch.nn.Module | None]]:
    """Each pre-norm layer of the model with its kind and the pre-norm layer after it in its list (a loop
    of layers runs a list in order), None where there is none."""
    following = {}
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            listed = list(module)
            for layer, after in zip(listed, listed[1:], strict=False):
                if type(after).__name__ in PRE_NORM_LAYERS:
                    following[id(layer)] = after
    return [
        (module, PRE_NORM_LAYERS[type(module).__name__], following.get(id(module)))
        for module in model.modules()
        if type(module).__name__ in PRE_NORM_LAYERS
    ]
