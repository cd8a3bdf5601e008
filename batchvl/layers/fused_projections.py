"""Projections that read the same input, fused into one linear layer: q/k/v, and an MLP's gate and up.

A decoder layer multiplies its input by the query, key and value weights, and its MLP's input by the gate
and up weights: five matmuls where two do, as vLLM's `QKVParallelLinear` and `MergedColumnParallelLinear`
do it. Concatenated along the output dimension, each output column is the same dot product as before:
in fp32 the fused layers give the bits of the separate ones; in bf16 oneDNN may block the wider matmul
differently (measured: at most one bf16 rounding step apart, at some row counts). Fewer, wider calls
matter most where the engine spends its steps, decoding a few dozen rows at a time.

The attention module also rotates queries and keys in one call (`rotary.apply_rotary`, transformers'
bits) and calls the engine's paged attention directly; Qwen3-VL's normalizes each query and key head
before the rotation, as its stock module does. Both modules are drop-ins for the stock ones, built before
the weights are packed (`packed_linear` then packs the fused layers) and before the RMSNorms are swapped
(so q/k norms, kept as modules, take the native or Triton RMSNorm as every other norm does).
"""

from __future__ import annotations

import torch

from batchvl.layers.attention import paged_attention
from batchvl.layers.module_swap import replace_children
from batchvl.layers.native_kernels import native_ops, runs_natively
from batchvl.layers.rotary import apply_rotary_rows

# Attention modules computing o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))) with the
# cos/sin the decoder passes as `position_embeddings` (Qwen3-VL's with q_norm and k_norm, per head, between
# projection and rotation), and MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x)), in
# transformers 5.23.
FUSABLE_ATTENTION = (
    "Qwen2VLAttention",
    "Qwen2_5_VLAttention",
    "Qwen3VLTextAttention",
    "LlamaAttention",
    "Qwen2Attention",  # InternVL3's text
)
FUSABLE_MLPS = ("Qwen2MLP", "Qwen2_5_VLMLP", "Qwen3VLTextMLP", "LlamaMLP")


def fused_linear(*linears: torch.nn.Linear) -> torch.nn.Linear:
    """One linear layer whose outputs are those of `linears`, side by side."""
    first = linears[0]
    has_bias = first.bias is not None
    fused = torch.nn.Linear(
        first.in_features, sum(m.out_features for m in linears), bias=has_bias, device="meta"
    )
    with torch.no_grad():
        fused.weight = torch.nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
        if has_bias:
            fused.bias = torch.nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return fused


class GatedMLP(torch.nn.Module):
    """`down_proj(act_fn(gate) * up)`, with gate and up from one fused layer. A SiLU MLP takes the activation
    and the product in one pass where a kernel of torch's SiLU arithmetic and roundings runs: the native
    one on the CPU, where it builds, or a GPU's Triton one (`fused_kernels` sets it)."""

    def __init__(self, stock: torch.nn.Module):
        super().__init__()
        self.intermediate_size = stock.gate_proj.out_features
        self.gate_up_proj = fused_linear(stock.gate_proj, stock.up_proj)
        self.act_fn = stock.act_fn
        self.down_proj = stock.down_proj
        native = is_silu(stock.act_fn) and runs_natively(stock.gate_proj.weight)
        # (..., 2 * intermediate) -> (..., intermediate), or None: the eager ops
        self.silu_and_mul = native_silu_and_mul if native else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # The product written over the activation's output: the same op on the same operands, one
        # (tokens x intermediate) tensor fewer per layer.
        return self.down_proj(self.act_fn(gate).mul_(up))


