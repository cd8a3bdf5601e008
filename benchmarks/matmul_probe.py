"""Matmul rates, the throughput benchmark's yardsticks: the peak a method's child measures on its device
(the denominator of its FLOP shares), and the per-CPU probe the parent runs before and after the methods.

Run as a script, it is one probe: pinned to one CPU, one thread, it prints where it ran and its rate.

    python benchmarks/matmul_probe.py --cpu 0 --dtype float32 [--seconds 2] [--size 2048]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
from processes import PEER_ENV

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # by the names --dtypes takes


def matmul_peak(dtype: torch.dtype, device: str = "cpu", size: int = 2048, repeats: int = 10) -> float:
    """Best FLOP/s of a square matmul at this dtype and thread count, on the device. (Without batchvl:
    vLLM's peer calls it in vLLM's environment.)"""
    on = torch.device(device)
    # A CUDA matmul returns when it is queued: the clock is read once it is done.
    done = functools.partial(torch.cuda.synchronize, on) if on.type == "cuda" else lambda: None
    a, b = (torch.randn(size, size, dtype=dtype, device=on) for _ in range(2))
    torch.matmul(a, b)  # warm-up
    done()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        done()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def matmul_rate(dtype: torch.dtype, seconds: float, size: int = 2048) -> float:
    """FLOP/s of back-to-back square matmuls at this dtype and thread count over about `seconds`: a rate
    over a window (where `matmul_peak` takes the best call), so that probes running at once overlap."""
    a, b = (torch.randn(size, size, dtype=dtype) for _ in range(2))
    torch.matmul(a, b)  # warm-up
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.matmul(a, b)
        calls += 1
    return 2 * size**3 * calls / elapsed


def cpu_matmul_rates(dtype_name: str, seconds: float = 2.0, size: int = 2048) -> dict:
    """GFLOP/s of a one-thread matmul on each CPU this process may use, in a child pinned to it: each CPU
    alone, then all at once (a child per CPU). The CPUs of a virtual machine need not be equal cores: two
    may share one core's matrix unit, or share their cores with another tenant's work, and a method's
    threads split each matmul evenly, so a slow CPU paces all of them. These figures say what the
    machine was when the methods ran (both are in the report)."""
    cpus = sorted(os.sched_getaffinity(0))

    def probe(cpu: int) -> subprocess.Popen:
        command = [sys.executable, __file__, "--cpu", str(cpu), "--dtype", dtype_name]
        command += ["--seconds", str(seconds), "--size", str(size)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=PEER_ENV)

    def result(process: subprocess.Popen) -> dict:
        out, _ = process.communicate()
        if process.returncode:
            raise SystemExit(f"the matmul probe failed (exit {process.returncode})")
        return json.loads(out)

    alone = [result(probe(cpu)) for cpu in cpus]
    together = [result(process) for process in [probe(cpu) for cpu in cpus]]
    return {"dtype": dtype_name, "alone": alone, "together": together}


def main() -> None:
    """One probe of `cpu_matmul_rates`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", type=int, required=True)
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--size", type=int, default=2048)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    rate = matmul_rate(TORCH_DTYPES[args.dtype], args.seconds, args.size)
    print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "gflops": round(rate / 1e9, 1)}))


if __name__ == "__main__":
    main()
