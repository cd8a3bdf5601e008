"""Pixels on their way from a preprocessing worker to the job process: a file in shared memory (`/dev/shm`)
that the worker writes and names in its message, and that the job process maps and removes at once.

torch's own sharing sends a tensor's file descriptor, which the receiver then fetches from the sender over a
socket: a connection, an authentication handshake, the descriptor. In the job process the input thread does
this, and after each of those blocking calls it waits for the GIL, which the engine's thread holds between
the kernels it launches (`utils/background.py`): behind such an engine, with the GIL handed over every
1 ms, samples sent that way arrived at 76 a second where by name they arrive at 176
(`benchmarks/input_rate.py`, its transport rows). torch's `file_system` sharing opens them by name too,
but through a manager process per worker that inherits the job's standard output and error and, under
`--processes`, the pipe by which the launcher learns that a process ended: it held both some 2 s past the
job's end, and a killed process's shard claims looked alive to its siblings meanwhile.

A file holds the pixels and after them a nonce that the message carries too, so that a file which is not
the one written (removed, then made anew, empty, by the mapping) is refused rather than read as zeros.
The files of one pool are named `batchvl-pixels-<job pid>-<pool token>-<worker pid>-<n>`. The job process
removes each as it receives it; whenever the pool's workers stop (the pool's end, or their restart after
a worker failed) it removes those of its own never received (a sample sent by a worker that was then
killed, or waiting in the queue when the job stopped); and when a pool starts, those that a job process no
longer alive left behind (killed before its own removal: SIGKILL, the out-of-memory killer).

Whether a pool's job is alive is told by a lock, not by its pid: while it iterates, the pool holds an
exclusive `flock` on `batchvl-pixels-<job pid>-<pool token>.lock` (its forked workers share it), which the
kernel releases when the last of them dies, however it dies. A pool that starts and can take another's
lock removes that pool's files and its lock at once. A lock works across containers that share /dev/shm
(pids of another pid namespace mean nothing here) and is not fooled by a pid used again. Files with no
lock beside them (written by a version before the locks) are removed once their job's pid is gone and
they are old enough that no job could still be receiving them.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "batchvl-pixels"
LOCK_SUFFIX = ".lock"  # a pool's lock: `<its prefix>.lock`
NONCE_BYTES = 8
# A file with no lock beside it, of a job process that is gone, is removed once it is this old: a job
# receives its files within seconds, and another container's job (another pid namespace, its pids not seen
# here) may share /dev/shm
LEFT_BEHIND_AFTER_S = 600.0

_writer: _Writer | None = None  # set in a preprocessing worker by `write_as`


@dataclass
class _Writer:
    prefix: str
    count: int = 0

    def next_path(self) -> Path:
        self.count += 1
        return SHM_DIR / f"{self.prefix}-{os.getpid()}-{self.count}"


@dataclass(frozen=True)
class SharedPixels:
    """Pixels written to a file of shared memory, mapped here (`tensor`), and what a message names them by."""

    path: str
    nonce: int
    tensor: torch.Tensor

    def message(self) -> tuple:
        """What the receiver needs to map them: `receive`'s arguments."""
        return (self.path, tuple(self.tensor.shape), self.tensor.dtype, self.nonce)


def pool_prefix() -> str | None:
    """A new pool's file prefix, or None where there is no shared-memory folder to name files in (the
    workers then send torch's way)."""
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK):
        return None
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"


def write_as(prefix: str | None) -> None:
    """In a preprocessing worker: send pixels as files named after `prefix` (None: torch's way)."""
    global _writer
    _writer = _Writer(prefix) if prefix is not None else None


def writes_files() -> bool:
    return _writer is not None


def write(pixels: torch.Tensor) -> SharedPixels:
    """`pixels` copied into a new file of this worker's. Raises OSError where the file cannot be made
    whole (a full /dev/shm: the space is reserved first, not found missing by a write that would kill the
    worker; a file size limit)."""
    assert _writer is not None, "write_as was not called in this process"
    path = _writer.next_path()
    nbytes = pixels.numel() * pixels.element_size()
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, nbytes + NONCE_BYTES)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)
    storage = torch.UntypedStorage.from_file(str(path), True, nbytes + NONCE_BYTES)
    mapped = _view(storage, tuple(pixels.shape), pixels.dtype)
    mapped.copy_(pixels)
    nonce = secrets.randbits(63)
    _trailer(storage, nbytes).copy_(_nonce_bytes(nonce))
    return SharedPixels(str(path), nonce, mapped)


