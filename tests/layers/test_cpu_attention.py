"""bf16 attention on CPU as blocked matmuls: as accurate as torch's fused kernel, blocks invisible."""

import pytest
import torch
import torch.nn.functional as F

from batchvl.layers import cpu_attention


def qkv(batch: int, heads: int, length: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    # Spread-out scores, as trained models have: a softmax far from uniform.
    return [torch.randn(batch, heads, length, dim, generator=generator) * 2 for _ in range(3)]


@pytest.mark.parametrize("shape", [(1, 4, 300, 64), (3, 2, 17, 32), (1, 8, 1, 16)])
def test_as_close_to_float64_as_torchs_fused_bf16_kernel(shape):
    q, k, v = qkv(*shape)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).transpose(1, 2)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    fused = F.scaled_dot_product_attention(*bf16).transpose(1, 2)
    blocked = cpu_attention.blocked_attention(*bf16, scaling=None)
    assert blocked.shape == exact.shape and blocked.dtype == torch.bfloat16
    # float32 through the same code: the layout and the softmax, to rounding
    in_float32 = cpu_attention.blocked_attention(q, k, v, scaling=None)
    torch.testing.assert_close(in_float32.double(), exact, atol=1e-5, rtol=1e-5)
    fused_error = (fused.double() - exact).norm() / exact.norm()
    blocked_error = (blocked.double() - exact).norm() / exact.norm()
    assert blocked_error < 0.02
    assert blocked_error < 2 * fused_error + 1e-3


def test_query_blocks_do_not_change_the_result(monkeypatch):
    q, k, v = (t.bfloat16() for t in qkv(2, 3, 200, 32, seed=1))
    whole = cpu_attention.blocked_attention(q, k, v, scaling=0.2)
    monkeypatch.setattr(cpu_attention, "SCORE_BLOCK_ELEMENTS", 1)  # the smallest blocks allowed
    calls = []
    matmul = torch.matmul

    def counting(a, b):
        calls.append(a.shape)
        return matmul(a, b)

    monkeypatch.setattr(cpu_attention.torch, "matmul", counting)
    blocked = cpu_attention.blocked_attention(q, k, v, scaling=0.2)
    assert len(calls) == 2 * -(-200 // cpu_attention.MIN_QUERY_BLOCK)  # two matmuls per block of 32
    assert torch.equal(blocked, whole)


def test_only_bf16_on_a_cpu_without_amx_takes_the_blocked_path(monkeypatch):
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: False)
    assert cpu_attention.use_blocked_attention(torch.zeros(1, dtype=torch.bfloat16))
    assert not cpu_attention.use_blocked_attention(torch.zeros(1, dtype=torch.float32))
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: True)  # torch's fused kernel runs on the tiles
    assert not cpu_attention.use_blocked_attention(torch.zeros(1, dtype=torch.bfloat16))
