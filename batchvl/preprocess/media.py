"""What preprocessing hands to the engine: plain arrays plus a content hash, no PIL."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import xxhash


@dataclass(frozen=True)
class PreparedMedia:
    """A preprocessed image (or video clip) in its family's layout, and how it appears in the prompt.

    `pixel_values` is what the family's vision tower takes for this one item, stacked along axis 0 with
    other items of an encode call (Qwen: patch rows; CLIP-style towers: whole (3, H, W) crops or tiles).
    `placeholder` replaces the item's single placeholder token in the chat-template text; it holds
    `num_tokens` placeholder tokens (possibly in several runs, with text between), which the item's
    `num_tokens` embedding rows fill in order.
    """

    # (a serving rank of ViT data parallelism over NCCL receives them as a tensor on its GPU: vit_dp.py)
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]  # patch grid: (frames / tiles, rows, columns); its product is the cost
    content_hash: str
    num_tokens: int
    placeholder: str
    kind: str = "image"  # "image" or "video": which placeholder token and vision entry point
    seconds_per_grid_t: float = 0.0  # video: seconds of video per temporal grid step (Qwen2.5-VL positions)
    # `pixel_values` as a tensor in shared memory, set by `in_shared_memory` just before a worker sends the
    # media (what is sent; so nothing replaces the pixels after it); None: moved there when pickled
    shared_pixels: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid_thw)

    def in_shared_memory(self) -> PreparedMedia:
        """This media with its pixels moved to shared memory now, in the preprocessing worker's own
        thread, where a failure (a full /dev/shm, a file size limit) is raised to the caller. Left to the
        pickler, the move happens in the result queue's feeder thread, which prints the error and drops
        the sample: the job then waited for it forever. The same one copy either way."""
        tensor = torch.from_numpy(np.ascontiguousarray(self.pixel_values)).share_memory_()
        return dataclasses.replace(self, pixel_values=tensor.numpy(), shared_pixels=tensor)

    def __reduce__(self):
        """Pickled (to go from a preprocessing worker to the job process), the pixels travel as a torch
        tensor: torch's multiprocessing pickler sends a tensor in shared memory as a handle and the receiver
        maps those pages, where a numpy array would be copied into the pipe and out of it again."""
        kept = {f.name for f in dataclasses.fields(self)} - {"pixel_values", "shared_pixels"}
        fields = {name: getattr(self, name) for name in kept}
        pixels = self.shared_pixels
        if pixels is None:
            pixels = torch.from_numpy(np.ascontiguousarray(self.pixel_values))  # the pickler moves it
        return (_media_from_tensor, (pixels, fields))


def _media_from_tensor(pixels: torch.Tensor, fields: dict) -> PreparedMedia:
    return PreparedMedia(pixel_values=pixels.numpy(), **fields)


def content_hash(pixel_values: np.ndarray, grid_thw: tuple[int, int, int], kind: str = "image") -> str:
    """xxh3-128 of the preprocessed pixels, grid and kind: equal for identical media after preprocessing."""
    digest = xxhash.xxh3_128()
    digest.update(kind.encode())
    digest.update(np.ascontiguousarray(pixel_values))  # read in place: no copy of the pixels
    digest.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    return digest.hexdigest()
