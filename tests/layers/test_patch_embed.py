"""The patch embedding as a matmul: same embeddings as the convolution, and only where it may be."""

import pytest
import torch

from batchvl.layers.packed_linear import PackedLinear
from batchvl.layers.patch_embed import PatchLinear, patch_convs_as_linear
from batchvl.models.loader import load_model
from tests.conftest import bf16_packs


def test_patch_linear_equals_the_convolution_and_falls_back_on_other_inputs():
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=True)
    linear = PatchLinear(conv)
    patches = torch.randn(50, 3, 2, 14, 14)
    torch.testing.assert_close(linear(patches), conv(patches), atol=1e-5, rtol=1e-5)
    assert linear(patches).shape == (50, 32, 1, 1, 1)
    video = torch.randn(1, 3, 4, 28, 28)  # several kernels per input: not a patch, the convolution runs
    assert torch.equal(linear(video), conv(video))


def test_only_patch_convolutions_are_replaced():
    tower = torch.nn.Sequential(
        torch.nn.Conv3d(3, 8, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False),
        torch.nn.Conv3d(8, 8, kernel_size=3, stride=1, padding=1),  # overlapping windows: a real convolution
        torch.nn.Conv2d(3, 8, kernel_size=14, stride=14),  # a CLIP-style stem sees whole images
    )
    assert patch_convs_as_linear(tower) == 1
    assert [type(m) for m in tower] == [PatchLinear, torch.nn.Conv3d, torch.nn.Conv2d]


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.05), ("float32", 1e-5)])
def test_the_loader_uses_it_and_the_tower_embeds_as_with_the_convolution(
    tiny_model_dir, loaded_fp32, dtype, tolerance
):
    loaded = (
        load_model(str(tiny_model_dir), dtype=dtype, device="cpu") if dtype == "bfloat16" else loaded_fp32
    )
    proj = loaded.adapter.model.model.visual.patch_embed.proj
    assert isinstance(proj, PatchLinear)
    # packed, as the model's other linear layers (bf16 ones stay plain where oneDNN cannot pack them)
    assert isinstance(proj.linear, PackedLinear if dtype == "float32" or bf16_packs() else torch.nn.Linear)
    # The tower's embeddings stay those of the convolution, within the dtype's rounding.
    torch.manual_seed(0)
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, proj.conv.weight[0].numel())
    adapter = loaded.adapter
    with torch.inference_mode():
        fast = adapter.encode("image", pixels, grid)[0].float()
        adapter.model.model.visual.patch_embed.proj = proj.conv
        try:
            reference = adapter.encode("image", pixels, grid)[0].float()
        finally:
            adapter.model.model.visual.patch_embed.proj = proj
    assert fast.shape == reference.shape
    assert (fast - reference).abs().max() <= tolerance * reference.abs().max()
