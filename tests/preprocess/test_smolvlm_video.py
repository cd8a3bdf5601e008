"""SmolVLM2's video preprocessing against transformers' SmolVLM video processor and processor: the frames it
samples, the prompt it writes for them, and each frame's pixels as its image processor makes a frame that
is not split (the video processor itself needs torchvision)."""

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor
from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
from transformers.video_utils import VideoMetadata

from batchvl.inputs.types import MediaRef
from batchvl.models.processor import SmolVLMImageProcessorPil
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.smolvlm_video import VideoSampling, sampled_frame_indices, video_placeholder
from batchvl.preprocess.video import decode_frames
from tests.conftest import processor_and_preparer, tower_pixels, video_bytes


@pytest.mark.parametrize(
    "total,native_fps,fps,max_frames",
    [
        (300, 30.0, 1, 64),  # 10 s at 1 fps: 10 frames from the first to the last
        (3000, 30.0, 1, 64),  # 100 s: capped at 64, one second skipped at each end
        (3000, 30.0, 0.5, 8),  # the skip decided by the most frames, not the frames wanted
        (12, 10.0, 1, 64),  # 1.2 s: one frame
        (4, 25.0, 1, 64),  # 0.16 s: rounds to none, still one
        (30, 10.0, 4, 8),  # 3 s at 4 fps: 12, capped at 8
        (25, 10.0, 2, 64),  # 2.5 s at 2 fps: round(5.0) = 5
        (70, 2.0, 3, 100),  # more frames wanted than there are: repeats dropped
    ],
)
def test_frames_are_the_video_processors(total, native_fps, fps, max_frames):
    metadata = VideoMetadata(total_num_frames=total, fps=native_fps, duration=total / native_fps)
    expected = SmolVLMVideoProcessor.sample_frames(
        SimpleNamespace(num_frames=max_frames, fps=fps), metadata, num_frames=max_frames, fps=fps
    )
    sampling = VideoSampling(fps=fps, max_frames=max_frames, longest_edge=512)
    assert sampled_frame_indices(total, native_fps, sampling) == expected.tolist()


@pytest.fixture(scope="module")
def smolvlm(family_models):
    return processor_and_preparer(family_models, "smolvlm")


@pytest.mark.parametrize("total,native_fps", [(300, 30.0), (4000, 25.0), (12, 10.0)])
def test_prompt_is_the_processors(smolvlm, total, native_fps):
    processor, preparer = smolvlm
    indices = sampled_frame_indices(total, native_fps, preparer.sampling)
    metadata = VideoMetadata(
        total_num_frames=total, fps=native_fps, duration=total / native_fps, frames_indices=indices
    )
    video_inputs = {"pixel_values": np.zeros((1, len(indices))), "video_metadata": [metadata]}
    expected = SmolVLMProcessor.replace_video_token(processor, video_inputs, 0)
    seconds = [index / native_fps for index in indices]
    assert video_placeholder(preparer.spec, seconds, total / native_fps) == expected
    assert "sixty-four frames from a 0:02:40 [H:MM:SS]" in expected or total != 4000


def test_a_clip_is_its_frames_global_views(smolvlm):
    processor, preparer = smolvlm
    data = video_bytes(25, 10, 60, 100, seed=2)  # 2.5 s: 2 frames at 1 fps (round(2.5) = 2)
    clip = preparer(MediaRef(data, None, "video"))
    indices = sampled_frame_indices(25, 10.0, preparer.sampling)
    assert indices == [0, 24]
    frames = decode_frames(data, None, lambda total, fps: indices, 10**8).frames
    # the image processor's path for a frame that is not split: longest edge to the video size, then one tile
    reference = SmolVLMImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": preparer.sampling.longest_edge},
        max_image_size={"longest_edge": preparer.spec.tile},
    )
    expected = reference([[Image.fromarray(f) for f in frames]], return_tensors="np")["pixel_values"][0]
    assert clip.kind == "video" and clip.grid_thw[0] == 2
    assert clip.num_tokens == 2 * processor.image_seq_len
    np.testing.assert_allclose(tower_pixels(clip), expected, atol=1e-6)

    renderer = PromptRenderer(processor)
    rendered = renderer.render("What happens?", ["video"])
    assert "User: <video>What happens?" in rendered  # the template's space before a video
    ids = renderer.token_ids(rendered, [clip])
    assert ids.count(processor.image_token_id) == clip.num_tokens
    text = processor.tokenizer.decode(ids)
    assert "two frames from a 0:00:02 [H:MM:SS] video" in text
    assert "Frame from 00:00:" in text and "Frame from 00:02:" in text
