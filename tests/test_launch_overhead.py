"""benchmarks/launch_overhead.py: every Triton kernel of the engine compiled offline for a GPU (Triton's own
compiler and ptxas, as tests/test_kernel_resources.py compiles them) and its launch timed with a launcher
that runs nothing, on this CPU."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import launch_overhead  # noqa: E402


def test_each_kernels_launch_is_timed_with_triton_s_dispatch_apart():
    rows = launch_overhead.measure(calls=20)
    assert [row["launch"] for row in rows] == list(launch_overhead.launches())
    for row in rows:
        assert row["kernels"] == 1, row  # each launch function launched its one kernel, recorded once
        assert 0 < row["triton_dispatch_us"] < row["host_us"], row
        rest = row["host_us"] - row["triton_dispatch_us"]
        assert row["launch_function_us"] == pytest.approx(rest, abs=0.02)
