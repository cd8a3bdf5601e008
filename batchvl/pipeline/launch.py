"""What a run with the built-in engine holds: the model, loaded with the job's settings, and the engine
over it (assembled by `engine/builder.py`). Under torchrun every rank loads the model; the ranks' roles are
`engine/parallel/ranks.py`'s.

The preprocessing workers need the model's parts alone (`ModelParts`: its processor, config and dtype),
so a run reads those first, starts the workers, and loads the weights as the engine starts: the workers
are forked from a process without the weights in its memory, and prepare the first samples while they
load."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from batchvl.config import JobConfig
from batchvl.engine.builder import build_engine
from batchvl.engine.device.placement import process_device
from batchvl.engine.interface import EngineInterface
from batchvl.engine.parallel.vit_dp import DistributedContext
from batchvl.inputs.download import DownloadCache
from batchvl.models.loader import LoadedModel, ModelParts, load_model, load_model_parts
from batchvl.pipeline.engine_setup import EngineSetup
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.sample import SampleProcessor


def job_model_parts(cfg: JobConfig) -> ModelParts:
    """The job's model's parts, for this process's device (under torchrun, this rank's GPU)."""
    m = cfg.model
    return load_model_parts(m.path, m.dtype, process_device(m.device), m.trust_remote_code)


def load_job_model(cfg: JobConfig, parts: ModelParts | None = None) -> tuple[LoadedModel, float]:
    """The job's model, loaded with the job's thread count (over its `parts`, where read already); and the
    seconds loading took."""
    if cfg.engine.threads > 0:
        torch.set_num_threads(cfg.engine.threads)
    started = time.perf_counter()
    m = cfg.model
    device = process_device(m.device)  # under torchrun, this rank's GPU
    e = cfg.engine
    loaded = load_model(
        m.path, m.dtype, device, m.trust_remote_code, e.fused_kernels, e.vision_attention, parts
    )
    return loaded, time.perf_counter() - started


def builtin_engine_setup(
    cfg: JobConfig,
    parts: ModelParts,
    load: Callable[[], LoadedModel],
    context: DistributedContext | None,
    graph: PromptGraph,
    most_requests: int | None = None,
) -> EngineSetup:
    """The built-in engine over the model `load` gives (called as the engine starts): prompts as token ids,
    images as the family's pixels (what the preprocessing workers run per sample, from the model's
    `parts`: the family's media preparation and the prompts). `most_requests` bounds the requests the run
    makes, where known (`replica_count`'s choice for a small job)."""
    renderer = PromptRenderer(parts.processor)
    media = parts.family.media_preparer(parts.processor, parts.config, cfg.preprocess)
    cache = DownloadCache.of(cfg.input.download)
    samples = SampleProcessor(renderer, media, cfg.prompts, graph.follow_ups, cache)

    def start() -> EngineInterface:
        loaded = load()
        tokenizer, eos = loaded.processor.tokenizer, loaded.eos_token_ids()
        return build_engine(loaded.adapter, tokenizer, eos, cfg.engine, context, most_requests)

    return EngineSetup(renderer, samples, start, cfg.engine.lookahead)
