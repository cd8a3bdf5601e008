"""batchvl: batch, offline captioning and visual question answering with vision-language models.

The Python API (`batchvl.caption`, `batchvl.run`, `batchvl.load_model`, `batchvl.read_results`,
`batchvl.read_labels`) is imported on first use, so `import batchvl` stays light.
"""

import os

# Defaults for torch's CPU libraries, read when they load: set on `import batchvl`, before the API or a
# command imports torch; a user's own value wins. The measurements: docs/benchmarks.md, "CPU runtime
# settings".
# oneDNN compiles a kernel per matmul shape: this cache keeps every kernel the engine's row buckets need.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "2048")
# OpenMP threads spin about 50 us between ops, then sleep: quick on a quiet CPU, fair beside busy processes.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")

from batchvl import errors  # noqa: E402  (light: what a notebook catches, `batchvl.errors.UserError`)
from batchvl.version import __version__  # noqa: E402  (the environment above is set before any import)

_API = ("Results", "caption", "load_model", "read_labels", "read_results", "run")
__all__ = ["__version__", "errors", *_API]


def __getattr__(name: str):
    if name in _API:
        from batchvl import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchvl' has no attribute {name!r}")
