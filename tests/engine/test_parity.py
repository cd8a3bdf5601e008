"""The first gate: the engine's greedy tokens equal transformers `generate` in fp32, for every setting."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from batchvl.engine.engine import Engine, EngineLimits, EngineRequest
from batchvl.engine.request import SamplingParams
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image

MAX_NEW_TOKENS = 10
IMAGE_SIZES = [(100, 150), (60, 60), (200, 90), (28, 300)]
PROMPTS = ["Describe this image.", "What is in the picture? Answer in one short sentence, please."]


@pytest.fixture(scope="module")
def cases(tiny_model_dir, loaded_fp32):
    """(request inputs, expected token ids) for every image x prompt; image 0 appears twice."""
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    images.append(images[0])
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    renderer = PromptRenderer(loaded_fp32.processor)
    out = []
    for i, image in enumerate(images):
        prepared = prepare_image(
            image, QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
        )
        for j, prompt in enumerate(PROMPTS):
            rendered = renderer.render(prompt, 1)
            ids = renderer.token_ids(rendered, [prepared])
            inputs = processor(text=[rendered], images=[image], return_tensors="pt")
            assert inputs["input_ids"][0].tolist() == ids  # same prompt as the model's own processor
            generated = reference.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            expected = generated[0, inputs["input_ids"].shape[1] :].tolist()
            out.append(((i, j), ids, prepared, expected))
    return out


def run_engine(loaded, cases, limits: EngineLimits, sampling: SamplingParams | None = None):
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, limits, loaded.eos_token_ids())
    for tag, ids, prepared, _ in cases:
        engine.add_request(EngineRequest(ids, [prepared], sampling or SamplingParams(MAX_NEW_TOKENS), tag))
    results = {}
    while engine.num_unfinished:
        for result in engine.step():
            results[result.tag] = result
    return engine, results


@pytest.mark.parametrize(
    "limits",
    [
        EngineLimits(max_num_batched_tokens=16, max_num_seqs=64),  # chunks cut through every image
        EngineLimits(max_num_batched_tokens=37, max_num_seqs=3),
        EngineLimits(max_num_batched_tokens=64, max_num_seqs=1),
        EngineLimits(max_num_batched_tokens=4096, max_num_seqs=64),  # everything in one prefill step
        EngineLimits(max_num_batched_tokens=64, max_num_seqs=64, kv_cache_mb=0.2),  # forces preemption
        EngineLimits(max_num_batched_tokens=37, max_num_seqs=8, encoder_cache_mb=0, block_size=3),
        EngineLimits(max_num_batched_tokens=37, block_size=4, prefix_caching=False),
        EngineLimits(max_num_batched_tokens=37, block_size=4, disable_chunked_mm_input=True),
        EngineLimits(max_num_batched_tokens=16, block_size=4, lookahead=1),
    ],
    ids=[
        "budget16",
        "budget37-seqs3",
        "budget64-seqs1",
        "one-step",
        "preempt",
        "no-encoder-cache",
        "no-prefix-cache",
        "whole-images",
        "arrival-order",
    ],
)
def test_greedy_tokens_equal_generate(loaded_fp32, cases, limits):
    engine, results = run_engine(loaded_fp32, cases, limits)
    assert set(results) == {tag for tag, *_ in cases}
    for tag, ids, _, expected in cases:
        result = results[tag]
        assert result.error is None
        assert result.output_token_ids == expected, tag
        assert result.num_prompt_tokens == len(ids)
        assert result.text == loaded_fp32.processor.tokenizer.decode(expected, skip_special_tokens=True)
    if limits.kv_cache_mb < 1:
        assert engine.stats.preemptions > 0


def test_duplicate_images_are_encoded_once(loaded_fp32, cases):
    # prefix caching off: with it, later prompts of an image skip its placeholders and never ask for it
    engine, _ = run_engine(
        loaded_fp32, cases, EngineLimits(max_num_batched_tokens=4096, prefix_caching=False)
    )
    assert engine.stats.images_total == len(cases)
    assert engine.stats.images_encoded == len(IMAGE_SIZES)  # 5 images, one a duplicate, 2 prompts each
    assert engine.stats.encoder_cache_hits == len(cases) - len(IMAGE_SIZES)


def test_prefix_cache_skips_the_shared_system_prompt_and_image(loaded_fp32, cases):
    limits = EngineLimits(max_num_batched_tokens=4096, block_size=4)
    on, _ = run_engine(loaded_fp32, cases, limits)
    off, _ = run_engine(loaded_fp32, cases, replace(limits, prefix_caching=False))
    total_prompt = sum(len(ids) for _, ids, _, _ in cases)
    assert off.stats.prefill_tokens_computed == total_prompt and off.stats.prefix_cache_hit_tokens == 0
    saved = on.stats.prefix_cache_hit_tokens
    assert on.stats.prefill_tokens_computed + saved == total_prompt
    # each image's second prompt (and the duplicate image's two) skips at least system prompt + image
    pad = image_pad(loaded_fp32)
    image_end = {tag[0]: len(ids) - ids[::-1].index(pad) for tag, ids, _, _ in cases}
    assert saved >= sum((end // 4) * 4 for end in image_end.values())


def test_same_text_before_a_different_image_shares_only_the_text(loaded_fp32, cases):
    (_, first, _, expected_first), (_, second, _, expected_second) = cases[2], cases[4]  # images 1, 2
    pad = image_pad(loaded_fp32)
    assert first[: first.index(pad)] == second[: second.index(pad)] and first != second
    engine, results = run_engine(loaded_fp32, [cases[2], cases[4]], EngineLimits(block_size=4))
    assert engine.stats.prefix_cache_hit_tokens == (first.index(pad) // 4) * 4
    assert [r.output_token_ids for r in results.values()] == [expected_first, expected_second]


def image_pad(loaded) -> int:
    return loaded.adapter.placeholder_token_ids["image"]


def test_sampled_output_does_not_depend_on_batch(loaded_fp32, cases):
    sampling = SamplingParams(MAX_NEW_TOKENS, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    _, alone = run_engine(
        loaded_fp32, cases, EngineLimits(max_num_seqs=1, max_num_batched_tokens=64), sampling
    )
    _, batched = run_engine(
        loaded_fp32, cases, EngineLimits(max_num_seqs=64, max_num_batched_tokens=37), sampling
    )
    assert {t: r.output_token_ids for t, r in alone.items()} == {
        t: r.output_token_ids for t, r in batched.items()
    }
    greedy = {tag: expected for tag, _, _, expected in cases}
    assert any(alone[tag].output_token_ids != greedy[tag] for tag in greedy)  # it really sampled


def test_stop_token_ids_end_generation(loaded_fp32, cases):
    tag, ids, prepared, expected = cases[0]
    stop_token = expected[3]
    sampling = SamplingParams(MAX_NEW_TOKENS, stop_token_ids=(stop_token,))
    _, results = run_engine(loaded_fp32, [cases[0]], EngineLimits(), sampling)
    result = results[tag]
    assert result.output_token_ids == expected[: expected.index(stop_token) + 1]
    assert result.finish_reason == "stop"
    assert results[tag].finish_reason == "stop"


def test_max_new_tokens_finishes_with_length(loaded_fp32, cases):
    _, results = run_engine(loaded_fp32, cases[:1], EngineLimits(), SamplingParams(3))
    result = next(iter(results.values()))
    assert result.num_output_tokens == 3 and result.finish_reason == "length"


def test_request_larger_than_kv_cache_is_an_error_not_a_stall(loaded_fp32, cases):
    limits = EngineLimits(kv_cache_mb=0.02)  # 2 blocks of 16 tokens: less than any prompt here
    _, results = run_engine(loaded_fp32, cases[:2], limits)
    assert {r.error.error_type for r in results.values()} == {"kv_cache_too_small"}
    assert all("engine.kv_cache_mb" in r.error.message for r in results.values())


def test_several_images_in_one_prompt(tiny_model_dir, loaded_fp32):
    images = [random_image(80, 120, 7), random_image(140, 60, 8)]
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    renderer = PromptRenderer(loaded_fp32.processor)
    prepared = [
        prepare_image(image, QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor))
        for image in images
    ]
    rendered = renderer.render("Compare the two images.", 2)
    ids = renderer.token_ids(rendered, prepared)
    inputs = processor(text=[rendered], images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    expected = reference.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    expected = expected[0, inputs["input_ids"].shape[1] :].tolist()
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineLimits(max_num_batched_tokens=23),
        loaded_fp32.eos_token_ids(),
    )
    engine.add_request(EngineRequest(ids, prepared, SamplingParams(MAX_NEW_TOKENS), "two"))
    results = []
    while engine.num_unfinished:
        results += engine.step()
    assert results[0].output_token_ids == expected
