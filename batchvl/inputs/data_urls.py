"""`data:` URLs (RFC 2397) of images: the bytes they hold, in an `openai_batch` line's `image_url` or a
table's media cell. The bytes are then an image like any other, decoded and checked (its pixel limit) by
preprocessing."""

from __future__ import annotations

import base64
import binascii

URL_SAFE = str.maketrans("-_", "+/")


def is_data_url(value: str) -> bool:
    return value[:5].lower() == "data:"


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:` URL; ValueError saying why where it has none."""
    header, _, payload = url.partition(",")
    if ";base64" not in header.lower():
        raise ValueError("a data: image must be base64-encoded")
    try:
        return base64_bytes(payload)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data: image is not valid base64 ({exc})") from None


def base64_bytes(payload: str) -> bytes:
    """Standard or URL-safe base64, MIME-wrapped (line breaks, spaces) or not, padded or not; any other
    character is refused."""
    text = "".join(payload.split()).translate(URL_SAFE)
    if "=" not in text:
        text += "=" * (-len(text) % 4)
    return base64.b64decode(text, validate=True)
