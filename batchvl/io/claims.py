"""Shard claims: one lock file per shard, so concurrent runs of a job split its shards instead of each
doing all of them (two `batchvl run` of one job, or Slurm tasks whose slices overlap after a change).

A run claims a shard just before reading it: `output.dir/_batchvl/claims/<shard>.lock`, created
atomically and only if absent, naming the holder (host, pid and the process's start time). Another run
that finds a live claim skips the shard. A claim is stale once its holder is gone: on the same host, its
process no longer exists (or the pid now belongs to another process); from another host, the holder has
not refreshed the file's time for `STALE_S` (holders refresh every `HEARTBEAT_S`). A stale claim is taken
over by renaming it away first, which only one taker can do. Claims are removed when their shard is
committed and when the run ends, so a crash costs at most `STALE_S` of waiting on other hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import psutil

from batchvl.io.writers import create_text_exclusive

CLAIM_DIR = os.path.join("_batchvl", "claims")
HEARTBEAT_S = 60.0
STALE_S = 600.0


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float  # the process's start time: tells a reused pid from the holder

    @classmethod
    def of_process(cls, pid: int) -> Holder:
        return cls(socket.gethostname(), pid, psutil.Process(pid).create_time())

    def is_alive(self) -> bool:
        """Whether this holder runs, as far as this host can tell (another host's is judged by time)."""
        try:
            return psutil.Process(self.pid).create_time() == self.started
        except psutil.NoSuchProcess:
            return False


class ShardClaims:
    """The claims of one job's output folder, seen from one run (`holder`: the job's own process)."""

    def __init__(self, out_dir: str, holder: Holder):
        self.folder = os.path.join(out_dir, CLAIM_DIR)
        self.holder = holder
        self._refreshed = time.monotonic()

    def path(self, shard: str) -> str:
        return os.path.join(self.folder, f"{shard}.lock")

    def acquire(self, shard: str) -> Holder | None:
        """Claim the shard; None when it is now ours, else the live holder that has it."""
        path = self.path(shard)
        while True:
            if create_text_exclusive(path, json.dumps(asdict(self.holder))):
                return None
            holder = self._read(path)
            if holder is None:
                continue  # removed between the two calls (committed and released): try again
            if holder == self.holder:
                return None
            if not self._is_stale(path, holder):
                return holder
            taken = f"{path}.stale-{uuid.uuid4().hex}"
            with contextlib.suppress(FileNotFoundError):  # another taker was first: try again
                os.rename(path, taken)
                os.remove(taken)

    def release(self, shard: str) -> None:
        """Remove the shard's claim if it is ours."""
        path = self.path(shard)
        if self._read(path) == self.holder:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def refresh(self, shards: Iterable[str], every_s: float = HEARTBEAT_S) -> None:
        """Touch our claims among `shards` (at most every `every_s`), so other hosts see us alive."""
        now = time.monotonic()
        if now - self._refreshed < every_s:
            return
        self._refreshed = now
        for shard in shards:
            path = self.path(shard)
            if self._read(path) == self.holder:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)

    @staticmethod
    def _read(path: str) -> Holder | None:
        try:
            with open(path, encoding="utf-8") as handle:
                return Holder(**json.load(handle))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            return Holder("?", -1, 0.0)  # unreadable: judged by its age alone

    def _is_stale(self, path: str, holder: Holder) -> bool:
        if holder.host == self.holder.host:
            return not holder.is_alive()
        try:
            return time.time() - os.path.getmtime(path) > STALE_S
        except FileNotFoundError:
            return True
