"""Drop-ins for the models' norms and activation on CUDA, each one Triton kernel of `triton_elementwise`
(transformers' RMSNorm, torch's LayerNorm, QuickGELU), with the roundings of the modules they replace; the
norms also add a layer's residual before they normalize (`residual_norm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchvl.layers import triton_elementwise


class TritonRMSNorm(torch.nn.Module):
    """A stock RMSNorm (`rms_norm.STOCK_RMS_NORMS`) with its weight and epsilon, its output in the dtype
    the module gives (x's and the weight's promoted)."""

    def __init__(self, stock: torch.nn.Module):
        super().__init__()
        self.weight = stock.weight
        self.variance_epsilon = stock.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return triton_elementwise.rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of `residual + hidden_states`, that sum) in one kernel (see `residual_norm`)."""
        return triton_elementwise.rms_norm(hidden_states, self.weight, self.variance_epsilon, residual)


class TritonLayerNorm(torch.nn.Module):
    """torch.nn.LayerNorm over the last dimension, with its weight, bias and epsilon."""

    def __init__(self, stock: torch.nn.LayerNorm):
        super().__init__()
        self.weight = stock.weight
        self.bias = stock.bias
        self.eps = stock.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # torch's mixed-dtype LayerNorm: not the kernel's (one dtype)
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return triton_elementwise.layer_norm(x, self.weight, self.bias, self.eps)[0]

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of `residual + hidden_states`, that sum) in one kernel (see `residual_norm`)."""
        if hidden_states.dtype != self.weight.dtype or residual.dtype != hidden_states.dtype:
            summed = residual + hidden_states
            return self(summed), summed
        return triton_elementwise.layer_norm(hidden_states, self.weight, self.bias, self.eps, residual)


def replaces_layer_norm(module: torch.nn.Module) -> bool:
    """A LayerNorm over the last dimension with a weight and a bias: what the kernel computes."""
    return (
        type(module) is torch.nn.LayerNorm
        and len(module.normalized_shape) == 1
        and module.weight is not None
        and module.bias is not None
    )


class TritonQuickGELU(torch.nn.Module):
    """transformers' QuickGELUActivation. The bias before it stays in its linear layer: added by the
    kernel instead, a bf16 matmul's output would be rounded before the bias where the layer rounds once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_elementwise.quick_gelu(x)
