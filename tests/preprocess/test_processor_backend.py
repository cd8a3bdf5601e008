"""batchvl's preprocessing reproduces transformers' Pillow image processors; the processor it loads must be
that backend, also where torchvision is installed and transformers would default to its torchvision one
(whose resize rounds some pixels differently). Here torchvision is absent, so the default is Pillow either
way: the test watches what the loader asks transformers for, on both of its paths."""

import pytest
import transformers
from transformers.image_processing_backends import PilBackend

import batchvl.models.processor as processor_module
from batchvl.demo.tiny_model import build_tiny_model
from batchvl.models.loader import load_processor


def backends_asked(monkeypatch, loader_class) -> list:
    """The `backend` of every `loader_class.from_pretrained` call from now on (the calls still load)."""
    asked = []
    load = loader_class.from_pretrained

    def asking(*args, **kwargs):
        asked.append(kwargs.get("backend"))
        return load(*args, **kwargs)

    monkeypatch.setattr(loader_class, "from_pretrained", asking)
    return asked


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3", "smolvlm", "internvl"])
def test_the_loaded_processor_is_the_pillow_backend(tmp_path, monkeypatch, family):
    path = build_tiny_model(tmp_path / family, family=family, seed=0)
    asked = backends_asked(monkeypatch, transformers.AutoProcessor)
    loaded = load_processor(str(path), family)
    assert asked == ["pil"]
    assert isinstance(loaded.image_processor, PilBackend)


def test_the_image_only_fallback_asks_for_the_pillow_backend_too(tmp_path, monkeypatch):
    """Where AutoProcessor fails (a Qwen-VL video processor without torchvision), the image processor
    alone is loaded: from the Pillow backend as well."""
    path = build_tiny_model(tmp_path / "qwen2_vl", family="qwen2_vl", seed=0)

    def failing(*args, **kwargs):
        raise ImportError("the video processor needs torchvision")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", failing)
    asked = backends_asked(monkeypatch, processor_module.AutoImageProcessor)
    loaded = load_processor(str(path), "qwen2_vl")
    assert asked == ["pil"]
    assert isinstance(loaded.image_processor, PilBackend)
