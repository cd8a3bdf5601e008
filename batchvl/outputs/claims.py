"""Shard claims: one lock file per shard, so concurrent runs of a job split its shards instead of each
doing all of them (two `batchvl run` of one job, or Slurm tasks whose slices overlap after a change).

A run claims a shard just before reading it: `output.dir/_batchvl/claims/<shard>.lock`, created
atomically and only if absent (`OutputDir.create_exclusive`), naming the holder (host, pid and the
process's start time). Another run that finds a live claim skips the shard. A claim is stale once its
holder is gone: on the same host, its process no longer exists (or the pid now belongs to another
process); from another host, the holder has not refreshed the file's time for `STALE_S` (holders refresh
every `HEARTBEAT_S`). A stale claim is taken over by removing it and claiming again. Claims are removed
when their shard is committed and when the run ends, so a crash costs at most `STALE_S` of waiting on other
hosts. A killed run's claim on a shard that is committed (it was killed after the commit, or a later run
finished its rewrite) is never claimed again: a run removes every stale claim when it ends.

Taking a claim over, releasing ours and refreshing it act only on the claim that was read
(`OutputDir.remove_if_holds`, `touch_if_holds`). Locally this holds whatever the interleaving, so of two
runs that judged one claim stale, one takes it over and the other finds its claim and skips the shard. The
one gap needs three runs within microseconds: a taker that moved the other taker's new claim by mistake
puts it back, unless a third run has just claimed the free path; that run and the other taker then both run
the shard (committed once). On an object store, reading a claim and removing or rewriting it are separate
requests: two takers can both win, and a release or a heartbeat racing a takeover can remove or rewrite the
taker's new claim; the shard is then run twice and committed once.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import psutil

from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir

HEARTBEAT_S = 60.0
STALE_S = 600.0
# a process's start time is its start after boot plus the boot time, which each reader derives from the
# wall clock in whole seconds: two processes can read one start a second apart (more after a clock step)
STARTED_SLACK_S = 1.5


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
            return abs(psutil.Process(self.pid).create_time() - self.started) <= STARTED_SLACK_S
        except psutil.NoSuchProcess:
            return False


class ShardClaims:
    """The claims of one job's output folder, seen from one run (`holder`: the job's own process)."""

    def __init__(self, out: OutputDir, holder: Holder):
        self.out = out
        self.holder = holder
        self._claim = json.dumps(asdict(holder))
        self._refreshed = time.monotonic()

    def path(self, shard: str) -> str:
        return self.out.join(layout.CLAIMS, f"{shard}.lock")

    def acquire(self, shard: str) -> Holder | None:
        """Claim the shard; None when it is now ours, else the live holder that has it."""
        path = self.path(shard)
        while True:
            if self.out.create_exclusive(path, self._claim):
                return None
            try:
                claim = self.out.read_bytes(path)
            except FileNotFoundError:
                continue  # removed between the two calls (committed and released): try again
            holder = _holder_in(claim)
            if holder == self.holder:
                return None
            if not self._is_stale(path, holder):
                return holder
            self.out.remove_if_holds(path, claim)  # only that claim: another taker's stays

    def release(self, shard: str) -> None:
        """Remove the shard's claim if it is ours."""
        self.out.remove_if_holds(self.path(shard), self._claim.encode())

    def refresh(self, shards: Iterable[str], every_s: float = HEARTBEAT_S) -> None:
        """Touch our claims among `shards` (at most every `every_s`), so other hosts see us alive."""
        now = time.monotonic()
        if now - self._refreshed < every_s:
            return
        self._refreshed = now
        for shard in shards:
            self.out.touch_if_holds(self.path(shard), self._claim.encode())

    def remove_stale(self) -> None:
        """Remove the claims whose holders are gone, ours kept (each only if it is still the one read)."""
        for path in self.out.find(self.out.join(layout.CLAIMS), "*.lock"):
            try:
                claim = self.out.read_bytes(path)
            except FileNotFoundError:
                continue  # released since the listing
            holder = _holder_in(claim)
            if holder != self.holder and self._is_stale(path, holder):
                self.out.remove_if_holds(path, claim)

    def _is_stale(self, path: str, holder: Holder) -> bool:
        if holder.host == self.holder.host:
            return not holder.is_alive()
        modified = self.out.modified(path)
        return modified is None or time.time() - modified > STALE_S


def _holder_in(claim: bytes) -> Holder:
    try:
        return Holder(**json.loads(claim))
    except (ValueError, TypeError):
        return Holder("?", -1, 0.0)  # unreadable: judged by its age alone
