"""InternVL preprocessing (its GOT-OCR2 image processor) without transformers: an image cut into a grid of
square tiles chosen by its aspect ratio, plus a thumbnail.

The rule: among the grids of `min_patches` to `max_patches` tiles, take the one whose columns / rows is
nearest the image's width / height (on a tie, the larger grid while the image's area is over half the
grid's); resize the image to that grid of tiles, cut it row-major, and when there are several tiles append
the whole image resized to one tile. The processor always asks for tiles (its `crop_to_patches` default
overrides the image processor's, which the published checkpoints save as false). Every resize is
Pillow's on 8-bit pixels with the image processor's filter. In the prompt an image is `<img>`, then
`image_seq_length` context tokens per tile, then `</img>`; the tiles' features fill them in order. Checked
against the model's Hugging Face processor by a test.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from PIL import Image

from batchvl.errors import UserError
from batchvl.preprocess.image import check_aspect_ratio, square_tiles_media
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.pixel_normalization import image_processor_pixels


@dataclass(frozen=True)
class InternVLTileSpec:
    tile: int  # the vision tower's input side
    patch_size: int
    min_tiles: int
    max_tiles: int
    image_seq_length: int  # context tokens per tile
    resample: int  # a PIL resampling filter
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    start_image_token: str
    end_image_token: str
    image_token: str

    @classmethod
    def from_processor(cls, processor, patch_size: int) -> InternVLTileSpec:
        image_processor = processor.image_processor
        return cls(
            tile=int(image_processor.size["height"]),
            patch_size=patch_size,
            min_tiles=int(image_processor.min_patches),
            max_tiles=int(image_processor.max_patches),
            image_seq_length=int(processor.image_seq_length),
            **image_processor_pixels(image_processor),
            start_image_token=processor.start_image_token,
            end_image_token=processor.end_image_token,
            image_token=processor.image_token,
        )

    def placeholder(self, tiles: int) -> str:
        """What an image's placeholder token becomes in the prompt (the InternVL processor's text)."""
        context = self.image_token * self.image_seq_length * tiles
        return f"{self.start_image_token}{context}{self.end_image_token}"


@functools.lru_cache(maxsize=64)
def tile_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) of every grid of min_tiles..max_tiles tiles, fewest tiles first."""
    grids = [
        (columns, rows)
        for columns in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if min_tiles <= columns * rows <= max_tiles
    ]
    return sorted(grids, key=lambda grid: grid[0] * grid[1])  # stable: ties keep their order


def best_grid(height: int, width: int, spec: InternVLTileSpec) -> tuple[int, int]:
    """(columns, rows) whose aspect ratio is nearest the image's; on a tie the later (larger) grid, while the
    image covers more than half of it."""
    aspect = width / height
    best, best_difference = (1, 1), float("inf")
    for columns, rows in tile_grids(spec.min_tiles, spec.max_tiles):
        difference = abs(aspect - columns / rows)
        if difference < best_difference:
            best, best_difference = (columns, rows), difference
        elif difference == best_difference and width * height > 0.5 * spec.tile * spec.tile * columns * rows:
            best = (columns, rows)
    return best


def split_into_tiles(image: Image.Image, spec: InternVLTileSpec) -> list[np.ndarray]:
    """uint8 (T, T, 3) tiles, row-major, then the thumbnail when there are several."""
    side = spec.tile
    if spec.max_tiles <= 1:
        return [np.asarray(image.resize((side, side), resample=spec.resample))]
    columns, rows = best_grid(image.height, image.width, spec)
    pixels = np.asarray(image.resize((columns * side, rows * side), resample=spec.resample))
    tiles = [
        pixels[r * side : (r + 1) * side, c * side : (c + 1) * side]
        for r in range(rows)
        for c in range(columns)
    ]
    if len(tiles) > 1:
        tiles.append(np.asarray(image.resize((side, side), resample=spec.resample)))
    return tiles


def internvl_tile_spec(processor, model_config) -> InternVLTileSpec:
    kind = type(processor.image_processor).__name__
    if not kind.startswith("GotOcr2"):
        # InternVL3.5's converted checkpoints name Phi-4-multimodal's image processor, another tiling rule
        raise UserError(
            f"this InternVL checkpoint's image processor is {kind}; batchvl reads InternVL checkpoints with "
            "GOT-OCR2's tiling (InternVL3, InternVL2.5): use one of those"
        )
    patch_size = model_config.vision_config.patch_size
    patch_size = int(patch_size[0] if isinstance(patch_size, list | tuple) else patch_size)
    return InternVLTileSpec.from_processor(processor, patch_size)


def prepare_internvl_image(image: Image.Image, spec: InternVLTileSpec) -> PreparedMedia:
    check_aspect_ratio(image.height, image.width)
    tiles = split_into_tiles(image, spec)
    return square_tiles_media(tiles, spec, spec.image_seq_length, spec.placeholder(len(tiles)))
