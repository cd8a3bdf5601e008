"""A run's processes and what each holds: the model, the engine, and, under torchrun, the ViT data-parallel
ranks.

A plain run is one process that drives the job. Launched by torchrun with `engine.vit_parallel: data`,
rank 0 drives the job and every other rank only encodes its share of each encode round
(`engine/vit_dp.py`) until rank 0 lets it go.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from batchvl.config import JobConfig
from batchvl.engine.devices import launched_world_size, process_device, shares_its_gpu
from batchvl.engine.engine import Engine
from batchvl.engine.model_runner import encode_images
from batchvl.engine.replicas import EngineReplicas, replica_config, replica_count
from batchvl.engine.vit_dp import (
    DataParallelEncoder,
    DistributedContext,
    init_distributed,
    leave_process_group,
    release_serving_ranks,
    serve_encode_rounds,
)
from batchvl.errors import UserError
from batchvl.inputs.download import DownloadCache
from batchvl.models.loader import LoadedModel, load_model
from batchvl.pipeline.backend import RunBackend
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.sample import SampleProcessor

logger = logging.getLogger(__name__)

T = TypeVar("T")


def in_launched_processes(
    cfg: JobConfig, drive: Callable[[DistributedContext | None], T], serve: Callable[[DistributedContext], T]
) -> T:
    """Run `drive` in the driving process (the only one without torchrun), `serve` in every other rank."""
    world_size = launched_world_size()
    if world_size == 1:
        return drive(None)
    if cfg.engine.vit_parallel != "data":
        raise UserError(
            f"launched as {world_size} processes (WORLD_SIZE={world_size}) but engine.vit_parallel is "
            f"'{cfg.engine.vit_parallel}'; set engine.vit_parallel: data, or run without torchrun"
        )
    device = process_device(cfg.model.device)
    context = init_distributed(device, shares_its_gpu(cfg.model.device, device))
    try:
        return drive(context) if context.is_driver else serve(context)
    finally:
        if context.is_driver:
            release_serving_ranks(context.world_size)
        leave_process_group()


def load_job_model(cfg: JobConfig) -> tuple[LoadedModel, float]:
    """The job's model, loaded with the job's thread count; and the seconds loading took."""
    if cfg.engine.threads > 0:
        torch.set_num_threads(cfg.engine.threads)
    started = time.perf_counter()
    m = cfg.model
    device = process_device(m.device)  # under torchrun, this rank's GPU
    return load_model(m.path, m.dtype, device, m.trust_remote_code), time.perf_counter() - started


def _local_encode(cfg: JobConfig, loaded: LoadedModel):
    return functools.partial(encode_images, loaded.adapter, max_patches=cfg.engine.max_patches_per_encode)


def job_engine(
    cfg: JobConfig, loaded: LoadedModel, context: DistributedContext | None
) -> Engine | EngineReplicas:
    """The driver's engine; under torchrun its encode rounds are shared with the serving ranks; on the CPU,
    `engine.replicas` engines, each with its share of the threads and caches."""
    parallel_encoder = None
    if context is not None:
        parallel_encoder = DataParallelEncoder(context, _local_encode(cfg, loaded), loaded.adapter.device)
    tokenizer, eos = loaded.processor.tokenizer, loaded.eos_token_ids()
    adapter = loaded.adapter
    count = replica_count(cfg.engine, adapter.device, context is not None, adapter.model.config)
    if count == 1:
        return Engine(adapter, tokenizer, cfg.engine, eos, parallel_encoder)
    # A fast tokenizer's first `encode` may switch its truncation off (a write the replicas' threads
    # could race on); after it, their encodes and decodes only read.
    tokenizer.encode("x")
    config = replica_config(cfg.engine, count)
    threads_each = max(1, torch.get_num_threads() // count)
    logger.info("%d engine replicas of %d thread(s) each", count, threads_each)
    return EngineReplicas(lambda: Engine(adapter, tokenizer, config, eos), count, threads_each)


def builtin_backend(
    cfg: JobConfig, loaded: LoadedModel, context: DistributedContext | None, graph: PromptGraph
) -> RunBackend:
    """The built-in engine over the loaded model: prompts as token ids, images as the family's pixels (what
    the preprocessing workers run per sample: the family's media preparation and the prompts)."""
    renderer = PromptRenderer(loaded.processor)
    media = loaded.family.media_preparer(loaded.processor, loaded.adapter.model.config, cfg.preprocess)
    cache = DownloadCache.of(cfg.input.download)
    samples = SampleProcessor(renderer, media, cfg.prompts, graph.follow_ups, cache)
    engine = job_engine(cfg, loaded, context)
    if isinstance(engine, EngineReplicas):
        return RunBackend(engine, renderer, samples, engine.close, engine.count)
    return RunBackend(engine, renderer, samples)


def serve_rank(cfg: JobConfig, loaded: LoadedModel, context: DistributedContext) -> int:
    """A rank other than 0: encode its share of every round rank 0 sends, until it says stop; returns how
    many rounds it served."""
    rounds = serve_encode_rounds(_local_encode(cfg, loaded), loaded.adapter.device)
    logger.info("rank %d served %d encode rounds", context.rank, rounds)
    return rounds
