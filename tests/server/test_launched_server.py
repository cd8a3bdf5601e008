"""A server batchvl launches itself (`engine.server.launch`): killed mid-run it costs no row and doubles
none, and batchvl stops it on every way out.

Each test starts real vLLM servers through `batchvl run`, as a user's job file does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import batchvl
from tests.conftest import write_image_shards
from tests.server.conftest import LAUNCH, SERVER_ARGS, needs_vllm

# Each run starts its own vLLM server; the Slurm array's job is waited for up to 900 s
pytestmark = pytest.mark.timeout(1800)

NUM_SHARDS, SAMPLES_PER_SHARD = 8, 3


def launched_job(root: Path, model: Path, retries: int) -> Path:
    job = root / "job.yaml"
    job.write_text(f"""
model: {{path: {model}, dtype: float32}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
  - {{name: caption, text: Describe this image.}}
sampling: {{max_new_tokens: 32}}
engine:
  backend: openai
  server:
    launch: "{LAUNCH}"
    launch_args: {SERVER_ARGS!r}
    max_concurrency: 2
    retries: {retries}
    backoff_s: 0.2
    startup_timeout_s: 600
output: {{dir: out}}
""")
    return job


def start_run(root: Path, job: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "batchvl", "run", str(job), "--no-progress"]
    return subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def markers(root: Path) -> set[str]:
    return {p.name for p in (root / "out" / "_batchvl" / "done").glob("*.json")}


def wait_for(condition, timeout_s: float, what: str, run: subprocess.Popen):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run.poll() is not None:
            pytest.fail(f"the run ended (exit {run.returncode}) before {what}: {run.stdout.read()}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout_s} s")


def server_of(run: subprocess.Popen) -> psutil.Process | None:
    """The server the run launched: its child running vLLM's API server."""
    for child in psutil.Process(run.pid).children():
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                return child
        except psutil.Error:  # a child that has just ended (a zombie until reaped), or gone
            continue
    return None


def processes_in_group(pgid: int, wait_s: float = 10) -> list[int]:
    """The live processes of a process group (a killed one may take its parent's reaping to vanish, as a
    zombie that runs nothing), after waiting up to `wait_s` for none."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def kill_server_after_a_new_commit(root: Path, run: subprocess.Popen, committed_before: set[str]) -> int:
    """SIGKILL the run's server (its whole process group) once a shard more than before is committed; the
    group's id."""
    wait_for(lambda: markers(root) - committed_before, 600, "a new committed shard", run)
    server = wait_for(lambda: server_of(run), 10, "the server process", run)
    pgid = os.getpgid(server.pid)
    os.killpg(pgid, signal.SIGKILL)
    return pgid


@pytest.fixture
def job_root(tmp_path, vllm_model) -> tuple[Path, Path]:
    needs_vllm()
    write_image_shards(tmp_path / "data", [SAMPLES_PER_SHARD] * NUM_SHARDS)
    return tmp_path, vllm_model


def test_a_server_killed_mid_run_costs_no_row_and_a_rerun_completes_each_row_once(job_root):
    root, model = job_root
    # No restarts allowed: the run stops, exit 1, with the shards finished before committed.
    run = start_run(root, launched_job(root, model, retries=0))
    kill_server_after_a_new_commit(root, run, set())
    output = run.communicate(timeout=300)[0]
    assert run.returncode == 1, output
    assert "stopped answering" in output and "left for the next run" in output
    committed = markers(root)
    assert 0 < len(committed) < NUM_SHARDS
    rows = batchvl.read_results(root / "job.yaml").to_list()
    assert len(rows) == len(committed) * SAMPLES_PER_SHARD  # whole shards only, no row of a failed request
    assert {r["status"] for r in rows} == {"ok"}
    # The rerun restarts its server once after it is killed, and completes every row exactly once.
    run = start_run(root, launched_job(root, model, retries=2))
    first_pgid = kill_server_after_a_new_commit(root, run, committed)
    output = run.communicate(timeout=600)[0]
    assert run.returncode == 0, output
    assert "restarting it" in output
    rows = batchvl.read_results(root / "job.yaml").to_list()
    keys = [(r["key"], r["prompt"]) for r in rows]
    assert len(keys) == len(set(keys)) == NUM_SHARDS * SAMPLES_PER_SHARD
    assert {r["status"] for r in rows} == {"ok"}
    assert processes_in_group(first_pgid) == []


def test_sigterm_stops_the_run_and_its_server(job_root):
    root, model = job_root
    run = start_run(root, launched_job(root, model, retries=0))
    server = wait_for(lambda: server_of(run), 60, "the server process", run)
    pgid = os.getpgid(server.pid)
    wait_for(lambda: markers(root), 600, "a committed shard", run)
    run.send_signal(signal.SIGTERM)
    output = run.communicate(timeout=120)[0]
    assert run.returncode == 128 + signal.SIGTERM, output
    assert not server.is_running() and processes_in_group(pgid) == []


def test_a_slurm_array_starts_one_server_per_task_and_writes_every_row_once(tmp_path, vllm_model):
    from tests.slurm_cluster import missing_reason, start_cluster

    needs_vllm()
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    write_image_shards(tmp_path / "data", [2] * 4)
    launched_job(tmp_path, vllm_model, retries=0)
    cluster = start_cluster()
    try:
        env = {**cluster.env, "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "batchvl", "slurm", "job.yaml", "--array", "2", "--submit"]
        submitted = subprocess.run(
            [*command, "--sbatch-arg=--time=00:30:00"], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.split("submitted Slurm job ")[1].split()[0]
        cluster.wait_until_gone(job_id, timeout_s=900)
    finally:
        cluster.stop()
    logs = tmp_path / "out" / "_batchvl" / "logs"
    for task in (0, 1):  # each task started and stopped a server of its own
        assert "task" in (logs / f"task-{task}.log").read_text()
        assert "Application startup complete" in (logs / f"server-{task}.log").read_text()
    rows = batchvl.read_results(tmp_path / "job.yaml").to_list()
    keys = [(r["key"], r["prompt"]) for r in rows]
    assert len(keys) == len(set(keys)) == 8 and {r["status"] for r in rows} == {"ok"}
    model = str(vllm_model)
    assert not [p for p in psutil.process_iter(["cmdline"]) if model in " ".join(p.info["cmdline"] or [])]
