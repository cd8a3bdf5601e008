"""`make gpu-check`'s runner (scripts/gpu_check.py): a stage that fails, raises, hangs or no longer fits
the time budget is reported and the next one still runs; test outcomes are read from pytest's report, or
from what it printed when it was stopped. Its report goes to benchmarks/results/, named after the device
and the time, with the benchmarks' own reports beside it. (`DEVICE=cpu make gpu-check` runs the real
stages.)"""

import importlib
import json
import re
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture
def gpu_check(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("gpu_check")
    monkeypatch.setattr(module, "REPORT", tmp_path / "report.json")
    monkeypatch.setattr(module, "STARTED", time.monotonic())
    return module


def test_test_outcomes_are_counted_with_the_failures_named(gpu_check, tmp_path):
    tests = tmp_path / "test_two.py"
    tests.write_text(
        "def test_passes():\n    assert True\n\n\ndef test_fails():\n    assert 1 == 2, 'one is not two'\n"
    )
    outcome = gpu_check.pytest_stage([str(tests)], 60, tmp_path, "two")
    assert (outcome["ok"], outcome["passed"], outcome["failed"]) == (False, 1, 1)
    (failure,) = outcome["failures"]
    assert "test_fails" in failure and "one is not two" in failure


def test_a_stopped_test_run_reports_what_it_printed(gpu_check, tmp_path):
    tests = tmp_path / "test_slow.py"
    tests.write_text(
        "import time\n\n\ndef test_quick():\n    pass\n\n\ndef test_slow():\n    time.sleep(60)\n"
    )
    outcome = gpu_check.pytest_stage([str(tests)], 8, tmp_path, "slow")
    assert outcome["ok"] is False and outcome["rc"] == "timeout"
    ((test, printed),) = outcome["outcomes_printed"].items()  # the slow test was still running
    assert test.endswith("test_slow.py::test_quick") and printed == "PASSED"


def test_a_stopped_stage_takes_its_child_processes_with_it(gpu_check, tmp_path):
    """A test run stopped at its limit leaves nothing running on the device: its workers (or a job's) are
    killed with it."""
    pid_file = tmp_path / "child.pid"
    tests = tmp_path / "test_spawns.py"
    tests.write_text(
        "import subprocess, sys, time\n\n\ndef test_spawns():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(120)\n"
    )
    outcome = gpu_check.pytest_stage([str(tests)], 8, tmp_path, "spawns")
    assert outcome["rc"] == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        time.sleep(0.1)  # killed; then reaped by init
    assert not Path(f"/proc/{child}").exists()


def test_outcomes_are_read_from_what_pytest_printed_with_or_without_workers(gpu_check):
    printed = (
        "tests/a.py::test_one PASSED                  [ 33%]\n"
        "tests/a.py::test_two[x-1] FAILED             [ 66%]\n"
        "tests/a.py::test_three \n"  # still running
        "[gw1] [ 50%] PASSED tests/b.py::test_four \n"
        "[gw0] [100%] ERROR tests/b.py::test_five[cuda] \n"
        "collected 5 items\n"
    )
    assert gpu_check.printed_outcomes(printed) == {
        "tests/a.py::test_one": "PASSED",
        "tests/a.py::test_two[x-1]": "FAILED",
        "tests/b.py::test_four": "PASSED",
        "tests/b.py::test_five[cuda]": "ERROR",
    }


def test_a_test_stage_in_several_workers_counts_every_outcome(gpu_check, tmp_path):
    tests = tmp_path / "test_three.py"
    tests.write_text(
        "import os\n\n\ndef test_a():\n    assert os.environ['PYTEST_XDIST_WORKER'].startswith('gw')\n"
        "    assert os.environ['OMP_NUM_THREADS'] == str(max(1, (os.cpu_count() or 1) // 2))\n\n\n"
        "def test_b():\n    pass\n\n\ndef test_c():\n    assert False, 'c fails'\n"
    )
    outcome = gpu_check.pytest_stage([str(tests)], 60, tmp_path, "three", workers=2)
    assert (outcome["passed"], outcome["failed"]) == (2, 1)
    assert "c fails" in outcome["failures"][0]


def test_every_stage_is_reported_whatever_the_others_do(gpu_check, monkeypatch, tmp_path):
    def raises(work):
        raise RuntimeError("no GPU here")

    def slow(work):
        return {"ok": False, **gpu_check.run([sys.executable, "-c", "import time; time.sleep(30)"], 2)}

    stages = [("raises", raises), ("fine", lambda work: {"ok": True}), ("hangs", slow), ("late", raises)]
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    monkeypatch.setattr(gpu_check, "BUDGET_S", gpu_check.MIN_STAGE_S + 1.5)  # "late" no longer fits
    with pytest.raises(SystemExit) as exit_status:
        gpu_check.main()
    assert exit_status.value.code == 1
    report = json.loads(gpu_check.REPORT.read_text())
    stages = report["stages"]
    assert stages["raises"] == {"ok": False, "exception": "RuntimeError: no GPU here", "seconds": 0.0}
    assert stages["hangs"]["rc"] == "timeout"
    assert stages["fine"]["ok"] is True
    assert stages["late"] == {"ok": False, "skipped": "the time budget ran out"}
    assert report["ok"] is False


def test_chosen_stages_run_alone_in_the_script_order(gpu_check, monkeypatch):
    ran = []

    def stage(name):
        def run(work):
            ran.append(name)
            return {"ok": True}

        return run

    monkeypatch.setattr(gpu_check, "STAGES", [(name, stage(name)) for name in ("first", "second", "third")])
    monkeypatch.setenv("GPU_CHECK_STAGES", "third, first")
    with pytest.raises(SystemExit) as exit_status:
        gpu_check.main()
    assert exit_status.value.code == 0
    assert ran == ["first", "third"]
    assert list(json.loads(gpu_check.REPORT.read_text())["stages"]) == ["first", "third"]


def test_an_unknown_stage_name_stops_before_any_stage_runs(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "STAGES", [("first", lambda work: {"ok": True})])
    monkeypatch.setenv("GPU_CHECK_STAGES", "frist")
    with pytest.raises(SystemExit) as exit_status:
        gpu_check.main()
    assert "no stage frist; the stages are first" in str(exit_status.value.code)
    assert not gpu_check.REPORT.exists()


def test_the_report_is_kept_in_the_results_named_after_the_device_and_the_time(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "ON_CPU", True)
    report = gpu_check.default_report()
    assert report.parent == gpu_check.ROOT / "benchmarks" / "results"
    assert re.fullmatch(r"gpu-check-cpu-\d{8}T\d{6}Z\.json", report.name), report.name


def test_the_benchmarks_reports_are_copied_beside_the_report_named_after_it(gpu_check, monkeypatch):
    def benchmark(work):
        (work / "host_step.json").write_text('{"step_ms": 4.0}')
        return {"ok": True}

    monkeypatch.setattr(gpu_check, "STAGES", [("host_step", benchmark)])
    with pytest.raises(SystemExit):
        gpu_check.main()
    copy = gpu_check.REPORT.with_name("report-host_step.json")
    assert json.loads(copy.read_text()) == {"step_ms": 4.0}
    assert sorted(path.name for path in gpu_check.REPORT.parent.glob("*.json")) == [
        "report-host_step.json",
        "report.json",
    ]


def test_the_fused_kernels_benchmark_is_skipped_on_the_cpu_in_one_line(gpu_check, monkeypatch, tmp_path):
    """benchmarks/fused_elementwise.py needs CUDA: on the CPU it says so and exits 2, which a DEVICE=cpu
    trial reports as skipped, not failed."""
    monkeypatch.setattr(gpu_check, "ON_CPU", True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    outcome = gpu_check.fused_elementwise(tmp_path)
    assert outcome["ok"] is True and outcome["rc"] == 2
    assert (
        outcome["skipped"]
        == "fused_elementwise.py times Triton kernels on a CUDA device: no CUDA device here"
    )
    assert "fused_elementwise" in [name for name, _ in gpu_check.STAGES]


@pytest.mark.parametrize("name", ["decode_attention", "prefill_attention"])
def test_the_attention_kernels_benchmarks_are_skipped_on_the_cpu_in_one_line(
    gpu_check, monkeypatch, tmp_path, name
):
    monkeypatch.setattr(gpu_check, "ON_CPU", True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    outcome = getattr(gpu_check, name)(tmp_path)
    assert outcome["ok"] is True and outcome["rc"] == 2
    assert outcome["skipped"] == f"{name}.py times Triton kernels on a CUDA device: no CUDA device here"
    assert name in [stage for stage, _ in gpu_check.chosen_stages()]


def test_optional_stages_run_only_when_named(gpu_check, monkeypatch):
    names = [name for name, _ in gpu_check.chosen_stages()]
    assert "gpu_throughput_2b" in names and not set(names) & gpu_check.OPTIONAL
    monkeypatch.setenv("GPU_CHECK_STAGES", "gpu_throughput_7b")
    assert [name for name, _ in gpu_check.chosen_stages()] == ["gpu_throughput_7b"]


def test_the_7b_runs_with_every_fast_path_by_default_after_its_baseline_where_named(gpu_check, monkeypatch):
    """The goal's second model is measured in a window's first call, right after the 2B runs; a call naming
    its baseline too runs that first, so that the fast run's texts are set against it."""
    names = [name for name, _ in gpu_check.chosen_stages()]
    assert names[names.index("gpu_throughput_2b_fast") + 1] == "gpu_throughput_7b_fast"
    monkeypatch.setenv("GPU_CHECK_STAGES", "gpu_throughput_7b_fast,gpu_throughput_7b")
    assert [name for name, _ in gpu_check.chosen_stages()] == ["gpu_throughput_7b", "gpu_throughput_7b_fast"]


def test_a_fast_paths_run_says_how_many_texts_equal_the_baselines(gpu_check, monkeypatch, tmp_path):
    """The 2B run with fast paths is set against the run without them: the share of samples whose text is
    the baseline's (the benchmark is faked here: its flags and files as the stage passes them)."""
    texts = {(): {"a": "a cat", "b": "a dog"}, ("cuda_graphs", "overlap"): {"a": "a cat", "b": "a frog"}}
    commands = []

    def fake_run(command, limit_s, **kwargs):
        commands.append(command)
        flags = tuple(arg[2:].replace("-", "_") for arg in command if arg in ("--cuda-graphs", "--overlap"))
        Path(command[command.index("--json") + 1]).write_text(json.dumps({"samples_per_s": 1.0}))
        Path(command[command.index("--texts") + 1]).write_text(json.dumps(texts[flags]))
        return {"rc": 0, "seconds": 1.0, "stdout": ""}

    monkeypatch.setattr(gpu_check, "run", fake_run)
    baseline = gpu_check.gpu_throughput(tmp_path, "2b")
    assert baseline["ok"] and "same_text_share_vs_eager" not in baseline
    fast = gpu_check.gpu_throughput(tmp_path, "2b", ("cuda_graphs", "overlap"))
    assert fast["ok"] and fast["same_text_share_vs_eager"] == 0.5
    assert {"--cuda-graphs", "--overlap"} <= set(commands[1]) and "--fused-kernels" not in commands[1]
    # the texts are not kept beside the report, as the benchmarks' own JSON reports are
    assert not [path for path in tmp_path.glob("*.json") if "texts" in path.name]


def test_the_host_step_stages_time_the_2b_model_serial_and_with_the_fast_paths(
    gpu_check, monkeypatch, tmp_path
):
    """On a GPU the stages run host_step.py at Qwen2-VL-2B's size, 256 or 1,024 decodes a step, the last one
    with decode graphs and overlapped steps, each into its own JSON, which the stage's outcome carries."""
    commands = []

    def fake_run(command, limit_s, **kwargs):
        commands.append(command)
        Path(command[command.index("--json") + 1]).write_text(json.dumps({"step_ms_median": 5.0}))
        return {"rc": 0, "stdout": ""}

    monkeypatch.setattr(gpu_check, "run", fake_run)
    monkeypatch.setattr(gpu_check, "ON_CPU", False)
    stages = dict(gpu_check.STAGES)
    outcomes = [stages[name](tmp_path) for name in ("host_step", "host_step_1024", "host_step_1024_fast")]
    assert all(outcome["ok"] and outcome["step_ms_median"] == 5.0 for outcome in outcomes)
    named = [Path(command[command.index("--json") + 1]).name for command in commands]
    assert named == ["host_step.json", "host_step_1024.json", "host_step_1024_fast.json"]
    requests = [command[command.index("--requests") + 1] for command in commands]
    assert requests == ["256", "1024", "1024"] and all("2b" in command for command in commands)
    fast = [{"--overlap", "--cuda-graphs"} <= set(command) for command in commands]
    assert fast == [False, False, True]


def test_the_fast_paths_parity_stage_runs_the_parity_tests_with_every_fast_path_on(
    gpu_check, monkeypatch, tmp_path
):
    """The stage's pytest sees BATCHVL_TEST_FAST_PATHS=1 beside the test device, and runs the engine and
    family parity files (here on a stand-in test file that reads the environment)."""
    probe = tmp_path / "test_environment.py"
    probe.write_text(
        "import os\n\n\ndef test_fast_paths_on():\n"
        "    assert os.environ['BATCHVL_TEST_FAST_PATHS'] == '1'\n"
        "    assert os.environ['BATCHVL_TEST_DEVICE'] == 'cuda'\n"
    )
    assert gpu_check.FAST_PATHS_PARITY_TESTS == [
        "tests/engine/test_parity.py",
        "tests/engine/test_family_parity.py",
    ]
    monkeypatch.setattr(gpu_check, "FAST_PATHS_PARITY_TESTS", [str(probe)])
    monkeypatch.setattr(gpu_check, "DEVICE", "cuda")
    monkeypatch.setattr(gpu_check, "test_workers", lambda: 1)
    outcome = dict(gpu_check.STAGES)["fast_paths_parity"](tmp_path)
    assert (outcome["ok"], outcome["passed"], outcome["failed"]) == (True, 1, 0), outcome


def test_the_vision_call_stage_times_the_2b_tower_on_a_gpu_and_the_tiny_one_on_the_cpu(
    gpu_check, monkeypatch, tmp_path
):
    """On a GPU the stage runs vision_call.py at Qwen2-VL-2B's size and carries its rows; a DEVICE=cpu trial
    runs the tiny model at two small call sizes. A run that wrote no report is a failed stage."""
    commands = []

    def fake_run(command, limit_s, **kwargs):
        commands.append(command)
        if len(commands) < 3:
            Path(command[command.index("--json") + 1]).write_text(json.dumps({"rows": [{"wall_ms": 9.0}]}))
        return {"rc": 0, "stdout": "| table |"}

    monkeypatch.setattr(gpu_check, "run", fake_run)
    stages = dict(gpu_check.STAGES)
    monkeypatch.setattr(gpu_check, "ON_CPU", False)
    on_gpu = stages["vision_call"](tmp_path)
    monkeypatch.setattr(gpu_check, "ON_CPU", True)
    on_cpu = stages["vision_call"](tmp_path)
    assert on_gpu["ok"] and on_gpu["rows"] == [{"wall_ms": 9.0}] and on_cpu["ok"]
    assert commands[0][commands[0].index("--size") + 1] == "2b" and "--patches" not in commands[0]
    assert commands[1][commands[1].index("--size") + 1] == "tiny" and "--patches" in commands[1]
    (tmp_path / "vision_call.json").unlink()
    assert stages["vision_call"](tmp_path)["ok"] is False
    assert "vision_call" in [name for name, _ in gpu_check.chosen_stages()]


def test_a_failed_stages_output_names_the_checkouts_files_relative_to_it(gpu_check):
    """The report is kept in the repository: a traceback's paths are the checkout's own, not the machine's."""
    root = gpu_check.ROOT
    printed = f"File {root}/batchvl/api.py, line 1; rootdir: {root}"
    script = f"import sys; print({printed!r}); sys.exit(1)"
    outcome = gpu_check.run([sys.executable, "-c", script], 30)
    assert outcome["rc"] == 1
    assert outcome["output_tail"].strip() == "File batchvl/api.py, line 1; rootdir: ."


def test_the_tuned_run_takes_what_the_kernel_benchmarks_found_faster(gpu_check, monkeypatch, tmp_path):
    """The kernel benchmarks' reports, as they leave them in the check's folder, choose the tuned 2B run's
    launch settings and vision attention; its texts are set against the default fast run's too (the
    benchmark is faked: its flags and files as the stage passes them)."""
    assert gpu_check.gpu_throughput_tuned(tmp_path)["skipped"] == (
        "nothing beat the defaults in no kernel benchmark of this check (run them before it)"
    )
    decode = [{"shape": "2b", "sequences": 1024, "keys": 600, "grouped_us": 100.0}]
    decode.append({**decode[0], "launch": {"BLOCK_KEYS": 128}, "grouped_us": 80.0})
    (tmp_path / "decode_attention.json").write_text(json.dumps({"results": decode}))
    vision = [
        {"patches": 32768, "fused_kernels": True, "vision_attention": "flash_varlen", "wall_ms": 100.0},
        {"patches": 32768, "fused_kernels": True, "vision_attention": "sdpa", "wall_ms": 99.0},
    ]
    (tmp_path / "vision_call.json").write_text(json.dumps({"rows": vision}))
    fast_texts = tmp_path / "gpu_throughput-2b-cuda_graphs-overlap-fused_kernels.texts"
    fast_texts.write_text(json.dumps({"a": "a cat", "b": "a dog"}))
    commands = []

    def fake_run(command, limit_s, **kwargs):
        commands.append(command)
        Path(command[command.index("--json") + 1]).write_text(json.dumps({"samples_per_s": 2.0}))
        Path(command[command.index("--texts") + 1]).write_text(json.dumps({"a": "a cat", "b": "a bat"}))
        return {"rc": 0, "seconds": 1.0, "stdout": ""}

    monkeypatch.setattr(gpu_check, "run", fake_run)
    tuned = gpu_check.gpu_throughput_tuned(tmp_path)
    assert tuned["ok"] and tuned["samples_per_s"] == 2.0
    assert tuned["launch_settings"] == {"triton_grouped_decode": {"BLOCK_KEYS": 128}}
    assert tuned["vision_attention"] is None  # 1% faster: within the noise
    assert tuned["tuned_from"] == ["decode_attention", "vision_call"]
    (command,) = commands
    passed = json.loads(command[command.index("--launch-settings") + 1])
    assert passed == {"triton_grouped_decode": {"BLOCK_KEYS": 128}} and "--vision-attention" not in command
    assert {"--cuda-graphs", "--overlap", "--fused-kernels"} <= set(command)
    assert tuned["same_text_share_vs_default_launch"] == 0.5 and "same_text_share_vs_eager" not in tuned
    assert Path(command[command.index("--json") + 1]).name == (
        "gpu_throughput-2b-cuda_graphs-overlap-fused_kernels-tuned.json"
    )
    assert "gpu_throughput_2b_tuned" in gpu_check.OPTIONAL
