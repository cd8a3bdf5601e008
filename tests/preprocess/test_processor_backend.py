"""batchvl's preprocessing reproduces transformers' Pillow image processors; the processor it loads must be
that backend, also where torchvision is installed and transformers would default to its torchvision one
(whose resize rounds some pixels differently). Here torchvision is absent, so the default is Pillow either
way: the test watches what the loader asks transformers for, on both of its paths."""

import pytest
from transformers.image_processing_backends import PilBackend

import batchvl.models.processor as processor_module
from batchvl.demo.tiny_model import build_tiny_model
from batchvl.models.loader import load_processor


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_the_loaded_processor_is_the_pillow_backend(tmp_path, monkeypatch, family):
    import transformers

    path = build_tiny_model(tmp_path / family, family=family, seed=0)
    asked = []
    load = transformers.AutoProcessor.from_pretrained

    def asking(*args, **kwargs):
        asked.append(kwargs.get("backend"))
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", asking)
    loaded = load_processor(str(path), family)
    assert asked == ["pil"]
    assert isinstance(loaded.image_processor, PilBackend)


def test_the_image_only_fallback_asks_for_the_pillow_backend_too(tmp_path, monkeypatch):
    """Where AutoProcessor fails (a Qwen-VL video processor without torchvision), the image processor
    alone is loaded: from the Pillow backend as well."""
    import transformers

    path = build_tiny_model(tmp_path / "qwen2_vl", family="qwen2_vl", seed=0)

    def failing(*args, **kwargs):
        raise ImportError("the video processor needs torchvision")

    asked = []
    load = processor_module.AutoImageProcessor.from_pretrained

    def asking(*args, **kwargs):
        asked.append(kwargs.get("backend"))
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", failing)
    monkeypatch.setattr(processor_module.AutoImageProcessor, "from_pretrained", asking)
    loaded = load_processor(str(path), "qwen2_vl")
    assert asked == ["pil"]
    assert isinstance(loaded.image_processor, PilBackend)
