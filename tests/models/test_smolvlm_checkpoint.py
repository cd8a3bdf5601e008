"""A SmolVLM2 checkpoint as published names the stock `SmolVLMProcessor`, which cannot be built without
torchvision (its video processor) and num2words (its video prompts): batchvl builds its image-only
processor from the checkpoint's parts, with the checkpoint's own settings, and its prompts and pixels are
the stock layout's."""

import json

import numpy as np
import pytest
from transformers import AutoConfig

from batchvl.config import PreprocessConfig
from batchvl.demo import chat_templates
from batchvl.demo.tiny_model import build_tiny_model
from batchvl.inputs.types import MediaRef
from batchvl.models.loader import load_processor
from batchvl.models.processor import SmolVLMImageOnlyProcessor
from batchvl.models.registry import model_family
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import png_bytes, random_image, tower_pixels


@pytest.fixture(scope="module")
def published_layout(tmp_path_factory):
    """The tiny SmolVLM saved as the hub's checkpoints lay their processor out: `processor_config.json`
    with the stock class and the image tokens a frame fills, the image processor in
    `preprocessor_config.json`, the chat template in the processor's older `chat_template.json` (which the
    tokenizer does not read)."""
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "smolvlm", family="smolvlm", seed=0)
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    saved = json.loads((path / "processor_config.json").read_text())
    image_processor = {**saved.pop("image_processor"), "processor_class": "SmolVLMProcessor"}
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor))
    saved["processor_class"] = "SmolVLMProcessor"
    (path / "processor_config.json").write_text(json.dumps(saved))
    return path, saved["image_seq_len"]


def test_the_published_layout_loads_with_its_own_image_tokens_a_frame(published_layout):
    path, image_seq_len = published_layout
    processor = load_processor(str(path), "smolvlm")
    assert type(processor) is SmolVLMImageOnlyProcessor
    assert image_seq_len != 169  # the processor's default, which the model's features would not fill
    assert processor.image_seq_len == image_seq_len
    assert processor.chat_template == chat_templates.SMOLVLM


def test_the_published_layouts_prompt_and_pixels_are_the_processors(published_layout):
    path, _ = published_layout
    processor = load_processor(str(path), "smolvlm")
    config = AutoConfig.from_pretrained(path)
    prepare = model_family("smolvlm").media_preparer(processor, config, PreprocessConfig())
    renderer = PromptRenderer(processor)
    rendered = renderer.render("Describe this image.", 1)
    for image in (random_image(100, 150, 0), random_image(40, 40, 1)):
        prepared = prepare(MediaRef(png_bytes(image), None))
        inputs = processor(text=[rendered], images=[image], return_tensors="np")
        assert renderer.token_ids(rendered, [prepared]) == inputs["input_ids"][0].tolist()
        ours = tower_pixels(prepared)
        np.testing.assert_allclose(ours, inputs["pixel_values"].reshape(ours.shape), rtol=0, atol=1e-5)
