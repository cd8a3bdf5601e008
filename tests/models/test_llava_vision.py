"""LLaVA's vision call (models/llava.py): transformers' `get_image_features` without image sizes reads
nothing back from its tensors (on a GPU, each such read makes the host wait for the device)."""

import numpy as np
import torch

from tests.conftest import random_image
from tests.engine.fake_graphs import NoHostSync
from tests.engine.test_family_parity import prepare


def test_the_vision_call_reads_nothing_back(family_models, monkeypatch):
    _, loaded = family_models("llava")
    model = loaded.adapter.model.model
    get_image_features = model.get_image_features

    def guarded(*args, **kwargs):
        with NoHostSync():
            return get_image_features(*args, **kwargs)

    monkeypatch.setattr(model, "get_image_features", guarded)
    media = prepare(loaded, [random_image(60, 90, 0), random_image(200, 150, 1)])
    pixels = torch.from_numpy(np.concatenate([item.pixel_values for item in media]))
    rows = loaded.adapter.encode("image", pixels, torch.tensor([item.grid_thw for item in media]))
    assert len(rows) == 2 and rows[0].shape == rows[1].shape
