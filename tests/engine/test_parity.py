"""The first gate: the engine equals transformers `generate` in fp32, for every setting: the same greedy
tokens, logits within 1e-4 at every generated position, and the positions `get_rope_index` gives every
token fed. The test model attends sharply (see conftest), so a wrong position changes its tokens."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForImageTextToText

import batchvl.layers.attention as attention
import batchvl.models.qwen_vl as qwen_vl
from batchvl.config import EngineConfig
from batchvl.engine.request import EngineRequest, Request
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.stopping import StopChecker
from batchvl.layers.attention import InPlaceDecodes, KVCache
from batchvl.layers.native_kernels import native_ops
from batchvl.layers.row_buckets import bucket_rows, pads_rows
from batchvl.models.adapter import VLMAdapter
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image, reference_processor, tower_pixels
from tests.engine.reference import (
    EngineProbe,
    assert_matches_reference,
    make_case,
    run_cases,
    with_fast_paths,
)

MAX_NEW_TOKENS = 10
IMAGE_SIZES = [(100, 150), (60, 60), (200, 90), (28, 300)]
PROMPTS = ["Describe this image.", "What is in the picture? Answer in one short sentence, please."]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(tiny_model_dir, loaded_fp32, reference):
    """A case per image x prompt (image 0 appears twice), with generate's tokens and logits."""
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    images.append(images[0])
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    out = []
    for i, image in enumerate(images):
        prepared = prepare_image(image, spec)
        for j, prompt in enumerate(PROMPTS):
            rendered = renderer.render(prompt, 1)
            ids = renderer.token_ids(rendered, [prepared])
            inputs = processor(text=[rendered], images=[image], return_tensors="pt")
            assert inputs["input_ids"][0].tolist() == ids  # same prompt as the model's own processor
            # and the same pixels: a reference computed from other pixels differs by its input
            pixels = torch.from_numpy(tower_pixels(prepared))
            torch.testing.assert_close(pixels, inputs["pixel_values"], rtol=0, atol=1e-5)
            out.append(make_case(reference, (i, j), ids, [prepared], inputs, MAX_NEW_TOKENS))
    return out


def run_engine(loaded, cases, limits: EngineConfig, sampling: SamplingParams | None = None):
    return run_cases(loaded, cases, limits, sampling or SamplingParams(MAX_NEW_TOKENS))


LIMITS = {
    "budget16": EngineConfig(max_num_batched_tokens=16, max_num_seqs=64),  # chunks cut through every image
    "budget37-seqs3": EngineConfig(max_num_batched_tokens=37, max_num_seqs=3),
    "budget64-seqs1": EngineConfig(max_num_batched_tokens=64, max_num_seqs=1),
    "one-step": EngineConfig(max_num_batched_tokens=4096, max_num_seqs=64),  # everything in one prefill step
    "preempt": EngineConfig(max_num_batched_tokens=64, max_num_seqs=64, kv_cache_mb=0.2),  # forces preemption
    "no-encoder-cache": EngineConfig(
        max_num_batched_tokens=37, max_num_seqs=8, encoder_cache_mb=0, block_size=3
    ),
    "no-prefix-cache": EngineConfig(max_num_batched_tokens=37, block_size=4, prefix_caching=False),
    "whole-images": EngineConfig(max_num_batched_tokens=37, block_size=4, disable_chunked_mm_input=True),
    "arrival-order": EngineConfig(max_num_batched_tokens=16, block_size=4, lookahead=1),
}


@pytest.mark.parametrize("limits", LIMITS.values(), ids=LIMITS.keys())
def test_greedy_tokens_equal_generate(loaded_fp32, cases, limits):
    engine, observed = run_engine(loaded_fp32, cases, limits)
    assert set(observed) == {case.tag for case in cases}
    for case in cases:
        assert_matches_reference(observed[case.tag], case)
        result = observed[case.tag].result
        assert result.num_prompt_tokens == len(case.ids)
        tokens = case.expected.tokens
        assert result.text == loaded_fp32.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    if limits.kv_cache_mb != "auto" and limits.kv_cache_mb < 1:
        assert engine.stats.preemptions > 0


