"""The content hash of preprocessed media: the key under which encoded images are cached, in memory and on
disk across runs, so its value for given pixels must not drift between releases."""

import numpy as np

from batchvl.preprocess.media import content_hash


def pixels() -> np.ndarray:
    return np.arange(24, dtype=np.float32).reshape(4, 6) / 7


def test_the_key_of_given_pixels_is_the_one_stored_embeddings_were_saved_under():
    # xxh3-128 of b"image", the float32 pixels' bytes in row-major order, then the grid as int64
    assert content_hash(pixels(), (1, 2, 2)) == "3e07bd67ce820cbccaf1784b5e9a8e0f"


def test_a_strided_view_hashes_as_its_contiguous_copy_and_kind_and_grid_count():
    view = np.asfortranarray(pixels())
    assert not view.flags.c_contiguous
    assert content_hash(view, (1, 2, 2)) == content_hash(pixels(), (1, 2, 2))
    assert content_hash(pixels(), (1, 2, 2), kind="video") != content_hash(pixels(), (1, 2, 2))
    assert content_hash(pixels(), (1, 1, 4)) != content_hash(pixels(), (1, 2, 2))
