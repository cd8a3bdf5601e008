"""Video decoding (PyAV) and frame sampling: which frames a clip contributes, decoded to RGB arrays.

For the Qwen-VL families, frames are sampled uniformly at `fps` frames per second of video, at least
`min_frames`, at most `max_frames`, and always a multiple of the vision tower's temporal patch (the rule of
the Qwen-VL video processors); other families give `decode_frames` their own rule. Only the chosen frames
are converted to arrays, so a long clip costs decode time, not memory.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from batchvl.errors import SampleError
from batchvl.inputs.paths import is_empty_file


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of a clip, padded to a multiple of the temporal patch, and where they came from."""

    frames: np.ndarray  # uint8 (T, H, W, 3)
    frame_indices: list[int]  # index in the clip of each of the T frames (a repeated frame repeats its index)
    native_fps: float  # the clip's own frame rate: frame i is at i / native_fps seconds
    sampled_fps: float  # frames sampled per second of video (qwen-vl-utils' rule: sampled / duration)


@dataclass(frozen=True)
class FrameSampling:
    fps: float
    min_frames: int
    max_frames: int


def num_sampled_frames(
    total_frames: int, native_fps: float, sampling: FrameSampling, temporal_patch: int
) -> int:
    """How many frames to sample from a clip (a multiple of `temporal_patch`, unless the clip is shorter)."""
    if total_frames < temporal_patch:
        return total_frames  # every frame; the last one is repeated to fill the temporal patch
    cap = math.floor(min(sampling.max_frames, total_frames) / temporal_patch) * temporal_patch
    wanted = total_frames / native_fps * sampling.fps
    wanted = min(max(wanted, sampling.min_frames), cap, total_frames)
    return max(temporal_patch, math.floor(wanted / temporal_patch) * temporal_patch)


def frame_indices(total_frames: int, num_frames: int) -> list[int]:
    """`num_frames` indices spread uniformly from the first frame on."""
    step = total_frames / num_frames
    return [int(i * step) for i in range(num_frames)]


def pad_to_temporal_patch(
    frames: np.ndarray, indices: list[int], temporal_patch: int
) -> tuple[np.ndarray, list[int]]:
    """Repeat the last frame until the count is a multiple of the temporal patch."""
    missing = -len(frames) % temporal_patch
    if missing:
        frames = np.concatenate([frames, np.repeat(frames[-1:], missing, axis=0)])
        indices = indices + [indices[-1]] * missing
    return frames, indices


class ClipFrames(NamedTuple):
    """Chosen frames of a clip, decoded, with what a family's sampling rule read of the clip."""

    frames: np.ndarray  # uint8 (N, H, W, 3)
    indices: list[int]  # each frame's index in the clip
    total_frames: int
    native_fps: float


def decode_video(
    data: bytes | None, path: str | None, sampling: FrameSampling, temporal_patch: int, max_frame_pixels: int
) -> DecodedVideo:
    """Decode the sampled frames of a clip: uint8 (T, H, W, 3), T a multiple of `temporal_patch`."""

    def qwen_indices(total: int, native_fps: float) -> list[int]:
        return frame_indices(total, num_sampled_frames(total, native_fps, sampling, temporal_patch))

    clip = decode_frames(data, path, qwen_indices, max_frame_pixels)
    padded, padded_indices = pad_to_temporal_patch(clip.frames, clip.indices, temporal_patch)
    sampled_fps = len(clip.frames) * clip.native_fps / clip.total_frames
    return DecodedVideo(padded, padded_indices, clip.native_fps, sampled_fps)


def decode_frames(
    data: bytes | None,
    path: str | None,
    choose: Callable[[int, float], list[int]],
    max_frame_pixels: int,
) -> ClipFrames:
    """Decode the frames `choose(total frames, frames per second)` names (ascending) of a clip, or raise a
    SampleError saying what is wrong with it."""
    try:
        import av
    except ImportError as exc:  # a core dependency, but a broken install should say what is missing
        raise SampleError("video_unsupported", "video decoding needs PyAV: pip install av") from exc

    if (data is not None and len(data) == 0) or (data is None and (path is None or is_empty_file(path))):
        raise SampleError("empty_video", f"video {'file ' + path if path else 'data'} is empty (0 bytes)")
    try:
        total, native_fps = _count_frames(data, path)
        if total == 0:
            raise SampleError("video_decode_error", "video has no decodable frames")
        wanted = choose(total, native_fps)
        frames, indices = [], []
        with av.open(io.BytesIO(data) if data is not None else path) as container:
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_frame_pixels:
                raise SampleError(
                    "video_too_large",
                    f"video frames are {width}x{height}, over preprocess.max_image_pixels={max_frame_pixels}",
                )
            targets = iter(wanted)
            target = next(targets)
            for index, frame in enumerate(container.decode(stream)):
                while target is not None and index == target:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    indices.append(index)
                    target = next(targets, None)
                if target is None:
                    break
        if not frames:
            raise SampleError("video_decode_error", "no frame of the video could be decoded")
        return ClipFrames(np.stack(frames), indices, total, native_fps)
    except SampleError:
        raise
    except FileNotFoundError as exc:
        raise SampleError("file_not_found", f"video file not found: {path}") from exc
    except (av.error.FFmpegError, IndexError, ValueError, OSError) as exc:
        raise SampleError("video_decode_error", f"cannot decode video: {exc}") from exc


def _count_frames(data: bytes | None, path: str | None) -> tuple[int, float]:
    """(number of frames, frames per second) from the container, or by decoding when it does not say."""
    import av

    with av.open(io.BytesIO(data) if data is not None else path) as container:
        if not container.streams.video:
            raise SampleError("video_decode_error", "file has no video stream")
        stream = container.streams.video[0]
        native_fps = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
        if stream.frames > 0:
            return stream.frames, native_fps
        return sum(1 for _ in container.decode(stream)), native_fps
