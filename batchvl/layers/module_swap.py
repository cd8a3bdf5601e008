"""Swapping a model's submodules for batchvl's own, in place."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replace_children(
    model: torch.nn.Module,
    should_replace: Callable[[torch.nn.Module], bool],
    make: Callable[[torch.nn.Module], torch.nn.Module],
) -> int:
    """Replace every submodule for which `should_replace` holds with `make(submodule)`; returns how many.
    All targets are chosen before the first replacement, so a new module's own children are never visited."""
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if should_replace(child)
    ]
    for parent, name in targets:
        setattr(parent, name, make(getattr(parent, name)))
    return len(targets)
