"""The grouped decode kernel: checked against torch's attention by Triton's interpreter in a process of its
own (tests/layers/triton_grouped_decode_checks.py), compiled for a Hopper GPU, and its choice of splits."""

from pathlib import Path

import pytest

from batchvl.layers import triton_attention, triton_grouped_decode
from batchvl.layers.triton_grouped_decode import split_count
from tests.layers.interpreter import run_interpreter_checks

CHECKS = Path(__file__).with_name("triton_grouped_decode_checks.py")


@pytest.mark.timeout(400)
def test_the_grouped_kernel_and_the_prefill_tiles_equal_torchs_attention():
    run_interpreter_checks(CHECKS, 16, timeout_s=300)


def test_sequences_that_fill_the_gpu_are_not_split():
    assert split_count(sequences=256, kv_heads=2, mean_keys=2000) == 1  # 512 programs already
    assert split_count(sequences=64, kv_heads=4, mean_keys=100_000) == 2  # 256 programs, doubled to 512


def test_few_long_sequences_are_split_in_powers_of_two_of_no_fewer_than_256_keys():
    assert split_count(sequences=1, kv_heads=2, mean_keys=100_000) == 16  # at most 16
    assert split_count(sequences=4, kv_heads=2, mean_keys=2048) == 8  # 8 splits of 256 keys
    assert split_count(sequences=4, kv_heads=2, mean_keys=2047) == 4  # 8 would be under 256 keys
    assert split_count(sequences=4, kv_heads=2, mean_keys=511) == 1  # two halves under 256 keys


def test_grouped_heads_take_the_grouped_kernel():
    assert triton_attention.decode_kernel_name(12, 2) == "grouped"  # Qwen2-VL-2B
    assert triton_attention.decode_kernel_name(28, 4) == "grouped"  # 7B
    assert triton_attention.decode_kernel_name(16, 16) == "per_head"


def test_the_kernels_find_triton_language_among_their_modules_globals():
    """As triton_attention's (see its test): Triton 3.2 compiles with the module's globals only."""
    triton = pytest.importorskip("triton")
    for kernel in triton_grouped_decode._kernels():
        assert kernel.fn.__globals__["tl"] is triton.language


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("group,splits", [(6, 1), (7, 4)])
def test_the_kernels_compile_for_a_hopper_gpu(dtype, group, splits):
    """What the interpreter does not check (dot shapes and dtypes, loop-carried types, constexpr branches),
    by compiling for a Hopper's code; no GPU needed."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    split_kernel, merge_kernel = triton_grouped_decode._kernels()
    tensors = {"out": f"*{dtype}", "query": f"*{dtype}", "kv": f"*{dtype}"}
    parts = {"part_acc": "*fp32", "part_best": "*fp32", "part_total": "*fp32"}
    ints = dict.fromkeys(("rows", "pages", "starts", "lengths"), "*i64")
    strides = ("stride_ot", "stride_oh", "stride_qh", "stride_qt", "stride_kv", "stride_kh", "stride_ks")
    split_args = {
        **tensors,
        **parts,
        **ints,
        "scale": "fp32",
        "page_size": "i32",
        **dict.fromkeys(strides, "i32"),
    }
    precision = "ieee" if dtype == "fp32" else "tf32"
    sizes = {"HEAD_DIM": 128, "BLOCK_D": 128}
    split_constants = {
        **sizes, "GROUP": group, "GROUP_PADDED": 16, "BLOCK_N": 64, "SPLITS": splits, "PRECISION": precision
    }  # fmt: skip
    builds = [(split_kernel, split_args, split_constants)]
    if splits > 1:
        merge_args = {**tensors, **parts, **ints, "stride_ot": "i32", "stride_oh": "i32"}
        builds.append((merge_kernel, merge_args, {**sizes, "SPLITS": splits}))
    for kernel, arguments, constants in builds:
        signature = {name: arguments.get(name, "constexpr") for name in kernel.arg_names}
        source = ASTSource(kernel, signature, constants)
        # with the launches' own compile options
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options=triton_grouped_decode.CONTRACTED
        )
        assert ".entry" in compiled.asm["ptx"]
