"""The native bf16 attention of packed sequences (AVX512-BF16 dot products): as close to float64 as torch's
fused bf16 kernel, sequences independent of each other, and chosen only where the CPU runs it."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from batchvl.layers import cpu_attention, native_kernels, vision_attention
from batchvl.layers.native_kernels import native_ops

# Lengths around the kernel's blocks: 32 keys per packed block, 8 query rows per score tile, 64 per task.
LENGTHS = [1, 5, 33, 64, 100, 257]


@pytest.fixture(scope="module")
def ops():
    if native_ops() is None:
        pytest.skip("the native kernels did not build (needs a C++ compiler and ninja)")
    return native_ops()


def packed(lengths: list[int], heads: int, dim: int, seed: int = 0):
    """q, k, v as strided (T, H, D) views of one (T, 3, H, D) tensor, as the vision tower's qkv output is,
    with spread-out scores (a softmax far from uniform, as trained models have); and cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(lengths), 3, heads, dim, generator=generator) * 2).bfloat16()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens


def per_sequence(fn, q, k, v, cu_seqlens):
    bounds = cu_seqlens.tolist()
    return torch.cat(
        [
            fn(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
            for a, b in itertools.pairwise(bounds)
        ]
    )


def runs_here(ops) -> bool:
    """Whether this CPU runs the kernel. Where it does not, the kernel must refuse (it would stop the process
    on an illegal instruction) and never be chosen: that is what the tests check there."""
    q, k, v, cu_seqlens = packed([4], 2, 64)
    if ops.bf16_dot_products():
        # chosen for bf16 unless AMX tiles run torch's kernel faster
        assert cpu_attention.use_native_attention(q) != cpu_attention.has_amx()
        assert not cpu_attention.use_native_attention(q.float())
        return True
    assert not cpu_attention.use_native_attention(q)
    with pytest.raises(RuntimeError, match="bf16_dot_products"):
        ops.varlen_attention(torch.empty_like(q), q, k, v, cu_seqlens, 0.125)
    return False


# Every number of 16-lane vectors a head can take (the kernel's instantiations), with the Qwen-VL vision
# towers' 72 (Qwen3-VL) and 80 (Qwen2-VL, Qwen2.5-VL), whose last vector is partly used.
@pytest.mark.parametrize("dim", [16, 32, 40, 64, 72, 80, 96, 112, 128, 256])
def test_as_close_to_float64_as_torchs_fused_bf16_kernel(ops, dim):
    if not runs_here(ops):
        return
    q, k, v, cu_seqlens = packed(LENGTHS, 3, dim)
    out = cpu_attention.native_attention(q, k, v, cu_seqlens, None)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    exact = per_sequence(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), cu_seqlens)
    fused = per_sequence(F.scaled_dot_product_attention, q, k, v, cu_seqlens)
    fused_error = (fused.double() - exact).norm() / exact.norm()
    native_error = (out.double() - exact).norm() / exact.norm()
    assert native_error < 0.02
    assert native_error < 2 * fused_error + 1e-3


def test_head_sizes_the_kernel_is_not_built_for_keep_torch():
    assert all(native_kernels.bf16_attention_takes(dim) for dim in (2, 8, 72, 80, 128, 248, 256))
    assert not any(native_kernels.bf16_attention_takes(dim) for dim in (0, 7, 130, 192, 240, 258, 512))
    assert not cpu_attention.use_native_attention(torch.zeros(1, 130, dtype=torch.bfloat16))


def test_sequences_never_see_each_other(ops):
    if not runs_here(ops):
        return
    q, k, v, cu_seqlens = packed(LENGTHS, 2, 64, seed=1)
    together = cpu_attention.native_attention(q, k, v, cu_seqlens, 0.3)
    bounds = cu_seqlens.tolist()
    for a, b in itertools.pairwise(bounds):
        alone = cpu_attention.native_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), 0.3)
        assert torch.equal(together[a:b], alone)
    # An empty sequence in cu_seqlens is no sequence; other keys changing changes nothing else.
    with_empty = torch.tensor([0, 0, *bounds[1:]])
    assert torch.equal(cpu_attention.native_attention(q, k, v, with_empty, 0.3), together)
    k2 = k.clone()
    k2[bounds[2] : bounds[3]] = 0
    changed = cpu_attention.native_attention(q, k2, v, cu_seqlens, 0.3)
    assert torch.equal(changed[: bounds[2]], together[: bounds[2]])
    assert torch.equal(changed[bounds[3] :], together[bounds[3] :])
    assert not torch.equal(changed[bounds[2] : bounds[3]], together[bounds[2] : bounds[3]])


