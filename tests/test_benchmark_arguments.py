"""The throughput benchmark's arguments. `--device`: checked before any work, in one line with its fix (CUDA
faked where the check needs a GPU), and passed to batchvl's job; and its per-CPU probe of the machine.
`--rounds`: the methods' order alternates between rounds, each method's row is its median round, each
round's ratios are taken within the round, and a count that runs nothing is refused the same way."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmark(monkeypatch):
    """A benchmark module by its name: the scripts import their siblings by plain names."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


@pytest.fixture
def throughput(benchmark):
    return benchmark("throughput")


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


def test_batchvls_job_runs_on_the_benchmarks_device(benchmark, tmp_path):
    model = {"path": str(tmp_path), "dtype": "bfloat16", "device": "cuda:1"}
    cfg = benchmark("batchvl_method").batchvl_job(tmp_path, ["caption"], tmp_path / "out", model)
    assert (cfg.model.device, cfg.model.dtype) == ("cuda:1", "bfloat16")


@pytest.mark.parametrize(("two_prompt_share", "parts"), [(0, ["one_prompt"]), (1, ["two_prompts"])])
def test_a_workload_without_one_of_its_parts_runs_the_other_alone(
    benchmark, tmp_path, two_prompt_share, parts
):
    from batchvl.demo.tiny_model import build_tiny_model

    workload = benchmark("throughput_workload")
    workload.write_workload(tmp_path, 3, 0.0, 2, 2, two_prompt_share=two_prompt_share)
    assert list(workload.workload_parts(tmp_path)) == parts
    prompts = workload.PARTS[parts[0]]
    expected = [(f"s{i}", name) for i in range(3) for name in prompts]
    assert workload.expected_rows(tmp_path) == expected

    model = build_tiny_model(tmp_path / "model", size="tiny", seed=0)
    result = benchmark("batchvl_method").run_batchvl(tmp_path, str(model), "float32")
    assert sorted((key, name) for key, name, status, _ in result["rows"] if status == "ok") == sorted(
        expected
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm", "internvl"])
def test_the_transformers_batches_give_each_prompt_its_own_image(benchmark, tmp_path, family):
    # SmolVLM's processor refuses a flat list of a batch's images ("[8] images per sample")
    from batchvl.demo.tiny_model import build_tiny_model

    workload = benchmark("throughput_workload")
    workload.write_workload(tmp_path, 3, 0.0, 2, 2, two_prompt_share=0.0)
    model = build_tiny_model(tmp_path / "model", family=family, size="tiny", seed=0)
    result = benchmark("transformers_method").run_transformers(tmp_path, str(model), torch.float32, 2, "cpu")
    assert [status for _, _, status, _ in result["rows"]] == ["ok"] * 3, result["rows"]


def refusal(tmp_path: Path, *args: str) -> str:
    """The benchmark run with these arguments: it must exit 2 having written nothing; its stderr."""
    out = tmp_path / "result.json"
    script = str(BENCHMARKS / "throughput.py")
    command = [sys.executable, script, *args, "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert not out.exists()
    return result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_asking_for_a_gpu_the_machine_lacks_is_one_line_and_exit_2_before_any_work(tmp_path):
    assert refusal(tmp_path, "--device", "cuda") == (
        "error: --device cuda but no CUDA device is available; use --device cpu\n"
    )


def test_the_vllm_peer_is_given_only_the_arguments_it_takes(throughput, benchmark, monkeypatch, tmp_path):
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
    vllm_peer = benchmark("vllm_peer")
    arguments = vllm_peer.argument_parser().parse_args(vllm[2:])  # after the python and the script
    assert (arguments.root, arguments.dtype) == (tmp_path, "bfloat16")
    assert batchvl[batchvl.index("--device") + 1] == "cpu"


def test_the_cpu_probe_measures_each_cpu_pinned_alone_and_all_at_once(benchmark):
    """The per-CPU matmul figures the report keeps: a child per CPU, pinned there, one after another and
    then together, each with a rate."""
    cpus = sorted(os.sched_getaffinity(0))
    rates = benchmark("matmul_probe").cpu_matmul_rates("float32", seconds=0.05, size=64)
    assert rates["dtype"] == "float32"
    for when in ("alone", "together"):
        assert [probe["cpus"] for probe in rates[when]] == [[cpu] for cpu in cpus]
        assert all(probe["gflops"] > 0 for probe in rates[when])


def test_every_other_round_runs_the_methods_in_the_opposite_order(throughput):
    assert throughput.round_orders(["c", "e"], 3) == [["c", "e"], ["e", "c"], ["c", "e"]]
    assert throughput.round_orders(["a", "c", "e"], 1) == [["a", "c", "e"]]


def test_a_methods_row_is_its_median_round_by_wall_time(throughput):
    runs = [{"wall_s": 9.0, "round": 0}, {"wall_s": 6.0, "round": 1}, {"wall_s": 7.5, "round": 2}]
    assert throughput.median_run(runs)["round"] == 2
    assert throughput.median_run(runs[:1])["round"] == 0


def test_ratios_are_taken_within_a_round_first_pass_and_warm(throughput):
    batchvl = {"wall_s": 5.0, "warm_wall_s": 4.0}
    assert throughput.speedups(batchvl, {"wall_s": 10.0}) == (2.0, 2.5)  # vLLM: one pass, after a warm-up
    assert throughput.speedups(batchvl, {"wall_s": 10.0, "warm_wall_s": 6.0}) == (2.0, 1.5)  # a GPU peer


def test_rounds_that_run_nothing_are_refused_in_one_line_before_any_work(tmp_path):
    assert refusal(tmp_path, "--rounds", "0") == (
        "error: --rounds 0 runs nothing; give 1 or more (an odd count, for a median round)\n"
    )


# ---- the GPU throughput benchmark (benchmarks/gpu_throughput.py) ----------------------------------------


def gpu_throughput_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(BENCHMARKS / "gpu_throughput.py"),
        *args,
        "--json",
        str(tmp_path / "r.json"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env)


def test_the_gpu_benchmarks_arguments_are_checked_in_one_line_before_any_work(tmp_path):
    refused = gpu_throughput_run(tmp_path, "--device", "gpu")
    assert refused.returncode == 2 and not (tmp_path / "r.json").exists()
    assert refused.stderr == "error: --device gpu is not a device; use cpu, cuda or cuda:N\n"
    refused = gpu_throughput_run(tmp_path, "--device", "cpu", "--samples", "0")
    assert refused.stderr == "error: --samples 0 runs nothing; give 1 or more\n"
    assert gpu_throughput_run(tmp_path, "--size", "9b").returncode == 2  # argparse's choices
    refused = gpu_throughput_run(tmp_path, "--device", "cpu", "--max-num-seqs", "0")
    assert refused.stderr == "error: --max-num-seqs 0 runs nothing; give 1 or more, or auto\n"
    refused = gpu_throughput_run(tmp_path, "--device", "cpu", "--launch-settings", '{"triton_x": {}}')
    assert refused.returncode == 2 and refused.stderr.startswith(
        "error: --launch-settings: no kernels' module"
    )
    refused = gpu_throughput_run(tmp_path, "--device", "cpu", "--launch-settings", "{BLOCK_KEYS: 128}")
    assert refused.returncode == 2 and "--launch-settings: not JSON" in refused.stderr


def test_the_gpu_benchmark_runs_on_the_cpu_with_the_gpus_figures_null(tmp_path):
    done = gpu_throughput_run(
        tmp_path,
        "--device",
        "cpu",
        "--size",
        "tiny",
        "--samples",
        "6",
        "--cuda-graphs",
        "--overlap",
        "--fused-kernels",
        "--launch-settings",
        '{"triton_grouped_decode": {"BLOCK_KEYS": 128}}',
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "r.json").read_text())
    assert (row["device"], row["size"], row["samples"]) == ("cpu", "tiny", 6)
    assert row["engine"]["launch_settings"] == {"triton_grouped_decode": {"BLOCK_KEYS": 128}}
    assert set(row["model_build_phases_s"]) == {"processor", "weights", "prepare"}
    assert row["samples_per_s"] > 0 and row["workload_tflop_per_sample"] > 0
    for gpu_only in ("kernel_time_share", "measured_matmul_peak_tflops", "datasheet_bf16_tflops"):
        assert row[gpu_only] is None
    assert row["limit_samples_per_s"] == {"datasheet": None, "measured_matmul_peak": None}
    assert row["share_of_limit"] == {"datasheet": None, "measured_matmul_peak": None}
    assert set(row["split_s"]) == {"vision", "prefill_steps", "decode_steps"}
    assert sum(row["split_flops_share"].values()) == pytest.approx(1, abs=1e-3)
    assert row["split_steps"]["prefill"] >= 1 and row["split_steps"]["decode"] >= 63  # 64 new tokens each
    # the job's own settings, recorded as given (on the CPU the engine ignores cuda_graphs; overlap runs)
    assert (row["engine"]["cuda_graphs"], row["engine"]["overlap"]) == (True, True)
    assert row["engine"]["fused_kernels"] is False  # asked for, but ignored off CUDA: recorded as run
    assert row["engine"]["decode_kernel"] == "native"
    # `auto` step sizes as the engine resolved them (the CPU's), not the word
    assert (row["engine"]["max_num_batched_tokens"], row["engine"]["max_patches_per_encode"]) == (2048, 4096)
    assert row["engine"]["max_num_seqs"] == 256
    assert row["split_s_is_launch_time"] is True


def test_the_gpu_benchmarks_labeling_workload_runs_every_answer_under_its_grammar(tmp_path):
    done = gpu_throughput_run(
        tmp_path, "--device", "cpu", "--size", "tiny", "--samples", "4", "--labels", "--overlap"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "r.json").read_text())
    assert row["workload"] == "labels" and row["grammar_s"] > 0
    assert row["engine"]["overlap"] is True
    # ended by the grammar, not the budget of 256 (the captions run 64 tokens each)
    assert 10 < row["new_tokens_per_sample"] < 256 and row["new_tokens_per_sample"] != 64


