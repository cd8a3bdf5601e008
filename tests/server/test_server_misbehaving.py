"""engine.backend: openai against a server that misbehaves (tests/fake_openai_server.py): one that hangs, a
request that brings the server down each time it is sent. Each ends in seconds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import cli
from tests.fake_openai_server import FakeOpenAIServer
from tests.server_jobs import (
    GONE_SIZES,
    PROMPTS,
    all_requests,
    at,
    files_under,
    rows_by_request,
    run,
    write_job,
)

FAKE_SERVER_PROGRAM = Path(__file__).parents[1] / "fake_server_process.py"


def launched(*launch_args: str, **keys) -> dict:
    """engine.server keys that launch the fake server as a program, with `launch_args`."""
    launch = {"launch": f"{sys.executable} {FAKE_SERVER_PROGRAM}", "launch_args": list(launch_args)}
    return {**launch, "retries": 2, "backoff_s": 0.05, "timeout_s": 5, "startup_timeout_s": 60, **keys}


@pytest.fixture
def fake(tiny_model_dir):
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        yield server


def test_a_server_that_hangs_mid_run_stops_it_as_a_gone_one_after_the_finished_shards(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys
):
    # One request at a time: shards 0 and 1 are answered, then shard 2's first request wedges the server.
    fake.hang_on.add("Describe s2-0.")
    server = at(fake.url, retries=1, max_concurrency=1, timeout_s=0.5)
    job = write_job(tmp_path, tiny_model_dir, server, sizes=GONE_SIZES)
    started = time.monotonic()
    code, out, err = cli(monkeypatch, capsys, "run", job, "--no-progress")

    assert code == 1, err
    assert time.monotonic() - started < 20  # a timeout and the health checks, not one per request
    (line,) = err.strip().splitlines()
    assert f"the server at {fake.url} stopped answering" in line
    assert "2 shard(s) were committed, 2 shard(s) are left" in line
    written = {name for name in files_under(tmp_path / "out") if not name.startswith("_batchvl/stats/")}
    assert written == {
        "part-0.parquet",
        "part-1.parquet",
        "_batchvl/done/part-0.json",
        "_batchvl/done/part-1.json",
        "_batchvl/inputs/part-0.json",  # the input each committed shard was made from
        "_batchvl/inputs/part-1.json",
    }
    done = rows_by_request(tmp_path, 2)
    assert set(done) == all_requests(GONE_SIZES[:2]) and all(r["status"] == "ok" for r in done.values())


def test_a_request_that_brings_the_server_down_each_time_is_a_server_crash_row_and_the_job_goes_on(
    tmp_path, tiny_model_dir, fake
):
    # A supervisor brings the server back 0.05 s after each crash; the other requests are in flight with
    # the poisoned one at first.
    fake.crash["Describe s0-1."] = 0.05
    fake.hold_s = 0.05
    run(write_job(tmp_path, tiny_model_dir, at(fake.url, retries=2, backoff_s=0.1), sizes=[2, 2]))

    rows = rows_by_request(tmp_path, 2)
    poisoned = rows.pop(("s0-1", "caption"))
    assert poisoned["status"] == "error" and poisoned["error_type"] == "server_crash"
    assert (
        "the server stopped answering each time this request was sent (3 times" in poisoned["error_message"]
    )
    assert set(rows) == all_requests([2, 2]) - {("s0-1", "caption")}
    assert {k: r["error_message"] for k, r in rows.items() if r["status"] != "ok"} == {}
    sends = [r.at for r in fake.completions("Describe s0-1.")]
    assert len(sends) == 3  # counted: the first send and its 2 retries
    # Each retry waited for the server to answer again (the first health check fails, the next comes after
    # 0.1 s), then its own backoff: 0.1 s, then 0.2 s.
    assert [b - a >= wait for a, b, wait in zip(sends, sends[1:], [0.2, 0.3], strict=False)] == [True, True]


def test_a_request_that_crashes_a_launched_server_each_time_is_a_server_crash_row_and_the_job_goes_on(
    tmp_path, tiny_model_dir
):
    # One request at a time. Each crash costs a restart: 2 before the poisoned request's third send (its
    # last retry), which is given up, then 1 for the requests after it: more than retries=2 in all.
    server = launched("--exit-on", "Describe s0-1.", max_concurrency=1)
    job = write_job(tmp_path, tiny_model_dir, server, sizes=[2, 2], prompts=PROMPTS[:1])
    summary = run(job)

    rows = rows_by_request(tmp_path, 2)
    poisoned = rows.pop(("s0-1", "caption"))
    assert poisoned["error_type"] == "server_crash" and "(3 times" in poisoned["error_message"]
    assert {k: r["error_message"] for k, r in rows.items() if r["status"] != "ok"} == {}
    assert set(rows) == all_requests([2, 2], PROMPTS[:1]) - {("s0-1", "caption")}
    log = (tmp_path / "out" / "_batchvl" / "logs" / "server-0.log").read_text()
    assert log.count("exiting on 'Describe s0-1.'") == 3 and log.count("serving [") == 4
    assert summary.stats["samples"] == 4


def test_a_launched_server_that_dies_whatever_it_is_sent_is_restarted_retries_plus_one_times_then_gone(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    # Every request brings the server down: the first is given up as a server_crash after 2 restarts in a
    # row, the restart after it is on its account, and the next request's crash finds no restart left. A
    # give-up that reset the count would restart the server twice more for every request of the job.
    server = launched("--exit-on", "Describe s", max_concurrency=1)
    job = write_job(tmp_path, tiny_model_dir, server, sizes=[2, 2], prompts=PROMPTS[:1])
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")

    assert code == 1, err
    assert "stopped answering (after 2 retries and 3 restart(s))" in err.strip().splitlines()[-1]
    log = (tmp_path / "out" / "_batchvl" / "logs" / "server-0.log").read_text()
    assert log.count("serving [") == 4  # the start and 3 restarts: retries + 1
    assert not [name for name in files_under(tmp_path / "out") if name.endswith(".parquet")]


def test_a_launched_server_that_refuses_its_arguments_is_one_short_line_naming_the_problem(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    job = write_job(tmp_path, tiny_model_dir, launched("--bogus-flag", "1"), sizes=[1])
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")

    assert code == 2
    (line,) = err.strip().splitlines()
    assert "the server exited with code 2 while starting: " in line
    assert "error: unrecognized arguments: --bogus-flag 1" in line and "--option-" not in line
    assert len(line) < 500


def test_a_server_its_launch_command_wraps_without_exec_goes_when_batchvl_is_killed(tmp_path, tiny_model_dir):
    # The launch command is a shell that runs the server as its child (not exec'd): the kernel's
    # parent-death signal reaches the shell alone.
    wrapper = f'{sys.executable} {FAKE_SERVER_PROGRAM} "$@"; echo the server ended'
    server = {"launch": f"bash -c '{wrapper}' wrapper", "launch_args": ["--hold-s", "60"]}
    job = write_job(tmp_path, tiny_model_dir, server, sizes=[1])
    log = tmp_path / "out" / "_batchvl" / "logs" / "server-0.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "batchvl", "run", str(job), "--no-progress"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server_pid = None
    try:
        deadline = time.monotonic() + 60
        while server_pid is None:
            assert time.monotonic() < deadline and run.poll() is None, "the server did not start"
            found = re.search(r"\(pid (\d+)\)", log.read_text()) if log.exists() else None
            server_pid = int(found.group(1)) if found else None
            time.sleep(0.1)
        time.sleep(1)  # the job's requests wait at the server
        run.kill()
        run.wait()
        assert gone_within(server_pid, 20), "the wrapped server outlived batchvl"
    finally:
        run.kill()
        if server_pid is not None and not gone_within(server_pid, 0):
            os.kill(server_pid, signal.SIGKILL)


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def test_a_launched_server_that_does_not_answer_in_time_is_stopped(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    marker = f"never-answers-{tmp_path.name}"
    server = {
        "launch": f"{sys.executable} -c 'import time; time.sleep(120)' {marker}",
        "startup_timeout_s": 2,
    }
    job = write_job(tmp_path, tiny_model_dir, server, sizes=[1])
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")

    assert code == 2 and "did not answer within engine.server.startup_timeout_s=2 s" in err
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_a_launched_server_is_probed_once_started_and_stopped_when_it_refuses(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    marker = f"refuses-probes-{tmp_path.name}"
    prompts = [{"name": "digits", "text": "Digits {key}", "regex": "[0-9]{3}"}]
    job = write_job(tmp_path, tiny_model_dir, launched("--reject-probes", marker), sizes=[1], prompts=prompts)
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")

    assert code == 2 and "refuses prompt 'digits''s request" in err
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == []
