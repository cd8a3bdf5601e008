"""Images for a server: the bytes sent decode to the pixels batchvl's engine takes, re-encoded only where
the server's own decoding would differ."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from batchvl.errors import SampleError
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.image import decode_image
from batchvl.preprocess.media_urls import DataURLPreparer
from tests.conftest import random_image

PREPARE = DataURLPreparer(max_image_pixels=10_000_000)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def sent(url: str) -> tuple[str, bytes]:
    header, payload = url.split(",", 1)
    return header, base64.b64decode(payload)


@pytest.mark.parametrize("fmt, mime", [("JPEG", "image/jpeg"), ("PNG", "image/png"), ("WEBP", "image/webp")])
def test_an_upright_rgb_image_is_sent_as_its_own_bytes(fmt, mime):
    data = encoded(random_image(30, 40, seed=1), fmt)
    header, body = sent(PREPARE(MediaRef(data, None)).url)
    assert header == f"data:{mime};base64" and body == data


def test_a_file_on_disk_is_sent_as_its_bytes(tmp_path):
    data = encoded(random_image(30, 40, seed=2), "JPEG")
    (tmp_path / "a.jpg").write_bytes(data)
    assert sent(PREPARE(MediaRef(None, str(tmp_path / "a.jpg"))).url)[1] == data


def rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    return encoded(random_image(30, 40, seed=3), "JPEG", exif=exif)


@pytest.mark.parametrize(
    "data",
    [
        rotated_jpeg(),
        encoded(random_image(30, 40, seed=4).convert("RGBA"), "PNG"),
        encoded(random_image(30, 40, seed=5).convert("P"), "PNG"),
        encoded(random_image(30, 40, seed=6).convert("CMYK"), "JPEG"),
        encoded(random_image(30, 40, seed=7), "BMP"),
    ],
    ids=["exif-rotated", "rgba", "palette", "cmyk", "bmp"],
)
def test_any_other_image_is_sent_as_the_png_of_the_pixels_the_engine_takes(data):
    header, body = sent(PREPARE(MediaRef(data, None)).url)
    assert header == "data:image/png;base64"
    engine_pixels = np.asarray(decode_image(data, None, 10_000_000))
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(body))), engine_pixels)


def decoded_png(url: str) -> np.ndarray:
    header, body = sent(url)
    assert header == "data:image/png;base64"
    return np.asarray(Image.open(io.BytesIO(body)))


def test_an_exif_rotated_image_is_sent_turned_upright():
    # Orientation 6: displayed turned a quarter clockwise; lossless PNG, so the pixels are known exactly.
    pixels = np.random.default_rng(8).integers(0, 256, (4, 6, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encoded(Image.fromarray(pixels), "PNG", exif=exif)
    assert np.array_equal(decoded_png(PREPARE(MediaRef(data, None)).url), np.rot90(pixels, k=-1))


def test_a_cmyk_image_is_sent_as_the_rgb_its_inks_make():
    cmyk = np.random.default_rng(9).integers(0, 256, (5, 7, 4), dtype=np.uint8)
    data = encoded(Image.fromarray(cmyk, mode="CMYK"), "TIFF")  # lossless
    ink, black = cmyk[..., :3].astype(float), cmyk[..., 3:].astype(float)
    rgb = np.round((255 - ink) * (255 - black) / 255).astype(np.uint8)  # each ink and the black absorb light
    assert np.array_equal(decoded_png(PREPARE(MediaRef(data, None)).url), rgb)


def test_a_bad_image_is_the_engines_error_and_a_video_is_unsupported():
    with pytest.raises(SampleError) as broken:
        PREPARE(MediaRef(b"not an image", None))
    assert broken.value.error_type == "image_decode_error"
    with pytest.raises(SampleError) as video:
        PREPARE(MediaRef(b"\x00" * 10, None, kind="video"))
    assert video.value.error_type == "unsupported_media"
