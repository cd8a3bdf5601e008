"""Qwen-VL image and video preprocessing without transformers or torchvision: resize, then patchify.

It reproduces the model's own image processor (checked by a parity test against it) with numpy and
Pillow only, so it runs in worker processes that never import torch models, and on machines where
torchvision is missing; up to the normalization, which the vision call makes on the tower's device
(`pixel_normalization.py`): a still image's patch rows hold its one frame, repeated there into the
temporal patch (the model's processor repeats the frame first). Everything it needs from the processor
is copied into a small, picklable spec.
Qwen2-VL, Qwen2.5-VL and Qwen3-VL share it; they differ in the spec's numbers (patch 14 or 16, the
normalization) and in how a video appears in the prompt (Qwen3-VL puts a timestamp before each frame).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from batchvl.config import PreprocessConfig
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.image import channels_first, check_aspect_ratio, decode_image
from batchvl.preprocess.media import PreparedMedia, prepared_media
from batchvl.preprocess.pixel_normalization import PixelNormalization, image_processor_pixels
from batchvl.preprocess.video import DecodedVideo, FrameSampling, decode_video


@dataclass(frozen=True)
class QwenVisionSpec:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    resample: int  # a PIL resampling filter
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"
    # Qwen3-VL: each temporal step of a video is "<t seconds><|vision_start|>pads<|vision_end|>"
    video_timestamps: bool = False
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged patch."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_image_processor(
        cls,
        image_processor,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_timestamps: bool = False,
    ) -> QwenVisionSpec:
        size = image_processor.size
        # transformers 5 keeps pixel COUNTS in shortest_edge / longest_edge; older ones used min/max_pixels.
        own_min = size.get("shortest_edge") or size.get("min_pixels") or image_processor.min_pixels
        own_max = size.get("longest_edge") or size.get("max_pixels") or image_processor.max_pixels
        return cls(
            patch_size=int(image_processor.patch_size),
            temporal_patch_size=int(image_processor.temporal_patch_size),
            merge_size=int(image_processor.merge_size),
            min_pixels=int(min_pixels if min_pixels is not None else own_min),
            max_pixels=int(max_pixels if max_pixels is not None else own_max),
            **image_processor_pixels(image_processor),
            video_timestamps=video_timestamps,
        )

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def video_placeholder(self, grid_thw: tuple[int, int, int], video: DecodedVideo) -> str:
        """What a video's placeholder token becomes in the prompt."""
        num_tokens = self.num_image_tokens(grid_thw)
        if not self.video_timestamps:
            return self.video_token * num_tokens
        # The time of a temporal step is the mean of its first and last frame (the Qwen3-VL processor's rule).
        tp = self.temporal_patch_size
        seconds = [index / video.native_fps for index in video.frame_indices]
        per_frame = num_tokens // grid_thw[0]
        return "".join(
            f"<{(seconds[i] + seconds[i + tp - 1]) / 2:.1f} seconds>"
            f"{self.vision_start}{self.video_token * per_frame}{self.vision_end}"
            for i in range(0, len(seconds), tp)
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of `factor`, with a pixel count within [min_pixels, max_pixels],
    keeping the aspect ratio as closely as possible (the Qwen-VL rule)."""
    check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(
    frames: np.ndarray, spec: QwenVisionSpec, temporal: int | None = None
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(T, C, H, W) with T a multiple of `temporal` (default: the temporal patch) -> (t*h*w, C*tp*p*p) rows
    in the order the vision tower expects: merge windows contiguous, so merged tokens follow row-major
    order."""
    num_frames, channels, height, width = frames.shape
    p, m = spec.patch_size, spec.merge_size
    tp = spec.temporal_patch_size if temporal is None else temporal
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    patches = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return np.ascontiguousarray(rows), (grid_t, grid_h, grid_w)


def prepare_image(image: Image.Image, spec: QwenVisionSpec) -> PreparedMedia:
    """An RGB PIL image -> the model's pixel_values rows, grid and content hash."""
    height, width = smart_resize(image.height, image.width, spec.factor, spec.min_pixels, spec.max_pixels)
    resized = image.resize((width, height), resample=spec.resample)
    frame = channels_first(np.asarray(resized))[None]
    pixel_values, grid = patchify(frame, spec, temporal=1)
    # A still image is its own temporal neighbour: its rows repeat the frame to fill the temporal patch.
    normalization = PixelNormalization.of(spec, repeat=spec.temporal_patch_size)
    num_tokens = spec.num_image_tokens(grid)
    return prepared_media(pixel_values, grid, num_tokens, spec.image_token * num_tokens, normalization)


def video_frame_max_pixels(spec: QwenVisionSpec, video_max_pixels: int, num_frames: int) -> int:
    """Per-frame pixel cap: an even share of the clip's budget (per temporal patch), never below the
    image minimum (x1.05) nor above the image maximum (the qwen-vl-utils rule)."""
    share = video_max_pixels * spec.temporal_patch_size // num_frames
    return max(min(spec.max_pixels, share), int(spec.min_pixels * 1.05))


def prepare_video(video: DecodedVideo, spec: QwenVisionSpec, video_max_pixels: int) -> PreparedMedia:
    """Sampled frames (T a multiple of the temporal patch) -> pixel_values rows, grid and placeholder."""
    frames = video.frames
    num_frames, height, width, _ = frames.shape
    max_pixels = video_frame_max_pixels(spec, video_max_pixels, num_frames)
    new_height, new_width = smart_resize(height, width, spec.factor, spec.min_pixels, max_pixels)
    resized = np.stack(
        [
            np.asarray(Image.fromarray(f).resize((new_width, new_height), resample=spec.resample))
            for f in frames
        ]
    )
    pixel_values, grid = patchify(channels_first(resized), spec)
    return prepared_media(
        pixel_values,
        grid,
        spec.num_image_tokens(grid),
        spec.video_placeholder(grid, video),
        PixelNormalization.of(spec),
        kind="video",
        seconds_per_grid_t=spec.temporal_patch_size / video.sampled_fps,
    )


@dataclass(frozen=True)
class QwenMediaPreparer:
    """MediaRef -> PreparedMedia for the Qwen-VL families; picklable, so it can run in worker processes."""

    spec: QwenVisionSpec
    frames: FrameSampling
    video_max_pixels: int
    max_image_pixels: int

    @classmethod
    def from_config(
        cls, processor, model_config, pre: PreprocessConfig, video_timestamps: bool = False
    ) -> QwenMediaPreparer:
        spec = QwenVisionSpec.from_image_processor(
            processor.image_processor, pre.min_pixels, pre.max_pixels, video_timestamps
        )
        return cls(
            spec,
            FrameSampling(pre.video_fps, pre.video_min_frames, pre.video_max_frames),
            pre.video_max_pixels,
            pre.max_image_pixels,
        )

    def __call__(self, ref: MediaRef) -> PreparedMedia:
        if ref.kind == "video":
            clip = decode_video(
                ref.data, ref.path, self.frames, self.spec.temporal_patch_size, self.max_image_pixels
            )
            return prepare_video(clip, self.spec, self.video_max_pixels)
        return prepare_image(decode_image(ref.data, ref.path, self.max_image_pixels), self.spec)
