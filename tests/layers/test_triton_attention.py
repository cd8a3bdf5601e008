"""The language model's Triton attention, checked on CPU tensors by Triton's interpreter in a process of
its own (tests/layers/triton_kernel_checks.py: the interpreter must be on before Triton is first imported,
and on for this whole session it would give every CPU cache these kernels)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchvl.layers import triton_attention

CHECKS = Path(__file__).with_name("triton_kernel_checks.py")


def test_the_kernels_equal_torchs_attention_and_the_engine_with_them_equals_generate():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        str(CHECKS),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "9 passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def test_the_kernels_are_for_cuda_caches_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_attention.takes(torch.zeros(1))  # a CPU cache keeps the native kernels
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_attention.takes(torch.zeros(1))
