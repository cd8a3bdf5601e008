"""The host's time a launch of each of the engine's Triton kernels costs, on any machine, GPU or not.

An eager step (a prefill chunk's, a vision call's) launches its Triton kernels one by one from Python, a
dozen a decoder layer: on a GPU whose host is slow the launches, not the kernels, can bound the step (on
the lent H200's host a fused norm's call at one row took some 57 us, torch's own LayerNorm 25 us:
`fused_elementwise.py`). Here each kernel is compiled for a GPU offline, as `kernel_resources.py` compiles
it, and its launcher is replaced by one that does nothing: a call through the engine's launch function then
costs what it costs the host in Python (the launch function's own tensors and arguments, then Triton's
dispatch: specializing the arguments, finding the compiled kernel), without the driver's launch itself.
Beside each call, Triton's dispatch alone (the kernel called with arguments made once) says how much of it
is the launch function's. The shapes are `kernel_resources.py`'s (2B's widths); the per-call time does not
depend on them.

    python benchmarks/launch_overhead.py [--calls 5000] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from kernel_resources import (
    ELEMENTWISE_ROWS,
    _OfflineDriver,
    compiling_for,
    decode_launch,
    elementwise_launches,
    prefill_launch,
)
from workloads import write_json

ARCH = 90


def launches() -> dict[str, Callable[[], None]]:
    """Each kernel's call through the engine's launch function, on CPU tensors of a step's shapes (the
    rotations called on their queries and keys as they lie, where `fused_elementwise.py`'s cases copy them
    back first)."""
    from fused_elementwise import HEAD_DIM, HEADS, KV_HEADS, VISION_HEAD_DIM, VISION_HEADS

    from batchvl.layers.triton_elementwise import rotary_, rotary_into_cache_

    rows = ELEMENTWISE_ROWS

    def rotation(heads: int, dim: int, vision: bool) -> Callable[[], None]:
        qk = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
        cos = torch.zeros(rows, dim, dtype=torch.float32 if vision else torch.bfloat16)
        return lambda: rotary_(qk, cos, cos, vision=vision)

    qkv = torch.zeros(rows, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cos = torch.zeros(rows, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(2, KV_HEADS, 4 * rows, HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.arange(rows)
    qk, values = qkv[:, : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    return {
        **elementwise_launches(),
        "rotary_q_k": rotation(HEADS + KV_HEADS, HEAD_DIM, vision=False),
        "rotary_q_k_into_cache": lambda: rotary_into_cache_(qk, values, cos, cos, cache, slots),
        "vision_rotary_q_k": rotation(2 * VISION_HEADS, VISION_HEAD_DIM, vision=True),
        "grouped_decode_2b": decode_launch("2b"),
        "paged_prefill_2b": prefill_launch(),
    }


def microseconds(call: Callable[[], None], calls: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def measure(calls: int) -> list[dict]:
    """Per launch function, its host time a call and Triton's dispatch alone, in microseconds."""
    return [measure_launch(name, launch, calls) for name, launch in launches().items()]


def measure_launch(name: str, launch: Callable[[], None], calls: int) -> dict:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    with compiling_for(ARCH) as compiled:
        launch()
    for _, kernel in compiled:
        kernel.module, kernel.function = object(), 0  # (no binary loaded: nothing runs)
        kernel._run = lambda *args: None
    dispatch = JITFunction.__getitem__
    recorded: list[tuple] = []  # each of its kernels' launches: (kernel, grid, arguments, keywords)

    def recording(kernel, grid):
        def launch_once(*args, **kwargs):
            recorded.append((kernel, grid, args, kwargs))
            return dispatch(kernel, grid)(*args, **kwargs)

        return launch_once

    previous = driver._active
    driver.set_active(_OfflineDriver(ARCH))
    try:
        with mock.patch.object(JITFunction, "__getitem__", recording):
            launch()
        whole = microseconds(launch, calls)
        dispatch_alone = sum(
            microseconds(lambda k=k, g=g, a=a, kw=kw: k[g](*a, **kw), calls) for k, g, a, kw in recorded
        )
    finally:
        driver._active = previous
    return {
        "launch": name,
        "kernels": len(recorded),
        "host_us": round(whole, 2),
        "triton_dispatch_us": round(dispatch_alone, 2),
        "launch_function_us": round(whole - dispatch_alone, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = measure(args.calls)
    print(f"{'launch':24} kernels  host us  Triton's dispatch us  launch function us")
    for row in rows:
        print(
            f"{row['launch']:24} {row['kernels']:7} {row['host_us']:8.1f} {row['triton_dispatch_us']:21.1f}"
            f" {row['launch_function_us']:19.1f}"
        )
    import triton

    report = {"torch": torch.__version__, "triton": triton.__version__, "calls": args.calls, "rows": rows}
    write_json(args.json, report)


if __name__ == "__main__":
    main()
