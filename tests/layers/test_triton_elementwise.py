"""The elementwise Triton kernels, checked on CPU tensors by Triton's interpreter in a process of their own
(tests/layers/triton_elementwise_checks.py; the interpreter must be on before Triton is first imported),
and compiled for a Hopper GPU, which checks what only the compiler does."""

from pathlib import Path

import pytest

from batchvl.layers import triton_elementwise
from tests.layers.interpreter import run_interpreter_checks

CHECKS = Path(__file__).with_name("triton_elementwise_checks.py")


@pytest.mark.timeout(600)
def test_the_kernels_equal_transformers_modules_under_the_interpreter():
    run_interpreter_checks(CHECKS, 49, timeout_s=500)


def test_the_module_imports_without_triton():
    # Triton is imported when a kernel is first built: the module imports on any machine
    assert "triton" not in triton_elementwise.__dict__


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_a_hopper_gpu(dtype):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = triton_elementwise._kernels()
    pointers = ("out", "new_residual", "x", "residual", "weight", "bias", "gate_up", "cos", "sin")
    pointers += ("cache", "values")  # (the rotation's into a cache layer)
    arguments = {**dict.fromkeys(pointers, f"*{dtype}"), "slots": "*i64", "eps": "fp32"}
    rotary_blocks = {"HALF": 64, "BLOCK_H": 16, "BLOCK_D": 64}
    builds = [
        *(
            (kernels.rms_norm, {"HAS_RESIDUAL": residual, "BLOCK": 2048, "ROWS": rows})
            for residual in (True, False)
            for rows in (1, 4)
        ),
        (kernels.silu_and_mul, {"BLOCK": triton_elementwise.BLOCK_COLUMNS}),
        (kernels.quick_gelu, {"HAS_BIAS": True, "BLOCK": triton_elementwise.BLOCK_COLUMNS}),
        *(
            (kernels.layer_norm, {"HAS_RESIDUAL": residual, "BLOCK": 2048, "ROWS": rows})
            for residual in (True, False)
            for rows in (1, 4)
        ),
        *(
            (kernels.rotary, {**rotary_blocks, "ROUND_STEPS": dtype == "bf16", "INTO_CACHE": cache})
            for cache in (False, True)
        ),
    ]
    target = GPUTarget("cuda", 90, 32)
    for kernel, constants in builds:
        signature = {
            name: arguments.get(name, "constexpr" if name in constants else "i32")
            for name in kernel.arg_names
        }
        source = ASTSource(kernel, signature, constants)
        compiled = triton.compile(source, target=target, options=triton_elementwise.EAGER_ROUNDING)
        assert ".entry" in compiled.asm["ptx"]
        # no product and sum contracted into one rounding, as the eager ops round twice
        assert "fma.rn.f32" not in compiled.asm["ptx"], kernel.fn.__name__
