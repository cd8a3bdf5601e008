"""The one place an engine is assembled: the pipeline hands it the loaded model's parts and gets back what
it drives (`EngineInterface`), one engine or, on the CPU, `engine.replicas` of them; under ViT data
parallelism the engine's encode rounds are shared with the serving ranks."""

from __future__ import annotations

import functools
import logging

import torch

from batchvl.config import EngineConfig
from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.device.free_memory import free_cuda_bytes
from batchvl.engine.encoder_cache.cache import EncodeImages
from batchvl.engine.engine import Engine, step_sizes_for
from batchvl.engine.interface import EngineInterface
from batchvl.engine.model_runner import encode_images, kv_bytes_per_block
from batchvl.engine.parallel.replicas import EngineReplicas, replica_config, replica_count
from batchvl.engine.parallel.vit_dp import DataParallelEncoder, DistributedContext
from batchvl.engine.scheduling.kv_budget import check_holds_blocks
from batchvl.engine.scheduling.step_sizes import patches_per_encode

logger = logging.getLogger(__name__)


def local_encoder(adapter: ModelAdapter, config: EngineConfig) -> EncodeImages:
    """This process's vision calls (a serving rank's share of each round under ViT data parallelism)."""
    max_patches = patches_per_encode(config, adapter.device, lambda: free_cuda_bytes(adapter.device))
    return functools.partial(encode_images, adapter, max_patches=max_patches)


def weight_bytes(adapter: ModelAdapter) -> int:
    """The bytes of the model's weights, as a step reads them: its parameters and its buffers (the CPU's
    packed linear weights are buffers)."""
    tensors = [*adapter.model.parameters(), *adapter.model.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def build_engine(
    adapter: ModelAdapter,
    tokenizer,
    eos_token_ids: list[int],
    config: EngineConfig,
    context: DistributedContext | None = None,
    most_requests: int | None = None,
) -> EngineInterface:
    """The engine a job drives: one `Engine`, or `replica_count` of them side by side on the CPU, each with
    its share of the threads and caches (`replica_config`; `most_requests`: at most the requests it will be
    given, where known). Its step sizes are resolved once, here: under ViT data parallelism rank 0's own
    vision calls then have the engine's size."""
    config = step_sizes_for(adapter, config)
    under_torchrun, model = context is not None, adapter.model.config
    count = replica_count(config, adapter.device, under_torchrun, model, most_requests, weight_bytes(adapter))
    if count == 1:
        parallel_encoder = None
        if context is not None:
            parallel_encoder = DataParallelEncoder(context, local_encoder(adapter, config), adapter.device)
        return Engine(adapter, tokenizer, config, eos_token_ids, parallel_encoder)
    # A fast tokenizer's first `encode` may switch its truncation off (a write the replicas' threads
    # could race on); after it, their encodes and decodes only read.
    tokenizer.encode("x")
    check_holds_blocks(config, kv_bytes_per_block(adapter, config.block_size), count)
    share = replica_config(config, count)
    threads_each = max(1, torch.get_num_threads() // count)
    logger.info("%d engine replicas of %d thread(s) each", count, threads_each)
    return EngineReplicas(lambda: Engine(adapter, tokenizer, share, eos_token_ids), count, threads_each)
