"""`batchvl run --processes N` end to end on the CPU: N engine processes split the job's shards, one stats
file and one exit code for the node; a process killed mid-run loses nothing a rerun does not redo; a stop
signal reaches every process; wrong flags are refused before any work. (`--gpus` is the same launch with a
GPU per process: its flags are checked here, its GPUs in test_node_parts.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from batchvl.api import run as run_api
from batchvl.errors import UserError
from tests.conftest import output_rows, write_image_shards

PROMPTS = 2


def job_yaml(
    model_dir, sampling: str = "{max_new_tokens: 6}", engine: str = "{max_num_seqs: 2}", prefetch=8
) -> str:
    return f"""
model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
  - {{name: caption, text: Describe this image.}}
  - {{name: short, text: One word.}}
sampling: {sampling}
engine: {engine}
preprocess: {{workers: 1, prefetch: {prefetch}}}
output: {{dir: out}}
"""


def command(*args) -> list[str]:
    return [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress", *args]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def batchvl(folder, *args) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), cwd=folder, env=ENV, capture_output=True, text=True, timeout=300)


def start(folder, *args) -> subprocess.Popen:
    return subprocess.Popen(
        command(*args), cwd=folder, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def stats_files(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / "out" / "_batchvl" / "stats").glob("*.json"))]


def committed(folder) -> list[str]:
    return sorted(p.stem for p in (folder / "out" / "_batchvl" / "done").glob("*.json"))


def wait_for(condition, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_two_processes_write_every_row_once_equal_to_one_process(tmp_path, tiny_model_dir):
    sizes = [2, 2, 2, 2]
    for name in ("one", "two"):
        write_image_shards(tmp_path / name / "data", sizes)
        (tmp_path / name / "job.yaml").write_text(job_yaml(tiny_model_dir))
    single = batchvl(tmp_path / "one")
    assert single.returncode == 0, single.stderr
    node = batchvl(tmp_path / "two", "--processes", "2")
    assert node.returncode == 0, node.stderr
    assert "done: 8 samples, 16 ok, 0 errors, 4 shard(s) written" in node.stdout
    assert "process 0 (cpu): " in node.stdout and "process 1 (cpu): " in node.stdout
    assert "another run has it" not in node.stderr  # a sibling's shard is no notice: the node ran it

    assert output_rows(tmp_path / "two" / "out", 4) == output_rows(tmp_path / "one" / "out", 4)
    (stats,) = stats_files(tmp_path / "two")  # one file for the node, none of the processes' own
    assert (stats["samples"], stats["requests"], stats["ok"], stats["shards_committed"]) == (8, 16, 16, 4)
    assert (stats["shards_total"], stats["shards_claimed_elsewhere"], stats["vit_parallel_ranks"]) == (
        4,
        0,
        1,
    )
    processes = stats["processes"]
    assert [p["device"] for p in processes] == ["cpu", "cpu"]
    assert [p["exit_code"] for p in processes] == [0, 0]
    assert sum(p["samples"] for p in processes) == 8
    assert sum(p["shards_committed"] for p in processes) == 4
    assert stats["input_wait_s"] == pytest.approx(sum(p["input_wait_s"] for p in processes), abs=0.01)
    assert stats["output_tokens"] == sum(
        r["num_output_tokens"] for r in output_rows(tmp_path / "two" / "out", 4)
    )
    assert list((tmp_path / "two" / "out" / "_batchvl" / "claims").iterdir()) == []


SAMPLES = 4  # per shard of the longer jobs


def long_job(folder, model_dir, num_shards: int) -> None:
    """A job whose processes read little ahead of their engine: tiny images are read far faster than they
    are run, and a process claims a shard as it reads it, so with the default look-ahead and read-ahead the
    first process to start claims every shard of so small a job before the other has loaded its model."""
    write_image_shards(folder / "data", [SAMPLES] * num_shards)
    sampling, engine = (
        "{max_new_tokens: 16, ignore_eos: true}",
        "{max_num_seqs: 2, lookahead: 1, replicas: 1}",
    )
    (folder / "job.yaml").write_text(job_yaml(model_dir, sampling, engine, prefetch=1))


def a_child_holding_a_claim(folder, launcher: subprocess.Popen) -> int | None:
    """The pid of a process of the launch that holds a shard's claim, once a shard is committed."""
    if not committed(folder):
        return None
    children = {child.pid for child in psutil.Process(launcher.pid).children()}
    for lock in (folder / "out" / "_batchvl" / "claims").glob("*.lock"):
        try:
            pid = json.loads(lock.read_text())["pid"]
        except (OSError, ValueError):
            continue  # released meanwhile, or being written
        if pid in children:
            return pid
    return None


