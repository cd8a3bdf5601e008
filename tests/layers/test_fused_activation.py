"""A two-layer MLP's activation run inside its first linear layer (a oneDNN post-op): in float32 the MLP's
outputs within float32 rounding, in bf16 as close to the float32 MLP as the stock bf16 MLP, for every
activation it takes; unknown activations and tied weights left alone."""

import copy

import pytest
import torch
from transformers.activations import GELUActivation, GELUTanh, QuickGELUActivation, SiLUActivation

from batchvl.layers.fused_activation import fuse_mlp_activations
from batchvl.layers.packed_linear import PackedLinear
from batchvl.models.loader import load_model
from tests.conftest import bf16_packs


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


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact.double()).norm() / exact.double().norm())


@pytest.mark.parametrize(
    "activation",
    [QuickGELUActivation(), SiLUActivation(), GELUActivation(), GELUTanh()],
    ids=["quick_gelu", "silu", "gelu", "gelu_tanh"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.inference_mode()
def test_a_fused_bf16_mlp_is_as_close_to_float32_as_the_stock_bf16_mlp(activation, seed):
    torch.manual_seed(seed)
    exact = TwoLayerMLP(activation).eval()
    stock = copy.deepcopy(exact).to(torch.bfloat16)
    fused = copy.deepcopy(stock)
    assert fuse_mlp_activations(fused) == int(bf16_packs())  # nothing to fuse into where bf16 is not packed
    assert type(fused.fc1) is (PackedLinear if bf16_packs() else torch.nn.Linear)
    assert (fused.fc1.dtype if bf16_packs() else fused.fc1.weight.dtype) == torch.bfloat16
    x = (torch.randn(64, 32) * 3).to(torch.bfloat16)
    reference = exact(x.float())
    stock_error = relative_error(stock(x), reference)
    assert 1e-3 < stock_error < 1e-2  # bf16 rounding, not an exact match
    assert relative_error(fused(x), reference) <= 1.25 * stock_error


def test_unknown_activations_and_tied_weights_stay_as_they_are():
    unknown = TwoLayerMLP(torch.nn.ReLU6())
    tied = TwoLayerMLP(SiLUActivation())
    other = torch.nn.Linear(32, 128)
    other.weight = tied.fc1.weight  # held by two modules
    model = torch.nn.ModuleDict({"unknown": unknown, "tied": tied, "other": other})
    assert fuse_mlp_activations(model) == 0
    assert all(type(m) is torch.nn.Linear for m in (unknown.fc1, tied.fc1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loader_fuses_the_vision_mlps(tiny_model_dir, loaded_fp32, dtype):
    loaded = loaded_fp32 if dtype == "float32" else load_model(str(tiny_model_dir), dtype=dtype, device="cpu")
    for block in loaded.adapter.model.model.visual.blocks:
        if dtype == "bfloat16" and not bf16_packs():
            assert type(block.mlp.fc1) is torch.nn.Linear and type(block.mlp.act) is not torch.nn.Identity
            continue
        assert type(block.mlp.fc1) is PackedLinear and block.mlp.fc1.activation == "swish"
        assert type(block.mlp.act) is torch.nn.Identity
