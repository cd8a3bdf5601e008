"""bf16 runs its own kernels (blocked vision attention, the patch embedding as a matmul, grouped decode
attention), so its outputs are not compared bit for bit. They must be as close to the float32 model as
transformers' own bf16 model is: the engine's logits for every generated position, against the float32
model's logits for the same tokens."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.models.loader import load_model
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image, reference_processor

IMAGE_SIZES = [(100, 150), (200, 90), (28, 300), (300, 280)]
PROMPT = "Describe this image."
NEW_TOKENS = 6


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact.double()).norm() / exact.double().norm())


@pytest.fixture(scope="module")
def engine_logits(tiny_model_dir):
    return bf16_engine_logits(tiny_model_dir)


def bf16_engine_logits(tiny_model_dir) -> dict:
    """Per image: the prompt's inputs, the engine's generated tokens and its (tokens, vocab) logits."""
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded.processor)
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    # chunks of 37 tokens: prefill runs over cached context, then steps of several decodes together
    limits = EngineConfig(max_num_batched_tokens=37, max_num_seqs=8)
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, limits, loaded.eos_token_ids())
    inputs = {}
    for tag, (h, w) in enumerate(IMAGE_SIZES):
        image = random_image(h, w, tag)
        prepared = prepare_image(image, spec)
        rendered = renderer.render(PROMPT, 1)
        inputs[tag] = processor(text=[rendered], images=[image], return_tensors="pt")
        sampling = SamplingParams(NEW_TOKENS, ignore_eos=True)
        engine.add_request(EngineRequest(renderer.token_ids(rendered, [prepared]), [prepared], sampling, tag))

    logits: dict[int, list[torch.Tensor]] = {tag: [] for tag in inputs}
    execute = engine.runner.execute

    def recording(chunks, embeddings):
        out = execute(chunks, embeddings)
        sampled = [chunk for chunk in chunks if chunk.samples_next_token]
        for chunk, row in zip(sampled, out.sampled, strict=True):
            logits[chunk.request.tag].append(row.clone())
        return out

    engine.runner.execute = recording
    tokens = {}
    while engine.num_unfinished:
        for result in engine.step():
            tokens[result.tag] = result.output_token_ids
    return {tag: (inputs[tag], tokens[tag], torch.stack(logits[tag])) for tag in inputs}


def model_logits(model, inputs, generated: list[int]) -> torch.Tensor:
    """The model's logits predicting each generated token, given the prompt and the tokens before it."""
    prompt = inputs["input_ids"]
    fed = torch.tensor([generated[:-1]])
    ids = torch.cat([prompt, fed], dim=1)
    token_types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(fed)], dim=1)
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=token_types,
            pixel_values=inputs["pixel_values"].to(model.dtype),
            image_grid_thw=inputs["image_grid_thw"],
        )
    return out.logits[0, prompt.shape[1] - 1 :].float()


def test_bf16_engine_is_as_close_to_float32_as_transformers_bf16(tiny_model_dir, engine_logits):
    assert_as_close_as_transformers_bf16(tiny_model_dir, engine_logits)


def assert_as_close_as_transformers_bf16(tiny_model_dir, engine_logits: dict) -> None:
    exact = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    stock_bf16 = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    for tag, (inputs, generated, logits) in engine_logits.items():
        assert logits.shape[0] == len(generated) == NEW_TOKENS
        reference = model_logits(exact, inputs, generated)
        engine_error = relative_error(logits, reference)
        stock_error = relative_error(model_logits(stock_bf16, inputs, generated), reference)
        assert engine_error < 1.25 * stock_error, (tag, engine_error, stock_error)
