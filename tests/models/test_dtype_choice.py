"""`model.dtype: auto` runs bf16 only where the CPU has native bf16 matmuls, and an explicit bfloat16 on
a CPU without them says, once, what it costs there."""

import logging
import re

import pytest
import torch

from batchvl.models.loader import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(("capability", "dtype"), [("AVX2", torch.float32), ("AVX512", torch.bfloat16)])
def test_auto_picks_bf16_only_where_it_is_native(monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert resolve_dtype("auto", CPU) == dtype
    assert resolve_dtype("float32", CPU) == torch.float32


def test_an_explicit_bf16_without_native_support_warns_with_the_measured_cost(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.WARNING, logger="batchvl.models.loader"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    (record,) = caplog.records
    assert "this CPU (AVX2) has no native bf16 matmul" in record.getMessage()
    assert re.search(r"took \d+x as long as fp32 here; use model.dtype: auto", record.getMessage())


def test_an_explicit_bf16_with_native_support_is_quiet(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with caplog.at_level(logging.WARNING, logger="batchvl.models.loader"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert caplog.records == []
