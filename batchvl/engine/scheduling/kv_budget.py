"""How much memory the paged KV cache gets.

`engine.kv_cache_mb` as given, or with `auto` (the default): 1024 MiB on the CPU, where the cache shares
the machine's memory with everything else; on CUDA, what the GPU has free once the model is loaded (the
engine is built after it), less what the largest step's activations were measured to take
(`activation_peak`), a bound for a vision call (`vision_reserve_bytes`) and the encoder cache's embeddings,
times `engine.gpu_memory_utilization`. A fixed 1024 MiB left most of a large GPU unused (about 18.7k tokens of
Qwen2-VL-7B in bf16: heavy preemption), where vLLM users expect the cache to fill the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from batchvl.config import EngineConfig
from batchvl.engine.device.free_memory import free_cuda_bytes
from batchvl.engine.fast_paths import path_on
from batchvl.errors import UserError
from batchvl.utils.memory import MB

CPU_KV_CACHE_MB = 1024
# A vision call's activations, which the measured step leaves out: at 4,096 patches a call, Qwen2-VL's
# 675M-parameter tower holds about 100 MiB of them at once in bf16 (its MLP's 4,096 x 5,120 intermediate
# rows are 40 MiB). A bound, not a measurement; it grows with the patches of a larger call.
VISION_RESERVE_MB = 512
VISION_RESERVE_PATCHES = 4096
# The caching allocator's slack around the measured peak (blocks it rounds up and cannot split).
PEAK_HEADROOM = 1.25


def fixed_kv_cache_mb(config: EngineConfig) -> float:
    """`engine.kv_cache_mb` where the GPU's free memory does not decide it: as given, or CPU_KV_CACHE_MB with
    `auto` (also what engine replicas on the CPU share)."""
    return CPU_KV_CACHE_MB if config.kv_cache_mb == "auto" else config.kv_cache_mb


def check_kv_cache_fits(config: EngineConfig, device: torch.device) -> None:
    """Refuse an `engine.kv_cache_mb` larger than the device's whole memory (a typo: 1e12 ended a run in a
    MemoryError after its output folder was made); whether a smaller one fits beside the model is known
    only once the model is loaded."""
    if config.kv_cache_mb == "auto":
        return
    if device.type == "cuda":
        total, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    else:
        total, where = psutil.virtual_memory().total, "this machine's memory"
    if config.kv_cache_mb * MB > total:
        raise UserError(
            f"engine.kv_cache_mb={config.kv_cache_mb:g} is more than {where} ({total / MB:.0f} MiB); "
            "lower it, or set it to auto"
        )


def check_holds_blocks(config: EngineConfig, block_bytes: int, engines: int) -> None:
    """Refuse a fixed `engine.kv_cache_mb` that gives each of `engines` engines (replicas share it) less
    than one KV block of `block_bytes`, naming the value the job sets and the least that runs."""
    if config.kv_cache_mb == "auto" or config.kv_cache_mb * MB >= block_bytes * engines:
        return
    block = f"a block of {config.block_size} tokens of this model takes {block_bytes / MB:.3g} MiB"
    least = f"raise it to at least {block_bytes * engines / MB:.3g}"
    if engines == 1:
        raise UserError(f"engine.kv_cache_mb={config.kv_cache_mb:g} holds no KV block ({block}); {least}")
    raise UserError(
        f"engine.kv_cache_mb={config.kv_cache_mb:g} holds fewer KV blocks than its {engines} engine replicas "
        f"need, one each ({block}); {least}, or set engine.replicas: 1"
    )


def steps_held(config: EngineConfig, device: torch.device) -> int:
    """How many times the largest step's activations are kept free: the step itself; with decode graphs,
    their memory pool, which holds the largest decode step's activations (a part of the largest step's)
    apart from the memory eager steps allocate from, captured after the cache is sized; with overlapped
    steps, the step in flight's outputs (its logits, as many rows as the next step's at most) while the next
    one runs. (On an H200 the graphs, captured after a cache that left room for one step, ran the first
    long prefill out of memory.)"""
    return 1 + path_on(config, "cuda_graphs", device) + path_on(config, "overlap", device)


def vision_calls_held(config: EngineConfig, device: torch.device) -> int:
    """How many times a vision call's activations are kept free: the call itself; with vision graphs, their
    memory pool, which holds the largest graphed call's apart from the memory eager calls allocate from."""
    return 1 + path_on(config, "vision_graphs", device)


def vision_reserve_bytes(max_patches: int) -> int:
    """The memory kept for a vision call of at most `max_patches` patches: VISION_RESERVE_MB, scaled up for
    calls of more than VISION_RESERVE_PATCHES (activations grow with the rows a call packs)."""
    return int(VISION_RESERVE_MB * MB * max(1.0, max_patches / VISION_RESERVE_PATCHES))


def kv_cache_bytes(config: EngineConfig, device: torch.device, activation_peak: Callable[[], int]) -> int:
    """The cache's size in bytes; `activation_peak` measures the largest step's activations on `device`
    (called only where the size depends on it: `auto` on CUDA)."""
    if config.kv_cache_mb != "auto" or device.type != "cuda":
        return int(fixed_kv_cache_mb(config) * MB)
    activations = int(activation_peak() * PEAK_HEADROOM) * steps_held(config, device)
    free = free_cuda_bytes(device)
    vision = vision_reserve_bytes(config.max_patches_per_encode) * vision_calls_held(config, device)
    reserve = activations + vision + config.encoder_cache_mb * MB
    budget = int((free - reserve) * config.gpu_memory_utilization)
    if budget < MB:
        raise UserError(
            f"engine.kv_cache_mb is auto, but {device} has {free / MB:.0f} MiB free after the model, not "
            f"more than the {reserve / MB:.0f} MiB kept for activations and the encoder cache; free the "
            "GPU, set engine.kv_cache_mb, or lower engine.max_num_batched_tokens or engine.encoder_cache_mb"
        )
    return budget
