"""The engine's Triton kernels compiled for a GPU on a machine without one, and what each takes of an SM:
registers a thread, shared memory and spill stack, and how many of its programs an SM can then hold.

Each kernel is compiled through the engine's own launch function (`triton_grouped_decode`,
`triton_attention`, `triton_elementwise`) with CPU tensors of a real step's shapes standing in for the GPU's:
Triton specializes the arguments as for a launch (pointers' alignment, integers divisible by 16), which
decides whether its loads are vectors and pipelined, then compiles with its own compiler and ptxas for the
architecture asked (`--arch 90`: H100 and H200; `80`: A100). Nothing runs. Every launch setting that
`decode_attention.py` and `fused_elementwise.py` time beside the defaults is compiled as well, so that a
setting that does not compile, that spills registers, or that leaves an SM few programs at once is known
before a GPU window times it. What an SM holds is counted from its registers, threads and shared memory
alone (CUDA's occupancy rules; no other limit).

The specialization matters: compiled once from its signature alone (as the kernels' compile tests compile
it, a one-off, not kept here), the grouped decode kernel spilled registers and read its cache with scalar
2-byte loads; through its launch function it uses 168 registers, no spill, and pipelined 16-byte loads.

    python benchmarks/kernel_resources.py [--arch 90] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from launch_settings import applied
from workloads import write_json

REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
PROGRAMS_PER_SM = 32
REGISTER_UNIT = 256  # registers are given to a warp in these units
SHARED_PER_SM = {90: 228 * 1024, 80: 164 * 1024}  # bytes; each program also holds 1 KB for the system
RESERVED_SHARED = 1024

# The shapes compiled: a decode step of 2B's and 7B's heads (`decode_attention.py`'s), a step of 2B's prompt
# chunks (`prefill_attention.py`'s) and the elementwise ops at 2B's widths (`fused_elementwise.py`'s); the
# rows of a call change its grid, not its code
DECODE_SEQUENCES, DECODE_KEYS = 256, 600
PROMPT_CHUNK, PROMPT_CONTEXT = 256, 256
ELEMENTWISE_ROWS = 16


class _OfflineDriver:
    """What Triton asks of its active driver to compile: the target. Its device is one of its own (the
    negative architecture), so that each kernel keeps what it compiled for it apart from a real GPU's."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return -self.target.arch

    def get_current_stream(self, device=None) -> int:
        return 0


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[list]:
    """Inside the block, a kernel launch compiles the kernel for `arch` and runs nothing; yields the list
    that each launch's (kernel name, compiled kernel) is added to. Triton's driver and launches are put back
    after it."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []

    def compile_only(kernel, grid):
        def launch(*args, **kwargs):
            compiled.append((kernel.fn.__name__, kernel.run(*args, grid=grid, warmup=True, **kwargs)))

        return launch

    previous = driver._active  # (not `reset_active`: it would look for a GPU)
    driver.set_active(_OfflineDriver(arch))
    try:
        with mock.patch.object(JITFunction, "__getitem__", compile_only):
            yield compiled
    finally:
        driver._active = previous


def resources(kernel) -> dict:
    """A compiled kernel's registers a thread, shared memory and spill stack, from its binary."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
    return {
        "registers": int(found["REG"]),
        "spill_stack_bytes": int(found["STACK"]),
        "shared_bytes": kernel.metadata.shared + int(found["SHARED"]),
        "warps": kernel.metadata.num_warps,
        "stages": kernel.metadata.num_stages,
        "scalar_16bit_accesses": scalar_16bit_accesses(kernel.asm["ptx"]),
    }


def scalar_16bit_accesses(ptx: str) -> int:
    """The loads and stores of global memory in a kernel's PTX that move one 16-bit element each: where
    Triton could not prove a tensor's elements contiguous and aligned (an unspecialized stride, a mask that
    varies along the contiguous axis), a bf16 tile is read an element at a time instead of 16 bytes at a
    time."""
    accesses = re.findall(r"\b(?:ld|st)\.global[\w.:]*", ptx)
    scalar = [op for op in accesses if not re.search(r"\.v\d", op)]
    return sum(bool(re.search(r"\.(?:b16|u16|s16|f16|bf16)$", op)) for op in scalar)


