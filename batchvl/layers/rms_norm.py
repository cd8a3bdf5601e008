"""RMSNorm in one native pass (`native_kernels.rms_norm`) instead of transformers' eight eager ops.

The decoder normalizes twice per layer and once at the end, every step, a few dozen rows at a time on
decode steps: there each op's dispatch costs more than its arithmetic. Measured on a 2-core CPU with AMX
(40 rows of 512, `benchmarks/native_kernels.py`): 9.5 us against 18.6 us per call in float32, 12 us against
27 us in bf16. The kernel
rounds where transformers' module rounds (the normalized rows to the input dtype, then the product with
the weight), so bf16 outputs are the module's; float32 ones differ only in the order of the sum of
squares (about one float32 rounding step).
"""

from __future__ import annotations

import torch

from batchvl.layers.module_swap import replace_children
from batchvl.layers.native_kernels import native_ops, runs_natively

# transformers 5.23's RMSNorm modules that compute weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
# (Gemma-style norms, which scale by 1 + weight, are not listed).
STOCK_RMS_NORMS = (
    "Qwen2RMSNorm",
    "Qwen2VLRMSNorm",
    "Qwen2_5_VLRMSNorm",
    "Qwen3VLTextRMSNorm",
    "LlamaRMSNorm",
    "Idefics3RMSNorm",
)


class NativeRMSNorm(torch.nn.Module):
    """A drop-in for the stock RMSNorm modules on the CPU, with their weight and epsilon."""

    def __init__(self, stock: torch.nn.Module):
        super().__init__()
        self.weight = stock.weight
        self.variance_epsilon = stock.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # the stock module's type promotion
            return self.stock_forward(hidden_states)
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty_like(rows)
        native_ops().rms_norm(out, rows, self.weight, self.variance_epsilon)
        return out.view(hidden_states.shape)

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of `residual + hidden_states`, that sum) in one pass (see `decoder_stack`)."""
        if not hidden_states.dtype == residual.dtype == self.weight.dtype:
            summed = residual + hidden_states
            return self(summed), summed
        width = hidden_states.shape[-1]
        rows, added = (t.reshape(-1, width) for t in (hidden_states, residual))
        rows, added = (t if t.stride(-1) == 1 else t.contiguous() for t in (rows, added))
        out, summed = torch.empty_like(rows), torch.empty_like(rows)
        native_ops().add_rms_norm(out, summed, rows, added, self.weight, self.variance_epsilon)
        return out.view(hidden_states.shape), summed.view(hidden_states.shape)

    def stock_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def use_native_rms_norms(model: torch.nn.Module) -> int:
    """Replace the model's stock RMSNorm modules whose weights are float32 or bf16 on the CPU with
    NativeRMSNorm, where the native kernels build; returns how many were replaced."""
    return replace_children(
        model,
        lambda child: type(child).__name__ in STOCK_RMS_NORMS and runs_natively(child.weight),
        NativeRMSNorm,
    )
