"""batchvl's own Qwen-VL preprocessing against the model's Hugging Face processor."""

import io
import pickle

import numpy as np
import pytest
from PIL import Image

from batchvl.errors import SampleError
from batchvl.preprocess.image import decode_image
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image, smart_resize
from tests.conftest import tower_pixels


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def gradient(height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 40, size=(height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def make_image(mode: str, height: int, width: int, seed: int) -> Image.Image:
    rgb = Image.fromarray(gradient(height, width, seed))
    if mode == "RGBA":
        rgba = rgb.convert("RGBA")
        alpha = np.asarray(rgb.convert("L"))
        rgba.putalpha(Image.fromarray(alpha))
        return rgba
    if mode == "LA":
        la = rgb.convert("LA")
        la.putalpha(Image.fromarray(gradient(height, width, seed + 1)[..., 0]))
        return la
    if mode == "P+transparency":
        palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        palette.info["transparency"] = 0
        return palette
    return rgb.convert(mode)


CASES = [
    ("RGB", 224, 224, "PNG"),
    ("RGB", 480, 640, "JPEG"),
    ("RGB", 17, 300, "PNG"),
    ("RGB", 1, 1, "PNG"),
    ("RGB", 3, 600, "PNG"),  # aspect ratio 200:1, the largest accepted
    ("RGB", 1000, 37, "PNG"),
    ("L", 333, 251, "PNG"),
    ("LA", 120, 90, "PNG"),
    ("RGBA", 256, 128, "PNG"),
    ("P+transparency", 96, 200, "PNG"),
    ("P", 150, 150, "GIF"),
    ("CMYK", 200, 160, "JPEG"),
    ("1", 64, 80, "PNG"),
]


@pytest.mark.parametrize("mode,height,width,fmt", CASES)
def test_pixels_grid_and_ids_match_the_hf_processor(loaded_fp32, mode, height, width, fmt):
    processor = loaded_fp32.processor
    data = encoded(make_image(mode, height, width, seed=height + width), fmt)
    reference_input = Image.open(io.BytesIO(data))  # the HF processor gets the image in its own mode
    renderer = PromptRenderer(processor)
    text = renderer.render("What is in this picture?", 1)
    expected = processor(images=[reference_input], text=[text], return_tensors="np")

    spec = QwenVisionSpec.from_image_processor(processor.image_processor)
    ours = prepare_image(decode_image(data, None, 10**8), spec)

    assert ours.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0])
    assert ours.pixel_values.dtype == np.uint8  # normalized where the vision call is staged
    np.testing.assert_allclose(tower_pixels(ours), expected["pixel_values"], rtol=0, atol=1e-5)
    assert renderer.token_ids(text, [ours]) == expected["input_ids"][0].tolist()


@pytest.mark.parametrize("min_pixels,max_pixels", [(56 * 56, 28 * 28 * 16), (28 * 28 * 40, 28 * 28 * 400)])
def test_pixel_limits_match_the_hf_processor(loaded_fp32, min_pixels, max_pixels):
    image_processor = loaded_fp32.processor.image_processor
    image = Image.fromarray(gradient(300, 500, 1))
    expected = image_processor(
        images=[image], size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, return_tensors="np"
    )
    spec = QwenVisionSpec.from_image_processor(image_processor, min_pixels, max_pixels)
    ours = prepare_image(image, spec)
    assert ours.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0])
    np.testing.assert_allclose(tower_pixels(ours), expected["pixel_values"], rtol=0, atol=1e-5)


def test_smart_resize_follows_the_rule():
    for height, width in [(1, 1), (7, 1300), (480, 640), (4000, 3000), (28, 28), (29, 57)]:
        h, w = smart_resize(height, width, 28, 28 * 28 * 4, 28 * 28 * 256)
        assert h % 28 == 0 and w % 28 == 0
        assert 28 * 28 * 4 <= h * w <= 28 * 28 * 256
    with pytest.raises(SampleError) as info:
        smart_resize(1, 2000, 28, 56 * 56, 28 * 28 * 256)
    assert info.value.error_type == "extreme_aspect_ratio"


def test_sixteen_bit_images_keep_their_range():
    values = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    data = encoded(Image.fromarray(values), "PNG")
    rgb = np.asarray(decode_image(data, None, 10**8))
    # Pillow alone would clip everything above 255 to white; scaled, the gradient survives.
    assert rgb.min() == 0 and rgb.max() == 255
    assert abs(float(rgb.mean()) - 127.5) < 2


def test_exif_rotation_is_applied():
    pixels = np.full((40, 100, 3), 255, dtype=np.uint8)
    pixels[:, :50] = 0  # stored: left half black, right half white
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", exif=exif)
    decoded = np.asarray(decode_image(buffer.getvalue(), None, 10**8))
    assert decoded.shape == (100, 40, 3)
    # turned clockwise, the stored left side is now on top
    assert decoded[:45].mean() < 20 and decoded[55:].mean() > 235


def test_sample_errors_survive_pickling():
    error = pickle.loads(pickle.dumps(SampleError("image_decode_error", "cannot decode image")))
    assert (error.error_type, error.message) == ("image_decode_error", "cannot decode image")
