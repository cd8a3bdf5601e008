"""Each CPU kind's choice of attention kernels, checked on whatever CPU runs the suite.

batchvl's layers choose their bf16 kernels by two facts: whether AMX tiles count (`cpu_features.has_amx`,
from torch's probe of the CPU and oneDNN's cap) and whether the CPU has AVX512-BF16 dot products (the native
kernels' `bf16_dot_products`). Both are faked here, so one machine runs the choices of a CPU with AMX, of
an AVX-512 one without, and of an AVX2 one, and each choice is held to float64. The one kernel a CPU may
lack the instructions for, the native bf16 attention, runs where the CPU has them; elsewhere it must
refuse (it would stop the process on an illegal instruction), and that is checked instead.

Where the cap itself changes what torch runs (oneDNN's bf16 weight packing), a process of its own starts
under it: oneDNN reads it once, when it loads.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchvl.layers import attention, cpu_features, vision_attention
from batchvl.layers.attention import DecodeBatch, decode_attention, prefills_read_cache_in_place
from batchvl.layers.native_kernels import native_ops

# kind: (AMX tiles, AVX512-BF16 dot products)
KINDS = {"amx": (True, True), "avx512": (False, True), "avx2": (False, False)}
# What each kind runs in bf16: the vision tower's attention, prefill chunks from the cache in place or not,
# and the decode attention when the native decode kernel does not take it.
PICKS = {
    "amx": ("sdpa", False, "sdpa"),  # torch's fused kernel runs its products on the tiles
    "avx512": ("native", True, "matmuls"),
    "avx2": ("blocked", False, "matmuls"),
}
LENGTHS = [6, 6, 40, 70]  # two images of one size, two of others
HEADS, DIM = 2, 64


@pytest.fixture(scope="module")
def ops():
    if native_ops() is None:
        pytest.skip("the native kernels did not build (needs a C++ compiler and ninja)")
    return native_ops()


@pytest.fixture(params=list(KINDS))
def kind(request, monkeypatch, ops):
    """This process as a CPU of the kind: torch's AMX probe and the native kernels' answer faked, no
    oneDNN cap, no Triton interpreter (which would take the cache's attention)."""
    tiles, dot_products = KINDS[request.param]
    for name in (*cpu_features.ONEDNN_ISA_VARIABLES, "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: tiles)
    monkeypatch.setattr(ops, "bf16_dot_products", lambda: dot_products)
    cpu_features.has_amx.cache_clear()
    yield request.param
    cpu_features.has_amx.cache_clear()  # the next caller asks of the real CPU again


@pytest.fixture(scope="module")
def cpu_has_dot_products(ops) -> bool:
    return ops.bf16_dot_products()  # asked before any test fakes it


def calls_of(monkeypatch, module, names: list[str]) -> list[str]:
    """The names of `module`'s functions called, in order, each still doing its work."""
    called = []
    for name in names:
        function = getattr(module, name)

        def recording(*args, _name=name, _function=function, **kwargs):
            called.append(_name)
            return _function(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return called


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def packed_qkv(seed: int = 0) -> tuple:
    """(1, H, T, D) q, k, v over LENGTHS in float32, spread-out scores as trained models have; cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, sum(LENGTHS), DIM, generator=generator) * 2 for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return q, k, v, cu


def per_image(q, k, v, cu) -> torch.Tensor:
    """Each image attending only to itself, one SDPA call each: (1, T, H, D)."""
    bounds = cu.tolist()
    parts = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def test_the_vision_tower_attends_with_its_kinds_kernel(kind, monkeypatch, cpu_has_dot_products):
    q, k, v, cu = packed_qkv()
    exact = per_image(q.double(), k.double(), v.double(), cu)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    fused_error = relative_error(per_image(*bf16, cu), exact)  # torch's fused bf16 kernel's
    called = calls_of(monkeypatch, vision_attention, ["native_attention", "blocked_attention"])
    sdpa = calls_of(monkeypatch, F, ["scaled_dot_product_attention"])
    picked = PICKS[kind][0]
    if picked == "native" and not cpu_has_dot_products:
        with pytest.raises(RuntimeError, match="bf16_dot_products"):
            vision_attention.varlen_vision_attention(None, *bf16, None, cu_seq_lens_q=cu)
        assert called == ["native_attention"]
        return
    out = vision_attention.varlen_vision_attention(None, *bf16, None, cu_seq_lens_q=cu)[0]
    # the blocked matmuls: one call per run of equal lengths
    expected_calls = {"sdpa": [], "native": ["native_attention"], "blocked": ["blocked_attention"] * 3}
    assert called == expected_calls[picked]
    assert bool(sdpa) == (picked == "sdpa")
    assert out.shape == exact.shape and out.dtype == torch.bfloat16
    assert relative_error(out, exact) < 2 * fused_error + 1e-3
    del called[:], sdpa[:]
    out32 = vision_attention.varlen_vision_attention(None, q, k, v, None, cu_seq_lens_q=cu)[0]
    assert called == [] and sdpa  # float32 takes torch's fused kernel on every kind, as the reference model
    torch.testing.assert_close(out32.double(), exact, atol=1e-5, rtol=1e-5)


def decode_inputs() -> tuple:
    """Three decodes of 2 query heads over 1 KV head, of 9, 30 and 17 keys padded to 30: queries (B, H, D),
    keys and values (Hkv, B * L, D) in float32, and the batch with its mask."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, DIM, generator=generator) * 2
    keys, values = (torch.randn(1, 3 * 30, DIM, generator=generator) for _ in range(2))
    mask = torch.arange(30)[None, :] < torch.tensor([9, 30, 17])[:, None]
    return q, keys, values, DecodeBatch(rows=torch.arange(3), key_rows=torch.arange(1), mask=mask)


def exact_decodes(q, keys, values, batch) -> torch.Tensor:
    """Each decode over its own keys in float64, one SDPA call each: (B, H, D)."""
    lengths = batch.mask.sum(1).tolist()
    keys, values = (t.double().view(1, len(lengths), -1, DIM) for t in (keys, values))
    return torch.stack(
        [
            F.scaled_dot_product_attention(
                q[b].double()[:, None], keys[:, b, :length], values[:, b, :length], enable_gqa=True
            )[:, 0]
            for b, length in enumerate(lengths)
        ]
    )


def test_decodes_attend_with_their_kinds_kernel(kind, monkeypatch):
    *inputs, batch = decode_inputs()
    exact = exact_decodes(*inputs, batch)
    sdpa = calls_of(monkeypatch, attention.F, ["scaled_dot_product_attention"])
    out = decode_attention(*(t.bfloat16() for t in inputs), batch, scaling=None)
    assert bool(sdpa) == (PICKS[kind][2] == "sdpa")
    assert out.dtype == torch.bfloat16 and relative_error(out, exact) < 0.02
    del sdpa[:]
    out32 = decode_attention(*inputs, batch, scaling=None)
    assert sdpa  # float32 keeps torch's kernel on every kind
    torch.testing.assert_close(out32.double(), exact, atol=1e-5, rtol=1e-5)


def test_prefill_chunks_read_the_cache_in_place_where_the_native_kernel_runs(kind):
    layer = torch.zeros(2, 1, 4, DIM, dtype=torch.bfloat16)
    assert prefills_read_cache_in_place(layer) is PICKS[kind][1]
    assert not prefills_read_cache_in_place(layer.float())  # float32: torch's attention, every kind


# What a process under each oneDNN cap, on a CPU whose AMX tiles are faked, makes of them: whether the tiles
# count, whether bf16 linear layers are packed for oneDNN, and how far those layers' outputs are from
# float64's.
UNDER_A_CAP = textwrap.dedent(
    """
    import json

    import torch

    torch.cpu._is_amx_tile_supported = lambda: True
    torch.cpu._init_amx = lambda: True

    from batchvl.layers.cpu_features import has_amx
    from batchvl.layers.packed_linear import pack_linear_weights

    torch.manual_seed(0)
    exact = torch.nn.Linear(256, 96).double()
    x = torch.randn(33, 256, dtype=torch.float64)
    model = torch.nn.Sequential(torch.nn.Linear(256, 96)).bfloat16()
    model[0].load_state_dict(exact.state_dict())
    packed = pack_linear_weights(model)
    with torch.no_grad():
        want = exact(x)
        error = (model(x.bfloat16()).double() - want).norm() / want.norm()
    print(json.dumps({"amx": has_amx(), "packed": packed, "error": error.item()}))
    """
)


def runs_avx512_core() -> bool:
    """Whether the CPU itself has what oneDNN's bf16 kernels need (AVX-512 BW, VL and DQ), asked of the
    kernel's flags rather than of torch, which answers under this process's own cap."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags


@pytest.mark.parametrize(
    ("cap", "amx", "packed"),
    [
        ("AVX512_CORE_AMX", True, 1),  # a CPU with AMX
        ("AVX512_CORE_BF16", False, 1),  # AVX-512 without AMX: bf16 weights packed, the tiles not used
        ("AVX2", False, 0),  # oneDNN has no bf16 kernels there: the layer keeps F.linear
    ],
)
def test_a_process_under_a_onednn_cap_chooses_as_that_cpu(cap, amx, packed):
    if not runs_avx512_core():
        packed = 0  # a cap only lowers what oneDNN uses: an AVX2-only CPU packs no bf16 weight under any
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
    env.pop("DNNL_MAX_CPU_ISA", None)
    done = subprocess.run(
        [sys.executable, "-c", UNDER_A_CAP], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert (seen["amx"], seen["packed"]) == (amx, packed)
    assert seen["error"] < 0.01  # bf16 weights and inputs: a few units of bf16's 2**-8
