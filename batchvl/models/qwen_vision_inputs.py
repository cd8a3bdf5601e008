"""A Qwen-VL vision call's inputs derived from its images' grids, made on the host and sent in one copy.

transformers' Qwen-VL towers derive from the grid of each image or video, (t, h, w) in patches, the rotary
positions of the patches, the packed sequences' boundaries and longest length, Qwen2.5-VL's window order and
window boundaries, and Qwen3-VL's position-embedding interpolation (`transformers.vision_utils`). With the
grid on a GPU, each of these reads it back to the host (`tolist`, `repeat_interleave`, `item`) and its
per-image loops launch a dozen tiny kernels an image: the host waits for the device several times a call,
behind whatever step is still running there, which leaves an overlapped step (`engine.overlap`) nothing to
overlap. The same helpers take their results precomputed, by keyword: here they run on the grid's copy on
the CPU, which the host has anyway, and the integer results go to the device together in one copy
(`uploaded`). The tower's own attention is told the sequences' lengths with them
(`vision_attention.remember_lengths`), so that it reads nothing back either.
"""

from __future__ import annotations

import torch
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from batchvl.layers.attention import uploaded
from batchvl.layers.vision_attention import remember_lengths
from batchvl.utils.page_locked import locks_pages_for

# The inputs that cut a call's rows into the sequences the tower attends within (its images; Qwen2.5-VL's
# windows), each with the input of its longest sequence's rows
BOUNDARIES = {"cu_seqlens": "max_seqlen", "cu_window_seqlens": "max_window_seqlen"}


def grid_inputs(visual: torch.nn.Module, grid: torch.Tensor) -> dict:
    """The keyword inputs a Qwen2-VL or Qwen3-VL tower (`visual`) derives from a CPU `grid`, as its forward
    computes them, with Qwen2.5-VL's windows where the tower has them and Qwen3-VL's interpolation."""
    config = visual.config
    merge = visual.spatial_merge_size
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, config)
    inputs = {
        "position_ids": get_vision_position_ids(grid, merge),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max_seqlen,
    }
    if hasattr(visual, "fullatt_block_indexes"):  # Qwen2.5-VL: windowed attention in most blocks
        window_index, cu_window_seqlens = get_vision_window_index(
            grid, spatial_merge_size=merge, window_size=visual.window_size, patch_size=visual.patch_size
        )
        inputs.update(
            window_index=window_index,
            cu_window_seqlens=cu_window_seqlens,
            max_window_seqlen=get_max_seqlen(cu_window_seqlens, config),
        )
    if hasattr(visual, "num_grid_per_side"):  # Qwen3-VL: learned position embeddings, interpolated
        interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=config.spatial_merge_size,
        )
        inputs.update(interp_indices=interp_indices, interp_weights=interp_weights)
    return inputs


def on_device(inputs: dict, device: torch.device) -> dict:
    """`inputs` on `device`: the integer tensors in one copy, each back in its own dtype, the floating ones
    from page-locked memory without a wait, the rest (ints, None) as they are. The sequences' boundaries
    are remembered with their lengths for the tower's attention."""
    integers = {key: value for key, value in inputs.items() if _is_integer_tensor(value)}
    moved = dict(zip(integers, uploaded(list(integers.values()), device), strict=True))
    placed = {}
    for key, value in inputs.items():
        if key in moved:
            value = moved[key].to(inputs[key].dtype)  # `uploaded` packs as int64; on the CPU a no-op
        elif isinstance(value, torch.Tensor) and torch.device(device).type != "cpu":
            # page-locked for a CUDA device, as a vision call's pixels are staged (`pixel_staging`)
            host = value.pin_memory() if locks_pages_for(device) else value
            value = host.to(device, non_blocking=True)
        placed[key] = value
    for key in BOUNDARIES:
        if key in inputs:
            remember_lengths(placed[key], inputs[key].diff().tolist())
    return placed


def _is_integer_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point()
