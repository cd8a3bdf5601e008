"""`batchvl status` and the sbatch script: what is done, what to rerun, and how tasks are launched."""

import json
import shlex
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.commands.slurm import ArrayJob, array_expression, sbatch_script, write_array_job
from batchvl.commands.status import JobStatus, TaskStatus, format_status, job_status, status_json
from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import LocalDir
from tests.conftest import png_bytes, random_image, two_prompt_job_yaml


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("status")
    (root / "data").mkdir()
    for number in range(4):
        images = [png_bytes(random_image(40, 50 + 5 * i, seed=number * 10 + i)) for i in range(2)]
        if number == 0:
            images[1] = b"broken"
        pq.write_table(
            pa.table({"key": [f"k{number}{i}" for i in range(2)], "image": images}),
            root / "data" / f"part-{number}.parquet",
        )
    (root / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}", "preprocess: {workers: 0}"))
    return root


def test_array_expression_compresses_runs():
    assert array_expression([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert array_expression([3]) == "3" and array_expression([]) == ""


def test_status_counts_rows_and_names_the_tasks_to_rerun(job_dir, loaded_fp32):
    cfg = load_job_config(job_dir / "job.yaml")
    run_job(cfg, loaded=loaded_fp32, show_progress=False, task=TaskSlice(0, 3))  # shards 0 and 3
    status = job_status(cfg)  # N is read from the run's stats
    assert status.num_tasks == 3 and status.shards_total == 4 and status.shards_done == 2
    assert (status.rows_ok, status.rows_error) == (6, 2) and dict(status.errors_by_type) == {
        "image_decode_error": 2
    }
    assert status.missing_tasks == [1, 2]
    assert status.tasks[0].samples_per_s > 0 and status.tasks[1].samples_per_s is None
    text = format_status(status, "job.yaml")
    assert "shards: 2 of 4 done, 2 pending" in text
    assert "rows: 6 ok, 2 error (image_decode_error 2)" in text
    assert "rerun missing tasks (1-2): batchvl run job.yaml --shard I/3" in text

    script = write_array_job(ArrayJob(str(job_dir / "job.yaml"), cfg.output.dir, 3), LocalDir(cfg.output.dir))
    assert f"rerun missing tasks: sbatch --array=1-2 {script}" in format_status(job_status(cfg), "job.yaml")
    # another N: the same folder seen as 2 tasks (shards 0, 2 | 1, 3)
    assert job_status(cfg, num_tasks=2).missing_tasks == [0, 1]


def test_the_sbatch_script_runs_task_i_of_n_with_requeue_and_logs(tmp_path):
    job = ArrayJob(
        "/jobs/my job.yaml",
        str(tmp_path / "out"),
        7,
        overrides=["sampling.max_new_tokens=9", "prompts=[{name: a, text: 'x y'}]"],
        sbatch_args=["--time=04:00:00", "--partition=gpu"],
        signal_lead_s=120,
        python="/venv/bin/python",
        workdir="/jobs",
    )
    text = sbatch_script(job)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for expected in (
        "#SBATCH --array=0-6",
        f"#SBATCH --output={tmp_path / 'out' / '_batchvl' / 'logs' / 'task-%a.log'}",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=gpu",
    ):
        assert expected in lines
    (command,) = [line for line in lines if line.startswith("exec ")]
    # what bash hands the program: every value arrives whole, the task index is left for bash to fill
    assert shlex.split(command) == [
        "exec", "/venv/bin/python", "-m", "batchvl", "run", "/jobs/my job.yaml",
        "--shard", "${SLURM_ARRAY_TASK_ID}/7", "--requeue", "--no-progress", "--log-level", "info",
        "--set", "sampling.max_new_tokens=9", "--set", "prompts=[{name: a, text: 'x y'}]",
    ]  # fmt: skip
    path = write_array_job(job, LocalDir(str(tmp_path / "out")))
    assert Path(path).read_text() == text
    record = json.loads((tmp_path / "out" / "_batchvl" / "slurm" / "array.json").read_text())
    assert record["num_tasks"] == 7 and (tmp_path / "out" / "_batchvl" / "logs").is_dir()


def test_a_task_stopped_and_rerun_is_one_task_with_its_runs_added(tmp_path):
    from batchvl.commands.status import _runs_per_task

    folder = tmp_path / "_batchvl" / "stats"
    folder.mkdir(parents=True)
    runs = [  # a stopped run, a rerun that finished, a rerun that found everything done
        {"task": "1/2", "samples": 30, "output_tokens": 600, "processing_s": 10.0},
        {"task": "1/2", "samples": 10, "output_tokens": 200, "processing_s": 6.0},
        {"task": "1/2", "samples": 0, "output_tokens": 0, "processing_s": 0.0},
        {"task": "0/2", "samples": 8, "output_tokens": 80, "processing_s": 4.0},
    ]
    for number, run in enumerate(runs):
        (folder / f"run-{number}.json").write_text(json.dumps(run))
    merged = _runs_per_task(LocalDir(str(tmp_path)))
    task = merged[(2, 1)]
    assert (task.samples, task.output_tokens, task.processing_s) == (40, 800, 16.0)
    assert task.last_run == "run-1.json"
    assert merged[(2, 0)].samples == 8


def test_status_json_holds_the_error_counts_by_type():
    status = JobStatus("out", 2, [TaskStatus(0, shards=2, done=2), TaskStatus(1, shards=1)], rows_ok=3)
    status.rows_error = 3
    status.errors_by_type = Counter({"image_decode_error": 2, "server_error": 1})
    printed = json.loads(status_json(status))
    assert printed["errors_by_type"] == {"image_decode_error": 2, "server_error": 1}
    assert printed["rows_error"] == 3 and printed["missing_tasks"] == [1]
    assert [t["done"] for t in printed["tasks"]] == [2, 0]
