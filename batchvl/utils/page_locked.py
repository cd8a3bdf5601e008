"""Host memory for copies to and from a GPU: page-locked where the device at the other end is a CUDA
device, so that a copy runs without the host waiting for it (from pageable memory the driver stages the bytes
while the host waits, some 80 us a copy on an H200); plain memory elsewhere, where page-locking needs CUDA
and gains nothing. One rule for every copy of the engine's: the device's, not whether CUDA is present (a
CPU engine on a GPU machine locks no pages)."""

from __future__ import annotations

import torch


def locks_pages_for(device: torch.device | str) -> bool:
    """Whether host memory for copies to or from `device` is page-locked."""
    return torch.device(device).type == "cuda"


def host_empty(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised host tensor for copies to or from `device`, page-locked where `locks_pages_for` says.
    Page-locked, it comes from torch's caching host allocator, which hands a block out again only once the
    copies recorded on it are done: a later step never refills memory an earlier copy still reads."""
    return torch.empty(shape, dtype=dtype, pin_memory=locks_pages_for(device))
