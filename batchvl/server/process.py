"""A server batchvl starts for a job (`engine.server.launch`) and stops on every way out.

It runs in its own process group (so stopping it stops what it spawned, as vLLM's engine process) on a free
loopback port, with its output in a log file, and is ready when `/health` and `/v1/models` answer. Stopping
is SIGTERM to the group, then SIGKILL after a grace period. When batchvl's process dies without stopping
it (SIGKILL), a small watcher process (`group_watch.py`) stops the group, so a killed job leaves no server
behind, even one its launch command wraps without `exec`; on Linux the command's own process also gets
SIGTERM from the kernel (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from batchvl.errors import UserError
from batchvl.utils.secrets import masked_args

logger = logging.getLogger(__name__)

STOP_GRACE_S = 15.0  # SIGTERM, then this long before SIGKILL
POLL_S = 0.5
LOG_TAIL_BYTES = 16 * 1024  # the end of a server's log read for why it did not start
PROBLEM_CHARS = 300  # the most of it a one-line error quotes
ERROR_WORDS = re.compile(r"error|exception|unrecognized|invalid|not found|no such", re.IGNORECASE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere the job's exit stops it)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedServer:
    """`start` runs `command` plus the loopback host and a free port; `url` is its /v1 address."""

    def __init__(self, command: list[str], log_path: Path, startup_timeout_s: float):
        self.command = command
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._watcher: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.port = free_port()
        command = [*self.command, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting the server: %s (log: %s)", shlex.join(masked_args(command)), self.log_path)
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stopped as a whole, and not by Ctrl-C
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise UserError(
                    f"engine.server.launch: cannot run {command[0]!r} ({exc}); fix the command"
                ) from exc
        self._watcher = _group_watcher(self.process.pid)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        base = self.url.removesuffix("/v1")
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise UserError(
                    f"the server exited with code {self.process.returncode} while starting: "
                    f"{self.log_problem()} (its log: {self.log_path})"
                )
            try:
                # trust_env=False: a proxy of the environment (HTTP_PROXY) does not reach this loopback port
                healthy = httpx.get(f"{base}/health", timeout=5, trust_env=False).status_code == 200
                if healthy and httpx.get(f"{self.url}/models", timeout=5, trust_env=False).status_code == 200:
                    logger.info("the server answers at %s", self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        self.stop()
        raise UserError(
            f"the server did not answer within engine.server.startup_timeout_s={self.startup_timeout_s:g} s; "
            f"see its log {self.log_path}, or raise the timeout"
        )

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after the grace period; returns once it has exited."""
        process, self.process = self.process, None
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # the server is stopped here, not by it
            watcher.kill()
            watcher.wait()
        if process is None:
            return
        if process.poll() is None:
            logger.info("stopping the server (pid %d)", process.pid)
            _signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_GRACE_S)
        _signal_group(process.pid, signal.SIGKILL)  # what it spawned and left behind
        process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_problem(self) -> str:
        """What the end of the server's log says went wrong: its last line naming an error (a server's
        usage text and traceback above it are many lines), else its last line, cut to PROBLEM_CHARS."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                lines = [line.strip() for line in log.read().decode(errors="replace").splitlines()]
        except OSError:
            return "(no log)"
        lines = [line for line in lines if line] or ["(an empty log)"]
        named = [line for line in lines if ERROR_WORDS.search(line)]
        line = (named or lines)[-1]
        return line if len(line) <= PROBLEM_CHARS else line[: PROBLEM_CHARS - 3] + "..."


def _group_watcher(group: int) -> subprocess.Popen:
    """A process that stops the server's group once this process is gone (`group_watch.py`)."""
    watch = Path(__file__).with_name("group_watch.py")
    command = [sys.executable, str(watch), str(os.getpid()), str(group), str(STOP_GRACE_S)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)
