"""Linear layers with their weights laid out once for oneDNN, in bfloat16 on CPU.

`F.linear` in bf16 on CPU hands oneDNN a plain row-major weight on every call, and oneDNN reorders it
into its blocked layout each time. A decode step multiplies a few rows by every weight of the model, so
that reorder is most of the call: measured on AVX-512 with 2 threads, the 512x32768 output head took
2.7 ms for one row against 1.2 ms with the weight packed once at load, and the decoder's projections
1.2-1.6x as long. Large vision-tower calls gain less (about 1.1x). The packed kernel is the one
`F.linear` ends in, so the outputs are bitwise equal; float32, whose outputs must match the reference
model's, keeps `F.linear` (MKL's kernel there).

The packed weight replaces the plain one (no second copy), except for a weight shared with another
module (an output head tied to the input embeddings): the embedding still needs its rows, so that
linear keeps `F.linear`.
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """Drop-in for an `nn.Linear` whose bf16 weight is packed for oneDNN; inference only (the packed
    kernel has no backward), as the engine runs the model."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed)
        self.bias = linear.bias

    @property
    def dtype(self) -> torch.dtype:
        return self.packed_weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def packable(linear: torch.nn.Module, owners: dict[int, int]) -> bool:
    weight = getattr(linear, "weight", None)
    return (
        type(linear) is torch.nn.Linear
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and owners[id(weight)] == 1
    )


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` of the model whose weight is its own with a `PackedLinear`;
    returns how many were replaced (none where torch has no oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if packable(child, owners)
    ]
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(targets)
