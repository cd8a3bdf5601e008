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
        # Not zero-filled: filling the whole cache cost about 0.25 s per job (and made every page resident
        # at once). A slot is always written before a request reads it, except slot 0, which pads the
        # decode batch's key lists (masked out); it is zeroed so the padding is finite, since a masked
        # weight of 0 times a NaN is still NaN.
        shape = (num_slots, num_kv_heads, head_dim)
        cache = cls(
            keys=[torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            values=[torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )
        for tensor in (*cache.keys, *cache.values):
            tensor[0].zero_()
        return cache


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
class DecodeBatch:
    """The step's single-query sequences (decodes), attended in one call over keys padded to the longest.

    One attention call instead of one per sequence: on a decode-heavy step the per-call overhead of
    dozens of small calls outweighed the padding. Built once per step, used by every layer.
    """

    rows: torch.Tensor  # (B,) packed row of each query
    key_slots: torch.Tensor  # (B, L) cache slots of each sequence's keys, padded with slot 0
    mask: torch.Tensor  # (B, 1, 1, L) bool, True = a real key

    @classmethod
    def build(cls, sequences: list[SequenceSlice], device) -> DecodeBatch:
        longest = max(len(seq.key_slots) for seq in sequences)
        key_slots = torch.zeros((len(sequences), longest), dtype=torch.long)
        lengths = torch.tensor([len(seq.key_slots) for seq in sequences])
        for i, seq in enumerate(sequences):
            key_slots[i, : len(seq.key_slots)] = seq.key_slots
        mask = torch.arange(longest)[None, :] < lengths[:, None]
        rows = torch.tensor([seq.query_start for seq in sequences])
        return cls(rows.to(device), key_slots.to(device), mask[:, None, None, :].to(device))


@dataclass
class PagedAttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each packed token
    sequences: list[SequenceSlice]  # attended one by one (prefill chunks)
    decode: DecodeBatch | None = None  # the single-query sequences, attended together


def split_decodes(sequences: list[SequenceSlice], device) -> tuple[list[SequenceSlice], DecodeBatch | None]:
    """Sequences with one query and no mask (they attend to all their keys) go into one DecodeBatch."""
    single = [seq for seq in sequences if seq.num_queries == 1 and seq.mask is None]
    if len(single) < 2:
        return sequences, None
    others = [seq for seq in sequences if not (seq.num_queries == 1 and seq.mask is None)]
    return others, DecodeBatch.build(single, device)


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
    decode = meta.decode
    if decode is not None:
        q = query[0, :, decode.rows].transpose(0, 1)  # (B, H, D)
        out[decode.rows] = decode_attention(q, k_cache, v_cache, decode, scaling)
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


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeBatch, scaling: float | None
) -> torch.Tensor:
    """(B, H, D) queries, one per sequence, over their cached keys; returns (B, H, D)."""
    k = k_cache[decode.key_slots]  # (B, L, Hkv, D)
    v = v_cache[decode.key_slots]
    if q.dtype == torch.float32:
        # torch's fused CPU kernel is fastest in float32 (and is what the reference model runs).
        o = F.scaled_dot_product_attention(
            q[:, :, None],
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=decode.mask,
            scale=scaling,
            enable_gqa=True,
        )
        return o[:, :, 0]
    # In bf16 torch's CPU kernel is about twice as slow as two batched matmuls with the query heads of
    # each K/V head grouped (no K/V repeat), scores and softmax in float32.
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)  # (B, Hkv, G, D)
    scores = torch.matmul(grouped, k.permute(0, 2, 3, 1)).float()  # (B, Hkv, G, L)
    scores = scores * (dim**-0.5 if scaling is None else scaling)
    scores = scores.masked_fill(~decode.mask, float("-inf"))  # mask (B, 1, 1, L)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v.transpose(1, 2)).reshape(batch, heads, dim)


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention)
