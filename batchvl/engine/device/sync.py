"""Waiting for a device's queued work before a clock is read.

A CUDA op returns as soon as its kernel is queued: a time taken right after the forward measures the
launches, not the work. Synchronizing before the clock is read makes `forward_s` and `encode_s` the time
the device spent; on the CPU an op is done when it returns, and nothing waits.
"""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
