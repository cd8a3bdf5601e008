"""The language model's loop of layers as the engine's own: each layer's closing residual add done by the
next norm's kernel.

A pre-norm decoder layer computes

    h = x + attention(first_norm(x))
    x' = h + mlp(second_norm(h))

and transformers' text model calls its layers one after the other, then a final norm. The add before the
second norm is already fused into that norm inside the layer (`residual_norm`), but the add that ends it
leaves the layer: its sum is the next layer's input, which the next layer's first norm reads again. Here
the engine runs the loop itself and hands that add to the norm that follows it (the next layer's first
norm, and the final norm after the last layer), whose kernel adds, keeps the sum as the residual and
normalizes in one pass: `add_and_norm` of the native RMSNorm on the CPU (`rms_norm`) and of the Triton
one on CUDA (`engine.fused_kernels`). A norm without it (the stock module) gets the add eagerly: the sum is
the same, rounded to the activations' dtype before the norm reads it, as the layer's own add rounds it.

A step's layers thus pass over their activations once fewer each (twice fewer on the CPU, where the norm
inside the layer fuses its add here too), and the loop skips what transformers' text model and layer
calls do per step and per layer that the engine's packed step does not use: the causal mask (the engine's
attention reads its own metadata), the cache arguments, the hooks and the keyword plumbing of each layer's
call. Qwen3-VL adds its deepstack features after its first layers: the sum is made there, as the model
makes it, and the features added to it by the model's own `_deepstack_process` (which its adapter
replaces with a version that takes positions).
"""

from __future__ import annotations

import torch

from batchvl.layers.residual_norm import DECODER, PRE_NORM_LAYERS

# transformers 5.17-5.24's text models whose forward is embeddings -> rotary -> layers -> norm, nothing
# else that the engine's step uses (masks and caches aside), and whose layers are DECODER layers
TEXT_MODELS = (
    "Qwen2VLTextModel",
    "Qwen2_5_VLTextModel",
    "Qwen3VLTextModel",
    "LlamaModel",
    "Qwen2Model",
    "MistralModel",
)


def add_and_norm(
    norm: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of `residual + hidden_states`, that sum): by the norm's own kernel where it has one."""
    fused = getattr(norm, "add_and_norm", None)
    if fused is not None:
        return fused(hidden_states, residual)
    summed = residual + hidden_states
    return norm(summed), summed


class DecoderStack:
    """The text model's forward over the engine's packed step (batch 1), as the engine's own loop."""

    def __init__(self, text_model: torch.nn.Module, layers: list[torch.nn.Module]):
        self.text_model = text_model
        self.layers = layers

    @classmethod
    def of(cls, text_model: torch.nn.Module) -> DecoderStack | None:
        """The stack of a text model the loop computes as transformers does; None for another."""
        if type(text_model).__name__ not in TEXT_MODELS:
            return None
        layers = list(text_model.layers[: text_model.config.num_hidden_layers])
        if not all(PRE_NORM_LAYERS.get(type(layer).__name__) is DECODER for layer in layers):
            return None
        return cls(text_model, layers)

    def __call__(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        visual_pos_masks: torch.Tensor | None = None,
        deepstack_visual_embeds: list[torch.Tensor] | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        """The final norm's output (1, T, hidden) for input embeddings (1, T, hidden) at the positions the
        text model takes (a text axis before M-RoPE's three is dropped, as the model drops it); Qwen3-VL's
        deepstack arguments as its text model takes them."""
        text = self.text_model
        if position_ids.ndim == 3 and position_ids.shape[0] == 4:
            position_ids = position_ids[1:]
        position_embeddings = text.rotary_emb(inputs_embeds, position_ids)
        deepstack = deepstack_visual_embeds or []
        hidden, residual = inputs_embeds, None
        for index, layer in enumerate(self.layers):
            if residual is None:  # the first layer, or one after deepstack features: its input is whole
                normed, residual = layer.input_layernorm(hidden), hidden
            else:
                normed, residual = add_and_norm(layer.input_layernorm, hidden, residual)
            attended = layer.self_attn(
                hidden_states=normed,
                position_embeddings=position_embeddings,
                attention_mask=None,
                **attention_kwargs,
            )[0]
            normed, residual = add_and_norm(layer.post_attention_layernorm, attended, residual)
            hidden = layer.mlp(normed)
            if index < len(deepstack):
                hidden = text._deepstack_process(residual + hidden, visual_pos_masks, deepstack[index])
                residual = None
        if residual is None:
            return text.norm(hidden)
        return add_and_norm(text.norm, hidden, residual)[0]
