"""How a job-file key is declared (`job_key`: default, help text, bounds, whether it defines the output)
and how its bounds are checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from batchvl.errors import ConfigError

REQUIRED = dataclasses.MISSING


def job_key(
    default: Any = REQUIRED,
    help: str = "",
    factory: Any = None,
    *,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
    defines_output: bool = False,
    unset_leaves_fingerprint: bool = False,
    name: str | None = None,
) -> Any:
    """A job-file key: its default, help text, bounds (`above` is exclusive) and whether a shard's rows
    depend on it (`defines_output`: a changed value over committed shards is refused). A key added to a
    section that defines the output is `unset_leaves_fingerprint`: at its default it is left out of the
    fingerprint, so jobs that do not use it keep the fingerprint (and their committed shards) they had.
    `name` is the key's name in the job file where it cannot be the field's (a Python keyword)."""
    metadata = {
        "name": name,
        "help": help,
        "above": above,
        "at_least": at_least,
        "at_most": at_most,
        "defines_output": defines_output,
        "unset_leaves_fingerprint": unset_leaves_fingerprint,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def file_key(f: dataclasses.Field) -> str:
    """The key's name in the job file."""
    return f.metadata.get("name") or f.name


def check_bounds(key: str, value: Any, metadata: Mapping) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return  # null, or not a number
    above, at_least, at_most = metadata.get("above"), metadata.get("at_least"), metadata.get("at_most")
    low_ok = (above is None or value > above) and (at_least is None or value >= at_least)
    if low_ok and (at_most is None or value <= at_most):
        return
    if at_most is not None:
        low = f"({above:g}" if above is not None else f"[{at_least:g}"
        raise ConfigError(f"'{key}' must be in {low}, {at_most:g}], got {value}")
    if above == 0:
        raise ConfigError(f"'{key}' must be positive, got {value}")
    raise ConfigError(f"'{key}' must be >= {at_least if at_least is not None else above:g}, got {value}")
