"""A real one-node Slurm cluster on loopback for tests: munged, slurmctld and slurmd from Debian's
packages, every file in a temp folder, started by the test and stopped by pid."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def missing_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"Slurm not installed ({', '.join(absent)} missing; `make slurm` installs it)"
    if os.geteuid() != 0:
        return "the test cluster runs slurmd as root; not root here"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]  # SLURM_CONF for client commands
    processes: list[subprocess.Popen]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check)

    def job_states(self, job_id: str) -> dict[str, str]:
        """Array task id (e.g. '12_0') -> state, for tasks still known to squeue."""
        out = self.run("squeue", "-h", "-r", "-j", job_id, "-o", "%i %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_until_gone(self, job_id: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.job_states(job_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job_id} still queued: {self.job_states(job_id)}")
            time.sleep(0.5)

    def stop(self) -> None:
        munged_pid = self.root / "munge" / "munged.pid"  # runuser's child, stopped by its own pid
        if munged_pid.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(munged_pid.read_text().strip()), signal.SIGTERM)
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> SlurmCluster:
    # Its own short folder, readable by the munge user (pytest's temp folders are private to root, and a
    # socket path must stay short).
    root = Path(tempfile.mkdtemp(prefix="batchvl-slurm-"))
    root.chmod(0o755)
    host = socket.gethostname().split(".")[0]
    munge_dir = root / "munge"
    for name in ("state", "spool", "log"):
        (root / name).mkdir(parents=True)
    munge_dir.mkdir(mode=0o711)
    shutil.chown(munge_dir, "munge", "munge")
    key, sock = munge_dir / "munge.key", munge_dir / "munge.sock"
    subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "-c", "-k", str(key)], check=True)
    conf = root / "slurm.conf"
    # cred_expire: how long a requeued job waits before it may start again (120 s by default).
    conf.write_text(
        f"""ClusterName=batchvltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=10
CredType=cred/munge
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=5
MinJobAge=300
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    processes = [
        subprocess.Popen(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            **quiet,
        )
    ]
    cluster = SlurmCluster(root, env, processes)
    try:
        _wait_for(lambda: sock.exists(), "munged")
        processes.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], **quiet))
        processes.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf)], **quiet))
        _wait_for(lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout, "the node")
    except Exception:
        cluster.stop()
        raise
    return cluster


def _wait_for(ready, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up in {timeout_s:.0f} s")
        time.sleep(0.2)