@pytest.mark.parametrize("limits_name", ["budget16", "preempt"])
def test_with_every_fast_path_on_the_tokens_logits_and_positions_equal_generate(
    loaded_fp32, cases, limits_name
):
    """Decode graphs (fake ones on the CPU: the step called again over the graphs' static buffers) and
    overlapped steps together, as BATCHVL_TEST_FAST_PATHS=1 runs every parity test; the positions of a
    graphed step are read from the graphs' buffer, as on a GPU, where a replay calls no Python."""
    engine = with_fast_paths(loaded_fp32, LIMITS[limits_name])
    probe = EngineProbe(engine)
    for case in cases:
        engine.add_request(EngineRequest(case.ids, case.media, SamplingParams(MAX_NEW_TOKENS), case.tag))
    observed = probe.run()
    assert probe.graphed_steps > 0
    for case in cases:
        assert_matches_reference(observed[case.tag], case)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-ops"])
def test_both_decode_attention_paths_equal_generate(loaded_fp32, cases, monkeypatch, native):
    """Decodes are attended by the native kernel where it builds (as in every test above), by torch ops
    elsewhere; both give generate's tokens."""
    if native and native_ops() is None:
        pytest.skip("the native decode attention did not build (needs a C++ compiler and ninja)")
    if not native:
        monkeypatch.setattr(attention, "reads_cache_in_place", lambda layer: False)
    batch_sizes = []
    attend = InPlaceDecodes.attend

    def counting_attend(self, *args):
        batch_sizes.append(len(self.rows))
        return attend(self, *args)

    monkeypatch.setattr(InPlaceDecodes, "attend", counting_attend)
    _, observed = run_engine(loaded_fp32, cases, EngineConfig(max_num_batched_tokens=37, max_num_seqs=8))
    for case in cases:
        assert_matches_reference(observed[case.tag], case)
    if native:
        assert max(batch_sizes) > 1  # several decodes attended in one call
    else:
        assert batch_sizes == []


def test_steps_are_padded_to_their_row_bucket_on_the_cpu_alone_and_the_padding_writes_no_kv(
    loaded_fp32, cases, monkeypatch
):
    rows, written = [], []
    forward, write = VLMAdapter.forward, KVCache.write

    def recording_forward(self, token_ids, *args, **kwargs):
        rows.append(len(token_ids))
        return forward(self, token_ids, *args, **kwargs)

    def recording_write(self, layer, slots, key, value):
        assert key.shape[1] == value.shape[1] == len(slots)
        if layer == 0:
            written.append(len(slots))
        return write(self, layer, slots, key, value)

    monkeypatch.setattr(VLMAdapter, "forward", recording_forward)
    monkeypatch.setattr(KVCache, "write", recording_write)
    _, observed = run_engine(loaded_fp32, cases[:4], EngineConfig(max_num_batched_tokens=37, max_num_seqs=3))
    if pads_rows(loaded_fp32.adapter.device):
        assert rows == [bucket_rows(n) for n in written]  # every step: its tokens, then padding to the bucket
        assert any(padded > real for padded, real in zip(rows, written, strict=True))
    else:  # a GPU's steps: their tokens alone
        assert rows == written
    for case in cases[:4]:
        assert_matches_reference(observed[case.tag], case)


def one_d_positions(adapter, prompt_token_ids, media):
    positions, _ = VLMAdapter.prompt_positions(adapter, prompt_token_ids, media)
    return positions.expand(3, -1).contiguous(), 0


def positions_without_delta(adapter, prompt_token_ids, media):
    return ORIGINAL_POSITIONS(adapter, prompt_token_ids, media)[0], 0


ORIGINAL_POSITIONS = qwen_vl.Qwen2VLAdapter.prompt_positions