def test_the_gpu_benchmark_records_the_fused_kernels_as_the_model_has_them(benchmark):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from batchvl.layers.triton_modules import TritonRMSNorm

    has_fused_kernels = benchmark("gpu_throughput").has_fused_kernels
    stock = torch.nn.Sequential(torch.nn.Linear(4, 4), Qwen2RMSNorm(4))
    assert not has_fused_kernels(stock)
    assert has_fused_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4), TritonRMSNorm(stock[1])))


def test_the_gpu_benchmark_records_the_decode_kernel_of_the_models_heads(benchmark):
    decode_kernel = benchmark("gpu_throughput").decode_kernel

    def loaded(heads: int, kv_heads: int):
        text = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        return SimpleNamespace(
            adapter=SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(text_config=text)))
        )

    assert decode_kernel(loaded(12, 2), on_gpu=True) == "triton_grouped"  # Qwen2-VL-2B
    assert decode_kernel(loaded(16, 16), on_gpu=True) == "triton_per_head"
    assert decode_kernel(loaded(12, 2), on_gpu=False) == "native"


def test_a_gpus_datasheet_is_found_by_its_name(benchmark):
    datasheet = benchmark("gpu_throughput").datasheet
    assert datasheet("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert datasheet("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert datasheet("NVIDIA H200") == (989e12, 4.8e12)
    assert datasheet("NVIDIA A10") is None


def test_the_graph_capture_time_is_read_from_the_engines_decode_graphs(benchmark):
    seconds = benchmark("gpu_throughput").graph_capture_seconds
    graphs = SimpleNamespace(capture_s=1.2345)
    assert seconds(SimpleNamespace(runner=SimpleNamespace(decode_graphs=graphs))) == 1.23
    assert seconds(SimpleNamespace(runner=SimpleNamespace(decode_graphs=None))) is None  # no graphs
    assert seconds(None) is None  # no step ran


def test_kernel_time_is_the_union_of_the_traces_kernels(benchmark):
    timing = benchmark("step_timing")
    trace = {
        "traceEvents": [
            {"cat": "kernel", "ph": "X", "ts": 0, "dur": 10},
            {"cat": "kernel", "ph": "X", "ts": 5, "dur": 10},  # overlaps the first: counted once
            {"cat": "kernel", "ph": "X", "ts": 30, "dur": 5},
            {"cat": "gpu_memcpy", "ph": "X", "ts": 40, "dur": 100},  # a copy, not a kernel
            {"cat": "cpu_op", "ph": "X", "ts": 0, "dur": 1000},
        ]
    }
    intervals = timing.kernel_intervals(trace)
    assert len(intervals) == 3
    assert timing.busy_seconds(intervals) == pytest.approx(20e-6)


def test_the_node_benchmark_fails_when_more_processes_write_other_rows(benchmark, monkeypatch, tmp_path):
    """A launch's figure stands only beside rows equal to the first run's: one row changed, or one error
    row, and the benchmark stops naming the launch; `--then-gpus-all` adds a last run of `--gpus all`,
    checked the same way."""
    node_scaling = benchmark("node_scaling")
    import batchvl.demo.tiny_model as tiny_model

    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda folder, **kwargs: folder)
    monkeypatch.setattr(node_scaling, "write_shards", lambda *args: None)
    run = {"samples_per_s": 1.0, "wall_s": 1.0, "processing_s": 1.0, "per_process": []}
    ok, other, failed = [("s0", "ok", "a cat")], [("s0", "ok", "other")], [("s0", "error", "a cat")]
    launches = []

    def answering(answers: dict):
        def run_once(launch, *args):
            launches.append(launch)
            (value,) = launch.values()
            label = " ".join(f"--{key} {value}" for key, value in launch.items())
            return {**run, "launch": label, "processes": value}, answers[value]

        return run_once

    cases = [
        ({1: ok, 2: other}, [], "--processes 2"),
        ({1: failed, 2: failed}, [], "--processes 1"),
        ({1: ok, 2: ok, "all": other}, ["--then-gpus-all"], "--gpus all"),
    ]
    for answers, flags, named in cases:
        monkeypatch.setattr(node_scaling, "run_once", answering(answers))
        monkeypatch.setattr(sys, "argv", ["node_scaling.py", "--counts", "1,2", "--rounds", "1", *flags])
        with pytest.raises(SystemExit, match=named):
            node_scaling.main()
    monkeypatch.setattr(node_scaling, "run_once", answering({1: ok, 2: ok, "all": ok}))
    launches.clear()
    argv = ["node_scaling.py", "--rounds", "2", "--then-gpus-all", "--json", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", argv)
    node_scaling.main()
    report = json.loads((tmp_path / "r.json").read_text())
    assert [run["processes"] for run in report["runs"]] == [
        1,
        2,
        2,
        1,
        "all",
    ]  # the order alternates by round
    assert launches[-1] == {"gpus": "all"} and report["runs"][-1]["launch"] == "--gpus all"


# ---- host work per sample (benchmarks/host_per_sample.py) -----------------------------------------------


def refused_without_samples(script: str) -> list[str]:
    """The script's command with `--samples 0`, checked to be refused in one line before any work (the
    caller sets the count it runs)."""
    command = [sys.executable, str(BENCHMARKS / script), "--samples", "0"]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr == "error: --samples 0 runs nothing; give 1 or more\n"
    return command


def test_host_work_per_sample_is_the_wall_less_the_model_and_the_input_wait(tmp_path):
    command = refused_without_samples("host_per_sample.py")
    command[-1] = "5"
    done = subprocess.run(
        [*command, "--profile", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "r.json").read_text())
    assert row["samples"] == 5 and row["vision_s"] > 0 and row["forward_s"] > 0
    parts = row["vision_s"] + row["forward_s"] + row["input_wait_s"] + row["host_s"]
    assert parts == pytest.approx(row["wall_s"], abs=0.01)
    assert row["host_ms_per_sample"] == pytest.approx(1000 * row["host_s"] / 5, abs=0.2)  # host_s rounded
    functions = [entry["function"] for entry in row["own_time"]]
    assert any(name.startswith("batchvl/engine/") for name in functions), functions
    assert row["own_time"] == sorted(row["own_time"], key=lambda entry: -entry["own_s"])


def test_kernels_are_summed_once_where_they_overlap_and_ranked_by_time(benchmark):
    summary = benchmark("step_timing").kernel_summary
    kernels = [  # (name, start, duration) in microseconds; a CPU op and a memcpy are not kernels
        ("gemm", 0, 300),
        ("gemm", 400, 300),
        ("layer_norm", 100, 100),  # inside the first gemm: its time counts once
        ("attention", 800, 500),
    ]
    events = [{"cat": "kernel", "ph": "X", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    events += [{"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 0, "dur": 5000}]
    events += [{"cat": "gpu_memcpy", "ph": "X", "name": "Memcpy HtoD", "ts": 2000, "dur": 900}]
    result = summary(events)
    assert result["kernel_ms"] == 1.1 and result["kernels"] == 4
    assert [(k["name"], k["calls"], k["ms"]) for k in result["top_kernels"]] == [
        ("gemm", 2, 0.6),
        ("attention", 1, 0.5),
        ("layer_norm", 1, 0.1),
    ]


def test_the_vision_call_benchmark_refuses_sizes_that_time_nothing_in_one_line(tmp_path):
    script = str(BENCHMARKS / "vision_call.py")
    for patches in ("0", ",", "a,b"):
        out = tmp_path / "result.json"
        command = [sys.executable, script, "--device", "cpu", "--patches", patches, "--json", str(out)]
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode != 0 and not out.exists()
        assert "--patches" in result.stderr.strip().splitlines()[-1]


def test_the_input_rate_benchmark_refuses_a_setting_it_does_not_have_before_any_work(tmp_path):
    out = tmp_path / "rate.json"
    script = str(BENCHMARKS / "input_rate.py")
    command = [sys.executable, script, "--settings", "job,fastest", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=BENCHMARKS)
    assert result.returncode == 2 and not out.exists()
    assert "--settings: no setting fastest" in result.stderr


# ---- engine replicas' waits for requests (benchmarks/replica_idle.py) --------------------------------------


def test_replica_waits_are_put_in_tenths_of_each_jobs_wall(tmp_path):
    command = refused_without_samples("replica_idle.py")
    command[-1] = "4"
    done = subprocess.run(
        [*command, "--rounds", "1", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = json.loads((tmp_path / "r.json").read_text())["jobs"]
    assert [job["job"] for job in jobs] == ["one_prompt", "two_prompts"]
    for job in jobs:
        assert len(job["waits_s_by_tenth_of_wall"]) == 10
        assert sum(job["waits_s_by_tenth_of_wall"]) == pytest.approx(job["waits_s"], abs=0.06)
        assert 0 <= job["while_other_busy_s"] <= job["waits_s"] + 0.01
        assert job["waits_s"] <= job["replicas"] * job["wall_s"]
