"""Vision-tower attention over many images in ONE call per layer (images never attend to each other).

transformers hands a vision attention function the packed patches of all images plus `cu_seqlens` only
when the implementation's name contains "flash"; under that name this function runs:
- flash-attn's varlen kernel on CUDA when the package is installed;
- otherwise batched SDPA calls: consecutive sequences (images, or a video's frame groups) of similar
  length (within SIMILAR_LENGTHS) are laid out as one batch padded to the longest, with padded keys
  masked; equal lengths need no padding and no mask at all. The engine packs an encode call's images
  sorted by patch count, so similar sequences are neighbours and each run is a slice, not a gather.

The linear layers around the attention see every image of the call at once, whatever their sizes: one
vision forward per encode call instead of one per size class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VISION_ATTENTION_NAME = "batchvl_flash_varlen"  # "flash" in the name makes transformers pass cu_seqlens
SIMILAR_LENGTHS = 1.25  # sequences batched in one SDPA call differ in length by at most this factor


def _flash_varlen(query, key, value, cu_seqlens, max_length, scaling):
    from flash_attn import flash_attn_varlen_func

    # (1, H, T, D) -> (T, H, D)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu = cu_seqlens.to(torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_length, max_length, softmax_scale=scaling)
    return out[None]


def _batched_sdpa(query, key, value, lengths: list[int], scaling):
    _, heads, total, head_dim = query.shape
    count, longest = len(lengths), max(lengths)
    if all(length == longest for length in lengths):
        # (1, H, n*L, D) -> (n, H, L, D): a plain batch, no mask
        q, k, v = (t[0].reshape(heads, count, longest, head_dim).transpose(0, 1) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)
        return out.transpose(1, 2).reshape(1, total, heads, head_dim)
    device = query.device
    # where each packed row goes in the padded (n * L) layout
    rows = torch.cat([torch.arange(length, device=device) + i * longest for i, length in enumerate(lengths)])
    padded = []
    for t in (query, key, value):
        buffer = t.new_zeros((heads, count * longest, head_dim))
        buffer[:, rows] = t[0]
        padded.append(buffer.reshape(heads, count, longest, head_dim).transpose(0, 1))
    valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    out = F.scaled_dot_product_attention(*padded, attn_mask=valid[:, None, None, :], scale=scaling)
    out = out.transpose(0, 1).reshape(heads, count * longest, head_dim)[:, rows]
    return out.transpose(0, 1)[None]


def similar_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive sequences whose lengths are within SIMILAR_LENGTHS."""
    runs = []
    first = 0
    while first < len(lengths):
        low = high = lengths[first]
        end = first + 1
        while end < len(lengths):
            low, high = min(low, lengths[end]), max(high, lengths[end])
            if high > SIMILAR_LENGTHS * low:
                break
            end += 1
        runs.append((first, end - first))
        first = end
    return runs


def _grouped_sdpa(query, key, value, lengths: list[int], scaling):
    runs = similar_runs(lengths)
    if len(runs) == 1:
        return _batched_sdpa(query, key, value, lengths, scaling)
    _, heads, total, head_dim = query.shape
    out = query.new_empty((1, total, heads, head_dim))
    start = 0
    for first, count in runs:
        run_lengths = lengths[first : first + count]
        rows = slice(start, start + sum(run_lengths))
        out[:, rows] = _batched_sdpa(
            query[:, :, rows], key[:, :, rows], value[:, :, rows], run_lengths, scaling
        )
        start = rows.stop
    return out


def varlen_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """q/k/v (1, H, T, D) packed over sequences given by cu_seq_lens_q; returns (1, T, H, D)."""
    if cu_seq_lens_q is None:
        raise RuntimeError("varlen vision attention needs cu_seqlens (use it for vision_config only)")
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    if query.is_cuda:
        try:
            return _flash_varlen(query, key, value, cu_seq_lens_q, max(lengths), scaling), None
        except ImportError:
            pass  # flash-attn is optional; SDPA below works everywhere
    return _grouped_sdpa(query, key, value, lengths, scaling), None


def register_vision_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION_NAME, varlen_vision_attention)
