"""The activation of a two-layer MLP run inside its first linear layer, on CPU, in float32 and bf16.

Vision towers and projectors compute `fc2(act(fc1(x)))`, where the activation is elementwise passes of
eager PyTorch over the widest tensor of the tower (four times its width): QuickGELU,
`y * sigmoid(1.702 * y)`, is three of them. oneDNN applies an activation to a matmul's output inside the
call, while it is still in cache (a post-op). Measured on AVX-512 with 2 threads, float32, the Qwen2-VL
vision MLP (512 -> 2048 -> 512) took 56 ms against 71 ms for 2,900 patches and 19 ms against 28 ms
for 1,000.

- SiLU and GELU (exact or tanh) are oneDNN post-ops of their own.
- QuickGELU is SiLU of `1.702 * y`, divided by 1.702: `fc1` runs with its weight and bias scaled by
  1.702 and the SiLU post-op, and `fc2` with its weight divided by 1.702 (linear in its input).

In float32 the fused layers differ from the separate ops in the last bits (about 1e-6 relative), as
packing does; greedy outputs still equal the reference model's `generate` (the parity tests run fused).
In bf16 the fused MLP is not bitwise the stock one: the activation is computed on the float32 matmul
output and rounded once, where the stock ops round after every pass, and QuickGELU's scaled weights round
to other bf16 values. Against the float32 MLP it is as close as the stock bf16 MLP (SiLU and GELU a little
closer, QuickGELU within 1.1x of its error). There the gain is larger: with AMX the matmuls take so little
time that QuickGELU's three passes over the (patches x 2,048) activations cost more than `fc1` itself;
fused, encoding the throughput benchmark's images took 2.31-2.45 s against 2.46-2.82 s (2 threads).
"""

from __future__ import annotations

import torch
from transformers.activations import GELUActivation, GELUTanh, QuickGELUActivation, SiLUActivation

from batchvl.layers.packed_linear import PackedLinear, packs, parameter_owners

QUICK_GELU_SCALE = 1.702
# (first linear, activation, second linear): the two-layer MLPs of the supported towers and projectors
# (Qwen2-VL, Qwen3-VL, CLIP, SigLIP, LLaVA's projector), each computing second(activation(first(x))).
TWO_LAYER_MLPS = (
    ("fc1", "act", "fc2"),
    ("fc1", "activation_fn", "fc2"),
    ("linear_fc1", "act_fn", "linear_fc2"),
    ("linear_1", "act", "linear_2"),
)


def post_op(activation: torch.nn.Module) -> tuple[str, str, float] | None:
    """oneDNN's (post-op, algorithm) for the activation and the scale its input needs, or None."""
    kind = type(activation)
    if kind is QuickGELUActivation:
        return "swish", "", QUICK_GELU_SCALE
    if kind in (torch.nn.SiLU, SiLUActivation):
        return "swish", "", 1.0
    if kind is GELUActivation:
        return "gelu", "none", 1.0
    if kind is GELUTanh:
        return "gelu", "tanh", 1.0
    if kind is torch.nn.GELU:
        return "gelu", activation.approximate, 1.0
    return None


def fusable(first, activation, second, owners: dict[int, int]) -> bool:
    linears = (first, second)
    return (
        post_op(activation) is not None
        and all(type(m) is torch.nn.Linear for m in linears)
        and all(packs(m.weight.dtype) and m.weight.device.type == "cpu" for m in linears)
        and all(owners[id(m.weight)] == 1 for m in linears)
    )


def mlp_triples(model: torch.nn.Module):
    """(parent, first, activation, second) attribute names of every two-layer MLP, named or sequential."""
    for parent in model.modules():
        children = dict(parent.named_children())
        if isinstance(parent, torch.nn.Sequential):
            names = list(children)
            yield from ((parent, *names[i : i + 3]) for i in range(len(names) - 2))
        else:
            yield from ((parent, *triple) for triple in TWO_LAYER_MLPS if all(n in children for n in triple))


def fuse_mlp_activations(model: torch.nn.Module) -> int:
    """Run the activation of every two-layer MLP inside its first linear (packed for oneDNN);
    returns how many MLPs were fused (none where torch has no oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    owners = parameter_owners(model)
    fused = 0
    for parent, first, act, second in list(mlp_triples(model)):
        modules = [getattr(parent, name) for name in (first, act, second)]
        if not fusable(*modules, owners):
            continue
        activation, algorithm, scale = post_op(modules[1])
        setattr(parent, first, PackedLinear(modules[0], activation, algorithm, output_scale=scale))
        setattr(parent, act, torch.nn.Identity())
        setattr(parent, second, PackedLinear(modules[2], input_scale=1 / scale))
        fused += 1
    return fused
