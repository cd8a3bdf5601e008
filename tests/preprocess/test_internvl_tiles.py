"""InternVL's tiling against its GOT-OCR2 image processor's rule, and a checkpoint of another tiling refused
in one line (the prompts and pixels against the processor: tests/engine/test_family_parity.py)."""

import dataclasses

import pytest
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

from batchvl.errors import UserError
from batchvl.preprocess.internvl_tiles import InternVLTileSpec, best_grid, internvl_tile_spec


@pytest.fixture(scope="module")
def spec(family_models):
    """The tiny InternVL's spec at the real tile side."""
    _, loaded = family_models("internvl")
    return dataclasses.replace(InternVLTileSpec.from_processor(loaded.processor, 14), tile=448)


@pytest.mark.parametrize("tiles", [(1, 12), (1, 6), (2, 4), (1, 1)])
def test_the_grid_is_the_image_processors(spec, tiles):
    spec = dataclasses.replace(spec, min_tiles=tiles[0], max_tiles=tiles[1])
    # squares and 1:2, 2:1, 2:3 ... images tie between grids; small and large ones take either side of the
    # area rule that breaks the ties
    sides = [28, 100, 224, 300, 448, 600, 896, 1000, 1344, 2000, 4000]
    for height in sides:
        for width in sides:
            expected = get_optimal_tiled_canvas((height, width), (448, 448), *tiles)
            assert best_grid(height, width, spec) == expected, (height, width)


def test_a_checkpoint_with_another_tiling_is_refused(family_models):
    _, loaded = family_models("internvl")
    phi4 = type("Phi4MultimodalImageProcessorFast", (), {})()
    processor = type("Processor", (), {"image_processor": phi4})()
    with pytest.raises(UserError, match="Phi4MultimodalImageProcessorFast"):
        internvl_tile_spec(processor, loaded.adapter.model.config)
