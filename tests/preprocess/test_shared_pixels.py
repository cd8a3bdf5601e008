"""Pixels cross from a preprocessing worker to the job process as shared-memory files the message names: the
receiver maps and removes each, refuses a file that is not the one written, and no file outlives its job."""

import contextlib
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import psutil
import pytest
import torch

from batchvl.preprocess import shared_pixels
from batchvl.preprocess.media import PreparedMedia, host_pixels

pytestmark = pytest.mark.skipif(shared_pixels.pool_prefix() is None, reason="no writable /dev/shm")


@pytest.fixture
def writing():
    """This process writes pixel files, as a pool's worker does, under a prefix of its own."""
    prefix = shared_pixels.pool_prefix()
    shared_pixels.write_as(prefix)
    yield prefix
    shared_pixels.write_as(None)
    shared_pixels.remove_unreceived(prefix)


def files(prefix: str) -> list:
    return sorted(shared_pixels.SHM_DIR.glob(f"{prefix}-*"))


def media(dtype=np.float32) -> PreparedMedia:
    pixels = np.random.default_rng(0).standard_normal((300, 1176)).astype(dtype)
    return PreparedMedia(pixels, (1, 15, 20), "hash", 75, "<image>")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_pixels_arrive_equal_by_the_files_name_and_the_file_is_gone(writing, dtype):
    prepared = media()
    pixels = torch.from_numpy(prepared.pixel_values * 50).to(dtype)
    prepared = dataclasses.replace(prepared, pixel_values=host_pixels(pixels))
    sent = prepared.in_shared_memory()
    (path,) = files(writing)
    assert sent.shared_pixels.path == str(path)
    message = bytes(ForkingPickler.dumps(sent))
    assert len(message) < 10_000 and b"_media_from_file" in message  # the name, not the pixels
    received = pickle.loads(message)
    assert files(writing) == []  # mapped, then removed: its pages live as long as the mapping
    expected = torch.as_tensor(prepared.pixel_values)
    got = torch.as_tensor(received.pixel_values)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert (received.grid_thw, received.content_hash, received.shared_pixels) == ((1, 15, 20), "hash", None)


def test_a_file_that_is_not_the_one_written_is_refused_not_read_as_zeros(writing):
    sent = media().in_shared_memory()
    os.unlink(sent.shared_pixels.path)  # removed meanwhile: the mapping would make an empty one
    with pytest.raises(RuntimeError, match="is not the file its preprocessing worker wrote"):
        pickle.loads(ForkingPickler.dumps(sent))
    assert files(writing) == []


def test_outside_a_pools_worker_pixels_go_torchs_way():
    sent = media().in_shared_memory()
    assert isinstance(sent.shared_pixels, torch.Tensor) and sent.shared_pixels.is_shared()
    assert np.array_equal(pickle.loads(ForkingPickler.dumps(sent)).pixel_values, media().pixel_values)


def test_a_pools_files_never_received_are_removed_and_no_other(writing):
    kept = shared_pixels.pool_prefix()
    shared_pixels.write_as(kept)
    other = media().in_shared_memory()
    shared_pixels.write_as(writing)
    for _ in range(3):
        media().in_shared_memory()
    assert shared_pixels.remove_unreceived(writing) == 3 and files(writing) == []
    assert [str(path) for path in files(kept)] == [other.shared_pixels.path]
    pickle.loads(ForkingPickler.dumps(other))  # received: removed by its receiver
    assert files(kept) == []


def a_gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_files_a_gone_job_left_are_removed_once_old_and_no_others():
    gone, alive = a_gone_pid(), os.getpid()
    old = time.time() - shared_pixels.LEFT_BEHIND_AFTER_S - 60
    paths = {}
    for name, pid, mtime in (("gone_old", gone, old), ("gone_new", gone, None), ("alive_old", alive, old)):
        path = shared_pixels.SHM_DIR / f"{shared_pixels.PREFIX}-{pid}-{name}-1-1"
        path.write_bytes(b"x")
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        paths[name] = path
    try:
        shared_pixels.remove_left_behind()
        assert {name for name, path in paths.items() if path.exists()} == {"gone_new", "alive_old"}
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)


