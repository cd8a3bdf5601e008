"""InternVL's video preprocessing without transformers or torchvision: the frames, their pixels, prompt.

InternVL's video processor samples only the frames it is asked for (a count, or a rate); batchvl asks for
`preprocess.video_fps` frames a second, at least `video_min_frames` and at most `video_max_frames` (never
more than the clip has), and picks them as the processor's `sample_frames` does: evenly spaced, each from
the middle of its share of the clip. Each frame is resized to one tile (the image processor's filter, as
for an image's thumbnail: Pillow here, torchvision in the video processor, whose resize can round some
pixels one level differently); the prompt is `Frame1: <img>...</img>`, `Frame2: ...`, one line a frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from batchvl.config import PreprocessConfig
from batchvl.preprocess.frames_preparer import FramesPreparer
from batchvl.preprocess.image import square_tiles_media
from batchvl.preprocess.internvl_tiles import InternVLTileSpec, internvl_tile_spec, prepare_internvl_image
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.video import ClipFrames, FrameSampling


def sampled_frame_indices(total_frames: int, native_fps: float, sampling: FrameSampling) -> list[int]:
    wanted = int(total_frames / native_fps * sampling.fps)
    count = min(max(wanted, sampling.min_frames), sampling.max_frames, total_frames)
    step = total_frames / count
    # the processor's own arithmetic (torch's float32 steps, truncated), so that its picks are these
    return torch.arange(step / 2, total_frames, step).int().tolist()


def video_placeholder(spec: InternVLTileSpec, frames: int) -> str:
    """What a video's placeholder token becomes in the prompt (the InternVL processor's text)."""
    return "\n".join(f"Frame{i + 1}: {spec.placeholder(1)}" for i in range(frames))


def prepare_video(clip: ClipFrames, spec: InternVLTileSpec) -> PreparedMedia:
    side = spec.tile
    frames = [
        np.asarray(Image.fromarray(pixels).resize((side, side), resample=spec.resample))
        for pixels in clip.frames
    ]
    placeholder = video_placeholder(spec, len(frames))
    return square_tiles_media(frames, spec, spec.image_seq_length, placeholder, kind="video")


@dataclass(frozen=True)
class InternVLMediaPreparer(FramesPreparer):
    """Images as tiles, videos as above."""

    spec: InternVLTileSpec
    sampling: FrameSampling

    def choose_frames(self, total_frames: int, native_fps: float) -> list[int]:
        return sampled_frame_indices(total_frames, native_fps, self.sampling)

    def prepare_frames(self, clip: ClipFrames) -> PreparedMedia:
        return prepare_video(clip, self.spec)

    def prepare_image(self, image: Image.Image) -> PreparedMedia:
        return prepare_internvl_image(image, self.spec)


def internvl_media_preparer(processor, model_config, pre: PreprocessConfig) -> InternVLMediaPreparer:
    sampling = FrameSampling(pre.video_fps, pre.video_min_frames, pre.video_max_frames)
    spec = internvl_tile_spec(processor, model_config)
    return InternVLMediaPreparer(max_image_pixels=pre.max_image_pixels, spec=spec, sampling=sampling)
