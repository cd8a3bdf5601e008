"""SmolVLM2 and InternVL checkpoints as published name their stock processors (`SmolVLMProcessor`,
`InternVLProcessor`), which cannot be built without torchvision (their video processors; SmolVLM's also
needs num2words): batchvl builds its image-only processor from the checkpoint's parts, with the
checkpoint's own settings and chat template, and its prompts and pixels are the stock layout's."""

import json

import numpy as np
import pytest
from transformers import AutoConfig

from batchvl.config import PreprocessConfig
from batchvl.demo import chat_templates
from batchvl.demo.tiny_model import build_tiny_model
from batchvl.inputs.types import MediaRef
from batchvl.models.loader import load_processor
from batchvl.models.processor import IMAGE_ONLY_PROCESSORS
from batchvl.models.registry import model_family
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import png_bytes, random_image, tower_pixels

# family -> (stock processor, the setting of image tokens a tile fills and its default, the chat template,
# the image processor type the hub's checkpoints name)
LAYOUTS = {
    "smolvlm": ("SmolVLMProcessor", "image_seq_len", 169, chat_templates.SMOLVLM, "SmolVLMImageProcessor"),
    "internvl": (
        "InternVLProcessor",
        "image_seq_length",
        256,
        chat_templates.INTERNVL,
        "GotOcr2ImageProcessorFast",
    ),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def published_layout(request, tmp_path_factory):
    """A tiny checkpoint saved as the hub's lay their processor out: `processor_config.json` with the
    stock class and the image tokens a tile fills, the image processor in `preprocessor_config.json` (of
    the type the hub's checkpoints name), the chat template in the processor's older `chat_template.json`
    (which the tokenizer does not read)."""
    family = request.param
    stock, *_, image_processor_type = LAYOUTS[family]
    path = build_tiny_model(tmp_path_factory.mktemp("models") / family, family=family, seed=0)
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    saved = json.loads((path / "processor_config.json").read_text())
    image_processor = {**saved.pop("image_processor"), "processor_class": stock}
    image_processor["image_processor_type"] = image_processor_type
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor))
    saved["processor_class"] = stock
    (path / "processor_config.json").write_text(json.dumps(saved))
    return family, path, saved


def test_the_published_layout_loads_with_its_own_image_tokens_a_tile(published_layout):
    family, path, saved = published_layout
    _, setting, default, template, _ = LAYOUTS[family]
    processor = load_processor(str(path), family)
    assert type(processor) is IMAGE_ONLY_PROCESSORS[family]
    assert saved[setting] != default  # the processor's default, which the model's features would not fill
    assert getattr(processor, setting) == saved[setting]
    assert processor.chat_template == template


def test_the_published_layouts_prompt_and_pixels_are_the_processors(published_layout):
    family, path, _ = published_layout
    processor = load_processor(str(path), family)
    config = AutoConfig.from_pretrained(path)
    prepare = model_family(family).media_preparer(processor, config, PreprocessConfig())
    renderer = PromptRenderer(processor)
    rendered = renderer.render("Describe this image.", 1)
    for image in (random_image(100, 150, 0), random_image(40, 40, 1)):
        prepared = prepare(MediaRef(png_bytes(image), None))
        inputs = processor(text=[rendered], images=[image], return_tensors="np")
        assert renderer.token_ids(rendered, [prepared]) == inputs["input_ids"][0].tolist()
        ours = tower_pixels(prepared)
        np.testing.assert_allclose(ours, inputs["pixel_values"].reshape(ours.shape), rtol=0, atol=1e-5)
