"""SmolVLM2's and InternVL's video through the engine equals transformers `generate` fed the same frames
(fp32, greedy): a video, and an image with a video after it, whose frames fill image tokens after the
image's tiles; prefill chunks cut inside frames. (Their video processors need torchvision: the frames are
batchvl's, whose sampling, pixels and prompt tests/preprocess checks against the processors.)"""

import dataclasses

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig, PreprocessConfig
from batchvl.engine.sampling.params import SamplingParams
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.smolvlm_video import VideoSampling
from batchvl.preprocess.video import FrameSampling
from tests.conftest import png_bytes, random_image, video_bytes
from tests.engine.reference import assert_matches_reference, run_cases, video_cases

MAX_NEW_TOKENS = 8
# three frames of the 3 s clip, each family by its own rule
SAMPLING = {
    "smolvlm": VideoSampling(fps=4, max_frames=3, longest_edge=200),
    "internvl": FrameSampling(fps=4, min_frames=1, max_frames=3),
}


@pytest.mark.parametrize("budget", [7, 53, 4096])
@pytest.mark.parametrize("family", sorted(SAMPLING))
def test_video_and_image_with_video_match_generate(family_models, family, budget):
    path, loaded = family_models(family)
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    preparer = loaded.family.media_preparer(loaded.processor, reference.config, PreprocessConfig())
    preparer = dataclasses.replace(preparer, sampling=SAMPLING[family])
    clip = preparer(MediaRef(video_bytes(30, 10, 56, 84, seed=1), None, "video"))
    image = preparer(MediaRef(png_bytes(random_image(200, 150, 3)), None, "image"))
    assert clip.grid_thw[0] == 3 and image.grid_thw[0] > 1  # three frames; tiles and a global view
    cases = video_cases(reference, loaded.processor, clip, image, MAX_NEW_TOKENS)
    limits = EngineConfig(max_num_batched_tokens=budget)
    _, observed = run_cases(loaded, cases, limits, SamplingParams(MAX_NEW_TOKENS))
    for case in cases:
        assert_matches_reference(observed[case.tag], case)
