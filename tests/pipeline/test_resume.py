"""Nothing lost, nothing twice: shard commits with markers, resume after kill -9 or SIGTERM, split tasks,
refusal of a changed config, and the error budget. Runs are real jobs on the tiny model."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from batchvl.config import load_job_config
from batchvl.errors import ErrorBudgetExceeded, UserError
from batchvl.outputs.commit import marker_path, read_marker
from batchvl.outputs.writers import output_path
from batchvl.pipeline.runner import run_job
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import LocalDir
from tests.conftest import output_rows, two_prompt_job_yaml, write_image_shards

SHARD_SIZES = [3, 4, 2, 5, 3, 4]
BAD = (2, 1)  # an undecodable image: error rows, not a crash


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("resume")
    write_image_shards(root / "data", SHARD_SIZES, {BAD: b"not an image"})
    # One sequence at a time: shards finish one after another, so a run can be stopped between them.
    (root / "job.yaml").write_text(
        two_prompt_job_yaml(tiny_model_dir, "{max_num_seqs: 1, lookahead: 1}", "preprocess: {workers: 1}")
    )
    return root


def config(job_dir, out: str, *overrides: str):
    return load_job_config(job_dir / "job.yaml", [f"output.dir={out}", *overrides])


def rows_of(out_dir) -> list[dict]:
    return output_rows(out_dir, len(SHARD_SIZES))


@pytest.fixture(scope="module")
def reference(job_dir, loaded_fp32):
    run_job(config(job_dir, "reference"), loaded=loaded_fp32, show_progress=False)
    rows = rows_of(job_dir / "reference")
    assert len(rows) == 2 * sum(SHARD_SIZES)
    assert sum(r["status"] == "error" for r in rows) == 2  # the bad image, once per prompt
    return rows


def cli(job_dir, *args, own_group: bool = False) -> subprocess.Popen:
    """`batchvl run`; `own_group` gives it a process group of its own, as a terminal's foreground job."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress", *args]
    return subprocess.Popen(
        command,
        cwd=job_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def wait_for_first_commit(out_dir, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not list((out_dir / "_batchvl" / "done").glob("*.json")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.02)


def committed(out_dir) -> list[int]:
    return [n for n in range(len(SHARD_SIZES)) if read_marker(LocalDir(str(out_dir)), f"part-{n}.parquet")]


def test_split_tasks_together_write_exactly_the_rows_of_one_run(job_dir, loaded_fp32, reference):
    for index in range(3):
        summary = run_job(
            config(job_dir, "split"), loaded=loaded_fp32, show_progress=False, task=TaskSlice(index, 3)
        )
        assert summary.stats["task"] == f"{index}/3"
    assert rows_of(job_dir / "split") == reference
    tasks = [
        read_marker(LocalDir(str(job_dir / "split")), f"part-{n}.parquet").task
        for n in range(len(SHARD_SIZES))
    ]
    assert sorted(tasks) == sorted(["0/3", "1/3", "2/3"] * 2)  # 6 shards, 3 tasks


@pytest.mark.timeout(900)  # a run killed, then a rerun limited to 300 s
def test_kill_9_in_the_middle_then_rerun_gives_the_rows_of_an_uninterrupted_run(job_dir, reference):
    out = job_dir / "killed"
    process = cli(job_dir, "--set", "output.dir=killed")
    wait_for_first_commit(out, process)
    workers = psutil.Process(process.pid).children(recursive=True)
    assert workers, "the job runs its preprocessing in worker processes"
    process.send_signal(signal.SIGKILL)
    process.wait()
    # The preprocessing workers go with it, instead of hanging on a queue nobody reads any more.
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []
    done_at_kill = committed(out)
    assert 0 < len(done_at_kill) < len(SHARD_SIZES), "the kill should land in the middle of the run"
    for number in set(range(len(SHARD_SIZES))) - set(done_at_kill):
        assert not os.path.exists(
            output_path(LocalDir(str(out)), f"part-{number}.parquet")
        )  # nothing partial

    rerun = cli(job_dir, "--set", "output.dir=killed")
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    assert f"{len(done_at_kill)} already done" in stdout
    assert rows_of(out) == reference
    leftovers = [name for name in os.listdir(out) if name.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize(
    ("signum", "from_a_terminal"),
    [(signal.SIGTERM, False), (signal.SIGINT, True)],  # Slurm's stop; Ctrl-C, to the whole group
)
@pytest.mark.timeout(900)  # a stopped run limited to 120 s, then a rerun to 300 s
def test_a_signal_stops_after_the_current_step_with_the_summary_and_a_rerun_finishes(
    job_dir, reference, signum, from_a_terminal
):
    name = signal.Signals(signum).name
    out = job_dir / f"stopped-{name}"
    process = cli(job_dir, "--set", f"output.dir={out.name}", own_group=from_a_terminal)
    wait_for_first_commit(out, process)
    if from_a_terminal:
        os.killpg(process.pid, signum)  # the job and its preprocessing workers get it
    else:
        process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr  # 130 for Ctrl-C, 143 for SIGTERM
    assert "restarting preprocessing workers" not in stderr  # the workers left the stop to the job
    assert f"stopped by {name} after committing" in stderr and "left for the next run" in stderr
    done = committed(out)
    assert 0 < len(done) < len(SHARD_SIZES)
    assert stdout.startswith("stopped: ") and f"{len(done)} shard(s) written" in stdout
    (stats_file,) = (out / "_batchvl" / "stats").glob("run-*.json")
    assert json.loads(stats_file.read_text())["stopped_by"] == name

    rerun = cli(job_dir, "--set", f"output.dir={out.name}")
    _, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    assert rows_of(out) == reference


def test_a_changed_config_is_refused_unless_overwrite(job_dir, loaded_fp32, reference):
    out = "changed"
    run_job(config(job_dir, out), loaded=loaded_fp32, show_progress=False)
    # Engine limits do not change outputs: everything is skipped.
    again = run_job(config(job_dir, out, "engine.max_num_seqs=4"), loaded=loaded_fp32, show_progress=False)
    assert again.stats["shards_skipped"] == len(SHARD_SIZES) and again.stats["shards_committed"] == 0
    with pytest.raises(
        UserError,
        match=r"holds 6 shard\(s\) written with a different config \(changed: "
        r"preprocess.max_pixels\); rerun with --overwrite",  # not prompts: their rows are reused
    ):
        run_job(
            config(job_dir, out, "preprocess.max_pixels=40000", "prompts=[{name: caption, text: Hi.}]"),
            loaded=loaded_fp32,
            show_progress=False,
        )
    redone = run_job(
        config(job_dir, out, "sampling.max_new_tokens=2", "output.overwrite=true"),
        loaded=loaded_fp32,
        show_progress=False,
    )
    assert redone.stats["shards_committed"] == len(SHARD_SIZES)
    rows = rows_of(job_dir / out)
    assert all(r["num_output_tokens"] <= 2 for r in rows)
    assert (
        read_marker(LocalDir(str(job_dir / out)), "part-0.parquet").config["sampling"]["max_new_tokens"] == 2
    )


def test_a_shard_without_its_marker_is_redone_and_stale_temp_files_go(job_dir, loaded_fp32, reference):
    out = job_dir / "partial"
    run_job(config(job_dir, "partial"), loaded=loaded_fp32, show_progress=False)
    os.remove(marker_path(LocalDir(str(out)), "part-1.parquet"))  # killed between the rename and the marker
    os.remove(output_path(LocalDir(str(out)), "part-4.parquet"))  # a marker whose output is gone
    stale = out / f".part-3.parquet.tmp-{os.uname().nodename}-999999999"
    stale.write_bytes(b"half a file")
    stale_card = out / f".README.md.tmp-{os.uname().nodename}-999999999"  # killed writing the dataset card
    stale_card.write_text("# half a card")
    summary = run_job(
        config(job_dir, "partial", "output.overwrite=false"), loaded=loaded_fp32, show_progress=False
    )
    assert summary.stats["shards_committed"] == 2 and summary.stats["shards_skipped"] == 4
    assert not stale.exists() and not stale_card.exists()
    assert rows_of(out) == reference


def test_over_the_error_budget_the_run_commits_and_then_fails(job_dir, loaded_fp32, reference):
    out = job_dir / "budget"
    # 2 error rows of 42: 4.8%
    with pytest.raises(
        ErrorBudgetExceeded, match=r"2 of 42 rows are errors \(4.8%\), over output.max_error_rate=0.01"
    ) as info:
        run_job(
            config(job_dir, "budget", "output.max_error_rate=0.01"), loaded=loaded_fp32, show_progress=False
        )
    assert info.value.exit_code == 3
    assert rows_of(out) == reference  # everything was committed first
    # the same command again finds every shard committed and still answers for their error rows
    with pytest.raises(
        ErrorBudgetExceeded,
        match=r"^2 of 42 rows are errors \(4.8%\), over output.max_error_rate=0.01 \(42 of the rows are of "
        r"shards committed by earlier runs\)",
    ) as again:
        run_job(
            config(job_dir, "budget", "output.max_error_rate=0.01"), loaded=loaded_fp32, show_progress=False
        )
    assert again.value.exit_code == 3 and again.value.summary.stats["shards_committed"] == 0
    summary = run_job(
        config(job_dir, "budget2", "output.max_error_rate=0.05"), loaded=loaded_fp32, show_progress=False
    )
    assert summary.stats["errors"] == 2
