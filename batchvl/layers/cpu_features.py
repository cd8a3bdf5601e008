"""What this CPU's matrix units can do, asked of torch once."""

from __future__ import annotations

import functools

import torch


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX tiles (and the OS lets this process use them). With AMX, torch's fused CPU
    attention kernel runs its bf16 inner products on the tiles; without, it computes them in float32."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, hence the fallback
    return bool(probe and probe() and torch.cpu._init_amx())
