"""AMX as batchvl sees it: the CPU's tiles, unless oneDNN, which runs torch's linear layers and attention
micro-kernels, is capped below them; then batchvl chooses its kernels as on a CPU without the tiles."""

import pytest

from batchvl.layers import cpu_features


@pytest.fixture
def fresh_answer(monkeypatch):
    for name in cpu_features.ONEDNN_ISA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cpu_features.has_amx.cache_clear()
    yield
    cpu_features.has_amx.cache_clear()  # the next caller asks under the real environment again


@pytest.mark.parametrize(
    ("name", "cap", "allowed"),
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", False),
        ("ONEDNN_MAX_CPU_ISA", "avx2", False),
        ("DNNL_MAX_CPU_ISA", "AVX512_CORE_VNNI", False),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", True),
        ("ONEDNN_MAX_CPU_ISA", "AVX10_1_512_AMX_FP16", True),
        ("ONEDNN_MAX_CPU_ISA", "ALL", True),
    ],
)
def test_a_cap_below_amx_turns_the_tiles_off(fresh_answer, monkeypatch, name, cap, allowed):
    monkeypatch.setenv(name, cap)
    assert cpu_features.onednn_allows_amx() is allowed
    if not allowed:
        assert not cpu_features.has_amx()


def test_without_a_cap_onednn_may_use_them(fresh_answer):
    assert cpu_features.onednn_allows_amx()
