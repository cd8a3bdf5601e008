"""Qwen-VL vision calls padded to their row bucket with a blank image: the blank strip has the right grid,
the tower's linear layers get bucket-sized inputs, and every real image embeds as the stock tower embeds
it alone, without the padding."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.layers.packed_linear import PackedLinear
from batchvl.layers.row_buckets import bucket_rows
from batchvl.models.qwen_vl import padded_to_bucket


def test_the_blank_image_fills_the_rows_up_to_their_bucket():
    pixels = torch.randn(148, 6)  # two images: 4 x 12 and 10 x 10 patches
    grid = torch.tensor([[1, 4, 12], [1, 10, 10]])
    padded, padded_grid = padded_to_bucket(pixels, grid, 2, torch.bfloat16, "cpu")
    assert bucket_rows(148) == 160
    assert padded.shape == (160, 6) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:148], pixels.to(torch.bfloat16))
    assert not padded[148:].any()
    assert padded_grid.tolist() == [[1, 4, 12], [1, 10, 10], [1, 2, 6]]  # 12 rows, whole 2x2 windows


def test_rows_already_on_a_bucket_get_no_blank_image():
    pixels = torch.randn(128, 6)
    grid = torch.tensor([[1, 8, 16]])
    padded, padded_grid = padded_to_bucket(pixels, grid, 2, torch.float32, "cpu")
    assert torch.equal(padded, pixels)
    assert padded_grid is grid


def stock_embeddings(model_dir, family: str, pixels, grid) -> list[torch.Tensor]:
    """The transformers tower's per-image outputs, combined as the adapter combines them."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.model.get_image_features(pixels, grid, return_dict=True)
    if family != "qwen3_vl":
        return list(out.pooler_output)
    per_item = zip(out.pooler_output, *out.deepstack_features, strict=True)
    return [torch.cat(items, dim=-1) for items in per_item]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_padded_calls_embed_every_image_as_the_stock_tower(
    family, tiny_model_dir, loaded_fp32, family_models
):
    model_dir, loaded = (tiny_model_dir, loaded_fp32) if family == "qwen2_vl" else family_models(family)
    visual = loaded.adapter.model.model.visual
    patch_width = visual.patch_embed.proj.linear.in_features
    torch.manual_seed(0)
    grid = torch.tensor([[1, 4, 6], [1, 6, 10], [1, 2, 8]])  # 100 rows: the bucket is 112
    pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_width)

    seen_rows = []
    blocks = [m for m in visual.blocks.modules() if isinstance(m, PackedLinear)]
    hooks = [m.register_forward_pre_hook(lambda _, args: seen_rows.append(args[0].shape[0])) for m in blocks]
    try:
        got = loaded.adapter.encode("image", pixels, grid)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen_rows and set(seen_rows) == {112}  # no layer of the blocks pads its own input

    expected = stock_embeddings(model_dir, family, pixels, grid)
    assert len(got) == len(expected) == 3
    for mine, stock in zip(got, expected, strict=True):
        assert mine.shape == stock.shape
        torch.testing.assert_close(mine, stock, atol=1e-5 * float(stock.abs().max()), rtol=1e-4)
