"""The vision call benchmark's calls: of 448x448 images, and of the captioning workload's own image mix, on
which the tuned GPU run chooses the tower's attention (`launch_settings.fastest_vision_attention`)."""

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def vision_call(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("vision_call")


def test_a_call_takes_the_images_in_order_up_to_its_patches_and_at_least_one(vision_call):
    images = [SimpleNamespace(num_patches=n) for n in (1024, 1024, 1024, 1024, 3072, 1024, 1024)]
    assert vision_call.call_of(images, 8192) == images[:6]  # 7,168 then 8,192
    assert vision_call.call_of(images, 8191) == images[:5]
    assert vision_call.call_of(images[4:], 1024) == images[4:5]  # larger than the call: alone


def test_the_jobs_mix_has_every_fifth_image_of_another_size(vision_call, loaded_fp32):
    """(The tiny model's processor resizes both sizes down to its most pixels: 896x672 keeps its aspect.)"""
    mix = [image.grid_thw for image in vision_call.images(loaded_fp32, 10, job_mix=True)]
    square = {image.grid_thw for image in vision_call.images(loaded_fp32, 10)}
    assert len(square) == 1
    assert [grid in square for grid in mix] == [True, True, True, True, False] * 2
    assert mix[4] == mix[9] and mix[4][2] > mix[4][1]  # wider than high
