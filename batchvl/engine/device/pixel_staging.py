"""A vision call's pixels, put where and how its tower takes them in one copy of each item.

The items' pixels arrive as the preprocessing workers sent them, in shared-memory pages that the job
process maps: 8-bit, before their family's normalization (`preprocess/pixel_normalization.py`), a quarter
of the bytes of bfloat16 pixels (an eighth for a Qwen-VL still image, its frame not yet repeated into the
temporal patch). Each item is copied once, straight into the call's stack; towards a GPU the stack is
page-locked and sent without waiting, and the normalization, the repeat, the cast to the tower's dtype and
the call's zero padding rows are made there, from the quarter of the bytes. Items that are the tower's
input already (no normalization: media made by hand, as tests make it) are stacked in the tower's dtype
(the cast the tower would make itself), then the padding.
"""

from __future__ import annotations

import numpy as np
import torch

from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.pixel_normalization import normalized_pixels
from batchvl.utils.page_locked import locks_pages_for


def stage_pixels(
    items: list[PreparedMedia], rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The items' tower input stacked along its first axis, then zeros up to `rows` rows, in `dtype` on
    `device`. Items already on a device (a serving rank's share under ViT data parallelism over NCCL) are
    stacked there. The items of one call share one normalization (one family's, one kind of media)."""
    sent = host_stack(items, rows, dtype, device).to(device, non_blocking=True)
    return tower_input(sent, items, rows, dtype)


def host_stack(
    items: list[PreparedMedia], rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`stage_pixels`' stack before its upload, where the items are: their 8-bit pixels as sent where they
    have a normalization (the padding rows are made after it, on the device), else in `dtype` with the zero
    padding rows up to `rows`."""
    normalization = items[0].normalization
    if any(item.normalization != normalization for item in items):
        raise ValueError("a vision call's items must share one normalization (one family, one kind of media)")
    pixels = [item.pixel_values for item in items]
    if normalization is None:
        return _stacked_pixels(pixels, rows, dtype, device)
    return _stacked_pixels(pixels, sum(len(item) for item in pixels), torch.uint8, device)


def tower_input(
    sent: torch.Tensor, items: list[PreparedMedia], rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """The tower's input of `host_stack`'s stack once on the device: normalized there, with the zero
    padding rows up to `rows`, where the items have a normalization; else the stack as it is."""
    normalization = items[0].normalization
    return sent if normalization is None else normalized_pixels(sent, normalization, dtype, rows)


def _stacked_pixels(
    items: list[np.ndarray | torch.Tensor], rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`items` stacked, then zeros up to `rows` rows, in `dtype`, where the items are: page-locked when they
    are on the host and go to a GPU."""
    tensors = [torch.as_tensor(item) for item in items]
    source = tensors[0].device
    stacked = torch.empty(
        (rows, *tensors[0].shape[1:]),
        dtype=dtype,
        device=source,
        # page-locked: the upload then runs without the host waiting for it, and torch's allocator keeps
        # the pages from reuse until it is done
        pin_memory=source.type == "cpu" and locks_pages_for(device),
    )
    offset = 0
    for tensor in tensors:
        stacked[offset : offset + len(tensor)].copy_(tensor)
        offset += len(tensor)
    stacked[offset:].zero_()
    return stacked
