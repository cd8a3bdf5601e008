"""Triton kernels checked on CPU tensors by Triton's interpreter, in a pytest process of their own: the
interpreter must be on before Triton is first imported, and on for the whole test session it would give
every CPU tensor these kernels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreter_checks(checks: Path, num_checks: int, timeout_s: float) -> None:
    """Run the checks file under the interpreter; every one of its `num_checks` must pass, none skip."""
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
        str(checks),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{num_checks} passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def widen_bfloat16_dots() -> None:
    """Make the interpreter's `tl.dot` of bfloat16 operands multiply their values: Triton 3.9's interpreter
    keeps bfloat16 as raw 16-bit integers and multiplies those (a product off by 1e10). The operands are
    widened to float32 first, which is what a GPU's bfloat16 tensor cores compute: exact products, float32
    sums. Called in the checks' own process, after the interpreter is on."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bfloat16", False):
        return
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    dot.widens_bfloat16 = True
    builder.create_dot = dot
