"""A JSON schema's property order is part of the prompt: the model writes the properties in the order the
schema lists them (a `reasoning` property before `label` is how a model is made to think before it answers),
as vLLM, SGLang and OpenAI do. The engine's tokens equal transformers `generate` with xgrammar's own logits
processor over the schema compiled exactly as written (fp32, the tiny model, greedy)."""

import json

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForImageTextToText
from xgrammar.contrib.hf import LogitsProcessor

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.structured_output import OutputConstraint
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image, reference_processor
from tests.engine.reference import EngineProbe, generate_reference

# Properties deliberately out of alphabetical order, at the top level and inside a nested object.
SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string", "maxLength": 4},
        "label": {"type": "string", "enum": ["cat", "dog"]},
        "details": {
            "type": "object",
            "properties": {"size": {"enum": [1, 2]}, "color": {"type": "string", "enum": ["red"]}},
            "required": ["size", "color"],
        },
    },
    "required": ["reasoning", "label", "details"],
}
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_properties_are_generated_in_the_schema_order(tiny_model_dir, loaded_fp32, reference):
    tokenizer = loaded_fp32.processor.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer,
        vocab_size=reference.config.text_config.vocab_size,
        stop_token_ids=loaded_fp32.eos_token_ids(),
    )
    # The schema as the user wrote it: json.dumps keeps a dict's insertion order.
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    engine = Engine(loaded_fp32.adapter, tokenizer, EngineConfig(), loaded_fp32.eos_token_ids())
    probe = EngineProbe(engine)
    expected = {}
    for i in range(2):
        image = random_image(56, 84, seed=40 + i)
        rendered = renderer.render("Answer as JSON.", 1)
        inputs = processor(text=[rendered], images=[image], return_tensors="pt")
        expected[i] = generate_reference(
            reference, inputs, MAX_NEW_TOKENS, logits_processor=[LogitsProcessor(compiled)]
        ).tokens
        ids = renderer.token_ids(rendered, [prepare_image(image, spec)])
        engine.add_request(
            EngineRequest(
                ids,
                [prepare_image(image, spec)],
                SamplingParams(MAX_NEW_TOKENS),
                i,
                constraint=OutputConstraint.json_schema(SCHEMA),
            )
        )
    observed = probe.run()
    for i, tokens in expected.items():
        result = observed[i].result
        assert result.output_token_ids == tokens
        assert result.text.startswith('{"reasoning":"')
        if result.is_complete:  # a whole object: its keys in the schema's order, not sorted
            value = json.loads(result.text)
            assert list(value) == ["reasoning", "label", "details"]
            assert list(value["details"]) == ["size", "color"]
    texts = [observed[i].result.text for i in expected]
    assert any(observed[i].result.is_complete for i in expected), texts


def test_schemas_differing_only_in_property_order_are_different_constraints():
    reordered = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    assert OutputConstraint.json_schema(reordered) != OutputConstraint.json_schema(SCHEMA)
