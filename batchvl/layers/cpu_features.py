"""What this CPU's matrix units can do, asked of torch once."""

from __future__ import annotations

import functools
import os

import torch

# oneDNN's cap on the instruction sets it uses, under its current name and the one older releases read
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX tiles, the OS lets this process use them, and oneDNN may. With AMX, torch's
    fused CPU attention kernel runs its bf16 inner products on the tiles; without, it computes them in
    float32."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, hence the fallback
    return bool(probe and probe() and torch.cpu._init_amx()) and onednn_allows_amx()


def onednn_allows_amx() -> bool:
    """False where oneDNN's instruction sets are capped below AMX (say `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`):
    torch's linear layers and its fused attention's micro-kernels are oneDNN's, so they then run without
    the tiles, and batchvl's own kernels are chosen as on a CPU without them."""
    for name in ONEDNN_ISA_VARIABLES:
        cap = os.environ.get(name, "").strip().upper()
        if cap:
            return "AMX" in cap or cap in ("ALL", "DEFAULT")
    return True
