"""Video: frame sampling and grid arithmetic against the Qwen-VL formulas, decoding real mp4 clips."""

from dataclasses import replace

import numpy as np
import pytest

from batchvl.errors import SampleError
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_video, video_frame_max_pixels
from batchvl.preprocess.video import (
    DecodedVideo,
    FrameSampling,
    decode_video,
    frame_indices,
    num_sampled_frames,
)
from tests.conftest import video_bytes

SAMPLING = FrameSampling(fps=2.0, min_frames=4, max_frames=64)
SPEC = QwenVisionSpec(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=3136,
    max_pixels=50176,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    rescale_factor=1 / 255,
    resample=3,
)


@pytest.mark.parametrize(
    "total,fps,expected",
    [
        (300, 30.0, 20),  # 10 s at 2 fps
        (2500, 25.0, 64),  # 100 s would be 200 frames: capped by max_frames
        (3, 30.0, 2),  # 0.1 s: min_frames 4 asked, but only 3 frames -> the largest even count
        (7, 1.0, 6),  # 7 s would be 14 frames: at most all 7, rounded down to even
        (21, 10.0, 4),  # 2.1 s -> 4.2 -> 4
        (1, 30.0, 1),  # a single frame: kept, repeated later to fill the temporal patch
    ],
)
def test_number_of_sampled_frames(total, fps, expected):
    assert num_sampled_frames(total, fps, SAMPLING, temporal_patch=2) == expected


def test_frame_indices_are_uniform_from_the_start():
    assert frame_indices(300, 20) == list(range(0, 300, 15))
    assert frame_indices(7, 6) == [0, 1, 2, 3, 4, 5]
    assert frame_indices(10, 4) == [0, 2, 5, 7]


def test_per_frame_budget_and_grid():
    # 200k pixels over 8 frames: 50k per frame per temporal patch of 2 -> share 50000, under max 50176
    assert video_frame_max_pixels(SPEC, 200_000, 8) == 50_000
    # a tiny budget is floored at 1.05 x min_pixels
    assert video_frame_max_pixels(SPEC, 1000, 8) == 3292
    frames = np.zeros((8, 224, 320, 3), dtype=np.uint8)
    video = prepare_video(DecodedVideo(frames, list(range(8)), 4.0, 4.0), SPEC, 200_000)
    # smart_resize(224, 320, max 50000): beta = sqrt(71680 / 50000); 224/beta/28 -> 6, 320/beta/28 -> 9
    assert video.grid_thw == (4, 12, 18) and video.kind == "video"
    assert video.pixel_values.shape == (4 * 12 * 18, 3 * 2 * 14 * 14)
    assert video.num_tokens == 4 * 12 * 18 // 4 and video.placeholder == "<|video_pad|>" * video.num_tokens
    assert video.seconds_per_grid_t == 0.5  # 2 frames per temporal step, sampled at 4 per second


def test_decoded_frames_are_the_sampled_ones():
    clip = video_bytes(num_frames=20, fps=10)
    video = decode_video(clip, None, SAMPLING, temporal_patch=2, max_frame_pixels=10**8)
    frames = video.frames
    assert video.frame_indices == [0, 5, 10, 15] and video.native_fps == 10 and video.sampled_fps == 2
    assert frames.shape == (4, 64, 96, 3) and frames.dtype == np.uint8
    # 2 s at 2 fps = 4 frames: indices 0, 5, 10, 15, whose brightness is about 8 x index
    np.testing.assert_allclose([f.mean() for f in frames], [0, 40, 80, 120], atol=3)


def test_short_clip_is_padded_to_the_temporal_patch():
    video = decode_video(video_bytes(num_frames=1, fps=10), None, SAMPLING, 2, 10**8)
    frames = video.frames
    assert video.frame_indices == [0, 0]
    assert frames.shape[0] == 2 and np.array_equal(frames[0], frames[1])


@pytest.mark.parametrize(
    "data,error_type",
    [(b"", "empty_video"), (b"\x00\x01garbage" * 200, "video_decode_error")],
)
def test_broken_videos_are_sample_errors(data, error_type):
    with pytest.raises(SampleError) as info:
        decode_video(data, None, SAMPLING, 2, 10**8)
    assert info.value.error_type == error_type


def test_oversized_frames_are_refused():
    with pytest.raises(SampleError) as info:
        decode_video(video_bytes(4, 10), None, SAMPLING, 2, max_frame_pixels=1000)
    assert info.value.error_type == "video_too_large"


def test_qwen3_video_placeholder_has_a_timestamp_per_temporal_step():
    spec = replace(SPEC, video_timestamps=True)
    frames = np.zeros((4, 56, 56, 3), dtype=np.uint8)
    # frames 0, 5, 10, 15 of a 10 fps clip: 0.0 s, 0.5 s, 1.0 s, 1.5 s; a step's time is its frames' mean
    video = prepare_video(DecodedVideo(frames, [0, 5, 10, 15], 10.0, 2.0), spec, 10**6)
    assert video.grid_thw == (2, 4, 4)
    frame = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    assert video.placeholder == f"<0.2 seconds>{frame}<1.2 seconds>{frame}"
