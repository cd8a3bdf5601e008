"""batchvl: batch, offline captioning and visual question answering with vision-language models.

The Python API (`batchvl.caption`, `batchvl.run`, `batchvl.load_model`, `batchvl.read_results`,
`batchvl.read_labels`) is imported on first use, so `import batchvl` stays light.
"""

import os

# torch's oneDNN CPU kernels keep one compiled primitive per distinct matmul shape. The engine rounds the
# row counts of its matmuls up to a bounded set (`batchvl.layers.row_buckets`), so a model's layers need a
# few hundred primitives, built once each (3-13 ms apiece with AMX) and reused: the cache must hold them
# all, or evicted kernels are rebuilt over and over (at 64 entries a job spent more time building kernels
# than running them). Read when torch first uses oneDNN, so it is set on `import batchvl`, before the API
# or a command runs anything in torch; a user's value wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "2048")
# OpenMP threads that finish their share of an op wait for the next one: libgomp's default spins for about
# 3 ms first, so beside another CPU-bound process (a second job, a busy preprocessing worker) the spinning
# threads take the cores the others need (the throughput workload on 2 cores ran 9x slower beside one busy
# process). Never spinning (a passive policy) holds under contention but wakes a sleeping thread for every
# op, which cost 25% on a quiet CPU with AMX, where the ops are short. A spin of 5,000 rounds (about 50 us
# by libgomp's own estimate) got both: the best quiet time, and 1.9x slower beside a busy process on 2
# cores, the share of the CPU it lost. Read when the OpenMP runtime loads (with torch), so it is set here,
# before anything imports torch; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")

__version__ = "0.1.0"

_API = ("Results", "caption", "load_model", "read_labels", "read_results", "run")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from batchvl import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchvl' has no attribute {name!r}")
