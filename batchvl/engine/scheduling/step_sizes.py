"""How large an engine step and a vision call are: `engine.max_num_seqs`, `engine.max_num_batched_tokens`
and `engine.max_patches_per_encode` as given, or with `auto` (the default) the CPU's sizes on the CPU and,
on CUDA, more sequences on a large GPU and the largest of a few sizes whose activations fit a share of the
GPU's free memory.

Sequences: a decode step reads every weight once whatever its rows, so on a GPU more rows a step are
nearly free until the KV cache runs out; vLLM's offline default is 1,024 sequences on GPUs of 70 GiB or
more (H100, H200) and 256 elsewhere, and batchvl takes the same rule: a job's tokens are then decoded in
fewer, larger steps (what that gains is measured by the GPU check's `gpu_throughput_2b_256_seqs`).

The CPU's sizes (2,048 tokens, 4,096 patches) leave a large GPU's matmuls short and its launches many: a
step of 2,048 tokens is a few milliseconds of a Qwen2-VL-2B forward on an H100, about what the host spends
scheduling it. On CUDA the step's activations are measured once at the CPU's size (`activation_peak`, with
the model loaded and no cache yet, over at most the CPU's 256 sequences) and scaled to each larger size:
the logits' rows are scaled with the tokens, so from 8,192 tokens up the scaled figure bounds a step's
even at 1,024 sequences. A vision call's activations are bounded per patch
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

CPU_MAX_NUM_SEQS = 256
LARGE_GPU_MAX_NUM_SEQS = 1024
LARGE_GPU_BYTES = 70 * 2**30  # total memory from which a GPU counts as large
CPU_BATCHED_TOKENS = 2048
CPU_PATCHES_PER_ENCODE = 4096
# Tried largest first on CUDA; the CPU's size where none fits
GPU_BATCHED_TOKENS = (16384, 8192, 4096)
GPU_PATCHES_PER_ENCODE = (32768, 16384, 8192)
# The most of the GPU's free memory (after the model) a step's, or a vision call's, activations may take:
# the rest is the KV cache's, whose size bounds how many sequences decode at once
ACTIVATION_SHARE = 0.1


def num_seqs(config: EngineConfig, device: torch.device, total_bytes: Callable[[], int]) -> int:
    """`engine.max_num_seqs`: as given, or for `auto` LARGE_GPU_MAX_NUM_SEQS on a CUDA device whose
    `total_bytes()` (asked only then) are at least LARGE_GPU_BYTES, else CPU_MAX_NUM_SEQS."""
    if config.max_num_seqs != "auto":
        return config.max_num_seqs
    if device.type == "cuda" and total_bytes() >= LARGE_GPU_BYTES:
        return LARGE_GPU_MAX_NUM_SEQS
    return CPU_MAX_NUM_SEQS


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
    # The probe's sequences at most the CPU's: the logits' rows (a sampling sequence's a step) are scaled
    # with the tokens, so at 16,384 tokens the figure holds 2,048 rows' logits, and 4,096 at 1,024
    # sequences would rule a large GPU's budget out for a bound's slack (the chosen step is measured again)
    probe = dataclasses.replace(
        config,
        max_num_seqs=min(config.max_num_seqs, CPU_MAX_NUM_SEQS),
        max_num_batched_tokens=CPU_BATCHED_TOKENS,
        max_patches_per_encode=CPU_PATCHES_PER_ENCODE,
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
    total_bytes: Callable[[], int],
) -> EngineConfig:
    """`config` with its sizes as numbers (the same config where none is `auto`); `free_bytes` is asked
    once, and `step_peak` runs only where the token budget is `auto` on CUDA, on a config whose
    sequences are resolved (its probe step has that many)."""
    if "auto" not in (config.max_num_seqs, config.max_num_batched_tokens, config.max_patches_per_encode):
        return config
    config = dataclasses.replace(config, max_num_seqs=num_seqs(config, device, total_bytes))
    free = free_bytes() if device.type == "cuda" else 0
    return dataclasses.replace(
        config,
        max_num_batched_tokens=batched_tokens(config, device, step_peak, free),
        max_patches_per_encode=patches_per_encode(config, device, lambda: free),
    )