@pytest.mark.parametrize("wrong", [one_d_positions, positions_without_delta], ids=["1-d", "no-rope-delta"])
def test_the_gate_sees_wrong_positions(loaded_fp32, cases, monkeypatch, wrong):
    """The model is sensitive to positions: with them wrong, tokens change, and so the gate fails."""
    monkeypatch.setattr(qwen_vl.Qwen2VLAdapter, "prompt_positions", wrong)
    _, observed = run_engine(loaded_fp32, cases, EngineConfig(max_num_batched_tokens=37))
    changed = [c.tag for c in cases if observed[c.tag].result.output_token_ids != c.expected.tokens]
    assert len(changed) >= len(cases) // 2, changed
    for case in cases:
        last = case.positions.shape[1] - 1
        if wrong is positions_without_delta and int(case.positions[0, last]) == last:
            continue  # its rope delta is 0 (an image one merged patch high), or no generated token was fed
        with pytest.raises(AssertionError):
            assert_matches_reference(observed[case.tag], case)


def test_duplicate_images_are_encoded_once(loaded_fp32, cases):
    # prefix caching off: with it, later prompts of an image skip its placeholders and never ask for it
    engine, _ = run_engine(
        loaded_fp32, cases, EngineConfig(max_num_batched_tokens=4096, prefix_caching=False)
    )
    assert engine.stats.images_total == len(cases)
    assert engine.stats.images_encoded == len(IMAGE_SIZES)  # 5 images, one a duplicate, 2 prompts each
    assert engine.stats.encoder_cache_hits == len(cases) - len(IMAGE_SIZES)


