"""Packed attention over the engine's paged KV cache, plugged into transformers' AttentionInterface.

All scheduled tokens of a step go through the decoder as ONE packed sequence. transformers computes
q/k/v and applies RoPE, then calls `paged_attention` per layer; it writes this step's K/V into the
cache slots and attends each request's queries to that request's cached keys, so requests never see each
other. Batch metadata arrives as the `batchvl_attention` keyword argument, passed untouched by
transformers from the decoder call down to this function.

A step's decodes (one query each) are attended straight from the cache by the native kernel on a CPU
where it builds (`native_kernels`) and by Triton's on CUDA (`triton_attention`); elsewhere they are
gathered into a few padded batches for torch's attention. Prefill chunks, in bf16 on a CPU with bf16 dot
products (`cpu_attention.use_native_attention`) and on CUDA, are attended straight from the cache too, all
in one call per layer; elsewhere each takes torch's attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from batchvl.layers import triton_attention
from batchvl.layers.cpu_attention import use_native_attention
from batchvl.layers.cpu_features import has_amx
from batchvl.layers.native_kernels import HEAD_DIMS, native_ops, runs_natively
from batchvl.layers.triton_grouped_decode import split_count
from batchvl.utils.int_tensors import int64_tensor
from batchvl.utils.page_locked import host_empty

PAGED_ATTENTION_NAME = "batchvl_paged"


@dataclass
class KVCache:
    """Per layer, K and V of every slot in one tensor, head-major: (2, num_kv_heads, num_slots, head_dim).

    Head-major, so that a gather lands in the (kv_heads, keys, dim) layout the attention matmuls read
    without a transposing copy; K and V in one tensor, so that one `index_select` gathers both (advanced
    indexing with a slot tensor was about 10x slower for the same rows).
    """

    layers: list[torch.Tensor]
    # Whether a step's decodes are attended by the native kernel, straight from the cache. Decided when the
    # cache is allocated, so that the kernel is built (once per machine, about half a minute) before the first
    # step.
    decodes_in_place: bool = False
    # Whether prefill chunks are attended by the native bf16 kernel, straight from the cache.
    prefills_in_place: bool = False

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        # Not zero-filled: filling the whole cache cost about 0.25 s per job (and made every page resident
        # at once). A slot is always written before a request reads it, except slot 0, which pads the
        # decode batch's key lists (masked out); it is zeroed so the padding is finite, since a masked
        # weight of 0 times a NaN is still NaN.
        shape = (2, num_kv_heads, num_slots, head_dim)
        layers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for layer in layers:
            layer[:, :, 0].zero_()
        return cls(layers, reads_cache_in_place(layers[0]), prefills_read_cache_in_place(layers[0]))

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a step's K and V, each (num_kv_heads, T, head_dim), at `slots` (T,)."""
        kv = self.layers[layer]
        kv[0].index_copy_(1, slots, key)
        kv[1].index_copy_(1, slots, value)

    def gather_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of a flattened layer that hold K, then V, of every head at `slots` (any shape, flattened).
        The same for every layer: a step computes them once per sequence."""
        _, kv_heads, num_slots, _ = self.layers[0].shape
        first = torch.arange(2 * kv_heads, device=slots.device)[:, None] * num_slots
        return (first + slots.reshape(1, -1)).reshape(-1)

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the slots that `rows` came from, each (num_kv_heads, num_slots_gathered, head_dim)."""
        kv = self.layers[layer]
        _, kv_heads, _, dim = kv.shape
        picked = kv.view(-1, dim).index_select(0, rows).view(2, kv_heads, -1, dim)
        return picked[0], picked[1]


