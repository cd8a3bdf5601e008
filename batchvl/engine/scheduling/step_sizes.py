"""How large an engine step and a vision call are: `engine.max_num_batched_tokens` and
`engine.max_patches_per_encode` as given, or with `auto` (the default) the CPU's sizes on the CPU and, on
CUDA, the largest of a few sizes whose activations fit a share of the GPU's free memory.

The CPU's sizes (2,048 tokens, 4,096 patches) leave a large GPU's matmuls short and its launches many: a
step of 2,048 tokens is a few milliseconds of a Qwen2-VL-2B forward on an H100, about what the host spends
scheduling it. On CUDA the step's activations are measured once at the CPU's size (`activation_peak`, with
the model loaded and no cache yet) and scaled to each larger size: the logits' rows do not grow with the
tokens, so the scaled figure bounds the larger step's. A vision call's activations are bounded per patch
(`kv_budget.vision_reserve_bytes`), not measured. What the chosen sizes take is then kept out of the KV
cache (`kv_budget`), so the cache is smaller by that much: the KV budget measures the chosen step itself (a
second forward at start-up, of a fraction of a second), since the scaled figure is a bound made to choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from batchvl.config import EngineConfig
from batchvl.engine.scheduling.kv_budget import vision_reserve_bytes

CPU_BATCHED_TOKENS = 2048
CPU_PATCHES_PER_ENCODE = 4096
# Tried largest first on CUDA; the CPU's size where none fits
GPU_BATCHED_TOKENS = (16384, 8192, 4096)
GPU_PATCHES_PER_ENCODE = (32768, 16384, 8192)
# The most of the GPU's free memory (after the model) a step's, or a vision call's, activations may take:
# the rest is the KV cache's, whose size bounds how many sequences decode at once
ACTIVATION_SHARE = 0.1


def free_cuda_bytes(device: torch.device) -> int:
    torch.cuda.empty_cache()  # memory torch holds but no tensor uses is free
    return torch.cuda.mem_get_info(device)[0]


def batched_tokens(
    config: EngineConfig, device: torch.device, step_peak: Callable[[EngineConfig], int], free_bytes: int
) -> int:
    """`engine.max_num_batched_tokens`: as given, or for `auto` the CPU's size on the CPU, else the largest
    GPU size whose activations, scaled from `step_peak`'s measurement of a step of the CPU's size, fit
    ACTIVATION_SHARE of `free_bytes`."""
    if config.max_num_batched_tokens != "auto":
        return config.max_num_batched_tokens
    if device.type != "cuda":
        return CPU_BATCHED_TOKENS
    probe = dataclasses.replace(
        config, max_num_batched_tokens=CPU_BATCHED_TOKENS, max_patches_per_encode=CPU_PATCHES_PER_ENCODE
    )
    per_token = step_peak(probe) / CPU_BATCHED_TOKENS
    for tokens in GPU_BATCHED_TOKENS:
        if tokens * per_token <= ACTIVATION_SHARE * free_bytes:
            return tokens
    return CPU_BATCHED_TOKENS


def patches_per_encode(config: EngineConfig, device: torch.device, free_bytes: Callable[[], int]) -> int:
    """`engine.max_patches_per_encode`: as given, or for `auto` the CPU's size on the CPU, else the largest
    GPU size whose vision-call bound fits ACTIVATION_SHARE of `free_bytes()` (asked only then)."""
    if config.max_patches_per_encode != "auto":
        return config.max_patches_per_encode
    if device.type != "cuda":
        return CPU_PATCHES_PER_ENCODE
    free = free_bytes()
    for patches in GPU_PATCHES_PER_ENCODE:
        if vision_reserve_bytes(patches) <= ACTIVATION_SHARE * free:
            return patches
    return CPU_PATCHES_PER_ENCODE


def resolved_step_sizes(
    config: EngineConfig,
    device: torch.device,
    step_peak: Callable[[EngineConfig], int],
    free_bytes: Callable[[], int],
) -> EngineConfig:
    """`config` with both sizes as numbers (the same config where neither is `auto`); `free_bytes` is asked
    once, and `step_peak` runs only where the token budget is `auto` on CUDA."""
    if "auto" not in (config.max_num_batched_tokens, config.max_patches_per_encode):
        return config
    free = free_bytes() if device.type == "cuda" else 0
    return dataclasses.replace(
        config,
        max_num_batched_tokens=batched_tokens(config, device, step_peak, free),
        max_patches_per_encode=patches_per_encode(config, device, lambda: free),
    )
