"""Timing a CUDA call: the mean over repeated calls between two CUDA events, for the kernel benchmarks."""

from __future__ import annotations

import torch

CALLS = 50


def per_call_us(fn, warmup: int = 3) -> float:
    """The mean of CALLS calls between two CUDA events, after `warmup` calls (which compile the kernels)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS
