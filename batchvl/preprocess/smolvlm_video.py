"""SmolVLM2's video preprocessing without transformers or torchvision: the frames, their pixels, prompt.

The rules of SmolVLM's video processor and processor, with the checkpoint's `video_sampling` (frames per
second, most frames, the longest edge of a frame):
- frames: `round(fps x duration)` of them (at most the most, at least one), spread evenly (numpy's
  linspace, truncated, repeats dropped) from the first frame to the last, or from one second in to one
  second before the end when the clip is longer than the frames' span plus those two seconds;
- pixels: each frame's longest edge resized to the video size (aspect kept, as an image's first resize),
  then the frame squashed to one tile: a video is its frames' global views, never split into tiles;
- prompt: "You are provided the following series of {count in words} frames from a {H:MM:SS} [H:MM:SS]
  video.\n", then "\nFrame from MM:SS:" and the frame's global-view placeholder for each frame, then
  "\n\n". A frame's time and the clip's duration are whole seconds, truncated.

Resizes are Pillow's with the image processor's filter, as for images; the processor's own video path
resizes with torchvision, which can round some pixels one level differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
from num2words import num2words
from PIL import Image

from batchvl.config import PreprocessConfig
from batchvl.preprocess.frames_preparer import FramesPreparer
from batchvl.preprocess.image import square_tiles_media
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.tiled_vision import TiledVisionSpec, longest_edge_size, prepare_tiled_image
from batchvl.preprocess.video import ClipFrames

SKIP_SECONDS = 1  # left out at each end of a long clip


@dataclass(frozen=True)
class VideoSampling:
    fps: float
    max_frames: int
    longest_edge: int  # a frame's longest edge before it is squashed to one tile

    @classmethod
    def from_image_processor(cls, image_processor, tile: int) -> VideoSampling:
        """The checkpoint's `video_sampling` (kept by the image processor from its saved settings), or the
        video processor's defaults: 1 frame a second, at most 64, frames at the tile's size."""
        saved = getattr(image_processor, "video_sampling", None) or {}
        size = saved.get("video_size") or {}
        return cls(
            fps=float(saved.get("fps", 1)),
            max_frames=int(saved.get("max_frames", 64)),
            longest_edge=int(size.get("longest_edge", tile)),
        )


def sampled_frame_indices(total_frames: int, native_fps: float, sampling: VideoSampling) -> list[int]:
    duration = total_frames / native_fps
    wanted = max(1, min(int(round(sampling.fps * duration)), sampling.max_frames))
    start, end = 0, total_frames - 1
    # the processor compares with the most frames, not the frames wanted
    if duration - 2 * SKIP_SECONDS > sampling.max_frames * sampling.fps:
        start = int(SKIP_SECONDS * native_fps)
        end = min(int(total_frames - SKIP_SECONDS * native_fps), total_frames - 1)
    if start >= end:
        start, end = 0, total_frames - 1
    return np.unique(np.linspace(start, end, wanted, dtype=int)).tolist()


def video_placeholder(spec: TiledVisionSpec, seconds: list[float], duration: float) -> str:
    """What a video's placeholder token becomes in the prompt (SmolVLM's processor's text)."""
    length = timedelta(seconds=int(duration))
    text = (
        f"You are provided the following series of {num2words(len(seconds))} frames "
        f"from a {length} [H:MM:SS] video.\n"
    )
    for second in seconds:
        text += f"\nFrame from {int(second // 60):02d}:{int(second % 60):02d}:" + spec.placeholder(0, 0)
    return text + "\n\n"


def prepare_video(clip: ClipFrames, spec: TiledVisionSpec, sampling: VideoSampling) -> PreparedMedia:
    frames = []
    for pixels in clip.frames:
        frame = Image.fromarray(pixels)
        height, width = longest_edge_size(frame.height, frame.width, sampling.longest_edge)
        frame = frame.resize((width, height), resample=spec.resample)
        frames.append(np.asarray(frame.resize((spec.tile, spec.tile), resample=spec.resample)))
    seconds = [index / clip.native_fps for index in clip.indices]
    placeholder = video_placeholder(spec, seconds, clip.total_frames / clip.native_fps)
    return square_tiles_media(frames, spec, spec.image_seq_len, placeholder, kind="video")


@dataclass(frozen=True)
class SmolVLMMediaPreparer(FramesPreparer):
    """Images as Idefics3's tiles, videos as above."""

    spec: TiledVisionSpec
    sampling: VideoSampling

    def choose_frames(self, total_frames: int, native_fps: float) -> list[int]:
        return sampled_frame_indices(total_frames, native_fps, self.sampling)

    def prepare_frames(self, clip: ClipFrames) -> PreparedMedia:
        return prepare_video(clip, self.spec, self.sampling)

    def prepare_image(self, image: Image.Image) -> PreparedMedia:
        return prepare_tiled_image(image, self.spec)


def smolvlm_media_preparer(processor, model_config, pre: PreprocessConfig) -> SmolVLMMediaPreparer:
    spec = TiledVisionSpec.from_processor(processor, int(model_config.vision_config.patch_size))
    sampling = VideoSampling.from_image_processor(processor.image_processor, spec.tile)
    return SmolVLMMediaPreparer(max_image_pixels=pre.max_image_pixels, spec=spec, sampling=sampling)