def test_a_process_killed_mid_run_is_named_and_a_rerun_gives_every_row_once(tmp_path, tiny_model_dir):
    num_shards = 8
    long_job(tmp_path, tiny_model_dir, num_shards)
    launcher = start(tmp_path, "--processes", "2")
    victim = wait_for(lambda: a_child_holding_a_claim(tmp_path, launcher))
    os.kill(victim, signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, stderr
    # one line names it (Python's resource tracker may warn after it of the killed process's semaphores,
    # which it removes)
    (line,) = [line for line in stderr.splitlines() if line.startswith("batchvl: ")]
    assert line.startswith("batchvl: process ") and " (cpu) was killed by SIGKILL" in line, line
    assert "rerun the same command to finish the job" in line
    (stats,) = stats_files(tmp_path)
    dead = [p for p in stats["processes"] if p["exit_code"] == -signal.SIGKILL]
    alive = [p for p in stats["processes"] if p["exit_code"] == 0]
    assert len(dead) == 1 and len(alive) == 1
    assert alive[0]["shards_committed"] >= 1  # the other one went on and committed its shards
    for shard in committed(tmp_path):  # what is committed is whole
        assert pq.read_table(tmp_path / "out" / f"{shard}.parquet").num_rows == SAMPLES * PROMPTS
    # the dead one's claims were stale as soon as it died, and the one that finished removed them
    assert list((tmp_path / "out" / "_batchvl" / "claims").iterdir()) == []

    again = batchvl(tmp_path, "--processes", "2")
    assert again.returncode == 0, again.stderr
    rows = output_rows(tmp_path / "out", num_shards)
    assert Counter((r["key"], r["prompt"]) for r in rows) == {
        (f"s{n}-{i}", p): 1 for n in range(num_shards) for i in range(SAMPLES) for p in ("caption", "short")
    }
    assert list((tmp_path / "out" / "_batchvl" / "claims").iterdir()) == []


def test_sigint_to_the_launcher_stops_every_process_and_keeps_the_finished_shards(tmp_path, tiny_model_dir):
    long_job(tmp_path, tiny_model_dir, 8)
    launcher = start(tmp_path, "--processes", "2")
    wait_for(lambda: committed(tmp_path))
    children = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGINT)  # to the launcher alone: it passes the stop on
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("batchvl: stopped by SIGINT after committing "), last
    assert "stopped: " in stdout  # the node's one summary
    _, alive = psutil.wait_procs(children, timeout=10)  # its processes, their workers, the resource tracker
    assert not alive
    (stats,) = stats_files(tmp_path)
    assert stats["stopped_by"] == "SIGINT" and [p["exit_code"] for p in stats["processes"]] == [0, 0]
    done = committed(tmp_path)
    assert stats["shards_committed"] == len(done) < 8
    for shard in done:
        assert pq.read_table(tmp_path / "out" / f"{shard}.parquet").num_rows == SAMPLES * PROMPTS


def test_the_processes_of_a_killed_launcher_end_instead_of_running_on_unwatched(tmp_path, tiny_model_dir):
    long_job(tmp_path, tiny_model_dir, 8)
    launcher = start(tmp_path, "--processes", "2")
    wait_for(lambda: committed(tmp_path))
    processes = psutil.Process(launcher.pid).children(recursive=True)
    launcher.kill()
    launcher.communicate()
    _, alive = psutil.wait_procs(processes, timeout=5)  # each at its next message, its pipe broken
    assert not alive
    assert len(committed(tmp_path)) < 8


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--gpus", "2"], "--gpus 2: no CUDA device is available; on the CPU use --processes N"),
        (["--gpus", "all"], "--gpus all: no CUDA device is available"),
        (["--processes", "0"], "--processes must be a whole number, 1 or more, got 0"),
        (["--processes", "2", "--gpus", "1"], "--processes and --gpus both given"),
    ],
)
def test_wrong_node_flags_are_one_line_exit_2_before_any_work(tmp_path, tiny_model_dir, flags, fragment):
    long_job(tmp_path, tiny_model_dir, 1)
    result = batchvl(tmp_path, *flags)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and fragment in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--set", "engine.vit_parallel=data"], "start their own processes: run them outside torchrun"),
        (["--overwrite"], "--overwrite with --gpus / --processes would write again what the processes write"),
    ],
)
def test_a_job_the_launch_cannot_run_is_refused_before_any_process_starts(
    tmp_path, tiny_model_dir, flags, fragment
):
    long_job(tmp_path, tiny_model_dir, 1)
    result = batchvl(tmp_path, "--processes", "2", *flags)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert fragment in line, line
    assert not Path(tmp_path / "out" / "_batchvl" / "stats").exists()


def test_the_api_runs_a_job_in_processes_too(tmp_path, tiny_model_dir, loaded_fp32, monkeypatch):
    write_image_shards(tmp_path / "data", [2, 2])
    (tmp_path / "job.yaml").write_text(job_yaml(tiny_model_dir))
    with pytest.raises(UserError, match="with processes= or gpus= each loads its own"):
        run_api(tmp_path / "job.yaml", processes=2, model=loaded_fp32)
    results = run_api(tmp_path / "job.yaml", processes=2, progress=False)
    assert results.dataset.num_rows == 8 and results.stats["samples"] == 4
    assert [p["exit_code"] for p in results.stats["processes"]] == [0, 0]
