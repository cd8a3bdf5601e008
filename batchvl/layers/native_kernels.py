"""Kernels compiled for this machine on first use (`native/`), one Python module:

- `paged_decode_attention(out, query, kv, rows, slots, starts, lengths, scale)`: a step's decodes attended
  straight from the paged KV cache. The torch path gathers every decode's keys and values into a padded
  batch, then attends over the copy: each cached row is read, written and read again, and every layer of
  every step pays the gather and the attention call's set-up. The kernel reads each row once where it
  lies, the query heads sharing a KV head together. Measured on a 2-core CPU with AMX (bf16, 40
  sequences, 9,859 cached keys, 8 query and 2 KV heads of 64; `benchmarks/native_kernels.py`): 0.33-0.37
  ms per layer against 0.83-0.88 ms for the gather and torch's fused attention.
- `rms_norm(out, input, weight, eps)`, `silu_and_mul(out, gate_up)` and `rotary(out, x, cos, sin)`: a
  decoder's RMSNorm, a gated MLP's SiLU and product, and the rotary embedding of a layer's queries and
  keys, one pass each instead of chains of eager ops (`native/elementwise.cpp`).
- `varlen_attention(out, query, key, value, cu_seqlens, scale)` and `paged_prefill_attention(...)`: bf16
  attention with AVX512-BF16 dot products, for the vision tower's images and the language model's prefill
  chunks (`native/bf16_attention.cpp`); `bf16_dot_products()` says whether this CPU has them.

torch.utils.cpp_extension builds the sources once per machine kind and source version, under torch's
extensions directory (`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`), from a copy of
them there, so that checkouts sharing a home share the build (environments get one each: the build file
names where their torch and Python are installed); the first build takes
about half a minute, when the model is loaded. Processes starting together (a Slurm array on a
shared home) build it once: they queue on an flock, which the kernel releases when its holder dies.
cpp_extension's own lock is a file that a process killed mid-build (`kill -9`, a preempted Slurm task)
leaves behind, and every later load would wait on it forever; under the flock no other process can be
building, so such a file is stale and removed. The flags follow `torch.backends.cpu.get_cpu_capability()`,
which is in the build's name, so machines of different kinds sharing one home each get a build they can
run. Where it cannot be built (no C++ compiler, say), the engine stays on torch ops, with one warning;
`BATCHVL_NATIVE_KERNELS=0` keeps it there.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "native" / name
    for name in ("bindings.cpp", "paged_decode_attention.cpp", "elementwise.cpp", "bf16_attention.cpp")
]
DISABLE_VARIABLE = "BATCHVL_NATIVE_KERNELS"
# Compiler flags per torch CPU capability: ATen's vector types pick their ISA from CPU_CAPABILITY_*.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}
# The head sizes the decode attention is compiled for (a head's row is held in registers), and the dtypes
# every kernel takes.
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float32, torch.bfloat16)


def bf16_attention_takes(head_dim: int) -> bool:
    """Whether the bf16 attention kernels are compiled for this head size: any even size up to 128 (the
    Qwen-VL vision towers' 72 and 80 among them) and 242-256."""
    return head_dim % 2 == 0 and (0 < head_dim <= 128 or 240 < head_dim <= 256)


@functools.cache
def native_ops() -> ModuleType | None:
    """The module of native kernels, built for this machine, or None where it is turned off or cannot be
    built."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    name, flags = build_name_and_flags()
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        directory = build_directory(name)
        with open(directory / "batchvl.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            if not (directory / f"{name}.so").exists():
                logger.info("building the native kernels for this CPU (%s), once: about half a minute", name)
            module = load(
                name,
                [str(s) for s in sources_in(directory)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
            )
    except Exception as error:  # a missing compiler or ninja, a failed build: the torch path still works
        reason = " ".join(str(error).split())[:300]
        logger.warning("the engine runs on torch ops only: its native kernels did not build (%s)", reason)
        return None
    logger.debug("native kernels ready in %.1f s (%s)", time.perf_counter() - started, name)
    return module


def runs_natively(tensor: torch.Tensor) -> bool:
    """Whether the kernels take this tensor's kind (a CPU tensor in float32 or bf16) and were built here."""
    return tensor.device.type == "cpu" and tensor.dtype in DTYPES and native_ops() is not None


def build_name_and_flags() -> tuple[str, list[str]]:
    """The module's name (the CPU capability, then a digest of the flags, the Python and torch versions and
    the sources) and its compiler flags."""
    capability = torch.backends.cpu.get_cpu_capability()
    # No contraction of a product and a sum into one FMA: the kernels that give torch's bits round where
    # torch's separate ops round (GCC contracts by default, even through vector intrinsics).
    flags = [
        "-O3",
        "-ffp-contract=off",
        *ISA_FLAGS.get(capability, []),
        f"-DCPU_CAPABILITY={_namespace(capability)}",
        "-fopenmp",
    ]
    # The build links against this Python and this torch, and its build file names where they are
    # installed: environments sharing a home get a build each, where one at another path (another
    # virtualenv of the same versions) rebuilt the shared one at its first use, and the other back.
    digest = hashlib.sha256(" ".join([*flags, sys.version, torch.__version__, *installed_at()]).encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return f"batchvl_native_{capability.lower()}_{digest.hexdigest()[:12]}", flags


def installed_at() -> list[str]:
    """The folders of torch's and Python's headers and torch's libraries, as cpp_extension writes them into
    the build file (its compiler and linker flags)."""
    from torch.utils import cpp_extension

    return [*cpp_extension.include_paths(), *cpp_extension.library_paths(), sysconfig.get_paths()["include"]]


def sources_in(directory: Path) -> list[Path]:
    """The sources, copied into the build directory (once: its name holds their digest), which the build
    then compiles. cpp_extension's build file names the sources' paths, so building from each checkout's
    own files made every checkout or environment sharing a home (a cluster's, say) rebuild at its first
    use, and the next one rebuild back; from the copy, they share one build. Written whole, then renamed,
    so a process killed while copying leaves no half file."""
    folder = directory / "sources"
    folder.mkdir(exist_ok=True)
    copies = []
    for source in SOURCES:
        copy = folder / source.name
        if not copy.exists():
            partial = folder / f".{source.name}.partial"
            partial.write_bytes(source.read_bytes())
            partial.replace(copy)
        copies.append(copy)
    return copies


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _namespace(capability: str) -> str:
    """ATen's name for the vector code of a capability (its inline namespace); anything else: plain loops."""
    return capability if capability in ISA_FLAGS else "DEFAULT"


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` package's binary is beside the interpreter, which
    is not on PATH when a virtualenv's python runs without being activated."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
