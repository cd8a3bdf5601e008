"""A launched server's processes (batchvl/server/process.py, batchvl/server/group_watch.py): stopping it
stops all of its process group, and the watcher that stops the group once batchvl is gone gives it its
grace period between SIGTERM and SIGKILL."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from batchvl.server.client import served_models
from batchvl.server.process import ManagedServer

FAKE_SERVER_PROGRAM = Path(__file__).parents[1] / "fake_server_process.py"
GROUP_WATCH = Path(__file__).parents[2] / "batchvl" / "server" / "group_watch.py"


def gone(pid: int, within_s: float = 0.0) -> bool:
    """Whether the process has ended (a zombie no one has reaped yet has), waiting up to `within_s` for it
    (a process sent SIGKILL ends once the kernel next runs it)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def wait_for(path: Path, seconds: float = 30) -> str:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path.name} was not written"
        time.sleep(0.02)
    return path.read_text().strip()


def test_stopping_a_launched_server_kills_what_it_left_in_its_process_group(tmp_path):
    # The launch command starts a helper that ignores SIGTERM in the background, then runs the server: the
    # server goes at SIGTERM, the helper stays until the group's SIGKILL.
    leftover_pid = tmp_path / "leftover.pid"
    script = f'(trap "" TERM; exec sleep 120) & echo $! > {shlex.quote(str(leftover_pid))}; exec "$@"'
    command = ["bash", "-c", script, "wrapper", sys.executable, str(FAKE_SERVER_PROGRAM), "--model", "m"]
    server = ManagedServer(command, tmp_path / "server.log", startup_timeout_s=60)
    leftover = None
    try:
        server.start()
        leftover = int(wait_for(leftover_pid))
        assert not gone(leftover)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10  # the server went at SIGTERM: no grace period waited out
        assert not server.is_alive()
        assert gone(leftover, within_s=5), "a process of the server's group outlived its stop"
    finally:
        server.stop()
        if leftover is not None and not gone(leftover):
            os.kill(leftover, signal.SIGKILL)


def test_a_launched_server_slow_to_list_its_models_while_starting_is_waited_for(tmp_path):
    # Each of the start's health checks waits up to 5 s for an answer: a server that takes 1.5 s to list
    # its models (a loaded machine) is ready, not one that never answers.
    command = [sys.executable, str(FAKE_SERVER_PROGRAM), "--model", "m", "--slow-models-s", "1.5"]
    server = ManagedServer(command, tmp_path / "server.log", startup_timeout_s=30)
    try:
        server.start()
        assert server.is_alive()
        assert served_models(server.url, None) == ["m"]
    finally:
        server.stop()


SERVER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path

    def shut_down(signum, frame):
        time.sleep(0.5)  # what a server does on SIGTERM: finish, free its GPU, then exit
        Path(sys.argv[1]).with_name("shut-down").write_text("done")
        sys.exit(0)

    signal.signal(signal.SIGTERM, shut_down if sys.argv[2] == "handles" else signal.SIG_IGN)
    Path(sys.argv[1]).write_text("ready")
    time.sleep(120)
    """
)


def watched_group(tmp_path: Path, on_sigterm: str, grace_s: float) -> tuple[subprocess.Popen, float]:
    """A server in a process group of its own (`on_sigterm`: "handles" or "ignores" SIGTERM) and a watcher
    of it, started by a process that then exits at once, as a killed batchvl; the server's process and
    when that process exited."""
    ready = tmp_path / "ready"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(ready), on_sigterm], start_new_session=True)
    wait_for(ready)
    starter = (
        "import os, subprocess, sys; "
        "subprocess.Popen([sys.executable, sys.argv[1], str(os.getpid()), *sys.argv[2:]])"
    )
    subprocess.run(
        [sys.executable, "-c", starter, str(GROUP_WATCH), str(server.pid), str(grace_s)], check=True
    )
    return server, time.monotonic()


def test_the_watcher_gives_the_server_its_grace_period_to_shut_down_after_sigterm(tmp_path):
    server, _ = watched_group(tmp_path, "handles", grace_s=10)
    try:
        assert server.wait(20) == 0  # it exited on its own, not by SIGKILL
        assert (tmp_path / "shut-down").read_text() == "done"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_watcher_kills_a_server_that_ignores_sigterm_once_its_grace_period_is_over(tmp_path):
    server, orphaned = watched_group(tmp_path, "ignores", grace_s=1.5)
    try:
        assert server.wait(20) == -signal.SIGKILL
        assert time.monotonic() - orphaned > 1.0  # SIGTERM, then 1.5 s, then SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
