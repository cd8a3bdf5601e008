"""The vision tower's attention on CUDA with and without flash-attn, on a faked GPU: flash-attn where it
runs (fp16/bf16, Ampere or newer), torch's SDPA path where it refuses (fp32, older GPUs) or is not
installed, the missing package looked for once per process, and a failure of the kernel taken once."""

import sys
import types

import pytest
import torch

from batchvl.layers import vision_attention
from batchvl.layers.vision_attention import varlen_vision_attention
from tests.fake_cuda import on_fake_cuda

LENGTHS = [6, 6, 9]  # two images of one size and one of another


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """What this process knows of flash-attn and its GPU, forgotten before and after each test."""
    for cached in (vision_attention._flash_varlen_func, vision_attention._ampere_or_newer):
        cached.cache_clear()
    monkeypatch.setattr(vision_attention, "_flash_refusals", [])
    yield
    for cached in (vision_attention._flash_varlen_func, vision_attention._ampere_or_newer):
        cached.cache_clear()


def gpu(monkeypatch, major: int) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))


def flash_attn(monkeypatch, kernel) -> list:
    """An installed flash-attn whose varlen function is `kernel`; returns its calls' query dtypes."""
    calls = []

    def flash_attn_varlen_func(q, *args, **kwargs):
        calls.append(q.dtype)
        return kernel(q, *args, **kwargs)

    vision_attention._flash_varlen_func.cache_clear()  # as a process started with it installed
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    )
    return calls


def refuses(message: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(message)

    return kernel


def packed(dtype: torch.dtype) -> tuple:
    """q, k, v of (1, H, T, D) over LENGTHS, and cu_seqlens, on the CPU."""
    total = sum(LENGTHS)
    generator = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, total, 16, generator=generator).to(dtype) for _ in range(3)]
    cu = torch.tensor([0, 6, 12, 21])
    return (*qkv, cu)


def attend(q, k, v, cu) -> torch.Tensor:
    return varlen_vision_attention(None, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu)[0]


def on_gpu(q, k, v, cu) -> torch.Tensor:
    return attend(*(on_fake_cuda(t) for t in (q, k, v, cu))).cpu()


def test_fp32_on_a_gpu_with_flash_attn_runs_the_sdpa_path(monkeypatch):
    gpu(monkeypatch, 9)
    calls = flash_attn(monkeypatch, refuses("FlashAttention only support fp16 and bf16 data type"))
    tensors = packed(torch.float32)
    assert torch.equal(on_gpu(*tensors), attend(*tensors))  # the SDPA path the CPU runs in fp32
    assert calls == []


def sdpa_path(q, k, v) -> torch.Tensor:
    """The SDPA path a GPU without flash-attn runs, computed on the CPU: the same runs through torch's
    SDPA, not the bf16 kernel the CPU would choose for itself (on a CPU without AMX batchvl's own, whose
    bits differ from SDPA's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vision_attention, "use_blocked_attention", lambda query: False)
        return vision_attention._attention_per_run(q, k, v, LENGTHS, 0.25)


def test_a_gpu_before_ampere_runs_the_sdpa_path(monkeypatch):
    gpu(monkeypatch, 7)
    calls = flash_attn(monkeypatch, refuses("FlashAttention only supports Ampere GPUs or newer."))
    tensors = packed(torch.bfloat16)
    assert torch.equal(on_gpu(*tensors), sdpa_path(*tensors[:3]))
    assert calls == []


def test_flash_attn_runs_bf16_on_ampere(monkeypatch):
    gpu(monkeypatch, 8)
    calls = flash_attn(monkeypatch, lambda q, *args, **kwargs: torch.ones_like(q))
    out = on_gpu(*packed(torch.bfloat16))
    assert calls == [torch.bfloat16] and out.shape == (1, sum(LENGTHS), 2, 16) and bool((out == 1).all())


def test_a_missing_flash_attn_is_looked_for_once(monkeypatch):
    gpu(monkeypatch, 9)
    looked = []

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "flash_attn":
                looked.append(name)
            return None  # the other finders go on, and find nothing

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder, *sys.meta_path])
    monkeypatch.setattr(vision_attention, "torch_varlen_function", lambda: None)  # a torch without its own
    tensors = packed(torch.bfloat16)
    outputs = [on_gpu(*tensors) for _ in range(3)]  # three layers
    assert looked == ["flash_attn"]
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_a_failure_of_the_kernel_is_taken_once_and_an_out_of_memory_is_not_hidden(monkeypatch, caplog):
    gpu(monkeypatch, 8)
    calls = flash_attn(
        monkeypatch, refuses("FlashAttention forward only supports head dimension at most 256")
    )
    tensors = packed(torch.bfloat16)
    first, second = on_gpu(*tensors), on_gpu(*tensors)
    assert calls == [torch.bfloat16]  # not again in the next layer
    assert torch.equal(first, second)
    assert [r.getMessage() for r in caplog.records] == [
        "flash-attn failed on the vision tower (FlashAttention forward only supports head dimension at most "
        "256); using torch's SDPA instead"
    ]
    monkeypatch.setattr(vision_attention, "_flash_refusals", [])

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    flash_attn(monkeypatch, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        on_gpu(*tensors)


def sdpa_orders(monkeypatch) -> list[list[int]]:
    """SDPA's backend priority order at each of its calls, as they come."""
    orders = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        orders.append(torch._C._get_sdp_priority_order())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return orders


class SdpaTower:
    """A tower's attention module set to SDPA over each size's images (`engine.vision_attention: sdpa`)."""

    flash_varlen = False


def test_a_tower_set_to_sdpa_skips_the_flash_kernel_for_sdpa_with_cudnns_kernel_first(monkeypatch):
    """On a Hopper GPU with flash-attn installed, a module whose attention is set to SDPA runs the SDPA path
    (images of one size in one call, the same values as a GPU without flash-attn gets), each call asking
    for cuDNN's kernel first; a module not set runs the flash kernel."""
    gpu(monkeypatch, 9)
    calls = flash_attn(monkeypatch, lambda q, *args, **kwargs: torch.ones_like(q))
    orders = sdpa_orders(monkeypatch)
    tensors = packed(torch.bfloat16)
    q, k, v, cu = (on_fake_cuda(t) for t in tensors)
    out = varlen_vision_attention(SdpaTower(), q, k, v, None, scaling=0.25, cu_seq_lens_q=cu)[0].cpu()
    assert calls == []
    reference = sdpa_path(*tensors[:3])  # (its own SDPA calls, on the CPU, under torch's own order)
    assert torch.equal(out, reference)
    # (torch appends the backends not named after them)
    firsts = [order[: len(vision_attention.CUDA_SDPA_ORDER)] for order in orders]
    cudnn_first = [int(backend) for backend in vision_attention.CUDA_SDPA_ORDER]
    assert firsts[:2] == [cudnn_first, cudnn_first]  # two runs: the two images of one size, then the other
    assert firsts[2:] and all(order != cudnn_first for order in firsts[2:])
    on_gpu(*tensors)  # a module not set (None: transformers' own, or an engine's default)
    assert calls == [torch.bfloat16]


def test_the_sdpa_path_a_refused_flash_kernel_leaves_takes_torchs_own_order(monkeypatch):
    """cuDNN's kernel first is `engine.vision_attention: sdpa`'s choice, not the fallback's where flash
    refuses a GPU before Ampere: that path runs SDPA as it did before the setting."""
    gpu(monkeypatch, 7)
    flash_attn(monkeypatch, refuses("FlashAttention only supports Ampere GPUs or newer."))
    orders = sdpa_orders(monkeypatch)
    before = torch._C._get_sdp_priority_order()
    on_gpu(*packed(torch.bfloat16))
    assert orders == [before, before]


def test_a_bound_given_goes_to_the_kernel_and_a_failure_in_a_graphs_capture_is_not_a_refusal(monkeypatch):
    """A vision call replayed as a graph (`qwen_vision_graphs`) gives the kernel its shape's bound, which
    the kernel takes for the longest sequence; a kernel failing while a graph is being captured fails the
    capture (its caller then runs the call eagerly, the kernel still taken)."""
    gpu(monkeypatch, 9)
    bounds = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None):
        bounds.append((max_q, max_k))
        return torch.zeros_like(q)

    flash_attn(monkeypatch, kernel)
    q, k, v, cu = (on_fake_cuda(t) for t in packed(torch.bfloat16))
    varlen_vision_attention(None, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu, max_length_q=16)
    attend(q, k, v, cu)
    assert bounds == [(16, 16), (9, 9)]  # the bound given; else the longest of LENGTHS

    flash_attn(monkeypatch, refuses("operation not permitted when stream is capturing"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capturing"):
        attend(q, k, v, cu)
    assert vision_attention._flash_refusals == []
