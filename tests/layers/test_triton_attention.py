"""The language model's Triton attention, checked on CPU tensors by Triton's interpreter in a process of
its own (tests/layers/triton_kernel_checks.py: the interpreter must be on before Triton is first imported,
and on for this whole session it would give every CPU cache these kernels)."""

from pathlib import Path

import pytest
import torch

from batchvl.layers import triton_attention, triton_grouped_decode
from tests.layers.interpreter import run_interpreter_checks

CHECKS = Path(__file__).with_name("triton_kernel_checks.py")


@pytest.mark.timeout(900)  # its process of checks is itself limited to 600 s
def test_the_kernels_equal_torchs_attention_and_the_engine_with_them_equals_generate():
    run_interpreter_checks(CHECKS, 13, timeout_s=600)


def test_the_kernels_are_for_cuda_caches_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_attention.takes(torch.zeros(1))  # a CPU cache keeps the native kernels
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_attention.takes(torch.zeros(1))


def test_the_kernels_find_triton_language_among_their_modules_globals():
    """Triton 3.2, the one torch 2.6 requires, compiles a kernel with only its module's globals in scope, not
    the names of the function that defined it: without `tl` there, neither kernel built (NameError) and a GPU
    stayed on torch's path. (test_the_kernels_compile_for_a_hopper_gpu compiles them with Triton 3.2 in
    make test-oldest-torch.)"""
    triton = pytest.importorskip("triton")
    for kernel in triton_attention._kernels():
        assert kernel.fn.__globals__["tl"] is triton.language


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_a_hopper_gpu(dtype):
    # The interpreter runs the kernels' Python; compiling them (here, to a Hopper's code, no GPU needed)
    # checks what only the compiler does: loop-carried types, dot shapes, constexpr use.
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    decode, prefill = triton_attention._kernels()
    tensors = {name: f"*{dtype}" for name in ("out", "query", "kv")}
    strides = ("stride_ot", "stride_oh", "stride_qh", "stride_qt", "stride_kv", "stride_kh", "stride_ks")
    common = {**tensors, "scale": "fp32", **dict.fromkeys(strides, "i32")}
    sizes = {"GROUP": 6, "HEAD_DIM": 128, "BLOCK_D": 128}
    decode_args = {
        **common,
        **dict.fromkeys(("rows", "pages", "starts", "lengths"), "*i64"),
        "page_size": "i32",
    }
    prefill_args = {
        **common,
        **dict.fromkeys(("starts", "counts", "slots", "lengths"), "*i64"),
        "stride_sb": "i32",
    }
    precision = "ieee" if dtype == "fp32" else "tf32"
    # float32's tiles of 16 queries, exact products; bf16's of 64 on tensor cores
    block_m = triton_attention.BLOCK_QUERIES if dtype == "fp32" else triton_attention.BLOCK_QUERIES_16BIT
    builds = [
        (decode, decode_args, {**sizes, "BLOCK_N": triton_attention.BLOCK_KEYS}),
        (prefill, prefill_args, {**sizes, "BLOCK_M": block_m, "BLOCK_N": 64, "PRECISION": precision}),
    ]
    for kernel, arguments, constants in builds:
        order = list(kernel.arg_names)
        signature = {name: arguments.get(name, "constexpr") for name in order}
        source = ASTSource(kernel, signature, constants)
        # with the launches' own compile options
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options=triton_grouped_decode.CONTRACTED
        )
        assert ".entry" in compiled.asm["ptx"]
