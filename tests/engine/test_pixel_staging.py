"""A vision call's pixels staged in one copy of each item (engine/device/pixel_staging.py): the items'
values cast to the tower's dtype, in order, then zero rows up to the call's size, on the engine's device.
With BATCHVL_TEST_DEVICE=cuda (the GPU check's parity stage) the stack is built in page-locked memory and
sent without the host waiting; the values must be the same."""

import numpy as np
import pytest
import torch

from batchvl.engine.device.pixel_staging import stage_pixels
from batchvl.preprocess.media import PreparedMedia
from tests.conftest import TEST_DEVICE


def items(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, 6), dtype=np.float32) for rows in (12, 40, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [56, 64])  # the items' rows exactly, and 8 rows of padding
def test_the_items_are_stacked_in_the_towers_dtype_then_zero_rows(dtype, rows):
    arrays = items()
    staged = stage_pixels(arrays, rows, dtype, torch.device(TEST_DEVICE))
    assert staged.shape == (rows, 6) and staged.dtype == dtype
    assert staged.device.type == torch.device(TEST_DEVICE).type
    # the cast a tower makes of float32 pixels, made on the CPU
    expected = torch.from_numpy(np.concatenate(arrays)).to(dtype)
    assert torch.equal(staged[:56].cpu(), expected)
    assert not staged[56:].cpu().any()


def test_items_already_on_the_device_are_stacked_there():
    device = torch.device(TEST_DEVICE)
    tensors = [torch.from_numpy(array).to(device) for array in items(1)]
    staged = stage_pixels(tensors, 64, torch.bfloat16, device)
    assert staged.device.type == device.type
    assert torch.equal(staged[:56].cpu(), torch.cat([t.cpu() for t in tensors]).to(torch.bfloat16))
    assert not staged[56:].cpu().any()


def test_a_later_call_does_not_overwrite_what_an_earlier_one_staged():
    """Towards a GPU, each call's page-locked stack must not be reused while its upload may still run."""
    device = torch.device(TEST_DEVICE)
    first = stage_pixels(items(2), 56, torch.bfloat16, device)
    for seed in range(3, 8):
        stage_pixels(items(seed), 56, torch.bfloat16, device)
    assert torch.equal(first.cpu(), torch.from_numpy(np.concatenate(items(2))).to(torch.bfloat16))


def test_items_cast_in_the_workers_stage_as_the_float32_ones_do():
    """Pixels a preprocessing worker cast to the tower's bfloat16 (`PreparedMedia.in_dtype`, tensors)
    stage to the same values as float32 pixels cast here: the tower's input does not depend on where."""
    arrays = items(9)
    cast = [PreparedMedia(a, (1, 1, len(a)), "h", 1, "<image>").in_dtype(torch.bfloat16) for a in arrays]
    device = torch.device(TEST_DEVICE)
    from_workers = stage_pixels([media.pixel_values for media in cast], 64, torch.bfloat16, device)
    assert all(media.pixel_values.dtype == torch.bfloat16 for media in cast)
    assert torch.equal(from_workers.cpu(), stage_pixels(arrays, 64, torch.bfloat16, device).cpu())
