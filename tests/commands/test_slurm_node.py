"""`batchvl slurm --gpus N / --processes N`: each array task a node's worth of engines. The script asks
Slurm for the task's GPUs and runs one engine process per GPU it was given (or N processes on the job's
device); a launched server takes the task's GPUs itself; a wrong combination is one line, exit 2, before
any script is written. The array run on a real cluster is in test_slurm.py."""

import shlex
import sys
from pathlib import Path

import pytest

from batchvl.cli import main
from batchvl.commands.slurm import ArrayJob, sbatch_script
from tests.conftest import two_prompt_job_yaml, write_image_shards

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fake_server_process.py"


def task_command(job: ArrayJob) -> list[str]:
    (command,) = [line for line in sbatch_script(job).splitlines() if line.startswith("exec ")]
    return shlex.split(command)


def test_gpus_ask_slurm_for_them_and_run_an_engine_per_gpu_it_gave():
    job = ArrayJob("/jobs/job.yaml", "/out", 4, gpus=8, python="/venv/bin/python", workdir="/jobs")
    assert "#SBATCH --gres=gpu:8" in sbatch_script(job).splitlines()
    command = task_command(job)
    # `all`: the GPUs Slurm gave the task are the ones it sees, whatever their numbers on the node
    assert command[command.index("--gpus") + 1] == "all" and "--processes" not in command


def test_processes_run_n_engines_and_ask_for_no_gpu():
    job = ArrayJob("/jobs/job.yaml", "/out", 2, processes=3)
    assert "--gres" not in sbatch_script(job)
    command = task_command(job)
    assert command[command.index("--processes") + 1] == "3" and "--gpus" not in command


def test_a_launched_servers_task_gets_the_gpus_and_runs_one_batchvl():
    job = ArrayJob("/jobs/job.yaml", "/out", 2, gpus=4, server_takes_gpus=True)
    assert "#SBATCH --gres=gpu:4" in sbatch_script(job).splitlines()
    command = task_command(job)
    assert "--gpus" not in command and "--processes" not in command


def test_a_plain_array_asks_for_no_gpu_and_runs_one_process():
    job = ArrayJob("/jobs/job.yaml", "/out", 2)
    assert "--gres" not in sbatch_script(job)
    assert not {"--gpus", "--processes"} & set(task_command(job))


@pytest.fixture
def job_root(tmp_path, tiny_model_dir, monkeypatch):
    write_image_shards(tmp_path / "data", [2])
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def slurm_exit(monkeypatch, capsys, *args) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["batchvl", "slurm", "job.yaml", "--array", "2", *args])
    try:
        main()
        code = 0
    except SystemExit as ended:
        code = ended.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--gpus", "2", "--processes", "2"], "--gpus and --processes both given"),
        (["--gpus", "0"], "--gpus must be 1 or more"),
        (["--processes", "0"], "--processes must be 1 or more"),
        (["--processes", "2", "--set", "output.overwrite=true"], "--overwrite with --gpus / --processes"),
        (["--gpus", "2", "--set", "engine.vit_parallel=data"], "without engine.vit_parallel"),
        (
            [
                "--gpus",
                "2",
                "--set",
                "engine.backend=openai",
                "--set",
                "engine.server.url=http://127.0.0.1:9/v1",
            ],
            "run one batchvl against it",
        ),
    ],
)
def test_what_a_task_cannot_run_is_one_line_exit_2_and_writes_no_script(
    monkeypatch, capsys, job_root, args, named
):
    code, err = slurm_exit(monkeypatch, capsys, *args)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (job_root / "out").exists()


def test_the_gpus_flag_is_not_checked_against_the_login_nodes_own(monkeypatch, capsys, job_root):
    """A login node often has no GPU: the task's are Slurm's to give, so the CPU machine writes the script."""
    code, err = slurm_exit(monkeypatch, capsys, "--gpus", "2", "--sbatch-arg=--time=01:00:00")
    assert code == 0, err
    script = (job_root / "out" / "_batchvl" / "slurm" / "array.sbatch").read_text()
    assert "#SBATCH --gres=gpu:2" in script and "--gpus all" in script


def test_a_job_with_a_launched_server_gives_the_tasks_gpus_to_the_server(monkeypatch, capsys, job_root):
    launch = f"{sys.executable} {FAKE_SERVER}"
    args = ["--set", "engine.backend=openai", "--set", f"engine.server.launch={launch}"]
    args += ["--set", "engine.server.launch_args=[--tensor-parallel-size, '4']"]
    code, err = slurm_exit(monkeypatch, capsys, "--gpus", "4", *args)
    assert code == 0, err
    script = (job_root / "out" / "_batchvl" / "slurm" / "array.sbatch").read_text()
    assert "#SBATCH --gres=gpu:4" in script
    (command,) = [line for line in script.splitlines() if line.startswith("exec ")]
    assert "--gpus" not in shlex.split(command)
