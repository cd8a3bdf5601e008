"""A vision tower's patch embedding as one matmul instead of a 3-D convolution.

Qwen-VL vision towers embed pre-cut patches with a Conv3d whose kernel equals its stride and the input's
own size, so each output is one dot product of the flattened patch with each filter: a plain linear
layer (vLLM runs it as one too). On CPU oneDNN's convolution ran that about 3x slower than the matmul:
34 ms against 11 ms for 3,528 patches in bfloat16, 80 ms against 26 ms for 3,164 patches in float32. The
two sum in another order (about 1e-6 relative apart in float32); greedy outputs still equal the reference
model's `generate`.
"""

from __future__ import annotations

import torch

from batchvl.layers.module_swap import replace_children


class PatchLinear(torch.nn.Module):
    """Drop-in for a Conv3d with kernel == stride and no padding, applied to inputs of exactly one kernel;
    any other input goes through the original convolution. The matmul is an `nn.Linear` of its own (a view
    of the filters), so that packing the model's linear layers packs it as well."""

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.conv = conv
        self.kernel_size = tuple(conv.kernel_size)
        self.out_channels = conv.out_channels
        weight = conv.weight.detach().view(self.out_channels, -1)
        self.linear = torch.nn.Linear(weight.shape[1], self.out_channels, bias=False, device="meta")
        self.linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if conv.bias is not None:
            self.linear.bias = torch.nn.Parameter(conv.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:  # the model reads the embedding's dtype from it
        return self.conv.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != self.kernel_size:
            return self.conv(x)
        out = self.linear(x.reshape(x.shape[0], -1))
        return out.view(x.shape[0], self.out_channels, 1, 1, 1)


def is_patch_conv(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, torch.nn.Conv3d)
        and tuple(module.kernel_size) == tuple(module.stride)
        and all(p == 0 for p in module.padding)
        and module.groups == 1
        and tuple(module.dilation) == (1, 1, 1)
    )


def patch_convs_as_linear(model: torch.nn.Module) -> int:
    """Replace the model's patch convolutions with `PatchLinear`; returns how many were replaced."""
    return replace_children(model, is_patch_conv, PatchLinear)
