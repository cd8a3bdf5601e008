"""The engine's GPU fast paths, `engine.cuda_graphs`, `engine.overlap` and `engine.fused_kernels`, resolved
for a device: `auto` (each one's default) is on on CUDA and off elsewhere.

On an H200 at Qwen2-VL-2B's full size the three together captioned 60.4 samples/s against 44.4 without
them in the same check (`make gpu-check`'s `gpu_throughput_2b_fast` and `gpu_throughput_2b`), after their
parity tests had passed there with real CUDA graphs and compiled kernels (docs/benchmarks.md). On the CPU no
graph is captured and the fused kernels are Triton's, which need a GPU; overlapped steps gain where a device
computes one step while the host prepares the next, and a CPU does both: there they run only when asked for.
(The model's fused kernels are swapped in when it is loaded, before any engine: `load_model` reads the same
setting.)

`engine.vision_graphs` (the Qwen-VL towers' vision calls as CUDA graphs) is a fast path whose `auto` is off
until a GPU run has measured it (`make gpu-check`'s `vision_call` and `gpu_throughput_2b_fast_vision_graphs`);
a GPU run that finds it pays moves it from UNMEASURED_PATHS to FAST_PATHS.
"""

from __future__ import annotations

import dataclasses

import torch

from batchvl.config import EngineConfig

FAST_PATHS = ("cuda_graphs", "overlap", "fused_kernels")
# Fast paths whose `auto` is off until a GPU run has measured them against the path they replace
UNMEASURED_PATHS = ("vision_graphs",)


def fast_path_on(setting: bool | str, device: torch.device, measured: bool = True) -> bool:
    """A fast path's setting on `device`: as given, or for `auto`, whether `device` is a CUDA device (and
    the path `measured`: off otherwise)."""
    return measured and device.type == "cuda" if setting == "auto" else bool(setting)


def path_on(config: EngineConfig, name: str, device: torch.device) -> bool:
    """Whether the fast path `name` (of FAST_PATHS or UNMEASURED_PATHS) of `config` is on on `device`."""
    return fast_path_on(getattr(config, name), device, measured=name not in UNMEASURED_PATHS)


def fast_paths_resolved(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with each fast path a bool for `device`."""
    return dataclasses.replace(
        config, **{name: path_on(config, name, device) for name in FAST_PATHS + UNMEASURED_PATHS}
    )
