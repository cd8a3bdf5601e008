"""A stop signal stops a run within seconds whatever its step is doing: a step that never ends is
interrupted `STOP_GRACE_S` after the signal (exit 128 + signal, as a clean stop), and a run whose cleanup
then hangs too is ended from faulthandler's watchdog thread `HARD_EXIT_S` later, with the traceback of where
it hung. The hangs are injected into a real `batchvl run` (the tiny model): where a finished request
becomes its row, and where the run closes its input."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import two_prompt_job_yaml, write_image_shards

# The run's own entry point, with the deadlines shortened and the row of every finished request hung.
RUNNER = """
import sys, pathlib
import batchvl.pipeline.runner, batchvl.utils.stop
batchvl.utils.stop.STOP_GRACE_S = 1.0
batchvl.utils.stop.HARD_EXIT_S = 2.0

def hang(*args, **kwargs):
    pathlib.Path("hung").touch()
    while True:
        pass

def hang_on_close(*args, **kwargs):
    while True:
        pass

batchvl.pipeline.runner.result_row = hang
if {cleanup_hangs}:
    batchvl.pipeline.runner.BackgroundIterator.close = hang_on_close
from batchvl.cli import main
sys.argv = ["batchvl", "run", "job.yaml", "--no-progress"]
main()
"""


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("deadline")
    write_image_shards(root / "data", [2])
    (root / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}", "preprocess: {workers: 0}"))
    return root


@pytest.mark.parametrize("cleanup_hangs", [False, True])
def test_a_stop_signal_ends_a_hung_step_within_seconds(job_dir, cleanup_hangs):
    (job_dir / "hung").unlink(missing_ok=True)
    script = textwrap.dedent(RUNNER).replace("{cleanup_hangs}", str(cleanup_hangs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=job_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (job_dir / "hung").exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the run never reached its first row"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    took = time.monotonic() - sent
    if not cleanup_hangs:
        assert process.returncode == 128 + signal.SIGTERM, stderr
        assert "stopped by SIGTERM: the current step had not ended 1 s later, so it was interrupted" in stderr
        assert took < 1 + 9, took  # the grace, then the cleanup (slow on a busy machine)
    else:
        assert process.returncode == 1, stderr  # faulthandler's exit
        assert "Timeout (0:00:03)!" in stderr and "in hang_on_close" in stderr  # where, for a bug report
        assert took < 1 + 2 + 7, took
    assert "stopping after the current step" in stderr


# A run that stops cleanly before its deadline leaves no deadline behind: the process (a notebook's kernel,
# a test session) lives on past it.
DISARMED = """
import os, signal, time
import batchvl.utils.stop as stop
stop.STOP_GRACE_S = 0.3
stop.HARD_EXIT_S = 0.3
with stop.StopRequests() as requests:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert requests.requested
time.sleep(1.5)
print("alive")
"""


def test_the_stop_deadline_is_disarmed_when_the_run_ends(tmp_path):
    done = subprocess.run([sys.executable, "-c", DISARMED], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "alive"), done.stderr
