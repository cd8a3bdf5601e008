"""Prepared media cross from a preprocessing worker to the job process with their pixels in shared memory."""

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np

from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.pixel_normalization import PixelNormalization


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


def test_8_bit_pixels_cross_as_they_are_with_their_normalization():
    """A worker's 8-bit pixels cross in shared memory as 8-bit values, and the normalization that makes
    the tower's input of them comes with them."""
    rows = np.random.default_rng(1).integers(0, 256, (1000, 588), dtype=np.uint8)
    normalization = PixelNormalization(1 / 255, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), repeat=2)
    prepared = PreparedMedia(rows, (1, 20, 50), "hash", 250, "<image>", normalization=normalization)
    sent = prepared.in_shared_memory()
    data = ForkingPickler.dumps(sent)
    assert len(data) < 10_000
    received = pickle.loads(data)
    assert received.pixel_values.dtype == np.uint8 and np.array_equal(received.pixel_values, rows)
    assert received.normalization == normalization
