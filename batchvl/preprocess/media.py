"""What preprocessing hands to the engine: plain arrays plus a content hash, no PIL."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from batchvl.preprocess import shared_pixels
from batchvl.preprocess.pixel_normalization import PixelNormalization
from batchvl.preprocess.shared_pixels import SharedPixels


@dataclass(frozen=True)
class PreparedMedia:
    """A preprocessed image (or video clip) in its family's layout, and how it appears in the prompt.

    `pixel_values` holds what the family's vision tower takes for this one item, stacked along axis 0 with
    other items of an encode call (Qwen: patch rows; CLIP-style towers: whole (3, H, W) crops or tiles),
    before its normalization, which the vision call makes on the tower's device (`pixel_normalization.py`).
    `placeholder` replaces the item's single placeholder token in the chat-template text; it holds
    `num_tokens` placeholder tokens (possibly in several runs, with text between), which the item's
    `num_tokens` embedding rows fill in order.
    """

    # 8-bit pixels as the family's preparation leaves them before its normalization (`normalization`), a
    # numpy array; or the tower's input itself (normalization None: media made by hand, as tests make it);
    # a torch tensor on a serving rank of ViT data parallelism (vit_dp.py)
    pixel_values: np.ndarray | torch.Tensor
    grid_thw: tuple[int, int, int]  # patch grid: (frames / tiles, rows, columns); its product is the cost
    content_hash: str
    num_tokens: int
    placeholder: str
    kind: str = "image"  # "image" or "video": which placeholder token and vision entry point
    seconds_per_grid_t: float = 0.0  # video: seconds of video per temporal grid step (Qwen2.5-VL positions)
    # what makes the tower's input of the 8-bit `pixel_values`, where the vision call is staged
    normalization: PixelNormalization | None = None
    # `pixel_values` in shared memory, set by `in_shared_memory` just before a worker sends the media (what
    # is sent; so nothing replaces the pixels after it): a file named in the message (`shared_pixels.py`),
    # else a tensor sent torch's way; None: moved there when pickled
    shared_pixels: SharedPixels | torch.Tensor | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid_thw)

    def in_shared_memory(self) -> PreparedMedia:
        """This media with its pixels moved to shared memory now, in the preprocessing worker's own
        thread, where a failure (a full /dev/shm, a file size limit) is raised to the caller. Left to the
        pickler, the move happens in the result queue's feeder thread, which prints the error and drops
        the sample: the job then waited for it forever. The same one copy either way. In a pool's worker
        the pixels go to a file the message names (`shared_pixels.py`), elsewhere torch's way."""
        tensor = torch.as_tensor(self.pixel_values).contiguous()
        if shared_pixels.writes_files():
            shared = shared_pixels.write(tensor)
            return dataclasses.replace(self, pixel_values=host_pixels(shared.tensor), shared_pixels=shared)
        tensor.share_memory_()
        return dataclasses.replace(self, pixel_values=host_pixels(tensor), shared_pixels=tensor)

    def __reduce__(self):
        """Pickled (to go from a preprocessing worker to the job process), the pixels travel as the name of
        the file that holds them, or as a torch tensor: torch's multiprocessing pickler sends a tensor in
        shared memory as a handle and the receiver maps those pages, where a numpy array would be copied
        into the pipe and out of it again."""
        kept = {f.name for f in dataclasses.fields(self)} - {"pixel_values", "shared_pixels"}
        fields = {name: getattr(self, name) for name in kept}
        pixels = self.shared_pixels
        if isinstance(pixels, SharedPixels):
            return (_media_from_file, (pixels.message(), fields))
        if pixels is None:
            pixels = torch.as_tensor(self.pixel_values).contiguous()  # the pickler moves it
        return (_media_from_tensor, (pixels, fields))


def _media_from_tensor(pixels: torch.Tensor, fields: dict) -> PreparedMedia:
    return PreparedMedia(pixel_values=host_pixels(pixels), **fields)


def _media_from_file(message: tuple, fields: dict) -> PreparedMedia:
    return PreparedMedia(pixel_values=host_pixels(shared_pixels.receive(*message)), **fields)


def host_pixels(pixels: torch.Tensor) -> np.ndarray | torch.Tensor:
    """Host pixels as `PreparedMedia` holds them: a numpy array sharing the tensor's memory, or the tensor
    itself where numpy has no such dtype (bfloat16)."""
    return pixels if pixels.dtype == torch.bfloat16 else pixels.numpy()


def prepared_media(
    pixel_values: np.ndarray,
    grid_thw: tuple[int, int, int],
    num_tokens: int,
    placeholder: str,
    normalization: PixelNormalization,
    kind: str = "image",
    seconds_per_grid_t: float = 0.0,
) -> PreparedMedia:
    """A family's prepared media: its 8-bit pixels with the normalization that makes the tower's input of
    them, keyed by the content hash of both (with the grid and the kind)."""
    return PreparedMedia(
        pixel_values,
        grid_thw,
        content_hash(pixel_values, grid_thw, kind, normalization),
        num_tokens,
        placeholder,
        kind,
        seconds_per_grid_t,
        normalization,
    )


def content_hash(
    pixel_values: np.ndarray,
    grid_thw: tuple[int, int, int],
    kind: str = "image",
    normalization: PixelNormalization | None = None,
) -> str:
    """xxh3-128 of the preprocessed pixels, grid, kind and normalization: equal for identical media after
    preprocessing (for equal tower inputs)."""
    digest = xxhash.xxh3_128()
    digest.update(kind.encode())
    if normalization is not None:
        digest.update(normalization.digest_bytes())
    digest.update(np.ascontiguousarray(pixel_values))  # read in place: no copy of the pixels
    digest.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    return digest.hexdigest()
