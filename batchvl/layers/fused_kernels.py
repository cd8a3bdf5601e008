"""`engine.fused_kernels`: on CUDA, a model's elementwise passes as one Triton kernel each
(`triton_elementwise`), where eager PyTorch runs several kernels, each reading and writing the whole
activation again: RMSNorm (seven or eight kernels eager; Qwen3-VL's per-head q/k norms too), the MLP's
SiLU(gate) * up, the vision towers' LayerNorm and QuickGELU, each norm with the residual add before a
layer's second norm (decoder layers, vision encoder layers and blocks: `residual_norm`), and the rotary
embedding of queries and keys in batchvl's own attention modules, every family's text attention and the
Qwen-VL vision towers' (five to seven kernels per tensor eager). Each kernel rounds where the module it
replaces rounds.

The residual add that ends a decoder layer goes to the next norm's kernel in the engine's own loop of
layers (`decoder_stack`), the one that ends a vision layer to the next layer's first norm's kernel
(`residual_norm`). Left eager: the add that ends a tower's last layer, the GELUs
(GELU-tanh in SigLIP's and Qwen3-VL's vision MLPs, the exact GELU in LLaVA's projector and the Qwen-VL
mergers: torch runs each as one kernel already, so a Triton one could only take in the bias add before it,
which would round a bf16 matmul's output twice) and, for that reason, the bias before QuickGELU (see
`TritonQuickGELU`).

Applied by the loader on CUDA only; the tests apply it to CPU models under Triton's interpreter.
"""

from __future__ import annotations

import torch
from transformers.activations import QuickGELUActivation

from batchvl.layers import triton_elementwise
from batchvl.layers.fused_projections import FusedQKVAttention, GatedMLP, is_silu
from batchvl.layers.module_swap import replace_children
from batchvl.layers.qwen_vision_attention import QwenVisionAttention
from batchvl.layers.residual_norm import fuse_residual_norms, fused_residual_norm, fused_successor
from batchvl.layers.rms_norm import STOCK_RMS_NORMS
from batchvl.layers.triton_modules import (
    TritonLayerNorm,
    TritonQuickGELU,
    TritonRMSNorm,
    replaces_layer_norm,
)


def rotate_text_rows(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`FusedQKVAttention.rotate` by the kernel, in place: queries and keys (T, heads, D) of the fused q/k/v
    output, which nothing else reads."""
    return triton_elementwise.rotary_(qk, cos.contiguous(), sin.contiguous())


def rotate_text_rows_into_cache(*args: torch.Tensor) -> torch.Tensor:
    """`rotate_text_rows` that also writes the keys and the values into a cache layer at the step's slots
    (`FusedQKVAttention.rotate_into_cache`; `triton_elementwise.rotary_into_cache_`'s arguments)."""
    return triton_elementwise.rotary_into_cache_(*args)


def rotate_vision_rows(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`QwenVisionAttention.rotate` by the kernel, in place, in float32 as transformers' vision towers
    rotate (S, 2, heads, D) queries and keys."""
    rows, pair, heads, dim = qk.shape
    triton_elementwise.rotary_(qk.view(rows, pair * heads, dim), cos, sin, vision=True)
    return qk


def use_fused_kernels(model: torch.nn.Module) -> dict[str, int]:
    """Swap in the kernels wherever the model has what they replace; how many of each were swapped."""
    counts = {
        "rms_norm": replace_children(
            model, lambda child: type(child).__name__ in STOCK_RMS_NORMS, TritonRMSNorm
        ),
        "layer_norm": replace_children(model, replaces_layer_norm, TritonLayerNorm),
        "quick_gelu": replace_children(
            model, lambda child: type(child) is QuickGELUActivation, lambda _: TritonQuickGELU()
        ),
        "silu_and_mul": 0,
        "text_rotary": 0,
        "vision_rotary": 0,
    }
    for module in model.modules():
        if isinstance(module, GatedMLP) and is_silu(module.act_fn):
            module.silu_and_mul = triton_elementwise.silu_and_mul
            counts["silu_and_mul"] += 1
        elif isinstance(module, FusedQKVAttention):
            module.rotate = rotate_text_rows
            module.rotate_into_cache = rotate_text_rows_into_cache
            counts["text_rotary"] += 1
        elif isinstance(module, QwenVisionAttention):
            module.rotate = rotate_vision_rows
            counts["vision_rotary"] += 1
    fuse_residual_norms(model)  # where the norms above are Triton's
    norms = [fused_residual_norm(module) for module in model.modules()]
    counts["residual_rms_norm"] = sum(isinstance(norm, TritonRMSNorm) for norm in norms)
    counts["residual_layer_norm"] = sum(isinstance(norm, TritonLayerNorm) for norm in norms)
    counts["closing_add_ahead"] = sum(fused_successor(module) is not None for module in model.modules())
    return counts
