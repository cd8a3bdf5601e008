"""The device a process runs the model on: `model.device` resolved against the machine, and under torchrun
each rank's own GPU.

`auto` is CUDA when there is one. `cuda` is one GPU: the first in a plain run, and under torchrun the
rank's local GPU, rank i on GPU i % count, so more ranks than GPUs share them (two ranks on one GPU is
a way to keep it busy while the other rank's images are prepared). `cuda:N` names a GPU, for every rank.
Asking for a GPU the machine does not have is a mistake in how batchvl is called, refused before work.
"""

from __future__ import annotations

import torch

from batchvl.errors import UserError
from batchvl.utils.environment import env_int


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`model.device` as a torch device with its index; `local_rank`: this torchrun rank's, or None."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"model.device is '{name}' but no CUDA device is available; use 'cpu' or 'auto'")
    count = torch.cuda.device_count()
    index = torch.device(name).index
    if index is None:
        return torch.device("cuda", 0 if local_rank is None else local_rank % count)
    if index >= count:
        raise UserError(
            f"model.device is '{name}' but this machine has {count} CUDA device(s), cuda:0 to "
            f"cuda:{count - 1}; name one of those, or 'cuda'"
        )
    return torch.device("cuda", index)


TORCHRUN_FIX = "it is torchrun's: unset it to run one process"


def launched_world_size() -> int:
    return env_int("WORLD_SIZE", 1, TORCHRUN_FIX)


def launched_local_rank() -> int | None:
    """This process's rank on its machine under torchrun; None in a plain run."""
    return None if launched_world_size() == 1 else env_int("LOCAL_RANK", 0, TORCHRUN_FIX)


def process_device(name: str) -> torch.device:
    """The device of this process: the plain run's, or this torchrun rank's."""
    return resolve_device(name, launched_local_rank())


def shares_its_gpu(name: str, device: torch.device) -> bool:
    """Whether another torchrun rank on this machine runs on this process's GPU: all ranks do under
    `cuda:N`, and some do when there are more ranks than GPUs."""
    ranks_here = env_int("LOCAL_WORLD_SIZE", 1, TORCHRUN_FIX)
    if device.type != "cuda" or ranks_here == 1:
        return False
    return name.startswith("cuda:") or ranks_here > torch.cuda.device_count()
