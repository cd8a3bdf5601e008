"""Where a node's engine processes run (`batchvl run --gpus N|all` or `--processes N`), and the share of the
node's CPU cores each one takes.

`--gpus` gives process i the node's GPU i, as its only visible GPU (`CUDA_VISIBLE_DEVICES`, so that
everything that asks "the current GPU" asks its own) and `model.device: cuda`; `--processes` keeps the
job's `model.device`, so on the CPU each process is one more engine over the same cores. Either way the
cores this process may use are split evenly, and each process's preprocessing workers and torch threads
come from its share (half of it for workers, 1 to 8, as a single run takes half of the machine; the rest
for threads). `preprocess.workers` and `engine.threads` set in the job are taken as they are, per process:
the override for a node whose input or model wants another split. `--processes N` on one GPU gives each
process 1/N of `engine.gpu_memory_utilization`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from batchvl.config import JobConfig
from batchvl.errors import UserError
from batchvl.preprocess.pool import default_workers, usable_cores


@dataclass(frozen=True)
class Place:
    """One engine process of the node: its number and, under --gpus, the GPU it alone sees."""

    index: int
    gpu: str | None = None  # its CUDA_VISIBLE_DEVICES entry; None: the job's model.device

    def device(self, cfg: JobConfig) -> str:
        """The device as the launching process names it (what the summary and the stats show)."""
        return f"cuda:{self.index}" if self.gpu is not None else cfg.model.device


def node_places(processes: int | None, gpus: str | None) -> list[Place] | None:
    """The processes `--processes` / `--gpus` ask for (None: neither, a single run); a mistake is a
    UserError, before any work."""
    if processes is not None and gpus is not None:
        raise UserError(
            "--processes and --gpus both given: --gpus N for a process per GPU, else --processes N"
        )
    if processes is not None:
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise UserError(f"--processes must be a whole number, 1 or more, got {processes!r}")
        return [Place(i) for i in range(processes)]
    if gpus is None:
        return None
    asked = None if gpus == "all" else _positive(gpus)  # the spelling first: "x" is no number of GPUs
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--gpus {gpus}: no CUDA device is available; on the CPU use --processes N")
    wanted = count if asked is None else asked
    if wanted > count:
        raise UserError(
            f"--gpus {gpus}: this machine has {count} CUDA device(s); give {count} or fewer, or all"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(count)]
    return [Place(i, names[i].strip()) for i in range(wanted)]


def _positive(gpus: str) -> int:
    if not gpus.isdigit() or int(gpus) < 1:
        raise UserError(f"--gpus must be a number of GPUs, 1 or more, or all; got {gpus!r}")
    return int(gpus)


def process_config(cfg: JobConfig, place: Place, num_processes: int) -> JobConfig:
    """The job as process `place` runs it: its device, its workers and threads out of its share of cores."""
    share = max(1, usable_cores() // num_processes)
    workers = cfg.preprocess.workers
    if workers is None:
        workers = default_workers(share)
    threads = cfg.engine.threads or max(1, share - workers)
    model = cfg.model if place.gpu is None else dataclasses.replace(cfg.model, device="cuda")
    engine = dataclasses.replace(cfg.engine, threads=threads)
    if place.gpu is None and num_processes > 1 and _is_cuda(cfg.model.device):
        # the processes share one GPU: each sizes its KV cache from its share of the memory it finds free,
        # or the first would take what the others need for their models and activations
        share = cfg.engine.gpu_memory_utilization / num_processes
        engine = dataclasses.replace(engine, gpu_memory_utilization=share)
    return dataclasses.replace(
        cfg, model=model, engine=engine, preprocess=dataclasses.replace(cfg.preprocess, workers=workers)
    )


def _is_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")
