"""A run's processes and what each holds: the model, the engine, and, under torchrun, the ViT data-parallel
ranks.

A plain run is one process that drives the job. Launched by torchrun with `engine.vit_parallel: data`,
rank 0 drives the job and every other rank only encodes its share of each encode round
(`engine/parallel/vit_dp.py`) until rank 0 lets it go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from batchvl.config import JobConfig
from batchvl.engine.builder import build_engine, local_encoder
from batchvl.engine.device.placement import launched_world_size, process_device, shares_its_gpu
from batchvl.engine.parallel.vit_dp import (
    DistributedContext,
    init_distributed,
    leave_process_group,
    release_serving_ranks,
    serve_encode_rounds,
)
from batchvl.errors import UserError
from batchvl.inputs.download import DownloadCache
from batchvl.models.loader import LoadedModel, load_model
from batchvl.pipeline.engine_setup import EngineSetup
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


def builtin_engine_setup(
    cfg: JobConfig, loaded: LoadedModel, context: DistributedContext | None, graph: PromptGraph
) -> EngineSetup:
    """The built-in engine over the loaded model: prompts as token ids, images as the family's pixels (what
    the preprocessing workers run per sample: the family's media preparation and the prompts)."""
    renderer = PromptRenderer(loaded.processor)
    media = loaded.family.media_preparer(loaded.processor, loaded.adapter.model.config, cfg.preprocess)
    cache = DownloadCache.of(cfg.input.download)
    samples = SampleProcessor(renderer, media, cfg.prompts, graph.follow_ups, cache)
    tokenizer, eos = loaded.processor.tokenizer, loaded.eos_token_ids()
    engine = build_engine(loaded.adapter, tokenizer, eos, cfg.engine, context)
    return EngineSetup(engine, renderer, samples)


def serve_rank(cfg: JobConfig, loaded: LoadedModel, context: DistributedContext) -> int:
    """A rank other than 0: encode its share of every round rank 0 sends, until it says stop; returns how
    many rounds it served."""
    rounds = serve_encode_rounds(local_encoder(loaded.adapter, cfg.engine), loaded.adapter.device)
    logger.info("rank %d served %d encode rounds", context.rank, rounds)
    return rounds