def programs_per_sm(registers: int, warps: int, shared_bytes: int, arch: int) -> int:
    """How many programs of a kernel an SM holds at once, by its registers, threads and shared memory."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_threads = THREADS_PER_SM // (32 * warps)
    by_shared = SHARED_PER_SM[arch] // (shared_bytes + RESERVED_SHARED)
    return min(by_registers, by_threads, by_shared, PROGRAMS_PER_SM)


def decode_launch(shape: str) -> Callable[[], None]:
    """The grouped decode call of `decode_attention.py`'s step of `shape`'s heads, on CPU tensors."""
    from decode_attention import PAGE_SIZE, SHAPES, decode_step

    from batchvl.layers.triton_grouped_decode import grouped_decode_attention

    heads, kv_heads, head_dim = SHAPES[shape]
    step = decode_step(heads, kv_heads, head_dim, DECODE_SEQUENCES, DECODE_KEYS, torch.bfloat16, "cpu")
    query, kv, metadata = step
    out = torch.zeros(DECODE_SEQUENCES, heads, head_dim, dtype=torch.bfloat16)
    return lambda: grouped_decode_attention(out, query, kv, *metadata, head_dim**-0.5, PAGE_SIZE)


def prefill_launch() -> Callable[[], None]:
    """The paged prefill call of `prefill_attention.py`'s step of 2B's prompt chunks, on CPU tensors."""
    from prefill_attention import LM_HEADS, prompt_chunks

    from batchvl.layers.triton_attention import paged_prefill_attention

    heads, _, dim = LM_HEADS
    step = prompt_chunks(PROMPT_CHUNK, PROMPT_CONTEXT, "cpu")
    out = torch.zeros(step["count"] * PROMPT_CHUNK, heads, dim, dtype=torch.bfloat16)
    arguments = [step[name] for name in ("query", "kv", "starts", "counts", "slots", "lengths")]
    return lambda: paged_prefill_attention(out, *arguments, dim**-0.5, PROMPT_CHUNK)


def elementwise_launches() -> dict[str, Callable[[], None]]:
    """`fused_elementwise.py`'s fused ops at the 2B's widths, on CPU tensors, by its names."""
    from fused_elementwise import cases

    return {name: fused for name, _, fused, _ in cases(ELEMENTWISE_ROWS, torch.bfloat16, "cpu")}


def rows_of(case: str, launch: Callable[[], None], settings: dict, module: str, arch: int) -> list[dict]:
    """A row per kernel `launch` compiles for `arch` under the launch `settings` of the kernels' `module`
    (`launch_settings.TUNABLE`'s names)."""
    with applied({module: settings}), compiling_for(arch) as compiled:
        launch()
    rows = []
    for name, kernel in compiled:
        usage = resources(kernel)
        held = programs_per_sm(usage["registers"], usage["warps"], usage["shared_bytes"], arch)
        rows.append({"case": case, "kernel": name, "launch": settings, **usage, "programs_per_sm": held})
    return rows


def measure(arch: int) -> list[dict]:
    """Every kernel at its defaults and at the launch settings its benchmark sweeps."""
    from decode_attention import LAUNCHES, SHAPES
    from fused_elementwise import SWEEP

    rows = []
    for shape in SHAPES:
        for settings in ({}, *LAUNCHES):
            rows += rows_of(f"decode_{shape}", decode_launch(shape), settings, "triton_grouped_decode", arch)
    rows += rows_of("prefill_2b", prefill_launch(), {}, "triton_attention", arch)
    for op, launch in elementwise_launches().items():
        for settings in ({}, *SWEEP.get(op, ())):
            rows += rows_of(op, launch, settings, "triton_elementwise", arch)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_PER_SM), default=90)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = measure(args.arch)
    print(f"{'case':21} {'kernel':22} {'launch':45} regs stack shared  warps stages programs/SM 2-byte")
    for row in rows:
        launch = ", ".join(f"{key}={value}" for key, value in row["launch"].items()) or "defaults"
        usage = f"{row['registers']:4} {row['spill_stack_bytes']:5} {row['shared_bytes']:6}"
        shape = (
            f"{row['warps']:6} {row['stages']:6} {row['programs_per_sm']:11} {row['scalar_16bit_accesses']:6}"
        )
        print(f"{row['case']:21} {row['kernel']:22} {launch:45} {usage} {shape}")
    write_json(args.json, {"arch": args.arch, "triton": __import__("triton").__version__, "rows": rows})


if __name__ == "__main__":
    main()
