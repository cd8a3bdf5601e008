"""Prepared media cross from a preprocessing worker to the job process with their pixels in shared memory."""

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from batchvl.preprocess.media import PixelsInDtype, PreparedMedia


def media() -> PreparedMedia:
    pixels = np.random.default_rng(0).standard_normal((1000, 1176), dtype=np.float32)
    return PreparedMedia(pixels, (1, 20, 50), "hash", 250, "<image>", seconds_per_grid_t=0.5)


def test_the_pixels_go_through_shared_memory_not_the_pipe():
    sent = media()
    data = ForkingPickler.dumps(sent)  # what a worker's queue writes
    assert len(data) < 10_000 < sent.pixel_values.nbytes  # a handle to the pages, not the 4.7 MB
    received = pickle.loads(data)
    assert np.array_equal(received.pixel_values, sent.pixel_values)
    assert received.pixel_values.dtype == np.float32
    assert (received.grid_thw, received.content_hash, received.num_tokens, received.placeholder) == (
        sent.grid_thw,
        sent.content_hash,
        sent.num_tokens,
        sent.placeholder,
    )
    assert (received.kind, received.seconds_per_grid_t) == (sent.kind, sent.seconds_per_grid_t)


def test_a_plain_pickle_still_round_trips():
    sent = media()
    received = pickle.loads(pickle.dumps(sent))
    assert np.array_equal(received.pixel_values, sent.pixel_values)
    assert received.grid_thw == sent.grid_thw


def test_pixels_moved_to_shared_memory_in_the_worker_are_sent_as_they_are():
    """Moved by the worker itself (where a full /dev/shm is its sample's error row), not again by the
    pickler: the tensor's pages stay where the move put them."""
    sent = media().in_shared_memory()
    pages = sent.shared_pixels.untyped_storage().data_ptr()
    assert sent.shared_pixels.is_shared() and sent.pixel_values.ctypes.data == pages
    received = pickle.loads(ForkingPickler.dumps(sent))
    assert sent.shared_pixels.untyped_storage().data_ptr() == pages
    assert np.array_equal(received.pixel_values, media().pixel_values) and received.shared_pixels is None
    assert received.grid_thw == sent.grid_thw and received.content_hash == sent.content_hash


def test_pixels_cast_to_the_towers_bfloat16_in_the_worker_cross_as_bfloat16():
    """Cast as the engine would cast them (the same rounding), a bfloat16 tensor (numpy has no bfloat16)
    crosses in shared memory at half the bytes, its content hash that of the prepared float32 pixels."""
    prepared = media()
    cast = prepared.in_dtype(torch.bfloat16)
    expected = torch.from_numpy(prepared.pixel_values).to(torch.bfloat16)
    assert isinstance(cast.pixel_values, torch.Tensor) and torch.equal(cast.pixel_values, expected)
    assert cast.content_hash == prepared.content_hash
    sent = cast.in_shared_memory()
    assert sent.shared_pixels.is_shared() and sent.pixel_values.data_ptr() == sent.shared_pixels.data_ptr()
    data = ForkingPickler.dumps(sent)
    assert len(data) < 10_000
    received = pickle.loads(data)
    assert received.pixel_values.dtype == torch.bfloat16 and torch.equal(received.pixel_values, expected)
    assert received.pixel_values.nbytes == prepared.pixel_values.nbytes // 2


def test_pixels_the_tower_takes_as_they_are_are_not_cast():
    prepared = media()
    assert prepared.in_dtype(torch.float32) is prepared  # a float32 tower: nothing to do
    frames = PreparedMedia(np.zeros((1, 3, 8, 8), dtype=np.uint8), (1, 1, 1), "h", 1, "<image>")
    assert frames.in_dtype(torch.bfloat16) is frames  # not floating point: the tower's own to convert


def test_a_preparation_in_a_dtype_casts_prepared_media_and_passes_the_rest():
    prepare = PixelsInDtype(lambda ref: media() if ref == "image" else ref, torch.bfloat16)
    assert prepare("image").pixel_values.dtype == torch.bfloat16
    assert prepare("https://example.com/a.jpg") == "https://example.com/a.jpg"  # a media URL for a server
    assert pickle.loads(pickle.dumps(PixelsInDtype(np.asarray, torch.float16))).dtype == torch.float16
