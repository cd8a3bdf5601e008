"""One vision call's inputs for the vision-call tests: random images prepared as the family's preprocessing
prepares them, their pixel rows packed and their grids stacked."""

import torch

from tests.conftest import random_image, tower_pixels
from tests.engine.test_family_parity import prepare


def vision_call(loaded, sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel rows, grids) of one vision call over images of `sizes` (height, width), seeded by position."""
    media = prepare(loaded, [random_image(h, w, seed) for seed, (h, w) in enumerate(sizes)])
    pixels = torch.from_numpy(tower_pixels(media))
    return pixels, torch.tensor([item.grid_thw for item in media])
