"""Records that cross the reader boundary: shards and not-yet-decoded samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchvl.errors import SampleError


@dataclass(frozen=True)
class MediaRef:
    """One image of a sample, not decoded yet: encoded bytes, or a checked absolute path."""

    data: bytes | None
    path: str | None


@dataclass(frozen=True)
class ShardInfo:
    shard: str  # id: the input path relative to the inputs' common folder; names its output file
    path: str  # absolute input path
    num_rows: int


@dataclass
class Sample:
    shard: str
    index: int  # row index within the shard (input order)
    key: str
    images: list[MediaRef]
    fields: dict[str, Any] = field(default_factory=dict)  # other scalar columns, passed through
    error: SampleError | None = None  # the row itself is unusable: becomes error rows downstream
