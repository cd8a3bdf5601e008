"""The throughput benchmark's `--device`: checked before any work, in one line with its fix (CUDA faked
where the check needs a GPU), and passed to batchvl's job; and its per-CPU probe of the machine."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def throughput(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its sibling `workloads`
    return importlib.import_module("throughput")


def test_a_device_is_checked_against_the_machine_and_the_methods(throughput, monkeypatch):
    check = throughput.device_problem
    assert check("cpu", ["a", "b", "c", "d"]) is None
    assert check("gpu", ["c"]) == "--device gpu is not a device; use cpu, cuda or cuda:N"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check("cuda", ["c"]) == "--device cuda but no CUDA device is available; use --device cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check("cuda", ["a", "b", "c"]) is None
    assert check("cuda:1", ["c"]) == "--device cuda:1 but this machine has 1 CUDA device(s); name one"
    assert check("cuda", ["c", "d", "f"]) == (
        "methods d,f run vLLM's CPU build; with --device cuda leave them out of --methods"
    )


def test_batchvls_job_runs_on_the_benchmarks_device(throughput, tmp_path):
    model = {"path": str(tmp_path), "dtype": "bfloat16", "device": "cuda:1"}
    cfg = throughput.batchvl_job(tmp_path, ["caption"], tmp_path / "out", model)
    assert (cfg.model.device, cfg.model.dtype) == ("cuda:1", "bfloat16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_asking_for_a_gpu_the_machine_lacks_is_one_line_and_exit_2_before_any_work(tmp_path):
    out = tmp_path / "result.json"
    script = str(BENCHMARKS / "throughput.py")
    result = subprocess.run(
        [sys.executable, script, "--device", "cuda", "--json", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr == "error: --device cuda but no CUDA device is available; use --device cpu\n"
    assert not out.exists()


def test_the_vllm_peer_is_given_only_the_arguments_it_takes(throughput, monkeypatch, tmp_path):
    """vLLM's CPU build takes no device: its command line is the one its own parser accepts, and batchvl's
    child still gets the device."""
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout='{"wall_s": 1.0}\n', stderr="")

    monkeypatch.setattr(throughput.subprocess, "run", fake_run)
    monkeypatch.setattr(throughput, "VLLM_VENV", Path(sys.executable).parent.parent)
    for method in ("e", "c"):
        throughput.run_child(str(BENCHMARKS / "throughput.py"), method, "bfloat16", tmp_path, tmp_path, "cpu")
    vllm, batchvl = commands
    vllm_peer = importlib.import_module("vllm_peer")
    arguments = vllm_peer.argument_parser().parse_args(vllm[2:])  # after the python and the script
    assert (arguments.root, arguments.dtype) == (tmp_path, "bfloat16")
    assert batchvl[batchvl.index("--device") + 1] == "cpu"


def test_the_cpu_probe_measures_each_cpu_pinned_alone_and_all_at_once(throughput):
    """The per-CPU matmul figures the report keeps: a child per CPU, pinned there, one after another and
    then together, each with a rate."""
    cpus = sorted(os.sched_getaffinity(0))
    rates = throughput.cpu_matmul_rates("float32", seconds=0.05, size=64)
    assert rates["dtype"] == "float32"
    for when in ("alone", "together"):
        assert [probe["cpus"] for probe in rates[when]] == [[cpu] for cpu in cpus]
        assert all(probe["gflops"] > 0 for probe in rates[when])
