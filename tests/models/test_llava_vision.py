"""LLaVA's vision call (models/llava.py): transformers' `get_image_features` without image sizes reads
nothing back from its tensors (on a GPU, each such read makes the host wait for the device)."""

from tests.engine.fake_graphs import guard_host_reads
from tests.models.vision_call import vision_call


def test_the_vision_call_reads_nothing_back(family_models, monkeypatch):
    _, loaded = family_models("llava")
    guard_host_reads(monkeypatch, loaded.adapter.model.model, "get_image_features")
    pixels, grid = vision_call(loaded, [(60, 90), (200, 150)])
    rows = loaded.adapter.encode("image", pixels, grid)
    assert len(rows) == 2 and rows[0].shape == rows[1].shape
