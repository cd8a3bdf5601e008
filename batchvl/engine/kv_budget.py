"""How much memory the paged KV cache gets.

`engine.kv_cache_mb` as given, or with `auto` (the default): 1024 MiB on the CPU, where the cache shares
the machine's memory with everything else; on CUDA, what the GPU has free once the model is loaded (the
engine is built after it), less a reserve for a step's activations and the encoder cache's embeddings,
times `engine.gpu_memory_utilization`. A fixed 1024 MiB left most of a large GPU unused (about 18.7k
tokens of Qwen2-VL-7B in bf16: heavy preemption), where vLLM users expect the cache to fill the GPU.
"""

from __future__ import annotations

import torch

from batchvl.config import EngineConfig
from batchvl.errors import UserError

MB = 1 << 20
CPU_KV_CACHE_MB = 1024
# A step's activations on the GPU: the packed forward of max_num_batched_tokens rows (a 7B model's gated
# MLP alone is about 150 MiB at 2,048 rows), the prefill chunks' attention scores, the step's float32
# logits, a vision call, and the caching allocator's slack. Not measured on a GPU yet: a bound, not a peak.
ACTIVATION_RESERVE_MB = 2048


def kv_cache_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_mb != "auto":
        return int(config.kv_cache_mb * MB)
    if device.type != "cuda":
        return CPU_KV_CACHE_MB * MB
    torch.cuda.empty_cache()  # memory torch holds but no tensor uses is free for the cache
    free, _total = torch.cuda.mem_get_info(device)
    reserve = (ACTIVATION_RESERVE_MB + config.encoder_cache_mb) * MB
    budget = int((free - reserve) * config.gpu_memory_utilization)
    if budget < MB:
        raise UserError(
            f"engine.kv_cache_mb is auto, but {device} has {free / MB:.0f} MiB free after the model, not "
            f"more than the {reserve / MB:.0f} MiB kept for activations and the encoder cache; free the "
            "GPU, set engine.kv_cache_mb, or lower engine.encoder_cache_mb"
        )
    return budget
