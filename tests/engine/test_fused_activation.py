"""A float32 two-layer MLP's activation run inside its first linear layer (a oneDNN post-op): the MLP's
outputs within float32 rounding, for every activation it takes; bf16 and tied weights left alone."""

import copy

import pytest
import torch
from transformers.activations import GELUActivation, GELUTanh, QuickGELUActivation, SiLUActivation

from batchvl.models.fused_activation import fuse_mlp_activations
from batchvl.models.packed_linear import PackedLinear


class TwoLayerMLP(torch.nn.Module):
    def __init__(self, activation: torch.nn.Module):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 128)
        self.act = activation
        self.fc2 = torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize(
    "activation",
    [
        QuickGELUActivation(),
        SiLUActivation(),
        GELUActivation(),
        GELUTanh(),
        torch.nn.GELU(approximate="tanh"),
    ],
    ids=["quick_gelu", "silu", "gelu", "gelu_tanh", "torch_gelu_tanh"],
)
@torch.inference_mode()
def test_the_fused_mlp_gives_the_mlps_outputs_within_fp32_rounding(activation):
    torch.manual_seed(0)
    mlp = TwoLayerMLP(activation).eval()
    fused = copy.deepcopy(mlp)
    assert fuse_mlp_activations(fused) == 1
    assert type(fused.fc1) is PackedLinear and fused.fc1.activation != "none"
    assert type(fused.act) is torch.nn.Identity
    x = torch.randn(7, 32) * 3
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-5)


def test_a_sequential_mlp_is_fused_too():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    reference = copy.deepcopy(mlp)
    assert fuse_mlp_activations(mlp) == 1
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), reference(x), rtol=1e-5, atol=1e-5)


def test_bf16_mlps_unknown_activations_and_tied_weights_stay_as_they_are():
    bf16 = TwoLayerMLP(QuickGELUActivation()).to(torch.bfloat16)
    unknown = TwoLayerMLP(torch.nn.ReLU6())
    tied = TwoLayerMLP(SiLUActivation())
    other = torch.nn.Linear(32, 128)
    other.weight = tied.fc1.weight  # held by two modules
    model = torch.nn.ModuleDict({"bf16": bf16, "unknown": unknown, "tied": tied, "other": other})
    assert fuse_mlp_activations(model) == 0
    assert all(type(m) is torch.nn.Linear for m in (bf16.fc1, unknown.fc1, tied.fc1))


def test_the_fp32_loader_fuses_the_vision_mlps(loaded_fp32):
    for block in loaded_fp32.adapter.model.model.visual.blocks:
        assert type(block.mlp.fc1) is PackedLinear and block.mlp.fc1.activation == "swish"
        assert type(block.mlp.act) is torch.nn.Identity
