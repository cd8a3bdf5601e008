"""What differs between the supported transformers releases, met by behaviour: Idefics3's adapter gives the
same per-image rows from either form of its vision outputs, and the image-only processors are found by
name however registrations are kept (the parity tests run both ends in CI: make test-oldest)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from batchvl.models.idefics3 import Idefics3Adapter

HIDDEN = 4
ROOT = Path(__file__).resolve().parents[2]


def test_idefics3_features_as_one_tensor_of_frames_give_each_image_its_frames_rows():
    """5.23 gives a list with one (frames * image_seq_len, hidden) tensor; 5.17 a (frames, image_seq_len,
    hidden) tensor."""
    frames, seq_len = 5, 3
    features = torch.randn(frames, seq_len, HIDDEN)
    adapter = Idefics3Adapter.__new__(Idefics3Adapter)
    adapter.device, adapter.dtype = torch.device("cpu"), torch.float32
    grid = torch.tensor([[2, 1, 1], [3, 1, 1]])  # two images: 2 frames and 3 frames

    def encoded(pooled):
        get_image_features = lambda frames, return_dict: SimpleNamespace(pooler_output=pooled)  # noqa: E731
        adapter.model = SimpleNamespace(model=SimpleNamespace(get_image_features=get_image_features))
        return adapter.encode("image", torch.zeros(frames, 3, 8, 8), grid)

    as_list = encoded([features.reshape(-1, HIDDEN)])
    as_tensor = encoded(features)
    assert [rows.shape for rows in as_list] == [(2 * seq_len, HIDDEN), (3 * seq_len, HIDDEN)]
    for ours, theirs in zip(as_list, as_tensor, strict=True):
        assert torch.equal(ours, theirs)


def test_image_only_processors_are_found_by_name_where_registrations_under_transformers_configs_fail():
    """As transformers 5.17 does: its mapping's `register` silently skips a key defined by transformers."""
    code = """
from transformers.models.auto import auto_factory
register = auto_factory._LazyAutoMapping.register
def register_as_5_17(self, key, value, exist_ok=False):
    if getattr(key, "__module__", "").startswith("transformers."):
        return
    register(self, key, value, exist_ok)
auto_factory._LazyAutoMapping.register = register_as_5_17
from transformers.models.auto.processing_auto import processor_class_from_name
from batchvl.models.processor import IMAGE_ONLY_PROCESSORS
for processor in IMAGE_ONLY_PROCESSORS.values():
    assert processor_class_from_name(processor.__name__) is processor, processor
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
