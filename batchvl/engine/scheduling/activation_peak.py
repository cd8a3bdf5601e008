"""The memory the largest step's activations take, measured on the GPU before the KV cache is sized.

vLLM's profiling run does the same: run the step that allocates the most once, with the model loaded and no
cache yet, and keep that much free. The largest step is `max_num_batched_tokens` prompt tokens spread over
`max_num_seqs` requests that each sample: the packed forward is as long as a step makes it (the MLP's
intermediate rows, q/k/v, the prefill attention) and the float32 logits have as many rows (at a 152k
vocabulary, 256 rows are 155 MB), each then drawn from as a top-p sampled row is (a sort of its vocabulary
beside the logits). Its KV cache is a throwaway one of just those tokens.

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
from batchvl.engine.sampling.sampler import make_generator, step_picks
from batchvl.engine.scheduling.block_manager import BlockManager, blocks_needed

# How the largest step's rows are drawn: with top-p, whose sort of each row makes the sampler's largest
# buffers (26 bytes a logit of a draw's piece, `sampler.GPU_SAMPLED_ELEMENTS`), so that the KV budget keeps
# them free beside the logits
PROBE_SAMPLING = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.5)


def largest_step(
    adapter: ModelAdapter, config: EngineConfig, draws: bool = True
) -> Callable[[], torch.Tensor]:
    """The largest step the config allows, ready to run (its throwaway KV cache already allocated, so that
    it is not counted as activations): calling it runs the forward, with `draws` draws every row's token
    as the costliest sampling does (`PROBE_SAMPLING`), and returns the step's sampled logits."""
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
    generators = [make_generator(request_id) for request_id in range(num_requests)]

    def run() -> torch.Tensor:
        logits = runner.execute(chunks, {}).sampled
        if draws:
            step_picks(logits, [PROBE_SAMPLING] * num_requests, generators)
        return logits

    return run


def step_activation_peak(adapter: ModelAdapter, config: EngineConfig, draws: bool = True) -> int:
    """Bytes the largest step allocates on the adapter's CUDA device beyond what is allocated before it
    (`draws`: its tokens drawn too, see `largest_step`)."""
    device = adapter.device
    run = largest_step(adapter, config, draws)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del run  # the throwaway cache and the step's tensors go before the real cache is sized
    torch.cuda.empty_cache()
    return peak
