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
