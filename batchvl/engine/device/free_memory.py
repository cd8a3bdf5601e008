"""What a CUDA device has for the engine's tensors, read as an engine is built: its step sizes and its KV
cache are sized from the memory free then.

Free memory is read after a garbage collection. An engine is held in reference cycles (on a CPU, the
engines of an ended job were still alive after it returned, and gone after `gc.collect()`), so the
engine of a job that has ended is freed only when the collector next runs: a second job in the same
process over the same loaded model (a notebook's next call, a benchmark's measured job after its
warm-up) found the first one's KV cache still allocated. On an H200 the measured 2B job's engine saw
between 10 and 20 GiB free of 139 (it chose vision calls of 8,192 patches, not 32,768) and sized its KV
cache from that. (vLLM also collects before it measures.)
"""

from __future__ import annotations

import gc

import torch


def free_cuda_bytes(device: torch.device) -> int:
    """Bytes free on `device` once unreachable objects are collected and the memory torch caches but no
    tensor uses is given back."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def total_cuda_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory
