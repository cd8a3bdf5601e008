"""The vision tower's attention on CUDA without flash-attn: torch's own flash varlen kernel, every image in
one call per layer, on a faked GPU (the kernel itself runs on CUDA only: here it is a recorder, and on the
CPU torch's real kernel is only seen to take the arguments it is given)."""

import sys

import pytest
import torch

from batchvl.layers import torch_flash_varlen, vision_attention
from tests.layers.test_flash_fallback import (  # noqa: F401 (fresh_process: a fixture)
    LENGTHS,
    flash_attn,
    fresh_process,
    gpu,
    on_gpu,
    packed,
    sdpa_path,
)


@pytest.fixture(autouse=True)
def no_flash_attn(monkeypatch):
    """A process without flash-attn, which has not looked for torch's kernel yet."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # imports of it fail
    torch_flash_varlen.torch_varlen_function.cache_clear()
    yield
    torch_flash_varlen.torch_varlen_function.cache_clear()


def torch_kernel(monkeypatch, kernel) -> list:
    """torch's varlen kernel as `kernel`; returns its calls' arguments."""
    calls = []

    def recording(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None):
        calls.append((q, cu_q, cu_k, max_q, max_k, softmax_scale))
        return kernel(q)

    monkeypatch.setattr(vision_attention, "torch_varlen_function", lambda: recording)
    return calls


def test_bf16_on_ampere_takes_every_image_in_one_call_of_torchs_kernel(monkeypatch):
    gpu(monkeypatch, 8)
    calls = torch_kernel(monkeypatch, torch.ones_like)
    q, k, v, cu = packed(torch.bfloat16)
    outputs = [on_gpu(q, k, v, cu) for _ in range(2)]  # two layers
    assert len(calls) == 2  # one call per layer for images of two sizes
    rows, cu_q, cu_k, max_q, max_k, scale = calls[0]
    assert rows.shape == (sum(LENGTHS), 2, 16) and torch.equal(rows.cpu(), q[0].transpose(0, 1))
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.tolist() == cu_k.tolist() == [0, 6, 12, 21]
    assert (max_q, max_k, scale) == (9, 9, 0.25)
    assert all(out.shape == (1, sum(LENGTHS), 2, 16) and bool((out == 1).all()) for out in outputs)


def test_flash_attn_is_preferred_where_installed(monkeypatch):
    gpu(monkeypatch, 9)
    own = torch_kernel(monkeypatch, torch.zeros_like)
    theirs = flash_attn(monkeypatch, lambda q, *args, **kwargs: torch.ones_like(q))
    assert bool((on_gpu(*packed(torch.bfloat16)) == 1).all())
    assert theirs == [torch.bfloat16] and own == []


@pytest.mark.parametrize("dtype,major", [(torch.float32, 9), (torch.bfloat16, 7)])
def test_fp32_or_a_gpu_before_ampere_runs_the_sdpa_path(monkeypatch, dtype, major):
    gpu(monkeypatch, major)
    calls = torch_kernel(monkeypatch, torch.ones_like)
    tensors = packed(dtype)
    assert torch.equal(on_gpu(*tensors), sdpa_path(*tensors[:3]))
    assert calls == []


def test_a_failure_of_torchs_kernel_is_said_once_by_its_name_then_sdpa(monkeypatch, caplog):
    gpu(monkeypatch, 9)

    def refuses(q):
        raise RuntimeError("FlashAttention only supports head dimension at most 256")

    calls = torch_kernel(monkeypatch, refuses)
    tensors = packed(torch.bfloat16)
    first, second = on_gpu(*tensors), on_gpu(*tensors)
    assert len(calls) == 1 and torch.equal(first, sdpa_path(*tensors[:3])) and torch.equal(first, second)
    assert [r.getMessage() for r in caplog.records] == [
        "torch's flash varlen attention failed on the vision tower (FlashAttention only supports head "
        "dimension at most 256); using torch's SDPA instead"
    ]


def cpu_rows():
    q = torch.randn(10, 2, 16).to(torch.bfloat16)
    return q, q, q, torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)


def test_this_torch_takes_the_public_function_with_the_scale_as_a_keyword(monkeypatch):
    import torch.nn.attention.varlen as varlen

    seen = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *args, **kwargs: seen.append((args, kwargs)) or "out")
    q, k, v, cu_q, cu_k = cpu_rows()
    assert torch_flash_varlen.torch_varlen_function()(q, k, v, cu_q, cu_k, 6, 6, softmax_scale=0.5) == "out"
    ((args, kwargs),) = seen
    assert args[:3] == (q, k, v) and args[3:] == (cu_q, cu_k, 6, 6) and kwargs == {"scale": 0.5}


def test_torch_2_10s_public_function_without_a_scale_gives_way_to_the_private_kernel(monkeypatch):
    import torch.nn.attention.varlen as varlen

    def as_in_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("a scale it cannot take would be lost")

    monkeypatch.setattr(varlen, "varlen_attn", as_in_2_10)
    assert torch_flash_varlen.torch_varlen_function() is torch_flash_varlen._private_varlen


def test_the_public_function_takes_these_arguments():
    # on the CPU the arguments are checked and passed to the kernel, then the CPU has no such kernel
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        torch_flash_varlen.torch_varlen_function()(*cpu_rows(), 6, 6, softmax_scale=0.5)


def test_an_older_torch_takes_the_private_kernel_with_cumulative_lengths(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # as torch before 2.10
    assert torch_flash_varlen.private_op_takes_cumulative_lengths()
    kernel = torch_flash_varlen.torch_varlen_function()
    assert kernel is torch_flash_varlen._private_varlen
    # on the CPU the arguments are parsed against the kernel's schema, then the CPU has no such kernel
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        kernel(*cpu_rows(), 6, 6, softmax_scale=0.5)


def test_a_torch_with_neither_route_has_no_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
    monkeypatch.setattr(torch_flash_varlen, "PRIVATE_OP", "_no_such_op")
    assert torch_flash_varlen.torch_varlen_function() is None
