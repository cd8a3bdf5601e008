"""What the kernel benchmarks share: their refusal without a GPU, the mean time of a CUDA call over repeated
calls between two CUDA events, and their report's common fields."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from workloads import write_json

CALLS = 50


def per_call_us(fn, warmup: int = 3) -> float:
    """The mean of CALLS calls between two CUDA events, after `warmup` calls (which compile the kernels)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS


def require_cuda(script: str) -> None:
    """Exit 2 with one line where there is no CUDA device: the kernels time nothing on a CPU."""
    if not torch.cuda.is_available():
        print(f"{script} times Triton kernels on a CUDA device: no CUDA device here", file=sys.stderr)
        sys.exit(2)


def write_report(path: Path | None, dtype: str, results: list[dict], **settings) -> None:
    """The report: the GPU, the dtype, torch's and Triton's versions, the calls timed, the benchmark's
    own `settings`, and its rows; written to `path` where given."""
    import triton

    report = {
        "device": torch.cuda.get_device_name(),
        "dtype": dtype,
        "torch": torch.__version__,
        "triton": triton.__version__,
        **settings,
        "calls": CALLS,
        "results": results,
    }
    write_json(path, report)
