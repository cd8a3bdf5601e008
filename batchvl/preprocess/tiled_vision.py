"""Idefics3-style preprocessing (Idefics3, SmolVLM) without transformers: an image split into square tiles
plus a global view.

The rule of the Idefics3 image processor: scale so the longest edge is `longest_edge` (short edge
truncated, then made even; at most 4096), round both edges up to multiples of the tile (the vision
tower's input side), cut that into rows x columns of tiles in row-major order and append the whole image
squashed to one tile; an image no larger than one tile stays a single frame. Every resize is Pillow's on
8-bit pixels (each re-quantizes, as the processor's do). In the prompt each tile is
`<fake_token_around_image><row_r_col_c>` + `image_seq_len` image tokens, a newline after each row, then
the global view; each frame's features fill its run of image tokens in order. Checked against the
model's Hugging Face processor by a test.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from batchvl.config import PreprocessConfig
from batchvl.preprocess.image import ImagePreparer, check_aspect_ratio, square_tiles_media
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.pixel_normalization import image_processor_pixels

MAX_SIDE = 4096  # the processor caps the resized longest edge here


@dataclass(frozen=True)
class TiledVisionSpec:
    longest_edge: int | None  # None: no first resize (the processor's do_resize off)
    tile: int
    patch_size: int
    image_seq_len: int  # image tokens per frame
    split: bool  # do_image_splitting
    resample: int  # a PIL resampling filter
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    image_token: str = "<image>"
    fake_image_token: str = "<fake_token_around_image>"
    global_image_token: str = "<global-img>"

    @classmethod
    def from_processor(cls, processor, patch_size: int) -> TiledVisionSpec:
        image_processor = processor.image_processor
        return cls(
            longest_edge=int(image_processor.size["longest_edge"]) if image_processor.do_resize else None,
            tile=int(image_processor.max_image_size["longest_edge"]),
            patch_size=patch_size,
            image_seq_len=int(processor.image_seq_len),
            split=bool(image_processor.do_image_splitting),
            **image_processor_pixels(image_processor),
            image_token=processor.image_token,
            fake_image_token=processor.fake_image_token,
            # Idefics3's processor names it global_image_tag, SmolVLM's global_image_token
            global_image_token=getattr(processor, "global_image_tag", None) or processor.global_image_token,
        )

    def placeholder(self, rows: int, cols: int) -> str:
        """What an image's placeholder token becomes in the prompt (the Idefics3 processor's text)."""
        run = self.image_token * self.image_seq_len
        global_view = f"{self.fake_image_token}{self.global_image_token}{run}{self.fake_image_token}"
        if rows == cols == 0:
            return global_view
        grid = "".join(
            "".join(f"{self.fake_image_token}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{global_view}"


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """Longest edge to `longest` (up or down), short edge truncated then made even; capped at MAX_SIDE."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / ratio)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * ratio)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges rounded up to multiples of the tile, the short one from the rounded long one."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def split_into_tiles(image: Image.Image, spec: TiledVisionSpec) -> tuple[list[np.ndarray], int, int]:
    """uint8 (T, T, 3) frames: the tiles row-major then the global view, and the (rows, cols) grid."""
    side = spec.tile
    if not spec.split:
        return [np.asarray(image.resize((side, side), resample=spec.resample))], 0, 0
    height, width = tile_multiple_size(image.height, image.width, side)
    image = image.resize((width, height), resample=spec.resample)
    if height <= side and width <= side:
        return [np.asarray(image)], 0, 0
    pixels = np.asarray(image)
    rows, cols = height // side, width // side
    frames = [
        pixels[r * side : (r + 1) * side, c * side : (c + 1) * side] for r in range(rows) for c in range(cols)
    ]
    frames.append(np.asarray(image.resize((side, side), resample=spec.resample)))
    return frames, rows, cols


def tiled_media_preparer(processor, model_config, pre: PreprocessConfig) -> ImagePreparer:
    spec = TiledVisionSpec.from_processor(processor, int(model_config.vision_config.patch_size))
    return ImagePreparer(functools.partial(prepare_tiled_image, spec=spec), pre.max_image_pixels)


def prepare_tiled_image(image: Image.Image, spec: TiledVisionSpec) -> PreparedMedia:
    check_aspect_ratio(image.height, image.width)
    if spec.longest_edge is not None:
        height, width = longest_edge_size(image.height, image.width, spec.longest_edge)
        image = image.resize((width, height), resample=spec.resample)
    frames, rows, cols = split_into_tiles(image, spec)
    return square_tiles_media(frames, spec, spec.image_seq_len, spec.placeholder(rows, cols))