def receive(path: str, shape: tuple[int, ...], dtype: torch.dtype, nonce: int) -> torch.Tensor:
    """The pixels a worker wrote to `path`, mapped; the file removed (its pages go with the mapping)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    storage = torch.UntypedStorage.from_file(path, True, nbytes + NONCE_BYTES)
    os.unlink(path)
    if not torch.equal(_trailer(storage, nbytes), _nonce_bytes(nonce)):
        raise RuntimeError(f"{path} is not the file its preprocessing worker wrote (removed meanwhile?)")
    return _view(storage, shape, dtype)


def remove_unreceived(prefix: str) -> int:
    """Remove the files of the pool with `prefix` that nobody received; how many there were."""
    return sum(_removed(path) for path in SHM_DIR.glob(f"{prefix}-*"))


@contextlib.contextmanager
def owning(prefix: str | None) -> Iterator[None]:
    """While a pool iterates: hold the lock of its files' `prefix` (None: no files, nothing held); at its
    end remove the files never received, then the lock."""
    if prefix is None:
        yield
        return
    lock = SHM_DIR / f"{prefix}{LOCK_SUFFIX}"
    # Made under another name and locked before it is renamed into place, so that no other pool's sweep
    # can find it unlocked and take it for a dead job's
    making = lock.with_name(f"{lock.name}-new")
    descriptor = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        os.rename(making, lock)
        yield
    finally:
        remove_unreceived(prefix)
        _removed(lock)
        _removed(making)  # (a rename that failed)
        os.close(descriptor)


def remove_left_behind() -> int:
    """Remove the files that job processes no longer alive left behind: at once those of a pool whose
    lock nobody holds, and those with no lock once old enough; how many files (locks aside)."""
    removed = 0
    locked: set[str] = set()  # the prefixes of pools alive
    for lock in SHM_DIR.glob(f"{PREFIX}-*{LOCK_SUFFIX}"):
        prefix = lock.name.removesuffix(LOCK_SUFFIX)
        if _held(lock):
            locked.add(prefix)
        else:
            removed += remove_unreceived(prefix)
            _removed(lock)
    now = time.time()
    for path in SHM_DIR.glob(f"{PREFIX}-*"):
        if path.name.endswith(LOCK_SUFFIX) or _pool_of(path.name) in locked:
            continue
        pid = path.name[len(PREFIX) + 1 :].split("-", 1)[0]
        try:
            old = now - path.stat().st_mtime > LEFT_BEHIND_AFTER_S
        except OSError:
            continue  # received meanwhile
        if old and pid.isdigit() and not psutil.pid_exists(int(pid)):
            removed += _removed(path)
    return removed


def _held(lock: Path) -> bool:
    """Whether a pool alive holds `lock` (a lock that cannot be opened, another user's, counts as held)."""
    try:
        descriptor = os.open(lock, os.O_RDONLY)
    except OSError:
        return True  # gone meanwhile (its pool ended and removed its files) or not ours to open
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(descriptor)  # (releases the lock, if this took it)
    return False


def _pool_of(name: str) -> str:
    """The prefix of the pool that wrote the file `name` (its first four dash-separated parts)."""
    return "-".join(name.split("-")[:4])


def _removed(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:  # received meanwhile, or another user's in a shared /dev/shm: not this job's to remove
        return False
    return True


def _view(storage: torch.UntypedStorage, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The storage's first bytes as a tensor of `shape` and `dtype`."""
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _trailer(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, nbytes, (NONCE_BYTES,))


def _nonce_bytes(nonce: int) -> torch.Tensor:
    return torch.tensor(list(nonce.to_bytes(NONCE_BYTES, "little")), dtype=torch.uint8)
