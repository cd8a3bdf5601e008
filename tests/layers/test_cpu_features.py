"""AMX as batchvl sees it: the CPU's tiles, unless oneDNN, which runs torch's linear layers and attention
micro-kernels, is capped below them; then batchvl chooses its kernels as on a CPU without the tiles. The
tiles are faked (torch's probe answers yes), so a CPU without them checks the cap as well as one with."""

import pytest
import torch

from batchvl.layers import cpu_features


@pytest.fixture
def fresh_answer(monkeypatch):
    for name in cpu_features.ONEDNN_ISA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cpu_features.has_amx.cache_clear()
    yield
    cpu_features.has_amx.cache_clear()  # the next caller asks under the real environment again


def cpu_with_tiles(monkeypatch, tiles: bool) -> None:
    """torch's probe of the CPU answers `tiles`: AMX tiles the OS lets this process use, or none."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: tiles)


@pytest.mark.parametrize(
    ("name", "cap", "allowed"),
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", False),
        ("ONEDNN_MAX_CPU_ISA", "avx2", False),
        ("DNNL_MAX_CPU_ISA", "AVX512_CORE_VNNI", False),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core", False),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", True),
        ("ONEDNN_MAX_CPU_ISA", "AVX10_1_512_AMX_FP16", True),
        ("ONEDNN_MAX_CPU_ISA", "ALL", True),
        # oneDNN reads the cap in any case
        ("ONEDNN_MAX_CPU_ISA", "avx512_core_amx", True),
        ("DNNL_MAX_CPU_ISA", "all", True),
    ],
)
def test_a_cap_below_amx_turns_the_tiles_off(fresh_answer, monkeypatch, name, cap, allowed):
    cpu_with_tiles(monkeypatch, True)
    monkeypatch.setenv(name, cap)
    assert cpu_features.onednn_allows_amx() is allowed
    assert cpu_features.has_amx() is allowed


@pytest.mark.parametrize("tiles", [True, False])
def test_without_a_cap_the_cpu_decides(fresh_answer, monkeypatch, tiles):
    cpu_with_tiles(monkeypatch, tiles)
    assert cpu_features.onednn_allows_amx()
    assert cpu_features.has_amx() is tiles
