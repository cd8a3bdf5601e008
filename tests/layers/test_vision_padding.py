"""Qwen-VL vision calls padded on the CPU to their row bucket with a blank image: the blank strip has the
right grid, the tower's linear layers get bucket-sized inputs, and every real image embeds as the stock
tower embeds it alone, without the padding. A GPU's calls are not padded."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.engine.model_runner import encode_images
from batchvl.layers.packed_linear import PackedLinear
from batchvl.layers.row_buckets import bucket_rows
from batchvl.models.qwen_vl import Qwen2VLAdapter, with_blank_image
from batchvl.preprocess.media import PreparedMedia


def test_the_blank_image_covers_the_rows_past_the_items():
    grid = torch.tensor([[1, 4, 12], [1, 10, 10]])  # 148 rows
    assert bucket_rows(148) == 160
    # 12 blank rows: whole 2x2 merge windows
    assert with_blank_image(grid, 160, 2).tolist() == [[1, 4, 12], [1, 10, 10], [1, 2, 6]]


def test_rows_with_no_padding_get_no_blank_image():
    grid = torch.tensor([[1, 8, 16]])
    assert with_blank_image(grid, 128, 2) is grid


def test_only_the_cpu_pads_a_call_where_no_vision_graph_takes_it():
    def rows(device: torch.device, graphs=None, given: int = 100) -> int:
        return Qwen2VLAdapter.vision_call_rows(SimpleNamespace(device=device, vision_graphs=graphs), given)

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert (rows(cpu), rows(gpu)) == (112, 100)
    # with vision graphs, the graphs' rows (multiples of 1,024) up to their largest
    graphs = SimpleNamespace(takes=lambda padded: padded <= 2048)
    assert (rows(gpu, graphs), rows(gpu, graphs, 1025), rows(gpu, graphs, 2049)) == (1024, 2048, 2049)


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
    grids = [(1, 4, 6), (1, 6, 10), (1, 2, 8)]  # 100 rows: the bucket is 112
    images = [
        PreparedMedia(torch.randn(t * h * w, patch_width).numpy(), (t, h, w), f"h{i}", t * h * w // 4, "")
        for i, (t, h, w) in enumerate(grids)
    ]

    seen_rows = []
    blocks = [m for m in visual.blocks.modules() if isinstance(m, PackedLinear)]
    hooks = [m.register_forward_pre_hook(lambda _, args: seen_rows.append(args[0].shape[0])) for m in blocks]
    try:
        got = encode_images(loaded.adapter, images, max_patches=4096)  # one call, staged by the engine
    finally:
        for hook in hooks:
            hook.remove()
    assert seen_rows and set(seen_rows) == {112}  # no layer of the blocks pads its own input

    pixels = torch.cat([torch.from_numpy(image.pixel_values) for image in images])
    expected = stock_embeddings(model_dir, family, pixels, torch.tensor(grids))
    assert len(got) == len(expected) == 3
    for mine, stock in zip(got, expected, strict=True):
        assert mine.shape == stock.shape
        torch.testing.assert_close(mine, stock, atol=1e-5 * float(stock.abs().max()), rtol=1e-4)
