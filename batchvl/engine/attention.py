"""Packed attention over the engine's paged KV cache, plugged into transformers' AttentionInterface.

All scheduled tokens of a step go through the decoder as ONE packed sequence. transformers computes
q/k/v and applies RoPE, then calls `paged_attention` per layer; it writes this step's K/V into the
cache slots and attends each request's queries to that request's cached keys, so requests never see each
other. Batch metadata arrives as the `batchvl_attention` keyword argument, passed untouched by
transformers from the decoder call down to this function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAGED_ATTENTION_NAME = "batchvl_paged"


@dataclass
class KVCache:
    """Per layer, K and V of every slot: (num_slots, num_kv_heads, head_dim)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_slots, num_kv_heads, head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )


@dataclass
class SequenceSlice:
    """One request's part of the packed step."""

    query_start: int  # first row of this request's queries in the packed step
    num_queries: int
    key_slots: torch.Tensor  # cache slots of all its tokens so far (context + this chunk), in position order
    mask: torch.Tensor | None  # (num_queries, num_keys) bool, True = attend; None = causal from 0 or decode

    @property
    def is_full_causal(self) -> bool:
        return self.num_queries == len(self.key_slots) and self.num_queries > 1


@dataclass
class PagedAttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each packed token
    sequences: list[SequenceSlice]


def chunk_mask(start: int, num_queries: int, device) -> torch.Tensor | None:
    """Mask for queries at positions [start, start+num_queries) over keys [0, start+num_queries)."""
    if num_queries == 1 or start == 0:
        return None  # decode attends to everything; a chunk from position 0 is plain causal
    key_pos = torch.arange(start + num_queries, device=device)
    query_pos = torch.arange(start, start + num_queries, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    batchvl_attention: PagedAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta = batchvl_attention
    if meta is None:
        raise RuntimeError(
            "paged attention needs batchvl_attention metadata; run the model through the engine"
        )
    layer = module.layer_idx
    k_cache, v_cache = meta.kv_cache.keys[layer], meta.kv_cache.values[layer]
    # (1, Hkv, T, D) -> (T, Hkv, D), the cache's slot layout.
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    num_tokens = query.shape[2]
    out = query.new_empty((num_tokens, query.shape[1], query.shape[3]))
    for seq in meta.sequences:
        rows = slice(seq.query_start, seq.query_start + seq.num_queries)
        q = query[:, :, rows]
        if seq.is_full_causal:
            # The whole context is this chunk: its K/V are the inputs themselves, no gather needed.
            k, v = key[:, :, rows], value[:, :, rows]
        else:
            k = k_cache[seq.key_slots].transpose(0, 1)[None]
            v = v_cache[seq.key_slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seq.mask, is_causal=seq.is_full_causal, scale=scaling, enable_gqa=True
        )
        out[rows] = o[0].transpose(0, 1)
    return out[None], None


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention)
