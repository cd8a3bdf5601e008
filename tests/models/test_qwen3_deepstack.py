"""Qwen3-VL's deepstack features added by the media rows' positions (`qwen_vl.add_deepstack_features`), not
by a boolean mask on the device: the sums of transformers' own `_deepstack_process`, bit for bit, and an
engine step with an image runs it without reading a tensor's values (on a GPU, a wait for the device in
every deepstack layer)."""

import pytest
import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.models.qwen_vl import add_deepstack_features
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import random_image
from tests.engine.fake_graphs import NoHostSync
from tests.engine.test_family_parity import prepare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_features_are_added_as_transformers_adds_them(dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 12, 8, generator=generator).to(dtype)
    positions = torch.tensor([2, 3, 4, 9])
    features = torch.randn(len(positions), 8, generator=generator)  # float32: both cast it to the hidden's
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, positions] = True
    before = hidden.clone()
    expected = Qwen3VLTextModel._deepstack_process(None, hidden, mask, features)
    ours = add_deepstack_features(hidden, positions, features)
    assert torch.equal(ours, expected) and not torch.equal(ours, hidden)
    assert torch.equal(hidden, before)  # the input is left as it was, as transformers leaves it


def test_a_step_with_an_image_adds_them_without_reading_a_tensor(family_models, monkeypatch):
    _, loaded = family_models("qwen3_vl")
    calls = []

    def guarded(hidden_states, media_positions, features):
        calls.append(len(media_positions))
        with NoHostSync():
            return add_deepstack_features(hidden_states, media_positions, features)

    monkeypatch.setattr(loaded.adapter.language_model, "_deepstack_process", guarded)
    renderer = PromptRenderer(loaded.processor)
    media = prepare(loaded, [random_image(60, 90, 0)])
    ids = renderer.token_ids(renderer.render("Describe this image.", 1), media)
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, EngineConfig(), loaded.eos_token_ids())
    engine.add_request(EngineRequest(ids, media, SamplingParams(2), "x"))
    while engine.num_unfinished:
        engine.step()
    images = sum(token_id == loaded.adapter.placeholder_token_ids["image"] for token_id in ids)
    assert calls == [images] * len(loaded.adapter.model.config.vision_config.deepstack_visual_indexes)