@dataclass
class SequenceSlice:
    """One request's part of the packed step."""

    query_start: int  # first row of this request's queries in the packed step
    num_queries: int  # its queries are its last num_queries tokens, each attending causally
    # cache slots of all its tokens so far (context + this chunk), in position order; on the CPU, where the
    # step's metadata is built (a GPU gets what it reads uploaded once per step, not one tensor per sequence).
    # int64, a tensor or a numpy array: the engine passes views of its block manager's numpy slots, where
    # a tensor view per sequence cost 3 us, most of a step's host work per decode
    key_slots: torch.Tensor | np.ndarray
    key_rows: torch.Tensor | None = None  # KVCache.gather_rows(key_slots), when it reads from the cache
    attention_mask: torch.Tensor | None = None  # causal_mask(...), built once a step for every layer
    # len(key_slots), as an int: read for every sequence of a step, where a tensor's len() costs 2 us
    num_keys: int | None = None

    def __post_init__(self):
        if self.num_keys is None:
            self.num_keys = len(self.key_slots)

    @property
    def is_decode(self) -> bool:
        """One query attending to every key so far."""
        return self.num_queries == 1

    @property
    def is_full_causal(self) -> bool:
        return self.num_queries == self.num_keys and self.num_queries > 1

    def causal_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """(num_queries, num_keys) additive mask in `dtype`, 0 where query i, at position start + i after the
        chunk's context of `start` keys, attends and -inf where it does not. None for a decode (it sees every
        key) and for a chunk from position 0 (plain causal). Built only by torch's attention path (the native
        kernels take the lengths alone), once a step: torch's attention turns a bool mask into this one on
        every call, which cost about 0.1 ms of a 0.9 ms bf16 call of 261 queries (one thread, AMX)."""
        start = self.num_keys - self.num_queries
        if self.num_queries == 1 or start == 0:
            return None
        key_pos = torch.arange(start + self.num_queries, device=device)
        query_pos = torch.arange(start, start + self.num_queries, device=device)
        hidden = key_pos[None, :] > query_pos[:, None]
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


# A decode group is split in two where that saves at least this many padded keys: about what one more
# gather and attention call per layer cost in rows (measured on a CPU with AMX, bf16, 2 threads).
MIN_KEYS_SAVED_PER_GROUP = 1024
MAX_DECODE_GROUPS = 4


@dataclass
class DecodeBatch:
    """Single-query sequences (decodes) of a step, attended in one call over keys padded to the longest.

    One attention call instead of one per sequence: on a decode-heavy step the per-call overhead of
    dozens of small calls outweighed the padding. A step's decodes form a few such batches of similar
    lengths (`length_groups`). Built once per step, used by every layer.
    """

    rows: torch.Tensor  # (B,) packed row of each query
    key_rows: torch.Tensor  # KVCache.gather_rows of the (B, L) key slots, each sequence padded with slot 0
    mask: torch.Tensor  # (B, L) bool, True = a real key

    @classmethod
    def build(cls, sequences: list[SequenceSlice], kv_cache: KVCache, device) -> DecodeBatch:
        longest = max(seq.num_keys for seq in sequences)
        key_slots = torch.zeros((len(sequences), longest), dtype=torch.long)
        lengths = torch.tensor([seq.num_keys for seq in sequences])
        for i, seq in enumerate(sequences):
            key_slots[i, : seq.num_keys] = torch.as_tensor(seq.key_slots)
        mask = torch.arange(longest)[None, :] < lengths[:, None]
        rows = torch.tensor([seq.query_start for seq in sequences])
        return cls(rows.to(device), kv_cache.gather_rows(key_slots.to(device)), mask.to(device))


