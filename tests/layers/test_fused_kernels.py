"""`engine.fused_kernels`' swaps: checked on CPU tensors by Triton's interpreter in a process of their own
(tests/layers/fused_kernels_checks.py: each swapped module against transformers', and a tiny model of
every family against `generate`). The loader's side: tests/models/test_fused_kernels_setting.py."""

from pathlib import Path

import pytest

from tests.layers.interpreter import run_interpreter_checks

CHECKS = Path(__file__).with_name("fused_kernels_checks.py")


@pytest.mark.timeout(600)
def test_the_swapped_modules_and_models_equal_transformers_under_the_interpreter():
    run_interpreter_checks(CHECKS, 40, timeout_s=500)
