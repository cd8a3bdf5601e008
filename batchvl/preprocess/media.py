"""What preprocessing hands to the engine: plain arrays plus a content hash, no tensors, no PIL."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash


@dataclass(frozen=True)
class PreparedImage:
    """A preprocessed image (or video clip): the vision tower's input rows and its patch grid."""

    pixel_values: np.ndarray  # (num_patches, channels * temporal_patch * patch * patch), float32
    grid_thw: tuple[int, int, int]
    content_hash: str
    kind: str = "image"  # "image" or "video": which placeholder token and vision entry point

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


def content_hash(pixel_values: np.ndarray, grid_thw: tuple[int, int, int], kind: str = "image") -> str:
    """xxh3-128 of the preprocessed pixels, grid and kind: equal for identical media after preprocessing."""
    digest = xxhash.xxh3_128()
    digest.update(kind.encode())
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    digest.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    return digest.hexdigest()
