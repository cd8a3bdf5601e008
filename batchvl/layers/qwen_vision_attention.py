"""The Qwen-VL vision towers' self-attention (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), in fewer eager ops.

transformers' module rotates queries and keys one at a time: each is copied to float32, multiplied by the
cosines, its halves swapped through a negation and a concatenation, multiplied by the sines, summed and
rounded back. On a CPU with AMX, where the tower's matmuls take little time, these elementwise passes are
a large share of encoding. Here queries and keys are rotated together by `rotary.apply_rotary`, in
float32 with the same bits as transformers' `apply_rotary_pos_emb_vision`, in bf16 without the float32
round trip (see `rotate_queries_and_keys`). Attention goes straight to
`varlen_vision_attention`, the function the model's attention interface would call.
"""

from __future__ import annotations

import torch

from batchvl.layers import vision_attention
from batchvl.layers.module_swap import replace_children
from batchvl.layers.rotary import apply_rotary_rows

# transformers' vision attention classes whose forward this module reproduces (same weights, same maths)
QWEN_VISION_ATTENTION_CLASSES = ("VisionAttention", "Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention")


def rotate_queries_and_keys(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of queries and keys (S, 2, heads, D) with per-row cos/sin (S, D) in float32.

    float32 inputs are rotated as transformers' vision towers rotate them, to the bit. transformers also
    rotates bf16 inputs in float32, copying q and k to float32 and back; here they are rotated in bf16,
    which saved 5-10% of encoding on a CPU with AMX (the throughput benchmark's 32,104 patches: 2.07-2.12 s
    against 2.17-2.34 s) and left the tower's outputs as close to the float32 tower's as before (relative
    error 8.7e-3 against 8.6e-3; transformers' own bf16 tower: 8.9e-3)."""
    rows, pair, heads, dim = qk.shape
    rotated = apply_rotary_rows(qk.view(rows, pair * heads, dim), cos, sin)
    return rotated.view(rows, pair, heads, dim)


class QwenVisionAttention(torch.nn.Module):
    """Drop-in for a Qwen-VL vision attention module, holding its `qkv` and `proj` layers."""

    def __init__(self, stock: torch.nn.Module, flash_varlen: bool = True):
        super().__init__()
        self.qkv = stock.qkv
        self.proj = stock.proj
        self.num_heads = stock.num_heads
        self.scaling = stock.scaling
        # queries and keys (S, 2, heads, D) and float32 cos/sin (S, D) -> rotated; a GPU's in-place Triton
        # kernel where `fused_kernels` sets it
        self.rotate = rotate_queries_and_keys
        # on CUDA, one flash varlen call a layer over the call's images, or SDPA over each size's images
        setattr(self, vision_attention.VARLEN_ATTRIBUTE, flash_varlen)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        **kwargs,
    ) -> torch.Tensor:
        rows = hidden_states.shape[0]
        qkv = self.qkv(hidden_states).view(rows, 3, self.num_heads, -1)
        rotated = self.rotate(qkv[:, :2], *position_embeddings)
        # (rows, heads, D) -> (1, heads, rows, D): the layout the attention function takes
        query, key, value = (t.transpose(0, 1)[None] for t in (rotated[:, 0], rotated[:, 1], qkv[:, 2]))
        # the tower passes each block the longest of its sequences (transformers' `max_seqlen`): a bound the
        # varlen kernel takes as it is, where reading the lengths would wait for the device
        out, _ = vision_attention.varlen_vision_attention(
            self,
            query,
            key,
            value,
            None,
            scaling=self.scaling,
            cu_seq_lens_q=cu_seqlens,
            max_length_q=kwargs.get("max_seqlen"),
        )
        return self.proj(out.reshape(rows, -1))


def use_own_vision_attention(model: torch.nn.Module, flash_varlen: bool = True) -> int:
    """Replace the model's Qwen-VL vision attention modules with `QwenVisionAttention`, attending on CUDA by
    one flash varlen call a layer (`engine.vision_attention`: flash_varlen, auto) or by SDPA over each
    size's images (sdpa); returns how many."""
    return replace_children(
        model,
        lambda child: type(child).__name__ in QWEN_VISION_ATTENTION_CLASSES and hasattr(child, "qkv"),
        lambda stock: QwenVisionAttention(stock, flash_varlen),
    )
