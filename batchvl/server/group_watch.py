"""Run as a program beside a server batchvl launched (`process.py`): once batchvl's process is gone, however
it went (SIGKILL included), it stops the server's whole process group, SIGTERM then SIGKILL after a grace
period. The kernel's parent-death signal reaches only the launch command's own process: a command that
wraps the server without `exec` (a site script, a `conda run`-style wrapper) would leave the server itself
running on the node.

Arguments: batchvl's pid, the server's process group, the grace period in seconds. Standard library only,
so that it starts in a moment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

POLL_S = 0.2


def main() -> None:
    parent, group, grace_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is batchvl's to handle
    while os.getppid() == parent:  # once batchvl is gone, this process is another's child
        time.sleep(POLL_S)
    _signal(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _signal(group, 0) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _signal(group, signal.SIGKILL)


def _signal(group: int, signum: int) -> bool:
    """Send `signum` to the group; whether any of it was there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)
        return True
    return False


if __name__ == "__main__":
    main()
