"""`engine.fused_kernels` reaches the loader, which swaps the kernels in on CUDA only (`auto`, the default:
on CUDA)."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

import batchvl.layers.fused_kernels as fused_kernels
from batchvl.config import EngineConfig, job_config_from_dict
from batchvl.models import loader
from batchvl.models.registry import model_family
from batchvl.pipeline import launch


def test_the_setting_is_auto_by_default():
    assert EngineConfig().fused_kernels == "auto"


@pytest.fixture
def swaps(monkeypatch) -> list:
    """The models the swap was applied to."""
    applied = []
    monkeypatch.setattr(fused_kernels, "use_fused_kernels", lambda model: applied.append(model) or {})
    return applied


@pytest.mark.parametrize(
    "device,setting,swapped",
    [
        ("cuda", True, True),
        ("cpu", True, False),
        ("cuda", False, False),
        ("cuda", "auto", True),
        ("cpu", "auto", False),
    ],
)
def test_the_loader_swaps_the_kernels_in_on_cuda_only(tiny_model_dir, swaps, device, setting, swapped):
    # the model stays on the CPU: the loader reads the device it is given, and builds nothing there
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    family = model_family("qwen2_vl")
    loaded = loader.prepared_model(
        model, str(tiny_model_dir), family, torch.float32, torch.device(device), fused_kernels=setting
    )
    assert swaps == ([loaded.adapter.model] if swapped else [])


@pytest.mark.parametrize(
    "setting,vision_attention", [(True, "auto"), (False, "sdpa"), ("auto", "flash_varlen")]
)
def test_the_jobs_setting_reaches_the_loader(monkeypatch, tmp_path, setting, vision_attention):
    """`engine.fused_kernels` and `engine.vision_attention`, both applied as the model is loaded."""
    calls = []
    monkeypatch.setattr(launch, "load_model", lambda *args: calls.append(args) or "loaded")
    job = job_config_from_dict(
        {
            "model": {"path": str(tmp_path), "device": "cpu"},
            "input": {"paths": [str(tmp_path / "*.parquet")]},
            "prompts": [{"name": "caption", "text": "Describe."}],
            "output": {"dir": str(tmp_path / "out")},
            "engine": {"fused_kernels": setting, "vision_attention": vision_attention},
        }
    )
    assert launch.load_job_model(job)[0] == "loaded"
    assert calls[0][-3] is setting and calls[0][-2] == vision_attention
