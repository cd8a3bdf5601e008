import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from batchvl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl", size="tiny", seed=0)


@pytest.fixture(scope="session")
def loaded_fp32(tiny_model_dir):
    from batchvl.models.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