def native_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a CPU gate/up output (..., 2 * I), gate first, by the native kernel: (..., I)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    activated = rows.new_empty((rows.shape[0], rows.shape[1] // 2))
    native_ops().silu_and_mul(activated, rows)
    return activated.view(*gate_up.shape[:-1], activated.shape[1])


def is_silu(activation: torch.nn.Module) -> bool:
    """torch's SiLU module or transformers' (`ACT2FN["silu"]`, which calls F.silu)."""
    return isinstance(activation, torch.nn.SiLU) or type(activation).__name__ == "SiLUActivation"


class FusedQKVAttention(torch.nn.Module):
    """A decoder layer's self-attention over the engine's paged KV cache, with q/k/v from one fused layer
    and, where the stock module has them (Qwen3-VL), its per-head q_norm and k_norm before the rotation.
    Takes the packed step as batch 1, (1, T, hidden), as the engine runs the decoder."""

    def __init__(self, stock: torch.nn.Module):
        super().__init__()
        config = stock.config
        self.layer_idx = stock.layer_idx
        self.head_dim = stock.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = stock.scaling
        self.qkv_proj = fused_linear(stock.q_proj, stock.k_proj, stock.v_proj)
        self.o_proj = stock.o_proj
        # RMSNorms over each head's D values, or None (the other families)
        self.q_norm = getattr(stock, "q_norm", None)
        self.k_norm = getattr(stock, "k_norm", None)
        # queries and keys (T, heads + kv heads, D) and cos/sin (T, D) -> rotated; a GPU's in-place Triton
        # kernel where `fused_kernels` sets it
        self.rotate = apply_rotary_rows
        # or, where `fused_kernels` sets it, that rotation writing the keys and the values (T, kv heads, D)
        # into a cache layer at the step's slots too (`triton_elementwise.rotary_into_cache_`), so that the
        # attention does not copy them there itself
        self.rotate_into_cache = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        batchvl_attention=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        rows = hidden_states.shape[1]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden_states).view(rows, heads + 2 * kv_heads, self.head_dim)
        cos, sin = (t[0] for t in position_embeddings)  # (1, T, D) -> (T, D)
        values = qkv[:, heads + kv_heads :]
        meta = batchvl_attention
        written = self.rotate_into_cache is not None and meta is not None
        if written:
            layer = meta.kv_cache.layers[self.layer_idx]
            qk = self.normalized_queries_and_keys(qkv)
            rotated = self.rotate_into_cache(qk, values, cos, sin, layer, meta.slot_mapping)
        else:
            rotated = self.rotate(self.normalized_queries_and_keys(qkv), cos, sin)
        # (T, heads, D) -> (1, heads, T, D): the layout the attention function takes
        query = rotated[:, :heads].transpose(0, 1)[None]
        key = rotated[:, heads:].transpose(0, 1)[None]
        value = values.transpose(0, 1)[None]
        out, _ = paged_attention(
            self, query, key, value, None, scaling=self.scaling, batchvl_attention=meta, kv_written=written
        )
        return self.o_proj(out.reshape(1, rows, -1)), None

    def normalized_queries_and_keys(self, qkv: torch.Tensor) -> torch.Tensor:
        """The queries and keys of qkv (T, heads + 2 kv heads, D), side by side for one rotation: a view
        of qkv, or where the module has q/k norms, their outputs in one new tensor (which the rotation may
        overwrite, as it may the view)."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.q_norm is None:
            return qkv[:, : heads + kv_heads]
        query = self.q_norm(qkv[:, :heads])
        key = self.k_norm(qkv[:, heads : heads + kv_heads])
        return torch.cat([query, key], dim=1)


def fuse_projections(model: torch.nn.Module) -> int:
    """Replace the model's fusable attention modules and MLPs (weights on the CPU, before packing) with
    their fused versions; returns how many modules were replaced."""
    replacements = {
        **dict.fromkeys(FUSABLE_ATTENTION, FusedQKVAttention),
        **dict.fromkeys(FUSABLE_MLPS, GatedMLP),
    }
    return replace_children(
        model,
        lambda child: type(child).__name__ in replacements,
        lambda stock: replacements[type(stock).__name__](stock),
    )
