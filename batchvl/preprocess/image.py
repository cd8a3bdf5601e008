"""Decode one image safely: pixel-count check before the full decode, EXIF rotation, any mode -> RGB."""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from batchvl.errors import SampleError
from batchvl.inputs.paths import is_empty_file
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.media import PreparedMedia, prepared_media
from batchvl.preprocess.pixel_normalization import PixelNormalization

SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def open_image(data: bytes | None, path: str | None, max_image_pixels: int) -> Image.Image:
    """Open and fully decode, refusing images over `max_image_pixels` from their header alone."""
    if (data is not None and len(data) == 0) or (data is None and path and is_empty_file(path)):
        raise SampleError("empty_image", f"image {'file ' + path if path else 'data'} is empty (0 bytes)")
    # Pillow's own bomb guard follows the job's limit: it warns above it (our header check below gives
    # the message) and raises above twice it, already inside Image.open. The setting is per process; a
    # worker only ever opens images for one job.
    Image.MAX_IMAGE_PIXELS = max_image_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data) if data is not None else path)
            width, height = image.size
            if width * height > max_image_pixels:
                raise SampleError(
                    "image_too_large", _too_large(f"{width}x{height} = {width * height}", max_image_pixels)
                )
            image.load()  # an animated image (GIF, APNG, WebP) stays on its first frame
        return image
    except SampleError:
        raise
    except Image.DecompressionBombError as exc:
        raise SampleError("image_too_large", _too_large(_bomb_size(exc), max_image_pixels)) from exc
    except FileNotFoundError as exc:
        raise SampleError("file_not_found", f"image file not found: {path}") from exc
    except Image.UnidentifiedImageError as exc:
        # Pillow's message names the in-memory buffer object; say what was read instead.
        source = path if data is None else f"{len(data)} bytes"
        raise SampleError(
            "image_decode_error", f"cannot decode image: not a format Pillow can read ({source})"
        ) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise SampleError("image_decode_error", f"cannot decode image: {exc}") from exc


def _too_large(size: str, max_image_pixels: int) -> str:
    return (
        f"image is {size} pixels, over preprocess.max_image_pixels={max_image_pixels} "
        "(raise it to caption such images)"
    )


def _bomb_size(exc: Exception) -> str:
    """The pixel count from Pillow's message ('Image size (400000000 pixels) exceeds limit ...')."""
    match = re.search(r"\((\d+) pixels\)", str(exc))
    return match[1] if match else "more than twice that many"


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB, the way the Hugging Face processors do it (transparency composited on
    white), except 16-bit images, which Pillow would clip to white: they are scaled to 8 bits."""
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image, dtype=np.float64)
        if image.mode != "I" or values.max(initial=0) > 255:
            values = values / 257.0  # 0..65535 -> 0..255
        image = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), mode="L")
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


MAX_ASPECT_RATIO = 200  # the Qwen-VL processors' limit; others would resize such images to absurd sizes


def check_aspect_ratio(height: int, width: int) -> None:
    if min(height, width) < 1:
        raise SampleError("image_too_small", f"image is {width}x{height}; it has no pixels")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise SampleError(
            "extreme_aspect_ratio",
            f"image is {width}x{height} (aspect ratio {ratio:.0f}:1); "
            f"at most {MAX_ASPECT_RATIO}:1 is accepted",
        )


def channels_first(frames: np.ndarray) -> np.ndarray:
    """8-bit (..., H, W, C) -> (..., C, H, W), a view: the towers' layout, normalized where the vision call is
    staged (`pixel_normalization.py`)."""
    return np.moveaxis(frames, -1, -3)


def square_tiles_media(
    tiles: list[np.ndarray], spec, tokens_per_tile: int, placeholder: str, kind: str = "image"
):
    """uint8 (T, T, 3) tiles (an image's or a video's frames) as one item the tower takes as a batch:
    (tiles, 3, T, T) pixels, a grid of (tiles, T / patch, T / patch), `tokens_per_tile` placeholder tokens
    each. `spec` gives the side (`tile`), the `patch_size` and the normalization."""
    pixel_values = np.ascontiguousarray(channels_first(np.stack(tiles)))
    side = spec.tile // spec.patch_size
    return prepared_media(
        pixel_values,
        (len(tiles), side, side),
        len(tiles) * tokens_per_tile,
        placeholder,
        PixelNormalization.of(spec),
        kind=kind,
    )


@dataclass(frozen=True)
class ImagePreparer:
    """MediaRef -> PreparedMedia for families that take images only; picklable for worker processes.
    `prepare` is a module-level function (or a partial of one) from an RGB image to the family's input."""

    prepare: Callable[[Image.Image], PreparedMedia]
    max_image_pixels: int

    def __call__(self, ref: MediaRef) -> PreparedMedia:
        if ref.kind == "video":
            raise SampleError("unsupported_media", "this model family takes images only, not video")
        return self.prepare(decode_image(ref.data, ref.path, self.max_image_pixels))


def decode_image(data: bytes | None, path: str | None, max_image_pixels: int) -> Image.Image:
    """Bytes or a path -> an upright RGB image, or a SampleError saying what is wrong with it."""
    return upright_rgb(open_image(data, path, max_image_pixels))


def upright_rgb(image: Image.Image) -> Image.Image:
    """A decoded image turned by its EXIF orientation and converted to RGB."""
    try:
        return to_rgb(ImageOps.exif_transpose(image))
    except (OSError, ValueError) as exc:
        raise SampleError("image_decode_error", f"cannot convert image to RGB: {exc}") from exc
