"""Mistakes in a command's arguments and in the environment a launcher sets are one line and exit 2,
before anything is written: folders that are files or cannot be made, counts out of range, an #SBATCH
option that would put a shell command into the script, Slurm's and torchrun's variables that are not
numbers, a retry of a job that never ran."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import cli, png_bytes, random_image, two_prompt_job_yaml


@pytest.fixture
def job_dir(tmp_path, tiny_model_dir, monkeypatch):
    (tmp_path / "data").mkdir()
    image = png_bytes(random_image(40, 48, seed=1))
    pq.write_table(pa.table({"key": ["a"], "image": [image]}), tmp_path / "data" / "p0.parquet")
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(monkeypatch, capsys, *args) -> str:
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["make-tiny-model", "a-file"], "error: a-file is a file; give a folder to write to"),
        (["make-sample-data", "a-file"], "error: a-file is a file; give a folder to write to"),
        (
            ["make-tiny-model", "/proc/batchvl-model"],
            "error: /proc/batchvl-model cannot be made (No such file or directory); give a folder that can "
            "be written",
        ),
        (["make-sample-data", "data2", "--num-shards", "0"], "Invalid value for '--num-shards'"),
        (["validate", "job.yaml", "--log-level", "loud"], "--log-level must be one of debug, info, warning"),
        (["status", "job.yaml", "--tasks", "0"], "Invalid value for '--tasks'"),
        (["slurm", "job.yaml", "--array", "0"], "error: --array must be at least 1, got 0"),
        (
            ["slurm", "job.yaml", "--array", "2", "--signal-lead", "-10"],
            "error: --signal-lead must be 0 or more seconds before the time limit, got -10",
        ),
        (
            ["slurm", "job.yaml", "--array", "2", "--sbatch-arg", "--time=1\nrm -rf ~"],
            "error: --sbatch-arg '--time=1\\nrm -rf ~' holds a line break or another control character; give "
            "each #SBATCH option as its own --sbatch-arg",
        ),
        (["slurm", "job.yaml", "--array", "2", "--sbatch-arg", "time=1"], "'time=1' is not an sbatch option"),
        (
            ["slurm", "job.yaml", "--array", "2", "--script-dir", "a-file"],
            "cannot be made (Not a directory: ",
        ),
        (["retry-failed", "job.yaml"], "does not exist: run the job first (batchvl run)"),
    ],
)
def test_a_commands_mistake_is_one_line_before_anything_is_written(
    job_dir, monkeypatch, capsys, args, message
):
    before = sorted(path.name for path in job_dir.iterdir())
    assert message in refused(monkeypatch, capsys, *args)
    assert sorted(path.name for path in job_dir.iterdir()) == before  # no output folder, no script


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SLURM_ARRAY_TASK_ID": "abc", "SLURM_ARRAY_TASK_COUNT": "2"},
            "error: SLURM_ARRAY_TASK_ID is 'abc', not a whole number; it is Slurm's, for an array task: pass "
            "--shard I/N to run task I of N instead",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "2"},
            "error: Slurm array task 5 is outside its array (2 task(s) from 0, step 1); pass --shard I/N",
        ),
        (
            {"WORLD_SIZE": "abc"},
            "error: WORLD_SIZE is 'abc', not a whole number; it is torchrun's: unset it to run one process",
        ),
    ],
)
def test_a_launchers_variable_that_is_not_a_task_of_the_job_is_one_line(
    job_dir, monkeypatch, capsys, env, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert refused(monkeypatch, capsys, "run", "job.yaml", "--no-progress").startswith(message)
    assert not (job_dir / "out").exists()
