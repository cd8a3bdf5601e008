"""A vision call's pixels staged in one copy of each item (engine/device/pixel_staging.py): the items' 8-bit
pixels normalized as the models' image processors normalize them (float32 arithmetic), a still image's
frame repeated into its temporal patch, cast to the tower's dtype, in order, then zero rows up to the
call's size, on the engine's device; items given as the tower's input already, cast and stacked. With
BATCHVL_TEST_DEVICE=cuda (the GPU check's parity stage) the stack is built in page-locked memory, sent
without the host waiting and normalized on the GPU; the values must be the same."""

import numpy as np
import pytest
import torch

from batchvl.engine.device.pixel_staging import stage_pixels
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.pixel_normalization import PixelNormalization
from tests.conftest import TEST_DEVICE

# CLIP's numbers: none of them a power of two, so that every step rounds
CLIP = PixelNormalization(1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


def tower_input(array: np.ndarray) -> PreparedMedia:
    return PreparedMedia(array, (1, 1, len(array)), "h", 1, "<image>")


def float_items(seed: int = 0) -> list[PreparedMedia]:
    rng = np.random.default_rng(seed)
    return [tower_input(rng.standard_normal((rows, 6), dtype=np.float32)) for rows in (12, 40, 4)]


def eight_bit_items(normalization: PixelNormalization, row: tuple[int, ...], seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        PreparedMedia(
            rng.integers(0, 256, (rows, *row), dtype=np.uint8),
            (1, 1, rows),
            "h",
            1,
            "<image>",
            normalization=normalization,
        )
        for rows in (12, 40, 4)
    ]


def processor_arithmetic(pixels: np.ndarray, normalization: PixelNormalization) -> np.ndarray:
    """The image processors' normalization in numpy, channels on axis 1: each step rounded to float32."""
    shape = (1, -1) + (1,) * (pixels.ndim - 2)
    values = pixels.astype(np.float32) * np.float32(normalization.rescale_factor)
    values -= np.asarray(normalization.image_mean, dtype=np.float32).reshape(shape)
    values /= np.asarray(normalization.image_std, dtype=np.float32).reshape(shape)
    return values


def values_of(items: list[PreparedMedia]) -> np.ndarray:
    return np.concatenate([item.pixel_values for item in items])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [56, 64])  # the items' rows exactly, and 8 rows of padding
def test_the_tower_inputs_are_stacked_in_the_towers_dtype_then_zero_rows(dtype, rows):
    given = float_items()
    staged = stage_pixels(given, rows, dtype, torch.device(TEST_DEVICE))
    assert staged.shape == (rows, 6) and staged.dtype == dtype
    assert staged.device.type == torch.device(TEST_DEVICE).type
    # the cast a tower makes of float32 pixels, made on the CPU
    expected = torch.from_numpy(values_of(given)).to(dtype)
    assert torch.equal(staged[:56].cpu(), expected)
    assert not staged[56:].cpu().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frames_are_normalized_as_the_image_processors_do_it(dtype):
    """(frames, 3, H, W), as the CLIP and tiled towers take them: each value exactly the processors'
    float32 arithmetic, then cast."""
    given = eight_bit_items(CLIP, (3, 4, 5))
    staged = stage_pixels(given, 60, dtype, torch.device(TEST_DEVICE))
    assert staged.shape == (60, 3, 4, 5) and staged.dtype == dtype
    expected = torch.from_numpy(processor_arithmetic(values_of(given), CLIP)).to(dtype)
    assert torch.equal(staged[:56].cpu(), expected)
    assert not staged[56:].cpu().any()


def test_a_still_images_rows_repeat_each_channels_values_into_the_temporal_patch():
    """Qwen-VL rows: (channels, temporal patch, patch, patch) values a row, the frame given once."""
    normalization = PixelNormalization(1 / 255, (0.5, 0.4, 0.3), (0.21, 0.25, 0.3), repeat=2)
    given = eight_bit_items(normalization, (3 * 7,))
    staged = stage_pixels(given, 64, torch.bfloat16, torch.device(TEST_DEVICE))
    assert staged.shape == (64, 3 * 2 * 7)
    frame = processor_arithmetic(values_of(given).reshape(56, 3, 7), normalization)
    expected = np.broadcast_to(frame[:, :, None], (56, 3, 2, 7)).reshape(56, 42)
    assert torch.equal(staged[:56].cpu(), torch.from_numpy(expected).to(torch.bfloat16))
    assert not staged[56:].cpu().any()


def test_items_already_on_the_device_are_stacked_and_normalized_there():
    device = torch.device(TEST_DEVICE)
    given = eight_bit_items(CLIP, (3, 2, 2), seed=1)
    on_device = [
        PreparedMedia(
            torch.from_numpy(item.pixel_values).to(device), (1, 1, 1), "h", 1, "<image>", normalization=CLIP
        )
        for item in given
    ]
    staged = stage_pixels(on_device, 64, torch.bfloat16, device)
    assert staged.device.type == device.type
    assert torch.equal(staged.cpu(), stage_pixels(given, 64, torch.bfloat16, torch.device("cpu")))


def test_a_call_of_items_normalized_otherwise_is_refused():
    other = PixelNormalization(1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    mixed = eight_bit_items(CLIP, (3, 2, 2))[:2] + eight_bit_items(other, (3, 2, 2))[:1]
    with pytest.raises(ValueError, match="share one normalization"):
        stage_pixels(mixed, 64, torch.float32, torch.device(TEST_DEVICE))


@pytest.mark.parametrize("given", [float_items, lambda seed: eight_bit_items(CLIP, (3, 2), seed)])
def test_a_later_call_does_not_overwrite_what_an_earlier_one_staged(given):
    """Towards a GPU, each call's page-locked stack must not be reused while its upload may still run."""
    device = torch.device(TEST_DEVICE)
    first = stage_pixels(given(2), 56, torch.bfloat16, device)
    expected = stage_pixels(given(2), 56, torch.bfloat16, torch.device("cpu"))
    for seed in range(3, 8):
        stage_pixels(given(seed), 56, torch.bfloat16, device)
    assert torch.equal(first.cpu(), expected)