def key_slot_table(sequences: list[SequenceSlice]) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernels' view of where sequences' keys are: (B, L) cache slots, each row in position order
    (past its length: unread), and (B,) lengths."""
    slots = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(seq.key_slots) for seq in sequences], batch_first=True
    )
    return slots, int64_tensor([seq.num_keys for seq in sequences])


@dataclass
class InPlaceDecodes:
    """Every single-query sequence of a step, attended by the native kernel where the cache holds its keys
    (`native_kernels`): no gather, no padding to a common length, one call per layer."""

    rows: torch.Tensor  # (B,) packed row of each query
    # the sequences' cache pages, each sequence's in position order from its start: the engine's block table
    # (a row per request, see `DeviceBlockTable`), or the slots of sequences given one by one
    pages: torch.Tensor
    starts: torch.Tensor  # (B,) where each sequence's pages begin in `pages`
    lengths: torch.Tensor  # (B,) keys
    page_size: int  # slots per page: the block size, or 1 where the pages are the slots themselves
    # Triton's grouped kernel: programs per sequence and KV head, where the caller fixes them (a CUDA graph,
    # whose pages buffer is not the step's); None: the kernel's choice from the step's pages
    splits: int | None = None

    @classmethod
    def build(cls, sequences: list[SequenceSlice], device: torch.device) -> InPlaceDecodes:
        """Sequences given one by one: their slots, one after the other, are the pages. (The engine passes
        its block table instead: at 256 decodes of 600 keys the slots were 150k ints to join and upload
        every step.)"""
        pages = [np.asarray(seq.key_slots) for seq in sequences]
        counts = np.array([len(own) for own in pages], dtype=np.int64)
        starts = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=starts[1:])
        rows = int64_tensor([seq.query_start for seq in sequences])
        lengths = int64_tensor([seq.num_keys for seq in sequences])
        joined = torch.from_numpy(np.concatenate(pages))
        return cls(*uploaded([rows, joined, torch.from_numpy(starts), lengths], device), page_size=1)

    def attend(self, out: torch.Tensor, query: torch.Tensor, kv: torch.Tensor, scaling: float) -> None:
        """Write into `out` (T, H, D), at each decode's row, its attention over its cached keys; `query` is
        (H, T, D) with contiguous heads, `kv` one layer of the cache."""
        kernels = paged_kernels(kv)
        splits = {"splits": self.splits} if kernels is triton_attention and self.splits is not None else {}
        kernels.paged_decode_attention(
            out, query, kv, self.rows, self.pages, self.starts, self.lengths, scaling, self.page_size,
            **splits,
        )  # fmt: skip


def decode_splits(kv_heads: int, lengths: np.ndarray, page_size: int) -> int:
    """Triton's grouped decode kernel's splits for decodes of `lengths` keys: what it chooses from the pages
    it is given where those are the sequences' own, for a caller that gives it a block table instead."""
    pages = int((-(-lengths // page_size)).sum())
    return split_count(len(lengths), kv_heads, pages * page_size / len(lengths))


@dataclass
class InPlacePrefills:
    """Every prefill chunk of a step, attended by the native bf16 kernel where the cache holds its keys
    (this step's written before): no gather, no mask, one call per layer."""

    starts: torch.Tensor  # (B,) packed row of each chunk's first query
    counts: torch.Tensor  # (B,) its queries, at the last positions of its keys
    slots: torch.Tensor  # (B, L) cache slots of each chunk's keys (context and chunk), in order
    lengths: torch.Tensor  # (B,)
    most_queries: int  # the largest count (Triton's grid, known on the host)

    @classmethod
    def build(cls, sequences: list[SequenceSlice], device: torch.device) -> InPlacePrefills:
        counts = [seq.num_queries for seq in sequences]
        starts = int64_tensor([seq.query_start for seq in sequences])
        tensors = uploaded([starts, int64_tensor(counts), *key_slot_table(sequences)], device)
        return cls(*tensors, max(counts))

    def attend(self, out: torch.Tensor, query: torch.Tensor, kv: torch.Tensor, scaling: float) -> None:
        """Write into `out` (T, H, D) each chunk's causal attention; `query` (H, T, D) with contiguous heads,
        `kv` a cache layer."""
        kernels = paged_kernels(kv)
        grid = (self.most_queries,) if kernels is triton_attention else ()
        kernels.paged_prefill_attention(
            out, query, kv, self.starts, self.counts, self.slots, self.lengths, scaling, *grid
        )


@dataclass
class PagedAttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each packed token
    sequences: list[SequenceSlice]  # attended one by one (prefill chunks)
    decodes: list[DecodeBatch] = field(default_factory=list)  # the single-query sequences, by length
    in_place_decodes: InPlaceDecodes | None = None  # or all of them, where the native kernel runs
    in_place_prefills: InPlacePrefills | None = None  # the prefill chunks, where the bf16 kernel runs

    @classmethod
    def build(
        cls,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        sequences: list[SequenceSlice],
        device,
        in_place_decodes: InPlaceDecodes | None = None,
    ) -> PagedAttentionMetadata:
        """Split off the decodes and compute, once for all layers, the cache rows each sequence reads. A
        caller that has the decodes' pages on the device already (the engine's block table) passes them as
        `in_place_decodes`, and none among `sequences`."""
        single = [seq for seq in sequences if seq.is_decode]
        if in_place_decodes is not None:
            meta = cls(kv_cache, slot_mapping, sequences, in_place_decodes=in_place_decodes)
        elif single and kv_cache.decodes_in_place:
            others = [seq for seq in sequences if not seq.is_decode]
            decodes = InPlaceDecodes.build(single, device)
            meta = cls(kv_cache, slot_mapping, others, in_place_decodes=decodes)
        else:
            meta = cls(kv_cache, slot_mapping, *split_decodes(sequences, kv_cache, device))
        if meta.sequences and kv_cache.prefills_in_place:
            meta.in_place_prefills = InPlacePrefills.build(meta.sequences, device)
            meta.sequences = []
        for seq in meta.sequences:
            if not seq.is_full_causal:
                seq.key_rows = kv_cache.gather_rows(torch.as_tensor(seq.key_slots).to(device))
                seq.attention_mask = seq.causal_mask(kv_cache.layers[0].dtype, device)
        return meta


def reads_cache_in_place(layer: torch.Tensor) -> bool:
    """Whether decodes can go to a kernel that reads the cache where it is: the native one, for a cache (a
    layer of it) it takes with a head size it is compiled for, or Triton's on CUDA."""
    return (layer.shape[-1] in HEAD_DIMS and runs_natively(layer)) or triton_attention.takes(layer)


def prefills_read_cache_in_place(layer: torch.Tensor) -> bool:
    """Whether prefill chunks can go to a kernel that reads the cache where it is: the native bf16 one on a
    CPU with bf16 dot products, or Triton's on CUDA."""
    return use_native_attention(layer) or triton_attention.takes(layer)


def paged_kernels(layer: torch.Tensor):
    """The kernels that attend straight from this cache layer: Triton's on CUDA (or under Triton's
    interpreter, as tests run them), the native ones on the CPU."""
    return (
        native_ops() if layer.device.type == "cpu" and not triton_attention.takes(layer) else triton_attention
    )


def uploaded(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Integer step metadata on `device` in one copy: packed into one host tensor, moved, and split again
    (a copy per tensor costs a transfer each on a GPU). The packed tensor is page-locked for a CUDA device
    (`page_locked`), and the copy does not wait. The device's stream orders the copy before the kernels that
    read it."""
    if torch.device(device).type == "cpu":
        return tensors
    flat = [tensor.reshape(-1).to(torch.long) for tensor in tensors]
    staging = host_empty(sum(piece.numel() for piece in flat), torch.long, device)
    torch.cat(flat, out=staging)
    packed = staging.to(device, non_blocking=True)
    pieces = packed.split([tensor.numel() for tensor in tensors])
    return [piece.view(tensor.shape) for piece, tensor in zip(pieces, tensors, strict=True)]


def split_decodes(
    sequences: list[SequenceSlice], kv_cache: KVCache, device
) -> tuple[list[SequenceSlice], list[DecodeBatch]]:
    """Decodes go into DecodeBatches, one per group of similar lengths (the torch path)."""
    single = [seq for seq in sequences if seq.is_decode]
    if len(single) < 2:
        return sequences, []
    others = [seq for seq in sequences if not seq.is_decode]
    groups = length_groups([seq.num_keys for seq in single])
    return others, [DecodeBatch.build([single[i] for i in group], kv_cache, device) for group in groups]


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of the decode sequences in groups that each pad to their own longest, longest group first.

    One batch pads every sequence to the step's longest; with images of many sizes in flight, half the
    keys a step gathered and attended were padding. Taken longest first, a group is cut in two at the
    point that pads the fewest keys, while that saves at least `MIN_KEYS_SAVED_PER_GROUP` keys and there
    are fewer than `MAX_DECODE_GROUPS` groups."""
    groups = [sorted(range(len(lengths)), key=lambda i: -lengths[i])]
    while len(groups) < MAX_DECODE_GROUPS:
        best = None  # (keys saved, group number, cut)
        for number, group in enumerate(groups):
            longest = lengths[group[0]]
            for cut in range(1, len(group)):
                saved = (len(group) - cut) * (longest - lengths[group[cut]])
                if best is None or saved > best[0]:
                    best = (saved, number, cut)
        if best is None or best[0] < MIN_KEYS_SAVED_PER_GROUP:
            break
        _, number, cut = best
        group = groups.pop(number)
        groups[number:number] = [group[:cut], group[cut:]]
    return [sorted(group) for group in groups]  # each in step order


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    batchvl_attention: PagedAttentionMetadata | None = None,
    kv_written: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The step's attention; `kv_written`: whether the caller wrote this step's K/V into the cache already
    (the rotation's kernel does on CUDA: `fused_projections.FusedQKVAttention`)."""
    meta = batchvl_attention
    if meta is None:
        raise RuntimeError(
            "paged attention needs batchvl_attention metadata; run the model through the engine"
        )
    layer = module.layer_idx
    cache = meta.kv_cache
    # (1, Hkv, T, D): already head-major. Rows past the slot mapping pad the step to its row bucket: they
    # write no KV, no query reads them, and their output is zero.
    real = len(meta.slot_mapping)
    if not kv_written:
        cache.write(layer, meta.slot_mapping, key[0, :, :real], value[0, :, :real])

    num_tokens = query.shape[2]
    out = query.new_empty((num_tokens, query.shape[1], query.shape[3]))
    if real < num_tokens:  # (a GPU's eager step has no padding rows: no call to fill none)
        out[real:] = 0
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    heads = query[0] if query.stride(-1) == 1 else query[0].contiguous()  # (H, T, D) as the kernels read it
    if meta.in_place_decodes is not None:
        meta.in_place_decodes.attend(out, heads, cache.layers[layer], scale)
    if meta.in_place_prefills is not None:
        meta.in_place_prefills.attend(out, heads, cache.layers[layer], scale)
    for decode in meta.decodes:
        q = query[0, :, decode.rows].transpose(0, 1)  # (B, H, D)
        out[decode.rows] = decode_attention(q, *cache.gather(layer, decode.key_rows), decode, scaling)
    for seq in meta.sequences:
        rows = slice(seq.query_start, seq.query_start + seq.num_queries)
        q = query[:, :, rows]
        if seq.is_full_causal:
            # The whole context is this chunk: its K/V are the inputs themselves, no gather needed.
            k, v = key[:, :, rows], value[:, :, rows]
        else:
            k, v = (t[None] for t in cache.gather(layer, seq.key_rows))
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=seq.attention_mask,
            is_causal=seq.is_full_causal,
            scale=scaling,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)
    return out[None], None


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, decode: DecodeBatch, scaling: float | None
) -> torch.Tensor:
    """(B, H, D) queries, one per sequence, over their gathered keys and values, each (Hkv, B * L, D);
    returns (B, H, D)."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[0]
    keys = keys.view(kv_heads, batch, -1, dim)  # (Hkv, B, L, D)
    values = values.view(kv_heads, batch, -1, dim)
    if q.dtype == torch.float32 or has_amx():
        # torch's fused CPU kernel is fastest in float32 (and is what the reference model runs), and in bf16
        # where it runs on AMX tiles; the batched matmuls below would also build a oneDNN kernel for every
        # new longest-key count, which changes from one decode step to the next.
        o = F.scaled_dot_product_attention(
            q[:, :, None],
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=decode.mask[:, None, None, :],
            scale=scaling,
            enable_gqa=True,
        )
        return o[:, :, 0]
    # In bf16 without AMX torch's CPU kernel is about twice as slow as two batched matmuls with the query
    # heads of each K/V head grouped (no K/V repeat), scores and softmax in float32.
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # (Hkv, B, G, D)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float()  # (Hkv, B, G, L)
    scores.mul_(dim**-0.5 if scaling is None else scaling)
    scores.masked_fill_(~decode.mask[None, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).transpose(0, 1).reshape(batch, heads, dim)


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention)
