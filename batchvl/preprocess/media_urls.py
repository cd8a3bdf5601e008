"""Media as an OpenAI-compatible server takes it: a URL in a chat message, usually a data URL.

An image is decoded and checked as for the built-in engine (so a bad image is the same error row on both
backends), then sent losslessly as PNG: the server's processor resizes and normalizes the same pixels the
built-in engine's would. Video is not sent to servers.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import xxhash

from batchvl.errors import SampleError
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.image import decode_image


@dataclass(frozen=True)
class MediaURL:
    kind: str  # "image"
    url: str
    content_hash: str  # xxh3-128 of the decoded RGB pixels and their size


@dataclass(frozen=True)
class DataURLPreparer:
    """MediaRef -> MediaURL (a PNG data URL); picklable for worker processes."""

    max_image_pixels: int

    def __call__(self, ref: MediaRef) -> MediaURL:
        if ref.kind == "video":
            raise SampleError(
                "unsupported_media",
                "video is not sent to a server (engine.backend: openai); use the batchvl backend",
            )
        image = decode_image(ref.data, ref.path, self.max_image_pixels)
        digest = xxhash.xxh3_128(f"{image.width}x{image.height}".encode())
        digest.update(image.tobytes())
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)  # lossless; the fastest level costs little size
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
        return MediaURL("image", url, digest.hexdigest())
