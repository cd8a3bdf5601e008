"""Whole numbers from the environment that launchers set (Slurm's array variables, torchrun's ranks): a
value that is not one is a one-line mistake naming the variable, never a `ValueError` traceback."""

from __future__ import annotations

import os
from collections.abc import Mapping

from batchvl.errors import UserError


def env_int(name: str, default: int, fix: str, env: Mapping[str, str] = os.environ) -> int:
    """`env[name]` as an int (`default` when unset); `fix` says what to do about a value that is not one."""
    text = env.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{name} is {text!r}, not a whole number; {fix}") from None