def test_the_vision_attention_function_takes_the_native_kernel_in_bf16(ops, monkeypatch):
    if not runs_here(ops):
        return
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: False)
    q, k, v, cu_seqlens = packed(LENGTHS, 2, 64, seed=2)
    views = [t.transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, T, D), as the tower hands them
    calls = []
    native = cpu_attention.native_attention
    monkeypatch.setattr(vision_attention, "native_attention", lambda *a: calls.append(1) or native(*a))
    out, _ = vision_attention.varlen_vision_attention(
        None, *views, None, scaling=0.125, cu_seq_lens_q=cu_seqlens
    )
    assert calls and torch.equal(out[0], native(q, k, v, cu_seqlens, 0.125))
    # float32 keeps torch's kernel, the reference model's own
    out32, _ = vision_attention.varlen_vision_attention(
        None, *(t.float() for t in views), None, scaling=0.125, cu_seq_lens_q=cu_seqlens
    )
    assert len(calls) == 1
    torch.testing.assert_close(
        out32[0],
        per_sequence(
            lambda *t: F.scaled_dot_product_attention(*t, scale=0.125),
            q.float(),
            k.float(),
            v.float(),
            cu_seqlens,
        ),
    )


def test_batched_towers_take_the_kernel_unmasked_in_bf16_and_sdpa_otherwise(ops, monkeypatch):
    """CLIP and SigLIP towers (LLaVA, Idefics3) hand attention (B, H, N, D) batches of one image size."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not runs_here(ops):
        return
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: False)
    generator = torch.Generator().manual_seed(4)
    projected = (torch.randn(3, 50, 3, 4, 72, generator=generator) * 2).bfloat16()  # (B, N, qkv, H, D)
    query, key, value = (projected[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = vision_attention.batched_vision_attention(module, query, key, value, None, scaling=0.1)
    assert out.shape == (3, 50, 4, 72)
    packed = [projected[:, :, i].reshape(150, 4, 72) for i in range(3)]
    assert torch.equal(
        out.reshape(150, 4, 72), cpu_attention.native_attention(*packed, torch.tensor([0, 50, 100, 150]), 0.1)
    )
    exact, _ = sdpa_attention_forward(module, query.double(), key.double(), value.double(), None, scaling=0.1)
    fused, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.1)
    assert (out.double() - exact).norm() < 2 * (fused.double() - exact).norm() + 1e-3 * exact.norm()
    # a patch mask, a causal module, or fp32: transformers' SDPA function, as before
    mask = torch.ones(3, 1, 50, 50, dtype=torch.bool)
    mask[:, :, :, 40:] = False
    for args, owner in [
        ((query, key, value, mask), module),
        ((query.float(), key.float(), value.float(), None), module),
    ]:
        got, _ = vision_attention.batched_vision_attention(owner, *args, scaling=0.1)
        assert torch.equal(got, sdpa_attention_forward(owner, *args, scaling=0.1)[0])
    module.is_causal = True
    got, _ = vision_attention.batched_vision_attention(module, query, key, value, None, scaling=0.1)
    assert torch.equal(got, sdpa_attention_forward(module, query, key, value, None, scaling=0.1)[0])


@pytest.mark.parametrize("family", ["llava", "idefics3", "smolvlm", "internvl"])
def test_a_bf16_tower_over_equal_crops_runs_on_the_kernel(ops, family, tmp_path, monkeypatch):
    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.models.loader import load_model

    loaded = load_model(
        str(build_tiny_model(tmp_path / family, family=family)), dtype="bfloat16", device="cpu"
    )
    vision = loaded.adapter.model.config.vision_config
    assert vision._attn_implementation == vision_attention.BATCHED_VISION_ATTENTION_NAME
    if not runs_here(ops) or cpu_attention.has_amx():
        return
    calls = []
    native = cpu_attention.native_attention
    monkeypatch.setattr(
        vision_attention, "native_attention", lambda *a: calls.append(a[0].shape) or native(*a)
    )
    tower = (
        loaded.adapter.model.model.vision_model
        if family in ("idefics3", "smolvlm")
        else loaded.adapter.model.model.vision_tower
    )
    size = vision.image_size[0] if isinstance(vision.image_size, list) else vision.image_size  # InternViT's
    with torch.inference_mode():
        tower(torch.randn(2, 3, size, size, dtype=torch.bfloat16))
    assert len(calls) == vision.num_hidden_layers
