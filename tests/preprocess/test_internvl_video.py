"""InternVL's video preprocessing against transformers' InternVL video processor and processor: the frames
it samples, the prompt it writes for them, and each frame's pixels as its image processor makes a tile.

The video processor's module imports torchvision, which is not installed everywhere: its `sample_frames` is
compiled here from transformers' own source, without the module's imports."""

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.video_utils import VideoMetadata

from batchvl.inputs.types import MediaRef
from batchvl.preprocess.internvl_video import sampled_frame_indices, video_placeholder
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.video import FrameSampling, decode_frames
from tests.conftest import processor_and_preparer, tower_pixels, video_bytes


def transformers_sample_frames():
    """`InternVLVideoProcessor.sample_frames` from transformers' source, as a plain function."""
    path = Path(inspect.getfile(transformers)).parent / "models" / "internvl" / "video_processing_internvl.py"
    tree = ast.parse(path.read_text())
    owner = next(node for node in tree.body if getattr(node, "name", None) == "InternVLVideoProcessor")
    method = next(node for node in owner.body if getattr(node, "name", None) == "sample_frames")
    namespace = {"torch": torch, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module([method], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["sample_frames"]


@pytest.mark.parametrize(
    "total,native_fps,sampling",
    [
        (300, 30.0, FrameSampling(fps=2.0, min_frames=4, max_frames=64)),  # 10 s at 2 fps: 20 frames
        (3000, 30.0, FrameSampling(fps=2.0, min_frames=4, max_frames=64)),  # 100 s: capped at 64
        (25, 10.0, FrameSampling(fps=2.0, min_frames=4, max_frames=64)),  # 2.5 s: 5 at 2 fps
        (12, 10.0, FrameSampling(fps=2.0, min_frames=4, max_frames=64)),  # 1.2 s: 2, raised to the fewest
        (3, 30.0, FrameSampling(fps=2.0, min_frames=4, max_frames=64)),  # 3 frames: all of them
        (1001, 29.97, FrameSampling(fps=1.0, min_frames=1, max_frames=7)),  # an NTSC rate, uneven steps
    ],
)
def test_frames_are_the_video_processors(total, native_fps, sampling):
    sample_frames = transformers_sample_frames()
    processor = type("Processor", (), {"num_frames": None, "initial_shift": True})()
    metadata = VideoMetadata(total_num_frames=total, fps=native_fps, duration=total / native_fps)
    by_rate = int(total / native_fps * sampling.fps)
    if sampling.min_frames <= by_rate <= min(sampling.max_frames, total):
        expected = sample_frames(processor, metadata, fps=sampling.fps)  # the processor's rate rule itself
    else:
        count = min(max(by_rate, sampling.min_frames), sampling.max_frames, total)
        expected = sample_frames(processor, metadata, num_frames=count)
    assert sampled_frame_indices(total, native_fps, sampling) == expected.tolist()


@pytest.fixture(scope="module")
def internvl(family_models):
    return processor_and_preparer(family_models, "internvl")


@pytest.mark.parametrize("frames", [1, 3, 8])
def test_prompt_is_the_processors(internvl, frames):
    processor, preparer = internvl
    video_inputs = {"pixel_values_videos": [np.zeros((frames, 3, 4, 4))]}
    expected = InternVLProcessor.replace_video_token(processor, video_inputs, 0)
    assert video_placeholder(preparer.spec, frames) == expected


def test_a_clip_is_its_frames_as_tiles(internvl):
    processor, preparer = internvl
    preparer = dataclasses.replace(preparer, sampling=FrameSampling(fps=2.0, min_frames=1, max_frames=64))
    data = video_bytes(25, 10, 60, 100, seed=2)  # 2.5 s: 5 frames at 2 fps
    clip = preparer(MediaRef(data, None, "video"))
    indices = sampled_frame_indices(25, 10.0, preparer.sampling)
    assert indices == [2, 7, 12, 17, 22]  # the middle of each fifth
    frames = decode_frames(data, None, lambda total, fps: indices, 10**8).frames
    image_processor = processor.image_processor
    reference = GotOcr2ImageProcessorPil(
        size=image_processor.size, image_mean=image_processor.image_mean, image_std=image_processor.image_std
    )  # one tile a frame: the processor's call without crop_to_patches
    expected = reference([Image.fromarray(f) for f in frames], return_tensors="np")["pixel_values"]
    assert clip.kind == "video" and clip.grid_thw[0] == 5
    assert clip.num_tokens == 5 * processor.image_seq_length
    np.testing.assert_allclose(tower_pixels(clip), expected, atol=1e-6)

    renderer = PromptRenderer(processor)
    rendered = renderer.render("What happens?", ["video"])
    assert "<video>\nWhat happens?" in rendered
    ids = renderer.token_ids(rendered, [clip])
    assert ids.count(processor.image_token_id) == clip.num_tokens
    assert "Frame5: <img>" in processor.tokenizer.decode(ids)
