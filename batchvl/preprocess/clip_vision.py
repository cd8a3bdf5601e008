"""LLaVA-1.5-style preprocessing (CLIP image processor) without transformers: one fixed-size crop per image.

The CLIP rule: optionally pad to a square with the mean colour (LLaVA's `do_pad`), resize so the
shortest edge is `shortest_edge` (bicubic, long edge truncated), centre-crop to `crop_size`; rescaling
and normalizing are the vision call's, on the tower's device (`pixel_normalization.py`). Every image
becomes the same (3, H, W) crop and the same number of placeholder tokens, so encode calls are plain
batches. Checked against the model's Hugging Face image processor by a test.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from batchvl.config import PreprocessConfig
from batchvl.preprocess.image import ImagePreparer, channels_first, check_aspect_ratio
from batchvl.preprocess.media import PreparedMedia, prepared_media
from batchvl.preprocess.pixel_normalization import PixelNormalization, image_processor_pixels


@dataclass(frozen=True)
class ClipVisionSpec:
    shortest_edge: int
    crop_height: int
    crop_width: int
    pad_to_square: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    resample: int  # a PIL resampling filter
    patch_size: int
    num_image_tokens: int  # placeholder tokens (= embedding rows) per image
    image_token: str = "<image>"

    @classmethod
    def from_processor(cls, processor) -> ClipVisionSpec:
        image_processor = processor.image_processor
        crop = image_processor.crop_size
        patch = int(processor.patch_size)
        num_tokens = (crop["height"] // patch) * (crop["width"] // patch)
        num_tokens += int(getattr(processor, "num_additional_image_tokens", 0) or 0)
        if getattr(processor, "vision_feature_select_strategy", None) == "default":
            num_tokens -= 1  # the CLS token's feature is dropped
        return cls(
            shortest_edge=int(image_processor.size["shortest_edge"]),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            pad_to_square=bool(getattr(image_processor, "do_pad", False)),
            **image_processor_pixels(image_processor),
            patch_size=patch,
            num_image_tokens=num_tokens,
            image_token=processor.image_token,
        )


def square_pad(image: Image.Image, mean: tuple[float, float, float]) -> Image.Image:
    """Centre the image on a square of the mean colour (LLaVA's pad_to_square)."""
    side = max(image.size)
    if image.width == image.height:
        return image
    canvas = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return canvas


def resize_shortest_edge(image: Image.Image, spec: ClipVisionSpec) -> Image.Image:
    check_aspect_ratio(image.height, image.width)
    short, long = sorted((image.width, image.height))
    new_long = int(spec.shortest_edge * long / short)
    size = (spec.shortest_edge, new_long) if image.width <= image.height else (new_long, spec.shortest_edge)
    return image.resize(size, resample=spec.resample)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, C) -> (height, width, C) from the centre; zero padding where the image is smaller."""
    pad_h, pad_w = max(height - pixels.shape[0], 0), max(width - pixels.shape[1], 0)
    if pad_h or pad_w:
        top, left = math.ceil(pad_h / 2), math.ceil(pad_w / 2)
        pixels = np.pad(pixels, ((top, pad_h - top), (left, pad_w - left), (0, 0)))
    top = (pixels.shape[0] - height) // 2
    left = (pixels.shape[1] - width) // 2
    return pixels[top : top + height, left : left + width]


def clip_media_preparer(processor, model_config, pre: PreprocessConfig) -> ImagePreparer:
    spec = ClipVisionSpec.from_processor(processor)
    return ImagePreparer(functools.partial(prepare_clip_image, spec=spec), pre.max_image_pixels)


def prepare_clip_image(image: Image.Image, spec: ClipVisionSpec) -> PreparedMedia:
    if spec.pad_to_square:
        image = square_pad(image, spec.image_mean)
    crop = center_crop(np.asarray(resize_shortest_edge(image, spec)), spec.crop_height, spec.crop_width)
    pixel_values = np.ascontiguousarray(channels_first(crop)[None])  # (1, 3, H, W)
    grid = (1, spec.crop_height // spec.patch_size, spec.crop_width // spec.patch_size)
    placeholder = spec.image_token * spec.num_image_tokens
    return prepared_media(pixel_values, grid, spec.num_image_tokens, placeholder, PixelNormalization.of(spec))
