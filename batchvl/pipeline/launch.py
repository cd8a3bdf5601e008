"""What a run with the built-in engine holds: the model, loaded with the job's settings, and the engine
over it (assembled by `engine/builder.py`). Under torchrun every rank loads the model; the ranks' roles are
`engine/parallel/ranks.py`'s."""

from __future__ import annotations

import functools
import time

import torch

from batchvl.config import JobConfig
from batchvl.engine.builder import build_engine
from batchvl.engine.device.placement import process_device
from batchvl.engine.parallel.vit_dp import DistributedContext
from batchvl.inputs.download import DownloadCache
from batchvl.models.loader import LoadedModel, load_model
from batchvl.pipeline.engine_setup import EngineSetup
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.preprocess.media import PixelsInDtype
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.sample import SampleProcessor


def load_job_model(cfg: JobConfig) -> tuple[LoadedModel, float]:
    """The job's model, loaded with the job's thread count; and the seconds loading took."""
    if cfg.engine.threads > 0:
        torch.set_num_threads(cfg.engine.threads)
    started = time.perf_counter()
    m = cfg.model
    device = process_device(m.device)  # under torchrun, this rank's GPU
    e = cfg.engine
    loaded = load_model(m.path, m.dtype, device, m.trust_remote_code, e.fused_kernels, e.vision_attention)
    return loaded, time.perf_counter() - started


def builtin_engine_setup(
    cfg: JobConfig, loaded: LoadedModel, context: DistributedContext | None, graph: PromptGraph
) -> EngineSetup:
    """The built-in engine over the loaded model: prompts as token ids, images as the family's pixels (what
    the preprocessing workers run per sample: the family's media preparation and the prompts)."""
    renderer = PromptRenderer(loaded.processor)
    media = loaded.family.media_preparer(loaded.processor, loaded.adapter.model.config, cfg.preprocess)
    media = PixelsInDtype(media, loaded.adapter.dtype)  # cast in the workers, not the engine's thread
    cache = DownloadCache.of(cfg.input.download)
    samples = SampleProcessor(renderer, media, cfg.prompts, graph.follow_ups, cache)
    tokenizer, eos = loaded.processor.tokenizer, loaded.eos_token_ids()
    start = functools.partial(build_engine, loaded.adapter, tokenizer, eos, cfg.engine, context)
    return EngineSetup(renderer, samples, start)
