"""Row counts rounded up to a bounded set of buckets, and the packed linear layers that use them."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from batchvl.layers.packed_linear import PackedLinear
from batchvl.layers.row_buckets import MAX_BUCKETS, bucket_rows, pads_rows, power_of_two_at_least
from tests.conftest import bf16_packs


def test_buckets_hold_their_rows_are_few_and_waste_at_most_an_eighth():
    buckets = {rows: bucket_rows(rows) for rows in range(1, 8193)}
    assert all(bucket >= rows for rows, bucket in buckets.items())
    assert len(set(buckets.values())) == MAX_BUCKETS == 56
    assert all(bucket % 16 == 0 for bucket in buckets.values())
    assert all(bucket - rows < 16 for rows, bucket in buckets.items() if rows <= 128)
    assert all(bucket <= rows * 1.125 for rows, bucket in buckets.items() if rows > 128)
    assert [bucket_rows(r) for r in (1, 16, 17, 129, 257, 2996, 4097)] == [16, 16, 32, 144, 288, 3072, 4608]


class KernelRows(TorchDispatchMode):
    """Records the row count of every oneDNN linear call."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_linear_pointwise" in str(func):
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_packed_linear_runs_its_kernel_on_bucketed_rows_and_returns_just_the_real_ones():
    torch.manual_seed(0)
    # bf16 where oneDNN packs it (the same bits as F.linear), fp32 where it cannot (within rounding)
    dtype = torch.bfloat16 if bf16_packs() else torch.float32
    linear = torch.nn.Linear(64, 48).to(dtype)
    packed = PackedLinear(linear)
    shapes = [(5, 64), (16, 64), (3, 100, 64), (300, 64)]
    inputs = [torch.randn(shape, dtype=dtype) for shape in shapes]
    with KernelRows() as seen:
        outputs = [packed(x) for x in inputs]
    assert seen.rows == [16, 16, 320, 320]
    for x, out in zip(inputs, outputs, strict=True):
        assert out.shape == (*x.shape[:-1], 48)
        expected = F.linear(x, linear.weight, linear.bias)
        if dtype == torch.bfloat16:
            assert torch.equal(out, expected)
        else:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_the_least_power_of_two_covering_a_count():
    assert [power_of_two_at_least(n) for n in (1, 2, 3, 16, 17, 640, 1024, 1025)] == [
        1, 2, 4, 16, 32, 1024, 1024, 2048,
    ]  # fmt: skip


def test_steps_are_padded_for_the_cpus_kernels_alone():
    assert pads_rows("cpu") and pads_rows(torch.device("cpu"))
    assert not pads_rows("cuda") and not pads_rows(torch.device("cuda", 1)) and not pads_rows("meta")
