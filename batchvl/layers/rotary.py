"""Rotary position embedding in the fewest eager ops that give transformers' bits.

transformers computes `x * cos + rotate_half(x) * sin`, where `rotate_half(x)` is `(-x2, x1)` (the two
halves of the head swapped, the first negated): a negation and a concatenation per tensor, then two
products and a sum. `roll(x, half)` is `(x2, x1)`, and a sign flip is exact, so `roll(x) * (-s1, s2)`
has the bits of `rotate_half(x) * sin`; the products and the sum are the same operations in the same
dtype. Queries and keys of one layer are rotated in one call.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` in x's dtype, with cos/sin broadcastable to x (head dim last)."""
    half = x.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    out = x * cos
    return out.add_(torch.roll(x, half, dims=-1).mul_(signed_sin))
