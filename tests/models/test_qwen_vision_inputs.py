"""A Qwen-VL vision call with its grid-derived inputs made on the host (models/qwen_vision_inputs.py): each
family's embeddings equal transformers' own `get_image_features` and `get_video_features`, and the tower
itself reads nothing back from its tensors (on a GPU, each such read makes the host wait for the device)."""

import pytest
import torch

from tests.engine.fake_graphs import guard_host_reads
from tests.models.vision_call import vision_call

QWEN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
IMAGE_SIZES = [(60, 90), (200, 150), (60, 90)]  # two sizes, one twice: equal-length sequences side by side


@pytest.fixture(params=QWEN_FAMILIES)
def loaded(request, family_models, loaded_fp32):
    return loaded_fp32 if request.param == "qwen2_vl" else family_models(request.param)[1]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_the_embeddings_equal_transformers_own_features(loaded, kind):
    pixels, grid = vision_call(loaded, IMAGE_SIZES)
    ours = loaded.adapter.encode(kind, pixels, grid)
    model = loaded.adapter.model.model
    features = model.get_video_features if kind == "video" else model.get_image_features
    device = loaded.adapter.device
    with torch.inference_mode():
        stock = features(pixels.to(device), grid.to(device), return_dict=True)
    hidden = stock.pooler_output[0].shape[-1]
    assert len(ours) == len(IMAGE_SIZES)
    # Qwen3-VL's interpolation weights are floats made here by the CPU's arithmetic, by transformers on the
    # device by the GPU's, which may round their last bit otherwise: equal on the CPU, within it on a GPU
    exact = device.type == "cpu" or not hasattr(model.visual, "num_grid_per_side")
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    for index, rows in enumerate(ours):
        assert same(rows[:, :hidden], stock.pooler_output[index])
    # Qwen3-VL's deepstack layers' features beside them: per layer, every image's rows in one tensor
    # (transformers 5.17) or split by image (later)
    for layer, deepstack in enumerate(getattr(stock, "deepstack_features", None) or []):
        theirs = deepstack if isinstance(deepstack, torch.Tensor) else torch.cat(deepstack)
        assert same(
            torch.cat([rows[:, hidden * (layer + 1) : hidden * (layer + 2)] for rows in ours]), theirs
        )


def test_the_tower_reads_nothing_back_from_its_tensors(loaded, monkeypatch):
    guard_host_reads(monkeypatch, loaded.adapter.model.model.visual, "forward")
    pixels, grid = vision_call(loaded, IMAGE_SIZES)
    assert len(loaded.adapter.encode("image", pixels, grid)) == len(IMAGE_SIZES)
