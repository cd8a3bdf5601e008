"""Row counts rounded up to a bounded set, so oneDNN builds each matmul kernel once per process.

oneDNN compiles a kernel for every distinct matmul shape it sees and keeps it in its primitive cache. The
engine's shapes change all the time: a step packs however many tokens were scheduled, a vision call
however many patches its images have. Measured with 2 threads on a CPU with AMX, building the bf16
kernel for a new row count took 3-13 ms (the 2048->512 vision projection: 9.5 ms) against 0.4-1 ms to
run it, and in fp32 a new row count cost about 3 ms: a job spent most of its matmul time compiling.

Rounded up to a bucket, a layer sees at most `MAX_BUCKETS` row counts up to 8,192 rows (and one more
per doubling beyond), so the kernels are built once and reused for the rest of the process. Buckets are
multiples of 16 up to 128, then eight per doubling (every 16 rows to 256, 32 to 512, ...): the padded
rows add at most 12.5% to a call of more than 128 rows, and below that the weights' memory traffic, not
the rows, sets the time (the 512x32768 output head: 0.76 ms for 1 row, 0.86 ms for 16).
"""

from __future__ import annotations

import torch

SMALL_STEP = 16  # buckets up to SMALL_LIMIT are multiples of this
SMALL_LIMIT = 128
STEPS_PER_DOUBLING = 8
MAX_BUCKETS = SMALL_LIMIT // SMALL_STEP + STEPS_PER_DOUBLING * 6  # up to 8,192 rows


def bucket_rows(rows: int) -> int:
    """The smallest bucket holding `rows` rows (see the module docstring)."""
    if rows <= SMALL_LIMIT:
        return max(SMALL_STEP, -(-rows // SMALL_STEP) * SMALL_STEP)
    step = (1 << ((rows - 1).bit_length() - 1)) // STEPS_PER_DOUBLING
    return -(-rows // step) * step


def pads_rows(device: torch.device | str) -> bool:
    """Whether a step's rows on `device` are padded to their bucket: on the CPU, for oneDNN's kernels. A
    GPU's matmul library takes any row count without building anything: padding rows there would only add
    work, up to an eighth of an eager step's (a vision call is not padded there either)."""
    return torch.device(device).type == "cpu"


def power_of_two_at_least(n: int) -> int:
    """The least power of two of at least n (n >= 1): a Triton block's size, or a graph's shape bound."""
    return 1 << (n - 1).bit_length()
