"""Array jobs on a real one-node Slurm cluster: the script `batchvl slurm` writes, submitted with
--submit, writes every row exactly once; a task told to stop by SIGUSR1 requeues itself and its
rerun resumes. Skipped, with the reason printed, where Slurm cannot be installed."""

import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.config import load_job_config
from batchvl.outputs.commit import read_marker
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import output_rows, png_bytes, random_image, two_prompt_job_yaml
from tests.slurm_cluster import missing_reason, start_cluster

# Starting the cluster and the reference run land on the first test, and a job is waited for up to 300 s
pytestmark = pytest.mark.timeout(1200)

# Shards of task 0 must take long enough that a stop sent after its first commit lands before its last:
# with one sequence at a time, ten samples of two prompts each per shard
NUM_SHARDS, SHARD_SIZE = 5, 10


@pytest.fixture(scope="module")
def cluster():
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    running = start_cluster()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("array")
    (root / "data").mkdir()
    for number in range(NUM_SHARDS):
        images = [
            png_bytes(random_image(40 + 7 * i, 50 + 9 * number, seed=100 + 10 * number + i))
            for i in range(SHARD_SIZE)
        ]
        keys = [f"s{number}-{i}" for i in range(SHARD_SIZE)]
        pq.write_table(pa.table({"key": keys, "image": images}), root / "data" / f"part-{number}.parquet")
    (root / "job.yaml").write_text(
        two_prompt_job_yaml(tiny_model_dir, "{max_num_seqs: 1, lookahead: 1}", "preprocess: {workers: 1}")
    )
    return root


def rows_of(out_dir) -> list[dict]:
    return output_rows(out_dir, NUM_SHARDS)


@pytest.fixture(scope="module")
def reference(job_dir, loaded_fp32):
    cfg = load_job_config(job_dir / "job.yaml", ["output.dir=reference"])
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    return rows_of(job_dir / "reference")


def batchvl(cluster, job_dir, *args) -> subprocess.CompletedProcess:
    env = {**cluster.env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "batchvl", *args],
        cwd=job_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def submit(cluster, job_dir, out: str, tasks: int, *args: str) -> str:
    result = batchvl(
        cluster,
        job_dir,
        "slurm",
        "job.yaml",
        "--array",
        str(tasks),
        "--submit",
        "--sbatch-arg=--time=00:30:00",
        "--set",
        f"output.dir={out}",
        *args,
    )
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted Slurm job (\d+)", result.stdout)[1]


def test_an_array_job_writes_every_row_once(cluster, job_dir, reference):
    job_id = submit(cluster, job_dir, "array", 3)
    cluster.wait_until_gone(job_id)
    out = job_dir / "array"
    assert rows_of(out) == reference
    tasks = sorted(read_marker(LocalDir(str(out)), f"part-{n}.parquet").task for n in range(NUM_SHARDS))
    assert tasks == [
        "0/3",
        "0/3",
        "1/3",
        "1/3",
        "2/3",
    ]  # each shard committed once, by the task it belongs to
    for index in range(3):
        log = (out / "_batchvl" / "logs" / f"task-{index}.log").read_text()
        assert f"task {index}/3: done:" in log
    status = batchvl(cluster, job_dir, "status", "job.yaml", "--set", "output.dir=array")
    assert "shards: 5 of 5 done, 0 pending" in status.stdout and "complete" in status.stdout, status.stderr


def test_an_array_of_tasks_of_two_processes_writes_every_row_once(cluster, job_dir, reference):
    """`--processes 2`: each task is a node's launch, whose processes split the task's shards."""
    job_id = submit(cluster, job_dir, "node-array", 2, "--processes", "2")
    cluster.wait_until_gone(job_id)
    out = job_dir / "node-array"
    assert rows_of(out) == reference
    tasks = sorted(read_marker(LocalDir(str(out)), f"part-{n}.parquet").task for n in range(NUM_SHARDS))
    assert tasks == ["0/2", "0/2", "0/2", "1/2", "1/2"]
    for index in range(2):
        log = (out / "_batchvl" / "logs" / f"task-{index}.log").read_text()
        assert f"task {index}/2: done:" in log and "process 1 (cpu)" in log, log


def test_sigusr1_stops_a_task_which_requeues_itself_and_resumes(cluster, job_dir, reference):
    out = job_dir / "requeued"
    job_id = submit(cluster, job_dir, "requeued", 2)  # task 0 holds shards 0, 2 and 4
    deadline = time.monotonic() + 120
    while read_marker(LocalDir(str(out)), "part-0.parquet") is None:
        assert time.monotonic() < deadline, "task 0 committed nothing"
        time.sleep(0.05)
    # What Slurm sends ahead of the time limit with --signal=B:USR1@lead
    cluster.run("scancel", f"--signal={signal.SIGUSR1.name.removeprefix('SIG')}", "--batch", f"{job_id}_0")
    log = out / "_batchvl" / "logs" / "task-0.log"
    while (
        "requeueing Slurm job" not in log.read_text()
        or cluster.job_states(job_id).get(f"{job_id}_0") != "PENDING"
    ):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    assert [n for n in (0, 2, 4) if read_marker(LocalDir(str(out)), f"part-{n}.parquet")] != [0, 2, 4], (
        "stopped too late"
    )
    cluster.wait_until_gone(job_id)  # the requeued task starts once its old credential expires

    text = log.read_text()
    assert "stopped by SIGUSR1 after committing" in text
    resumed = text.split("requeueing Slurm job")[1]
    assert re.search(r"task 0/2: done: .* [12] already done", resumed), resumed
    assert rows_of(out) == reference
    assert not [name for name in os.listdir(out) if name.startswith(".")]
