"""Media as an OpenAI-compatible server takes it: a URL in a chat message, a data URL here.

An image is decoded and checked as for the built-in engine, so a bad image is the same error row on both
backends. Its own bytes are sent where the server, decoding them, gets the pixels batchvl's engine would:
a JPEG, PNG or WebP already in RGB with no EXIF rotation (the common case, and no re-encoding). Any other
image (rotated, CMYK, palette, 16-bit, with alpha, another format) is sent as batchvl converted it, a
lossless PNG. With `engine.server.pass_urls`, an http(s) URL cell is sent as it is, for the server to
fetch. Video is not sent to servers.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import xxhash
from PIL import Image

from batchvl.errors import SampleError
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.image import open_image, upright_rgb

SENT_AS_IS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}  # format -> its MIME type
EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class MediaURL:
    kind: str  # "image"
    url: str
    content_hash: str  # xxh3-128 of the bytes sent


@dataclass(frozen=True)
class DataURLPreparer:
    """MediaRef -> MediaURL (a data URL); picklable for worker processes."""

    max_image_pixels: int

    def __call__(self, ref: MediaRef) -> MediaURL:
        if ref.kind == "video":
            raise SampleError(
                "unsupported_media",
                "video is not sent to a server (engine.backend: openai); use the batchvl backend",
            )
        if ref.data is None and ref.path is None:  # a URL the server fetches (engine.server.pass_urls)
            return MediaURL("image", ref.url, xxhash.xxh3_128_hexdigest(ref.url.encode()))
        image = open_image(ref.data, ref.path, self.max_image_pixels)  # decoded, as the engine's
        if _decodes_as_is(image):
            data = ref.data if ref.data is not None else Path(ref.path).read_bytes()
            mime = SENT_AS_IS[image.format]
        else:
            buffer = io.BytesIO()
            upright_rgb(image).save(buffer, format="PNG", compress_level=1)  # lossless, the fastest level
            data, mime = buffer.getvalue(), "image/png"
        url = f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
        return MediaURL("image", url, xxhash.xxh3_128_hexdigest(data))


def _decodes_as_is(image: Image.Image) -> bool:
    """Whether the image's own bytes decode to the RGB pixels batchvl would send: no conversion, no turn."""
    upright = image.getexif().get(EXIF_ORIENTATION, 1) == 1
    return image.format in SENT_AS_IS and image.mode == "RGB" and upright
