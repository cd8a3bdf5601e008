"""Linear layers with their weights laid out once for oneDNN, on CPU, in bfloat16 and float32.

`F.linear` on CPU hands its backend a plain row-major weight on every call. In bf16 that backend is
oneDNN, which reorders the weight into its blocked layout each time; a decode step multiplies a few rows
by every weight of the model, so that reorder is most of the call: measured on AVX-512 with 2 threads,
the 512x32768 output head took 2.7 ms for one row against 1.2 ms with the weight packed once at load,
and the decoder's projections 1.2-1.6x as long. The packed kernel is the one `F.linear` ends in there, so
bf16 outputs are bitwise equal.

In fp32, `F.linear` calls MKL's sgemm, and oneDNN's fp32 kernel on a packed weight is faster at every
size the engine runs (same machine): 1.3-3x for decode-sized calls (the output head at 16 rows: 11.3 ms
against 3.5 ms) and 1.1-1.2x for 2,048-row prefill and vision calls (the 2048->512 MLP projection at
2,048 rows: 22.3 ms against 19.5 ms). This is also how vLLM's CPU backend runs its linear layers. The two
libraries sum in another order, so fp32 outputs differ from `F.linear`'s in the last bits (about 1e-6
relative); greedy outputs still equal the reference model's `generate` (the parity tests run on packed
weights).

The packed weight replaces the plain one (no second copy), except for a weight shared with another
module (an output head tied to the input embeddings): the embedding still needs its rows, so that
linear keeps `F.linear`.
"""

from __future__ import annotations

import torch

from batchvl.layers.module_swap import replace_children
from batchvl.layers.row_buckets import bucket_rows


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of this dtype on this CPU: fp32 always; bf16 only where its bf16 kernels
    run (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT). On an AVX2-only CPU torch refuses to pack a bf16 weight, and
    a model the user asked for in bf16 there keeps `F.linear` (slow, as the loader's warning says, but it
    runs)."""
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(torch.nn.Module):
    """Drop-in for an `nn.Linear` whose weight is packed for oneDNN; inference only (the packed
    kernel has no backward), as the engine runs the model.

    `activation` is a oneDNN post-op applied to the output inside the call ("none", "swish", "gelu"),
    with its `algorithm` ("none" or "tanh" for GELU). The layer computes `linear(x * input_scale) *
    output_scale` (then the activation), with both scales folded into the packed weight and the bias
    (`fused_activation` uses them)."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        activation: str = "none",
        algorithm: str = "",
        output_scale: float = 1.0,
        input_scale: float = 1.0,
    ):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.activation = activation
        self.algorithm = algorithm
        with torch.no_grad():
            weight = linear.weight.detach()
            bias = linear.bias
            if output_scale * input_scale != 1.0:
                weight = weight * (output_scale * input_scale)
            if bias is not None and output_scale != 1.0:
                bias = torch.nn.Parameter(bias.detach() * output_scale, requires_grad=False)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed)
        self.bias = bias

    @property
    def dtype(self) -> torch.dtype:
        return self.packed_weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows are padded up to their bucket (`row_buckets`): the engine pads its packed steps itself, so
        the copy happens only for calls it does not shape (the output head's rows, other models' calls)."""
        rows = x.numel() // self.in_features
        padded = bucket_rows(rows)
        flat = x.reshape(rows, self.in_features)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros((padded - rows, self.in_features))])
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, self.activation, [], self.algorithm
        )
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fused = "" if self.activation == "none" else f", then {self.activation}"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN{fused}"


def parameter_owners(model: torch.nn.Module) -> dict[int, int]:
    """How many modules hold each parameter (by id): a weight held twice is tied to another module."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return owners


def packable(linear: torch.nn.Module, owners: dict[int, int]) -> bool:
    weight = getattr(linear, "weight", None)
    return (
        type(linear) is torch.nn.Linear
        and packs(weight.dtype)
        and weight.device.type == "cpu"
        and owners[id(weight)] == 1
    )


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every bf16 or fp32 CPU `nn.Linear` of the model whose weight is its own with a `PackedLinear`;
    returns how many were replaced (none where torch has no oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    owners = parameter_owners(model)
    packed = replace_children(model, lambda child: packable(child, owners), PackedLinear)
    if packed:
        release_checkpoint_mapping(model)
    return packed


@torch.no_grad()
def release_checkpoint_mapping(model: torch.nn.Module) -> None:
    """Give every plain parameter and buffer left memory of its own.

    Weights loaded in the checkpoint's own dtype are views of the safetensors file, mapped into memory,
    and the mapping lives while any tensor still points into it: with the linear weights packed, the
    embeddings, norms and biases kept the whole file resident beside the packed copies (the throughput
    benchmark's fp32 batchvl run peaked at 1.72 GB without this copy, 1.44 GB with it). Copied out, the
    mapping goes. Tied weights stay tied: each parameter object is copied once, in place."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_mkldnn:
            tensor.data = tensor.data.clone()
