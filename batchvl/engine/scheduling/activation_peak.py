"""The memory the largest step's activations take, measured on the GPU before the KV cache is sized.

vLLM's profiling run does the same: run the step that allocates the most once, with the model loaded and no
cache yet, and keep that much free. The largest step is `max_num_batched_tokens` prompt tokens spread over
`max_num_seqs` requests that each sample: the packed forward is as long as a step makes it (the MLP's
intermediate rows, q/k/v, the prefill attention) and the float32 logits have as many rows (at a 152k
vocabulary, 256 rows are 155 MB). Its KV cache is a throwaway one of just those tokens.

A vision call is not part of it: the runner encodes before the forward and frees the call's activations, so
its peak does not add to the step's; `kv_budget.VISION_RESERVE_MB` bounds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchvl.config import EngineConfig
from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.model_runner import ModelRunner
from batchvl.engine.request import Request, ScheduledChunk
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.scheduling.block_manager import BlockManager, blocks_needed


def largest_step(adapter: ModelAdapter, config: EngineConfig) -> Callable[[], torch.Tensor]:
    """The largest step the config allows, ready to run (its throwaway KV cache already allocated, so that
    it is not counted as activations): calling it runs the forward and returns the step's sampled logits."""
    num_tokens = config.max_num_batched_tokens
    num_requests = min(config.max_num_seqs, num_tokens)
    lengths = [num_tokens // num_requests + (i < num_tokens % num_requests) for i in range(num_requests)]
    num_blocks = sum(blocks_needed(length, config.block_size) for length in lengths)
    block_manager = BlockManager(
        num_blocks, config.block_size, max_running=num_requests, max_tokens_per_request=max(lengths)
    )
    runner = ModelRunner(adapter, block_manager)
    chunks = []
    for request_id, length in enumerate(lengths):
        token_ids = [0] * length  # what the tokens are does not change what the step allocates
        request = Request(request_id, token_ids, [], SamplingParams(max_new_tokens=1))
        request.positions = runner.prompt_positions(token_ids, [])
        block_manager.admit(request, [], length)
        chunks.append(ScheduledChunk(request, 0, length))
    return lambda: runner.execute(chunks, {}).sampled


def step_activation_peak(adapter: ModelAdapter, config: EngineConfig) -> int:
    """Bytes the largest step allocates on the adapter's CUDA device beyond what is allocated before it."""
    device = adapter.device
    run = largest_step(adapter, config)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del run  # the throwaway cache and the step's tensors go before the real cache is sized
    torch.cuda.empty_cache()
    return peak
