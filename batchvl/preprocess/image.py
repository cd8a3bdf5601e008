"""Decode one image safely and turn it into the model's patch layout plus a content hash."""

from __future__ import annotations

import io
import warnings

import numpy as np
import xxhash
from PIL import Image, ImageOps

from batchvl.engine.model_runner import PreparedImage
from batchvl.errors import SampleError


def decode_image(data: bytes | None, path: str | None, max_image_pixels: int) -> Image.Image:
    """Open, check the pixel count before the full decode, apply EXIF rotation, convert to RGB."""
    try:
        source = io.BytesIO(data) if data is not None else path
        with warnings.catch_warnings():
            # Pillow's own bomb check warns or raises at its fixed limit; ours is the job's setting.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source)
            width, height = image.size
            if width * height > max_image_pixels:
                raise SampleError(
                    "image_too_large",
                    f"image is {width}x{height} = {width * height} pixels, over "
                    f"preprocess.max_image_pixels={max_image_pixels}",
                )
            image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode != "RGB":
            image = image.convert("RGBA").convert("RGB") if "A" in image.getbands() else image.convert("RGB")
        return image
    except SampleError:
        raise
    except FileNotFoundError as exc:
        raise SampleError("file_not_found", f"image file not found: {path}") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise SampleError("image_decode_error", f"cannot decode image: {exc}") from exc


def content_hash(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
    """xxh3-128 of the preprocessed pixels and grid: equal for identical images after preprocessing."""
    digest = xxhash.xxh3_128()
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    digest.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    return digest.hexdigest()


def prepare_image(
    image: Image.Image, image_processor, min_pixels: int | None = None, max_pixels: int | None = None
) -> PreparedImage:
    """Resize, normalize and patchify with the model's image processor."""
    kwargs = {}
    if min_pixels is not None:
        kwargs["min_pixels"] = min_pixels
    if max_pixels is not None:
        kwargs["max_pixels"] = max_pixels
    try:
        out = image_processor(images=[image], return_tensors="np", **kwargs)
    except ValueError as exc:
        # e.g. an aspect ratio the resize rule refuses (Qwen: over 200:1)
        raise SampleError("image_preprocess_error", f"cannot preprocess image: {exc}") from exc
    pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    return PreparedImage(pixel_values, grid, content_hash(pixel_values, grid))
