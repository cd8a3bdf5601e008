"""The engine's Triton kernels compiled for a Hopper GPU on a machine without one
(benchmarks/kernel_resources.py): through their own launch functions, so that Triton specializes their
arguments as a launch does, at the defaults and at every launch setting the GPU check's sweeps time; what
each takes of an SM; and Triton's driver and launches as they were afterwards."""

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def resources():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module("kernel_resources")


@pytest.fixture(scope="module")
def hopper_rows(resources):
    return resources.measure(90)


def test_every_kernel_compiles_at_its_defaults_and_at_every_swept_setting(resources, hopper_rows):
    from decode_attention import LAUNCHES
    from fused_elementwise import SWEEP

    launches = {}
    for row in hopper_rows:
        launches.setdefault(row["case"], []).append(row["launch"])
    assert launches["decode_2b"] == launches["decode_7b"] == [{}, *LAUNCHES]
    assert launches["prefill_2b"] == [{}]
    for op in resources.elementwise_launches():
        assert launches[op] == [{}, *SWEEP.get(op, ())]


def test_no_kernel_spills_its_registers_at_its_defaults(hopper_rows):
    """Compiled from its signature alone, without a launch's specialization, the decode kernel spilled and
    loaded scalars: the launch functions' own arguments are what a GPU compiles."""
    defaults = [row for row in hopper_rows if not row["launch"]]
    assert len(defaults) == 11  # 2 decode shapes, the prefill, 8 elementwise ops
    assert all(row["spill_stack_bytes"] == 0 and row["registers"] > 0 for row in defaults)
    # and every kernel, at every setting, reads and writes its bf16 tiles in vectors
    assert all(row["scalar_16bit_accesses"] == 0 for row in hopper_rows)
    attention = [row for row in defaults if row["case"] in ("decode_2b", "decode_7b", "prefill_2b")]
    assert all(row["programs_per_sm"] >= 2 for row in attention)


def test_an_element_at_a_time_is_told_from_vectors_in_the_ptx(resources):
    ptx = """
        ld.global.b16 %rs1, [%rd1];
        @%p2 ld.global.L1::evict_last.b16 { %rs2 }, [ %rd2 + 0 ];
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd3 + 0 ];
        ld.global.v2.b16 { %rs3, %rs4 }, [ %rd4 + 0 ];
        ld.global.b64 %rd5, [ %rd6 + 0 ];
        st.global.b16 [ %rd7 + 0 ], { %rs5 };
        st.global.v4.b32 [ %rd8 + 0 ], { %r5, %r6, %r7, %r8 };
    """
    assert resources.scalar_16bit_accesses(ptx) == 3


def test_what_an_sm_holds_is_bound_by_registers_threads_and_shared_memory(resources):
    # 168 registers a thread, 4 warps: 5,376 a warp, 21,504 a program: 3 of 65,536
    assert resources.programs_per_sm(168, 4, 40960, 90) == 3
    # 170 a thread: 5,440 a warp, given in units of 256, 5,632: 2 programs where 21,760 would fit 3
    assert resources.programs_per_sm(170, 4, 0, 90) == 2
    assert resources.programs_per_sm(32, 4, 0, 90) == 16  # 2,048 threads an SM
    assert resources.programs_per_sm(32, 4, 83456, 80) == 1  # an A100's 164 KB of shared memory
    assert resources.programs_per_sm(16, 1, 0, 90) == 32  # at most 32 programs


def test_compiling_offline_leaves_triton_as_it_was(resources):
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    before = (driver._active, JITFunction.__getitem__)
    with resources.compiling_for(90) as compiled:
        resources.elementwise_launches()["silu_and_mul"]()
    ((name, kernel),) = compiled
    assert name == "silu_and_mul_kernel" and kernel.metadata.target.arch == 90
    assert (driver._active, JITFunction.__getitem__) == before