def test_prefix_cache_skips_the_shared_system_prompt_and_image(loaded_fp32, cases):
    limits = EngineConfig(max_num_batched_tokens=4096, block_size=4)
    on, observed = run_engine(loaded_fp32, cases, limits)
    off, _ = run_engine(loaded_fp32, cases, replace(limits, prefix_caching=False))
    total_prompt = sum(len(case.ids) for case in cases)
    assert off.stats.prefill_tokens_computed == total_prompt and off.stats.prefix_cache_hit_tokens == 0
    saved = on.stats.prefix_cache_hit_tokens
    assert on.stats.prefill_tokens_computed + saved == total_prompt
    # each image's second prompt (and the duplicate image's two) skips at least system prompt + image
    pad = image_pad(loaded_fp32)
    image_end = {case.tag[0]: len(case.ids) - case.ids[::-1].index(pad) for case in cases}
    assert saved >= sum((end // 4) * 4 for end in image_end.values())
    for case in cases:  # what came from the cache gives what computing it gives
        assert_matches_reference(observed[case.tag], case)


def test_same_text_before_a_different_image_shares_only_the_text(loaded_fp32, cases):
    first, second = cases[2], cases[4]  # images 1, 2
    pad = image_pad(loaded_fp32)
    text_before = [case.ids[: case.ids.index(pad)] for case in (first, second)]
    assert text_before[0] == text_before[1] and first.ids != second.ids
    engine, observed = run_engine(loaded_fp32, [first, second], EngineConfig(block_size=4))
    assert engine.stats.prefix_cache_hit_tokens == (first.ids.index(pad) // 4) * 4
    for case in (first, second):
        assert_matches_reference(observed[case.tag], case)


def image_pad(loaded) -> int:
    return loaded.adapter.placeholder_token_ids["image"]


def test_sampled_output_does_not_depend_on_batch(loaded_fp32, cases):
    sampling = SamplingParams(MAX_NEW_TOKENS, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    _, alone = run_engine(
        loaded_fp32, cases, EngineConfig(max_num_seqs=1, max_num_batched_tokens=64), sampling
    )
    _, batched = run_engine(
        loaded_fp32, cases, EngineConfig(max_num_seqs=64, max_num_batched_tokens=37), sampling
    )
    tokens = {tag: observed.result.output_token_ids for tag, observed in alone.items()}
    assert tokens == {tag: observed.result.output_token_ids for tag, observed in batched.items()}
    assert any(tokens[case.tag] != case.expected.tokens for case in cases)  # it really sampled


def test_stop_token_ids_end_generation(loaded_fp32, cases):
    case = cases[0]
    stop_token = case.expected.tokens[3]
    sampling = SamplingParams(MAX_NEW_TOKENS, stop_token_ids=(stop_token,))
    _, observed = run_engine(loaded_fp32, [case], EngineConfig(), sampling)
    result = observed[case.tag].result
    assert result.output_token_ids == case.expected.tokens[: case.expected.tokens.index(stop_token) + 1]
    assert result.finish_reason == "stop"


def test_max_new_tokens_finishes_with_length(loaded_fp32, cases):
    _, observed = run_engine(loaded_fp32, cases[:1], EngineConfig(), SamplingParams(3))
    result = observed[cases[0].tag].result
    assert result.num_output_tokens == 3 and result.finish_reason == "length"


def test_a_request_ends_with_length_when_it_fills_the_models_context():
    """A prompt may ask for more new tokens than the context has left: it ends where the context is full,
    and at an end-of-sequence token before that as always."""
    stopping = StopChecker(tokenizer=None, eos_token_ids=[2], max_model_len=12)
    request = Request(0, list(range(10, 20)), [], SamplingParams(max_new_tokens=100))
    request.output_token_ids.append(5)
    assert stopping.finish_reason(request) is None
    request.output_token_ids.append(6)  # the twelfth token
    assert stopping.finish_reason(request) == "length"
    request.output_token_ids[-1] = 2
    assert stopping.finish_reason(request) == "stop"


def test_request_larger_than_kv_cache_is_an_error_not_a_stall(loaded_fp32, cases):
    limits = EngineConfig(kv_cache_mb=0.02)  # 2 blocks of 16 tokens: less than any prompt here
    _, observed = run_engine(loaded_fp32, cases[:2], limits)
    errors = [o.result.error for o in observed.values()]
    assert {e.error_type for e in errors} == {"kv_cache_too_small"}
    assert all("engine.kv_cache_mb" in e.message for e in errors)


def test_several_images_in_one_prompt(tiny_model_dir, loaded_fp32, reference):
    images = [random_image(80, 120, 7), random_image(140, 60, 8)]
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    prepared = [prepare_image(image, spec) for image in images]
    rendered = renderer.render("Compare the two images.", 2)
    ids = renderer.token_ids(rendered, prepared)
    inputs = processor(text=[rendered], images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    case = make_case(reference, "two", ids, prepared, inputs, MAX_NEW_TOKENS)
    _, observed = run_engine(loaded_fp32, [case], EngineConfig(max_num_batched_tokens=23))
    assert_matches_reference(observed["two"], case)


def test_stop_strings_end_generation_where_generate_stops(tiny_model_dir, loaded_fp32, reference, cases):
    """A stop string ends the request at the token that completes it, as `generate(stop_strings=...)` does,
    and the text is cut before it."""
    processor = reference_processor(tiny_model_dir)
    tokenizer = loaded_fp32.processor.tokenizer
    checked = 0
    for case in cases[:6]:
        text = tokenizer.decode(case.expected.tokens, skip_special_tokens=True)
        # two printable characters from the middle of the output (a random model also writes partial
        # UTF-8, which decodes to U+FFFD: no user writes that as a stop string)
        middle = [i for i in range(len(text) // 3, len(text) - 1) if text[i : i + 2].isascii()]
        stop = text[middle[0] : middle[0] + 2] if middle else ""
        if not stop.strip() or not stop.isprintable():
            continue
        image = random_image(*IMAGE_SIZES[case.tag[0] % len(IMAGE_SIZES)], case.tag[0] % len(IMAGE_SIZES))
        rendered = PromptRenderer(loaded_fp32.processor).render(PROMPTS[case.tag[1]], 1)
        inputs = processor(text=[rendered], images=[image], return_tensors="pt")
        generated = reference.generate(
            **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, stop_strings=[stop], tokenizer=tokenizer
        )
        expected = generated[0, inputs["input_ids"].shape[1] :].tolist()
        sampling = SamplingParams(MAX_NEW_TOKENS, stop=(stop,))
        _, observed = run_engine(loaded_fp32, [case], EngineConfig(), sampling)
        result = observed[case.tag].result
        assert result.output_token_ids == expected, (case.tag, stop)
        assert result.finish_reason == "stop" and stop not in result.text
        assert text.startswith(result.text) and len(result.text) == text.find(stop)
        checked += 1
    assert checked >= 3
