"""Every family beyond Qwen2-VL: batchvl's preprocessing equals the family's processor, and the engine equals
transformers `generate` in fp32 (tokens, logits at every generated position, the family's positions), with
prompts cut inside images and caches on or off."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig, PreprocessConfig
from batchvl.engine.sampling.params import SamplingParams
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import NEW_FAMILIES, png_bytes, random_image, tower_pixels
from tests.engine.reference import assert_matches_reference, make_case, run_cases

MAX_NEW_TOKENS = 8
IMAGE_SIZES = [(100, 150), (60, 60), (200, 90), (28, 300)]
PROMPTS = ["Describe this image.", "What is in the picture? Answer in one short sentence, please."]
LIMITS = {
    "budget16": EngineConfig(max_num_batched_tokens=16, block_size=4),  # chunks cut through every image
    "budget37-seqs3": EngineConfig(max_num_batched_tokens=37, max_num_seqs=3),
    "no-caches": EngineConfig(max_num_batched_tokens=37, encoder_cache_mb=0, prefix_caching=False),
    "one-step": EngineConfig(max_num_batched_tokens=4096),
}


def prepare(loaded, images):
    prepare_media = loaded.family.media_preparer(
        loaded.processor, loaded.adapter.model.config, PreprocessConfig()
    )
    return [prepare_media(MediaRef(png_bytes(image), None)) for image in images]


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family_cases(request, family_models):
    """(family, loaded model, cases): each image x prompt (image 0 twice) and one prompt with two images."""
    path, loaded = family_models(request.param)
    processor = loaded.processor
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    renderer = PromptRenderer(processor)
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    groups = [[image] for image in images] + [[images[0]], [images[1], images[2]]]
    cases = []
    for i, group in enumerate(groups):
        prepared = prepare(loaded, group)
        for j, prompt in enumerate(PROMPTS):
            rendered = renderer.render(prompt, len(group))
            ids = renderer.token_ids(rendered, prepared)
            inputs = processor(text=[rendered], images=group, return_tensors="pt")
            # the preprocessing gate: same prompt ids and pixels as the family's own processor
            assert inputs["input_ids"][0].tolist() == ids
            ours = tower_pixels(prepared)
            # (tiled families batch the frames of a sample as (1, frames, 3, H, W))
            theirs = inputs["pixel_values"].numpy().reshape(ours.shape)
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
            cases.append(make_case(reference, (i, j), ids, prepared, inputs, MAX_NEW_TOKENS))
    return request.param, loaded, cases


def run_engine(loaded, cases, limits):
    return run_cases(loaded, cases, limits, SamplingParams(MAX_NEW_TOKENS))


@pytest.mark.parametrize("limits", LIMITS.values(), ids=LIMITS.keys())
def test_engine_equals_generate(family_cases, limits):
    _, loaded, cases = family_cases
    _, observed = run_engine(loaded, cases, limits)
    for case in cases:
        assert_matches_reference(observed[case.tag], case)


def test_caches_change_work_not_outputs(family_cases):
    _, loaded, cases = family_cases
    limits = EngineConfig(max_num_batched_tokens=4096, block_size=4)
    cached, with_caches = run_engine(loaded, cases, limits)
    plain, without = run_engine(loaded, cases, replace(limits, encoder_cache_mb=0, prefix_caching=False))
    for case in cases:
        assert_matches_reference(with_caches[case.tag], case)
        assert_matches_reference(without[case.tag], case)
    total_prompt = sum(len(case.ids) for case in cases)
    assert plain.stats.prefill_tokens_computed == total_prompt
    assert cached.stats.prefix_cache_hit_tokens > 0
    assert cached.stats.prefill_tokens_computed + cached.stats.prefix_cache_hit_tokens == total_prompt
    distinct = {img.content_hash for case in cases for img in case.media}
    assert cached.stats.images_encoded == len(distinct) < len(cases)  # each image once, not per request


ODD_SIZES = [(1, 1), (3, 600), (1000, 37), (17, 300), (84, 84), (400, 250)]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_preprocessing_matches_the_processor_on_odd_sizes_and_modes(family_models, family):
    _, loaded = family_models(family)
    processor = loaded.processor
    renderer = PromptRenderer(processor)
    rendered = renderer.render("What is this?", 1)
    images = [random_image(h, w, seed=h + w) for h, w in ODD_SIZES]
    images += [random_image(90, 60, 1).convert("L"), random_image(70, 120, 2).convert("RGBA")]
    for image in images:
        (prepared,) = prepare(loaded, [image])
        inputs = processor(text=[rendered], images=[image], return_tensors="np")
        assert renderer.token_ids(rendered, [prepared]) == inputs["input_ids"][0].tolist(), image.size
        ours = tower_pixels(prepared)
        theirs = inputs["pixel_values"].reshape(ours.shape)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5, err_msg=str(image.size))
