"""torch's own FlashAttention-2 varlen kernel, for the vision tower on CUDA where flash-attn is not
installed (it has no wheel to install on the GPU machines seen so far): every image of a vision call in
one attention call per layer, instead of one SDPA call per image size.

torch 2.11 and later have it public, `torch.nn.attention.varlen.varlen_attn` (2.10's has no `scale`);
older releases (2.6 among them) have the same kernel as the private `aten._flash_attention_forward` with
cumulative sequence lengths, which the public function calls. Both run on CUDA only, in fp16 or bf16 on
Ampere or newer GPUs: the vision attention checks that before calling it, as for flash-attn.
"""

from __future__ import annotations

import functools
import inspect

import torch

PRIVATE_OP = "_flash_attention_forward"


def private_op_takes_cumulative_lengths() -> bool:
    """Whether this torch has the private kernel with per-sequence cumulative lengths (its varlen form)."""
    try:
        op = getattr(torch.ops.aten, PRIVATE_OP)
    except AttributeError:
        return False
    return "cum_seq_q" in {argument.name for argument in op.default._schema.arguments}


def _private_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=None):
    dropout, causal, debug_mask = 0.0, False, False
    out = getattr(torch.ops.aten, PRIVATE_OP)(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout, causal, debug_mask, scale=softmax_scale
    )
    return out[0]


def _takes_scale(function) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == "scale" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


@functools.cache
def torch_varlen_function():
    """torch's varlen kernel behind flash-attn's signature, `(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q,
    max_k, softmax_scale=None)` over (T, H, D) rows and int32 cumulative lengths -> (T, H, D); None where
    this torch has neither route. Looked for once per process."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    # torch 2.10's public function takes no scale (2.11 added it): the private op serves there
    if varlen_attn is None or not _takes_scale(varlen_attn):
        return _private_varlen if private_op_takes_cumulative_lengths() else None

    def public_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=None):
        return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=softmax_scale)

    return public_varlen
