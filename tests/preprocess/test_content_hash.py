"""The content hash of preprocessed media: the key under which encoded images are cached, in memory and on
disk across runs, so its value for given pixels must not drift between releases."""

import dataclasses

import numpy as np

from batchvl.preprocess.media import content_hash
from batchvl.preprocess.pixel_normalization import PixelNormalization


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


def test_8_bit_pixels_are_keyed_with_the_normalization_that_makes_the_towers_input_of_them():
    """The same 8-bit pixels normalized otherwise (another checkpoint's image processor, a changed
    preprocessor config) are another tower input: never read another's stored embedding."""
    eight_bit = np.arange(24, dtype=np.uint8).reshape(4, 6)
    clip = PixelNormalization(
        1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    )
    # xxh3-128 of b"image", the normalization's numbers (float64) and repeat (int64), little-endian, the
    # pixels' bytes, then the grid as int64
    assert content_hash(eight_bit, (1, 2, 2), normalization=clip) == "875dac0da37a2ede40f0552044cb019e"
    others = [
        dataclasses.replace(clip, rescale_factor=1 / 127.5),
        dataclasses.replace(clip, image_mean=(0.5, 0.5, 0.5)),
        dataclasses.replace(clip, image_std=(0.5, 0.5, 0.5)),
        dataclasses.replace(clip, repeat=2),
    ]
    keys = {content_hash(eight_bit, (1, 2, 2), normalization=other) for other in [clip, *others]}
    assert len(keys) == 5
    assert content_hash(eight_bit, (1, 2, 2)) not in keys
