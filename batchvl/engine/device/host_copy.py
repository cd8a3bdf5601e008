"""A small device tensor read to the host later, without waiting for the device's other work.

`.tolist()` on a CUDA tensor waits for every kernel queued so far. An overlapped step has queued the next
forward by the time it reads the previous step's picks, so it copies them into page-locked memory
without blocking when they are made, records an event behind the copy, and later waits for that event
alone: the next forward keeps running while the host reads. On the CPU the tensor is read as it is.
"""

from __future__ import annotations

import torch

from batchvl.utils.page_locked import host_empty


class HostCopy:
    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda":
            self._host, self._done = tensor, None
            return
        self._host = host_empty(tensor.shape, tensor.dtype, tensor.device)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        """The tensor's values, once the copy (and what was queued before it) is done."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
