"""Slurm array jobs: the sbatch script `batchvl slurm` writes, its submission, and a task's requeue.

Task I of N runs `batchvl run job.yaml --shard I/N`; N is written into the script, so submitting it
again with `--array=<some tasks>` reruns those tasks on the same split. Each task logs to
`<files>/_batchvl/logs/task-I.log` (appended across reruns and requeues), where `<files>` is output.dir,
or a local folder when output.dir is on an object store (Slurm writes the logs and reads the script from
a filesystem). A record of the array, read by `batchvl status`, is kept in output.dir. `--signal=B:USR1@lead`
warns the task before its time limit; it stops after the current step and requeues itself, and the
requeued run resumes from the shards already committed.

A task can be a node's worth of engines: `--gpus N` asks Slurm for N GPUs per task (`--gres=gpu:N`) and
runs `batchvl run --gpus all` in it, one engine process per GPU Slurm gave the task (its
CUDA_VISIBLE_DEVICES); `--processes N` runs N engine processes on the job's device (the CPU). With the
openai backend and a launched server, the task's GPUs are the server's, which shards the model itself
(its tensor-parallel size set in `engine.server.launch_args`): the task runs one batchvl against it.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchvl.errors import UserError
from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir

logger = logging.getLogger(__name__)

RECORD_NAME = "array.json"


@dataclass
class ArrayJob:
    job_file: str  # absolute
    out_dir: str
    num_tasks: int
    files_dir: str = ""  # the local folder of the script and logs ("": out_dir)
    overrides: list[str] = field(default_factory=list)  # --set values passed to every task
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH lines, e.g. --time=04:00:00
    signal_lead_s: int = 300  # SIGUSR1 this long before the time limit
    gpus: int | None = None  # GPUs per task: --gres=gpu:N, and one engine process per GPU
    processes: int | None = None  # engine processes per task on the job's device
    server_takes_gpus: bool = False  # the task's GPUs go to a launched server, not to engine processes
    python: str = sys.executable
    workdir: str = field(default_factory=os.getcwd)

    @property
    def script_path(self) -> str:
        return os.path.join(self.files_dir or self.out_dir, layout.SLURM, "array.sbatch")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.files_dir or self.out_dir, layout.LOGS)


def sbatch_script(job: ArrayJob) -> str:
    name = f"batchvl-{Path(job.out_dir.rstrip('/')).name}"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --array=0-{job.num_tasks - 1}",
        f"#SBATCH --output={os.path.join(job.log_dir, 'task-%a.log')}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.signal_lead_s}",
        *([f"#SBATCH --gres=gpu:{job.gpus}"] if job.gpus else []),
        *(f"#SBATCH {arg}" for arg in job.sbatch_args),
        "",
        "# Written by `batchvl slurm`. Task I runs its slice of the input shards (--shard I/N). Rerunning a",
        "# task, or the whole array, resumes it: committed shards are skipped.",
        "set -eu",
        f"cd {shlex.quote(job.workdir)}",
        'echo "batchvl task ${SLURM_ARRAY_TASK_ID} of '
        + str(job.num_tasks)
        + ' on $(hostname) at $(date -Is)"',
        # exec: the batch shell becomes batchvl, so the B:USR1 signal reaches it directly.
        "exec "
        + shlex.join([job.python, "-m", "batchvl", "run", job.job_file])
        + f' --shard "${{SLURM_ARRAY_TASK_ID}}/{job.num_tasks}"'
        + "".join(f" {flag}" for flag in _node_flags(job))
        + " --requeue --no-progress --log-level info"
        + "".join(f" --set {shlex.quote(item)}" for item in job.overrides),
        "",
    ]
    return "\n".join(lines)


def _node_flags(job: ArrayJob) -> list[str]:
    """The task's engine processes: every GPU Slurm gave it (Slurm sets which it sees), or N on its device;
    none where a launched server takes the GPUs."""
    if job.gpus and not job.server_takes_gpus:
        return ["--gpus", "all"]
    if job.processes:
        return ["--processes", str(job.processes)]
    return []


def check_node_options(gpus: int | None, processes: int | None) -> None:
    """A task's GPUs or processes, refused in one line before anything is written. The GPUs are not looked
    for here: a login node often has none, and Slurm gives the task its own."""
    if gpus is not None and processes is not None:
        raise UserError("--gpus and --processes both given: --gpus N for N GPUs per task, else --processes N")
    for name, value in (("--gpus", gpus), ("--processes", processes)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be 1 or more, got {value}")


def check_script_options(num_tasks: int, signal_lead_s: int, sbatch_args: list[str]) -> None:
    """The array's size, the stop signal's lead and the #SBATCH options, refused in one line before the
    job is planned. An option is one line of the script: a line break in one would put the rest in the
    script as a shell command."""
    if num_tasks < 1:
        raise UserError(f"--array must be at least 1, got {num_tasks}")
    if signal_lead_s < 0:
        raise UserError(f"--signal-lead must be 0 or more seconds before the time limit, got {signal_lead_s}")
    for arg in sbatch_args:
        if any(ord(char) < 32 for char in arg):
            raise UserError(
                f"--sbatch-arg {arg!r} holds a line break or another control character; give each #SBATCH "
                "option as its own --sbatch-arg"
            )
        if not arg.startswith("-"):
            raise UserError(
                f"--sbatch-arg {arg!r} is not an sbatch option; write it as sbatch takes it, e.g. "
                "--time=04:00:00"
            )


def write_array_job(job: ArrayJob, out: OutputDir) -> str:
    """Write the script and a record of the array in `out` (read by `batchvl status`); returns the script
    path."""
    try:
        os.makedirs(job.log_dir, exist_ok=True)
        os.makedirs(os.path.dirname(job.script_path), exist_ok=True)
    except OSError as exc:
        where = job.files_dir or job.out_dir
        raise UserError(
            f"the script's folder under {where} cannot be made ({exc.strerror or exc}: {exc.filename}); "
            "give --script-dir a folder that can be written"
        ) from None
    Path(job.script_path).write_text(sbatch_script(job))
    os.chmod(job.script_path, 0o755)
    out.write_text(out.join(layout.SLURM, RECORD_NAME), json.dumps(asdict(job), indent=2))
    return job.script_path


def read_array_job(out: OutputDir) -> ArrayJob | None:
    try:
        return ArrayJob(**json.loads(out.read_text(out.join(layout.SLURM, RECORD_NAME))))
    except (OSError, ValueError, TypeError):
        return None


def submit(script_path: str, array: str | None = None) -> str:
    """sbatch the script (optionally only some tasks); returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError(f"sbatch not found (not a Slurm login node?); the script is {script_path}")
    command = [sbatch, "--parsable", *([f"--array={array}"] if array else []), script_path]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no message"
        raise UserError(f"sbatch refused the job: {message}; the script is {script_path}")
    return result.stdout.strip().split(";")[0]


def array_expression(indices: list[int]) -> str:
    """Task indices as a Slurm --array value: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            low, high = ordered[start], ordered[i - 1]
            parts.append(str(low) if low == high else f"{low}-{high}")
            start = i
    return ",".join(parts)


def requeue_this_task() -> None:
    """Put this Slurm job (array task) back in the queue; called last, after a clean stop."""
    job_id = os.environ.get("SLURM_JOB_ID")
    scontrol = shutil.which("scontrol")
    if not job_id or scontrol is None:
        logger.warning("--requeue: not running under Slurm; nothing to requeue")
        return
    # Said before, not after: Slurm ends this process as part of the requeue, often before `scontrol`
    # has returned, so a line printed afterwards may never be written.
    print(f"batchvl: requeueing Slurm job {job_id}", file=sys.stderr, flush=True)
    try:
        result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        print(f"batchvl: scontrol requeue {job_id} did not answer in 120 s", file=sys.stderr, flush=True)
        return
    if result.returncode != 0:
        print(
            f"batchvl: scontrol requeue {job_id} failed: {result.stderr.strip()}", file=sys.stderr, flush=True
        )
