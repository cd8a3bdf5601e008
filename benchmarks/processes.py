"""The throughput benchmark's processes: the environment its peers start in, and what a method's child
measures of a process (its start-up, its peak memory)."""

from __future__ import annotations

import os
import time
from pathlib import Path

# The environment the benchmark was given, before importing batchvl sets its OpenMP wait policy: the
# peers and the matmul probes run in it; batchvl's child gets batchvl's settings from the parent (its torch
# loads first). Every benchmark module imports batchvl inside functions only, so this is still the given one.
PEER_ENV = dict(os.environ)


def since_process_start() -> float:
    """Seconds since this process started: a method's start-up ends at its first result."""
    import psutil

    return time.time() - psutil.Process().create_time()


def peak_rss_kb(pid: int) -> int:
    """A live process's peak resident set (VmHWM), in KiB: of a server or engine process the method did not
    wait for, which getrusage does not count."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0