def test_a_file_not_ours_to_remove_is_left_without_an_error(monkeypatch):
    """Another user's file in a shared /dev/shm: the sticky folder refuses its removal to this job."""
    path = shared_pixels.SHM_DIR / f"{shared_pixels.PREFIX}-{a_gone_pid()}-0badf00d-1-1"
    path.write_bytes(b"x")
    old = time.time() - shared_pixels.LEFT_BEHIND_AFTER_S - 60
    os.utime(path, (old, old))
    unlink = type(path).unlink

    def refused(self, *args, **kwargs):
        if self == path:
            raise PermissionError(1, "Operation not permitted")
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "unlink", refused)
    try:
        assert shared_pixels.remove_left_behind() == 0 and path.exists()
    finally:
        monkeypatch.undo()
        path.unlink(missing_ok=True)


def test_a_file_that_cannot_be_made_whole_raises_and_is_not_left(writing, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        media().in_shared_memory()
    assert files(writing) == []


def lock_of(prefix: str):
    return shared_pixels.SHM_DIR / f"{prefix}{shared_pixels.LOCK_SUFFIX}"


# A job process that writes a pixel file under its pool's lock and is then killed, SIGKILL, as the
# out-of-memory killer does: nothing of its own runs after. With a worker argument it first forks a child
# that shares its lock and lives on, as a forked preprocessing worker would, until killed in its turn.
KILLED_JOB = """
import os, signal, sys, time, torch
from batchvl.preprocess import shared_pixels
prefix = shared_pixels.pool_prefix()
with shared_pixels.owning(prefix):
    shared_pixels.write_as(prefix)
    shared_pixels.write(torch.zeros(64))
    worker = os.fork() if len(sys.argv) > 1 else None
    if worker == 0:  # (its output closed: the test reads the job's to its end)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        time.sleep(120)
        os._exit(0)
    print(prefix, worker or "", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_job(*args: str) -> tuple[str, int | None]:
    """Run KILLED_JOB: its pool's prefix and the pid of its worker still alive, if it forked one."""
    done = subprocess.run([sys.executable, "-c", KILLED_JOB, *args], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    prefix, *worker = done.stdout.split()
    return prefix, int(worker[0]) if worker else None


def test_a_killed_jobs_files_are_removed_at_once_since_nobody_holds_its_lock():
    prefix, _ = killed_job()
    try:
        assert len(files(prefix)) == 1 and lock_of(prefix).exists()  # fresh: no age rule would take it
        assert shared_pixels.remove_left_behind() == 1
        assert files(prefix) == [] and not lock_of(prefix).exists()
    finally:
        shared_pixels.remove_unreceived(prefix)
        lock_of(prefix).unlink(missing_ok=True)


def test_a_killed_jobs_worker_still_alive_keeps_its_files_until_it_is_gone():
    prefix, worker = killed_job("with a worker")
    try:
        shared_pixels.remove_left_behind()
        assert len(files(prefix)) == 1 and lock_of(prefix).exists()  # the worker holds the lock
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert shared_pixels.remove_left_behind() == 1 and files(prefix) == []
    finally:
        with contextlib.suppress(OSError):
            os.kill(worker, signal.SIGKILL)
        shared_pixels.remove_unreceived(prefix)
        lock_of(prefix).unlink(missing_ok=True)


def test_a_pool_that_holds_its_lock_keeps_its_files_however_old_and_whatever_its_pid():
    """A job alive in another container sharing /dev/shm: its pid is not one this one sees."""
    prefix = f"{shared_pixels.PREFIX}-{a_gone_pid()}-0badf00d"
    with shared_pixels.owning(prefix):
        shared_pixels.write_as(prefix)
        try:
            media().in_shared_memory()
        finally:
            shared_pixels.write_as(None)
        old = time.time() - shared_pixels.LEFT_BEHIND_AFTER_S - 60
        (path,) = files(prefix)
        os.utime(path, (old, old))
        assert shared_pixels.remove_left_behind() == 0 and files(prefix) == [path]
    assert files(prefix) == [] and not lock_of(prefix).exists()  # its end removes both
