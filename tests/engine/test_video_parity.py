"""Video through the engine equals transformers `generate` fed the same video tensors (fp32, greedy): the
tokens, the logits at every generated position and the family's positions of every token.

The Hugging Face video processor needs torchvision, which is not available everywhere, so the reference
gets batchvl's own pixel_values_videos / video_grid_thw / input_ids; what is checked here is the model
side: video placeholders, 3-D positions with a temporal axis, embeddings cut across prefill chunks, for
each Qwen family (Qwen2.5-VL: positions spaced by seconds; Qwen3-VL: a timestamp and a placeholder run
per frame, deepstack features).
"""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig, PreprocessConfig
from batchvl.engine.sampling.params import SamplingParams
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image, prepare_video
from batchvl.preprocess.video import FrameSampling, decode_video
from tests.conftest import random_image, video_bytes
from tests.engine.reference import assert_matches_reference, run_cases, video_cases

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def family(request, family_models):
    """(loaded model, reference model) of one Qwen family."""
    if request.param == "qwen2_vl":
        path, loaded = request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("loaded_fp32")
    else:
        path, loaded = family_models(request.param)
    return loaded, AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [16, 53, 4096])
def test_video_and_image_with_video_match_generate(family, budget):
    loaded_fp32, reference = family
    processor = loaded_fp32.processor
    # the family's own spec: Qwen3-VL's has frame timestamps
    spec = loaded_fp32.family.media_preparer(processor, reference.config, PreprocessConfig()).spec
    sampling = FrameSampling(fps=4.0, min_frames=4, max_frames=8)
    clip = prepare_video(
        decode_video(video_bytes(30, 10, 56, 84, seed=1), None, sampling, 2, 10**8), spec, 10**6
    )
    image = prepare_image(random_image(60, 90, 3), spec)
    # 3 s at 4 fps would be 12 frames, capped at 8 -> 4 temporal patches; 8 frames over 3 s -> 0.75 s each
    assert clip.grid_thw[0] == 4 and clip.seconds_per_grid_t == pytest.approx(0.75)
    cases = video_cases(reference, processor, clip, image, MAX_NEW_TOKENS)
    limits = EngineConfig(max_num_batched_tokens=budget)
    _, observed = run_cases(loaded_fp32, cases, limits, SamplingParams(MAX_NEW_TOKENS))
    for case in cases:
        assert_matches_reference(observed[case.tag], case)


def test_qwen2_5_video_positions_are_spaced_by_seconds(family_models):
    # Random tiny weights rarely change a greedy token for a small position shift, so check the positions.
    path, loaded = family_models("qwen2_5_vl")
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    sampling = FrameSampling(fps=4.0, min_frames=4, max_frames=8)
    clip = prepare_video(decode_video(video_bytes(30, 10, 56, 84), None, sampling, 2, 10**8), spec, 10**6)
    renderer = PromptRenderer(loaded.processor)
    ids = renderer.token_ids(renderer.render("What happens?", ["video"]), [clip])
    tensor_ids = torch.tensor([ids])
    token_types = (tensor_ids == loaded.adapter.placeholder_token_ids["video"]).long() * 2
    grid = torch.tensor([clip.grid_thw])

    def rope_index(seconds):
        positions, delta = reference.model.get_rope_index(
            tensor_ids, token_types, video_grid_thw=grid, second_per_grid_ts=torch.tensor([seconds])
        )
        return positions[:, 0], int(delta[0, 0])

    positions, delta = loaded.adapter.prompt_positions(ids, [clip])
    expected, expected_delta = rope_index(0.75)
    assert torch.equal(positions, expected) and delta == expected_delta
    assert not torch.equal(positions, rope_index(1.0)[0])  # one second per step would place it elsewhere
