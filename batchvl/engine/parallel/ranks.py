"""A job's processes under torchrun (`engine.vit_parallel: data`): rank 0 drives the job, and every other
rank only encodes its share of each encode round (`vit_dp.py`) until rank 0 lets it go. A plain run is
one process that drives the job."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from batchvl.config import EngineConfig
from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.builder import local_encoder
from batchvl.engine.device.placement import launched_world_size, process_device, shares_its_gpu
from batchvl.engine.parallel.vit_dp import (
    DistributedContext,
    init_distributed,
    leave_process_group,
    release_serving_ranks,
    serve_encode_rounds,
)
from batchvl.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def in_launched_processes(
    config: EngineConfig,
    device_setting: str,
    drive: Callable[[DistributedContext | None], T],
    serve: Callable[[DistributedContext], T],
) -> T:
    """Run `drive` in the driving process (the only one without torchrun), `serve` in every other rank;
    `device_setting` is `model.device`."""
    world_size = launched_world_size()
    if world_size == 1:
        return drive(None)
    if config.vit_parallel != "data":
        raise UserError(
            f"launched as {world_size} processes (WORLD_SIZE={world_size}) but engine.vit_parallel is "
            f"'{config.vit_parallel}'; set engine.vit_parallel: data, or run without torchrun"
        )
    device = process_device(device_setting)
    context = init_distributed(device, shares_its_gpu(device_setting, device))
    try:
        return drive(context) if context.is_driver else serve(context)
    finally:
        if context.is_driver:
            release_serving_ranks(context.world_size)
        leave_process_group()


def serve_rank(adapter: ModelAdapter, config: EngineConfig, context: DistributedContext) -> int:
    """A rank other than 0: encode its share of every round rank 0 sends, until it says stop; returns how
    many rounds it served."""
    rounds = serve_encode_rounds(local_encoder(adapter, config), adapter.device)
    logger.info("rank %d served %d encode rounds", context.rank, rounds)
    return rounds
