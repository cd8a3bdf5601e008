"""Drop-ins for the models' norms and activation on CUDA, each one Triton kernel of `triton_elementwise`
(transformers' RMSNorm, torch's LayerNorm, QuickGELU), with the roundings of the modules they replace; the
norms also add a layer's residual before they normalize, and the add that ends the layer before theirs
(`residual_norm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchvl.layers import triton_elementwise


class TritonNorm(torch.nn.Module):
    """A norm by one kernel that also adds a residual first (`add_and_norm`), and that can take the add
    ending the layer before its own: `add_ahead` makes that sum and normalizes it in one pass, and the
    norm's next call, on that very sum, returns the output kept (see `residual_norm`)."""

    def __init__(self):
        super().__init__()
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # (a sum, its output): `add_ahead`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ahead = self._ahead
        if ahead is not None:
            self._ahead = None  # kept for the next call alone, whatever that call is on
            if ahead[0] is x:
                return ahead[1]
        return self.norm(x)

    def add_ahead(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + hidden_states`, normalized by the same kernel pass for this norm's next call: if that
        call is on the sum returned, it returns the output kept; on anything else it normalizes that. The
        sum and output are the ones `add_and_norm` gives: the same bits as the add and the call apart."""
        normed, summed = self.add_and_norm(hidden_states, residual)
        self._ahead = (summed, normed)
        return summed

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TritonRMSNorm(TritonNorm):
    """A stock RMSNorm (`rms_norm.STOCK_RMS_NORMS`) with its weight and epsilon, its output in the dtype
    the module gives (x's and the weight's promoted)."""

    def __init__(self, stock: torch.nn.Module):
        super().__init__()
        self.weight = stock.weight
        self.variance_epsilon = stock.variance_epsilon

    def norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return triton_elementwise.rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of `residual + hidden_states`, that sum) in one kernel (see `residual_norm`)."""
        return triton_elementwise.rms_norm(hidden_states, self.weight, self.variance_epsilon, residual)


class TritonLayerNorm(TritonNorm):
    """torch.nn.LayerNorm over the last dimension, with its weight, bias and epsilon."""

    def __init__(self, stock: torch.nn.LayerNorm):
        super().__init__()
        self.weight = stock.weight
        self.bias = stock.bias
        self.eps = stock.eps

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # torch's mixed-dtype LayerNorm: not the kernel's (one dtype)
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return triton_elementwise.layer_norm(x, self.weight, self.bias, self.eps)[0]

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of `residual + hidden_states`, that sum) in one kernel (see `residual_norm`)."""
        if hidden_states.dtype != self.weight.dtype or residual.dtype != hidden_states.dtype:
            summed = residual + hidden_states
            return self.norm(summed), summed
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
