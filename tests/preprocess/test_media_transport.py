"""Prepared media cross from a preprocessing worker to the job process with their pixels in shared memory."""

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np

from batchvl.preprocess.media import PreparedMedia


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
