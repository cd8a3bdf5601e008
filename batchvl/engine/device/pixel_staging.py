"""A vision call's pixels, put where and how its tower takes them in one copy of each item.

The items' pixels arrive as the preprocessing workers sent them, in shared-memory pages that the job
process maps: already in the tower's dtype where that is narrower than float32 (the workers cast them,
`PreparedMedia.in_dtype`: half the bytes to map and copy here), else float32. Stacked with `torch.cat`
and then cast (and padded, where the family pads a call) on the way to the tower, each call's pixels were
written twice on the host before the tower saw them; on a GPU they also crossed from pageable memory, a
copy the host waits for. Here each item is copied once, straight into the call's tensor in the tower's
dtype (the cast the tower would make itself, where the workers did not, so its input is the same),
followed by the call's zero padding rows; towards a GPU that tensor is page-locked and sent without
waiting.
"""

from __future__ import annotations

import numpy as np
import torch


def stage_pixels(
    items: list[np.ndarray | torch.Tensor], rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The items stacked along their first axis, then zeros up to `rows` rows, in `dtype` on `device`.
    Items already on a device (a serving rank's share under ViT data parallelism over NCCL) are stacked
    there."""
    return stacked_pixels(items, rows, dtype, device).to(device, non_blocking=True)


def stacked_pixels(
    items: list[np.ndarray | torch.Tensor], rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`stage_pixels`' tensor before its upload: where the items are, page-locked when they are on the host
    and go to a GPU."""
    tensors = [torch.as_tensor(item) for item in items]
    source = tensors[0].device
    stacked = torch.empty(
        (rows, *tensors[0].shape[1:]),
        dtype=dtype,
        device=source,
        # page-locked: the upload then runs without the host waiting for it, and torch's allocator keeps
        # the pages from reuse until it is done
        pin_memory=source.type == "cpu" and device.type == "cuda",
    )
    offset = 0
    for tensor in tensors:
        stacked[offset : offset + len(tensor)].copy_(tensor)
        offset += len(tensor)
    stacked[offset:].zero_()
    return stacked
