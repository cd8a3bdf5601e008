"""`make gpu-check`: batchvl's own engine on a GPU in at most 9 minutes, reported as one JSON.

Stages, each in a process of its own under its own time limit, so that one that fails or hangs is
reported and the next still runs, in the order of what a GPU window must answer first:

  environment      torch, CUDA, the GPU and its free memory, transformers, the optional kernels importable
  parity           the engine parity, family, sampler, logprobs, choice-scoring and constrained-decoding
                   tests with BATCHVL_TEST_DEVICE set (the engine on the device, references on the CPU), and
                   those of the fast paths: decode graphs (real CUDA graphs there), overlapped steps, the
                   fused kernels in every family, Qwen-VL vision calls that read nothing back, and
                   vision calls' pixels and steps' grammar bitmasks sent from page-locked memory
  fast_paths_job   the constrained job's prompts, greedy and keeping their log-probabilities, in fp32 with
                   every fast path on (engine.cuda_graphs, engine.overlap, engine.fused_kernels) on the
                   device against the CPU's eager run: texts equal
  gpu_throughput_2b  benchmarks/gpu_throughput.py: 1,000 captions by Qwen2-VL-2B (made on the GPU in bf16):
                   samples/s, the share of the workload's limit, the split between vision, prefill and
                   decode, the host's time in the steps by what it did, the GPU's idle time between steps
                   and its time in each (two CUDA events a step) and the allocators' waits, with no fast
                   path: the baseline; then the same job again, profiled, up to the end of a window of
                   steps that hold prompts: the GPU's kernel-time share there and its top kernels, and the
                   host's waits for the GPU after it
  gpu_throughput_2b_fast  the same with every fast path on, and the share of samples whose text equals the
                   baseline's
  gpu_throughput_7b_fast  the same job by Qwen2-VL-7B (made on the GPU in bf16) with every fast path on
  gpu_throughput_thin_fast  the same job with every fast path on the tiny model's layers at the real
                   images' sizes (`--size thin`: the 2B's patches and prompt tokens, every kernel small):
                   the samples/s the host allows this workload, its input, scheduling and launches
  input_rate       benchmarks/input_rate.py on the host: prepared samples a second reaching an engine thread
                   idle and busy in Python (as a GPU engine's is), with the job's input settings (pixels
                   sent as shared-memory files opened by name, GIL handoffs every 1 ms) and with torch's
                   and Python's defaults
  vision_call      benchmarks/vision_call.py: one vision call of Qwen2-VL-2B's tower at 4,096 to 32,768
                   patches of 448x448 images and at 32,768 of the 2B job's image mix, without and with the
                   fused kernels, then with them replayed as a graph and with them and its attention by
                   SDPA (cuDNN first): its wall, its pixels' staging and its kernels' time, the kernels
                   with the most of it, its TFLOP/s
  prefill_attention benchmarks/prefill_attention.py: a step of prompt chunks at Qwen2-VL-2B's heads by the
                   paged Triton kernel against torch's flash varlen one, and a vision call's attention by
                   torch's flash varlen kernel against SDPA's backends on images batched by size, per call;
                   refused on the CPU (reported as skipped)
  fast_paths_parity the engine and family parity tests again with every fast path on
                   (BATCHVL_TEST_FAST_PATHS=1): decode graphs, overlapped steps, the fused kernels
  sampled_job      a job sampling at temperature 0.8 on the device and on the CPU: rows ok on each, and the
                   share of rows whose text is the same (a seed's draws are the same on each device)
  constrained_job  a JSON-schema, regex, choices and free-text job in fp32 on the device and on the CPU:
                   rows and texts equal
  two_processes    benchmarks/node_scaling.py: one engine process, then two sharing the GPU (`--processes 2`),
                   then one per GPU (`--gpus all`): rows equal, samples/s and each process's input-wait
                   share
  vit_dp           the ViT data-parallel job test (two torchrun ranks on the one device) on the device
  host_step        benchmarks/host_step.py on the device at Qwen2-VL-2B's full size (`--size 2b`): host work
                   per step at 256 long decodes, and where it goes (the torch ops and Python functions with
                   the most host time); then the steps with the engine's own loop of the decoder's layers
                   against transformers' text model calling them, in alternated blocks
  host_step_1024   the same at 1,024 decodes a step, what `engine.max_num_seqs: auto` gives a large GPU
  host_step_1024_fast the same with decode graphs and overlapped steps: each step's wall against the serial
                   run's forward says whether the host or the GPU bounds a step of 1,024 decodes
  fused_elementwise benchmarks/fused_elementwise.py: the elementwise Triton kernels against the eager
                   transformers ops, per call, their outputs' differences and the fused calls' bytes a
                   second, at Qwen2-VL-2B's widths up to a vision call's 32,768 rows, where the norms
                   and elementwise kernels are timed under other launch settings too;
                   refused on the CPU (reported as skipped)
  launch_overhead  benchmarks/launch_overhead.py on the host: the Python of a launch of each Triton
                   kernel (the engine's launch function's, Triton's dispatch's), compiled offline for the
                   GPU, its launcher a no-op: beside fused_elementwise's one-row calls, a launch's Python
                   against the driver's part on this host
  decode_attention benchmarks/decode_attention.py: the per-head and the grouped Triton decode kernels per
                   call at Qwen2-VL-2B's and 7B's heads (256 sequences of 600 and 2,000 keys, 1,024 of 600,
                   8 of 16,384), their outputs' difference, the grouped one at 1 to 8 splits forced, and
                   at 2B's 256 and 1,024 sequences of 600 keys under other launch settings; refused on the
                   CPU (reported as skipped)
  sampling         benchmarks/sampling.py: a step's sampled picks at a 151,936-token vocabulary, 1 to 1,024
                   rows at temperature 0.8 alone and with top-p 0.9, drawn on the device against row by row
                   on the host (as `generate` draws)
  throughput_small benchmarks/throughput.py: transformers `generate` on padded batches of 8 against batchvl
                   in bf16 on the `small` model
  optional, run only when GPU_CHECK_STAGES names them: gpu_throughput_2b_cuda_graphs, _overlap and
                   _fused_kernels (one fast path alone, to tell their gains apart), gpu_throughput_2b_256_seqs
                   (no fast path, 256 sequences a step where `auto` gives a large GPU 1,024),
                   gpu_throughput_2b_fast_sdpa_vision (every fast path, the tower's attention by SDPA
                   over each size's images, cuDNN's kernel first: `engine.vision_attention: sdpa`),
                   gpu_throughput_2b_fast_sampled (every fast path, each caption sampled at temperature
                   0.8 and top-p 0.9, drawn on the device),
                   gpu_throughput_2b_labels and _labels_overlap (a JSON-schema labeling workload, its
                   grammar's masks filled between serial steps, then while overlapped steps run),
                   gpu_throughput_2b_tuned (every fast path with the launch settings and vision attention
                   that fused_elementwise, decode_attention and vision_call, named before it in the same
                   call, found faster than the defaults: benchmarks/launch_settings.py),
                   throughput_wide (the same as throughput_small at Qwen2-VL-2B's widths) and
                   gpu_throughput_7b (Qwen2-VL-7B with no fast path, the baseline of its fast run)

A GPU window's first call runs the check as it is; where its budget ran short, the second names the stages
left (GPU_CHECK_STAGES=sampled_job,constrained_job,...).
DEVICE=cpu runs the same stages on the CPU with smaller workloads, so the script is tried on any machine.
The JSON is printed and written to GPU_CHECK_JSON, by default into benchmarks/results/, where the project
keeps these reports: gpu-check-<GPU>-<UTC time>.json (e.g. gpu-check-nvidia-h200-20250101T120000Z.json;
`cpu` for a DEVICE=cpu trial, which git ignores), and the benchmarks' own full reports beside it, named
after it (...-host_step.json, ...-throughput-small.json). GPU_CHECK_BUDGET_S (540) bounds the whole run,
and a stage that no longer fits is reported as skipped; GPU_CHECK_STAGES (names, comma-separated) runs
only those stages, the optional ones included. The parity tests run in several processes where pytest-xdist
is installed (`make gpu-wheels` brings it): GPU_CHECK_TEST_WORKERS of them, by default a quarter of the
cores, at most 4. A stage stopped at its limit is killed with its child processes.

    DEVICE=cuda python scripts/gpu_check.py
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE = os.environ.get("DEVICE", "cuda")
ON_CPU = DEVICE == "cpu"
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", 540))
SHOWN = 2000  # characters of a failed stage's output kept in the report
PARITY_TESTS = [
    "tests/engine/test_parity.py",
    "tests/engine/test_family_parity.py",
    "tests/engine/test_tiled_video_parity.py",  # SmolVLM2's and InternVL's video frames as image tokens
    "tests/engine/test_sampler.py",
    "tests/engine/test_logprobs.py",
    "tests/engine/test_choice_scoring.py",
    "tests/engine/test_constrained_parity.py",
    "tests/engine/test_decode_graphs.py",
    "tests/engine/test_overlap.py",
    "tests/models/fused_kernels_gpu_checks.py",  # skipped on the CPU: its kernels need a GPU
    "tests/layers/triton_elementwise_checks.py",  # the same kernels against transformers' modules in bf16
    "tests/models/test_qwen_vision_inputs.py",  # the vision towers read nothing back from the GPU
    "tests/models/test_qwen3_deepstack.py",  # nor Qwen3-VL's deepstack additions
    "tests/models/test_idefics3_vision.py",  # nor Idefics3's tower
    "tests/models/test_llava_vision.py",  # nor LLaVA's
    "tests/engine/test_pixel_staging.py",  # vision calls' pixels sent from page-locked memory, not waited for
    "tests/models/test_qwen_vision_graphs.py",  # vision calls as CUDA graphs, replays equal to eager calls
    "tests/engine/test_structured_output.py",  # a step's grammar bitmask sent the same way
]
FAST_PATHS_PARITY_TESTS = ["tests/engine/test_parity.py", "tests/engine/test_family_parity.py"]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "count"],
}
STARTED = time.monotonic()


def machine_name() -> str:
    """The device a report is named after: the GPU's model in lower case (`nvidia-h200`), else DEVICE."""
    if not ON_CPU:
        try:
            import torch

            if torch.cuda.is_available():
                return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(DEVICE).lower()).strip("-")
        except Exception:  # a broken torch or driver is the environment stage's to report, not the name's
            pass
    return re.sub(r"[^a-z0-9]+", "-", DEVICE)


def default_report() -> Path:
    """benchmarks/results/gpu-check-<machine>-<UTC time>.json: one report per run, none overwritten."""
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return ROOT / "benchmarks" / "results" / f"gpu-check-{machine_name()}-{started}.json"


REPORT = Path(os.environ["GPU_CHECK_JSON"]) if os.environ.get("GPU_CHECK_JSON") else default_report()


def left_s() -> float:
    return BUDGET_S - (time.monotonic() - STARTED)


def run(command: list[str], limit_s: float, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """A command under min(limit_s, the time left): its exit status, seconds, standard output (with
    standard error where it was stopped) and, if it failed, its output's tail. The command runs in a
    process group of its own, killed whole at the limit: its children (test workers, a job's preprocessing
    workers) would otherwise go on holding the device while the next stages run."""
    timeout = min(limit_s, left_s())
    started = time.monotonic()
    with subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            text = relative(stdout + stderr)
            seconds = round(timeout, 1)
            return {"rc": "timeout", "seconds": seconds, "output_tail": text[-SHOWN:], "stdout": text}
    result = {"rc": process.returncode, "seconds": round(time.monotonic() - started, 1)}
    if process.returncode:
        result["output_tail"] = relative(stdout + stderr)[-SHOWN:]
    result["stdout"] = stdout
    return result


def relative(output: str) -> str:
    """A stage's output with the checkout's own paths made relative to it (`batchvl/...`): the report is
    kept in the repository, where the machine it ran on means nothing."""
    return output.replace(f"{ROOT}/", "").replace(str(ROOT), ".")


# ---- stages ----------------------------------------------------------------------------------------


def environment(work: Path) -> dict:
    import torch
    import transformers

    found = {
        name: importlib.util.find_spec(name) is not None for name in ("flash_attn", "xgrammar", "triton")
    }
    facts = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "importable": found,
    }
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        facts |= {
            "gpu": torch.cuda.get_device_name(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "gpu_memory_free_gib": round(free / 2**30, 1),
            "gpu_memory_total_gib": round(total / 2**30, 1),
        }
    return {"ok": ON_CPU or torch.cuda.is_available(), **facts}


def test_workers() -> int:
    """Processes for a test stage (pytest-xdist's `-n`, where it is installed): GPU_CHECK_TEST_WORKERS, by
    default a quarter of the cores, at most 4, so that each has 4 or more for torch's threads (the
    references run on the CPU). 1: one process, as without xdist."""
    if importlib.util.find_spec("xdist") is None:
        return 1
    default = min(4, (os.cpu_count() or 1) // 4)
    return max(1, int(os.environ.get("GPU_CHECK_TEST_WORKERS", default)))


OUTCOMES = {"PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"}


def printed_outcomes(stdout: str) -> dict[str, str]:
    """Test id -> outcome, from what `pytest -v` printed: `tests/a.py::test PASSED [ 50%]`, or under
    xdist `[gw0] [ 50%] PASSED tests/a.py::test`. A test still running has no outcome yet."""
    outcomes = {}
    for line in stdout.splitlines():
        words = line.split()
        test = next((word for word in words if "::" in word), None)
        outcome = next((word for word in words if word in OUTCOMES), None)
        if test and outcome:
            outcomes[test] = outcome
    return outcomes


def pytest_stage(
    files: list[str], limit_s: float, work: Path, name: str, workers: int = 1, env: dict | None = None
) -> dict:
    """The tests of `files` with the engine on DEVICE (and `env` set), in `workers` processes (each with its
    share of the cores for torch's threads): counts and failures from pytest's report, or what it printed
    if stopped."""
    junit = work / f"{name}.xml"
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    env = {"BATCHVL_TEST_DEVICE": DEVICE, **(env or {})}
    if workers > 1:
        command += ["-n", str(workers)]
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    result = run(command, limit_s, env=env)
    stdout = result.pop("stdout", "")
    if not junit.exists():  # stopped at its time limit: the outcomes printed so far
        return {"ok": False, "outcomes_printed": printed_outcomes(stdout), **result}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(junit).iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            counts["failed"] += 1
            message = (problem.get("message") or problem.text or "")[:400]
            failures.append(f"{case.get('classname')}::{case.get('name')}: {message}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    if not failures:
        result.pop("output_tail", None)
    return {"ok": result["rc"] == 0, **counts, "failures": failures[:20], **result}


def parity(work: Path) -> dict:
    """167 tests in 2026-11 (93 ran in 114-135 s on an H200 in one process): in several, they leave the
    throughput stages more of the check's minutes."""
    workers = test_workers()
    return {"workers": workers, **pytest_stage(PARITY_TESTS, 300, work, "parity", workers)}


def fast_paths_parity(work: Path) -> dict:
    """The engine and family parity tests again with every fast path on (BATCHVL_TEST_FAST_PATHS=1: decode
    graphs, overlapped steps, the fused kernels in the test models): 50 tests, 7 minutes on a 2-core CPU."""
    workers = test_workers()
    env = {"BATCHVL_TEST_FAST_PATHS": "1"}
    return {
        "workers": workers,
        **pytest_stage(FAST_PATHS_PARITY_TESTS, 200, work, "fast_paths_parity", workers, env),
    }


def vit_dp(work: Path) -> dict:
    files = ["tests/engine/test_vit_dp.py::test_two_rank_vit_data_parallel_job_equals_one_process"]
    return pytest_stage(files, 90, work, "vit_dp")


def write_images(folder: Path, count: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        height, width = (int(side) for side in rng.integers(28, 400, size=2))
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
        images.append(buffer.getvalue())
    images[-1] = images[0]  # a duplicate image: the encoder cache's hit
    keys = [f"k{i}" for i in range(count)]
    pq.write_table(pa.table({"key": keys, "image": images}), folder / "s.parquet")


def tiny_model(work: Path) -> Path:
    folder = work / "tiny"
    if not (folder / "config.json").exists():
        from batchvl.demo.tiny_model import build_tiny_model

        build_tiny_model(folder, size="tiny", seed=0, sharpness=8.0)
    return folder


def job_on(work: Path, name: str, device: str, prompts: str, sampling: str, engine: str = "{}") -> dict:
    """Runs the job in its own folder on `device` with the `engine` settings; its status counts and rows
    (prompt, key) -> row."""
    import pyarrow.parquet as pq

    root = work / f"{name}-{device.replace(':', '')}"
    write_images(root / "data", 24)
    (root / "job.yaml").write_text(
        f"model: {{path: {tiny_model(work)}, dtype: float32, device: {device}}}\n"
        'input: {paths: ["data/*.parquet"], key_column: key}\n'
        f"prompts: {prompts}\nsampling: {sampling}\nengine: {engine}\n"
        "preprocess: {workers: 1}\noutput: {dir: out}\n"
    )
    result = run([sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress"], 90, cwd=root)
    result.pop("stdout", None)
    if result["rc"] != 0:
        return {"job": result, "rows": {}}
    rows = pq.read_table(root / "out" / "s.parquet").to_pylist()
    statuses: dict[str, int] = {}
    for row in rows:
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
    return {"job": {**result, "statuses": statuses}, "rows": {(r["prompt"], r["key"]): r for r in rows}}


def compared(
    work: Path, name: str, prompts: str, sampling: str, same_required: bool, engine: str = "{}"
) -> dict:
    """The job on the device (with the `engine` settings) against the same job on the CPU (without them)."""
    on_device = job_on(work, name, DEVICE, prompts, sampling, engine)
    on_cpu = job_on(work, name, "cpu", prompts, sampling) if not ON_CPU else on_device
    device_rows, cpu_rows = on_device["rows"], on_cpu["rows"]
    same = [k for k in device_rows if k in cpu_rows and device_rows[k]["text"] == cpu_rows[k]["text"]]
    errors = [
        f"{k}: {r.get('error_type')}: {r.get('error_message')}"
        for k, r in device_rows.items()
        if r["status"] == "error"
    ]
    complete = bool(device_rows) and set(device_rows) == set(cpu_rows)
    share = round(len(same) / max(len(device_rows), 1), 3)
    return {
        "ok": complete and (share == 1.0 or not same_required),
        "device_job": on_device["job"],
        "cpu_job": on_cpu["job"],
        "rows": len(device_rows),
        "same_text_share": share,
        "device_errors": errors[:5],
    }


def sampled_job(work: Path) -> dict:
    prompts = "[{name: caption, text: Describe this image.}, {name: short, text: One word.}]"
    sampling = "{max_new_tokens: 24, temperature: 0.8, top_p: 0.9, top_k: 50, seed: 7, logprobs: true}"
    return compared(work, "sampled", prompts, sampling, same_required=False)


def constrained_prompts(choice_mode: str) -> str:
    """A JSON schema, a regex, choices (scored, or generated under their grammar) and free text."""
    return (
        f"[{{name: attrs, text: Describe the image as JSON., json_schema: {json.dumps(SCHEMA)}}}, "
        '{name: year, text: "Which year?", regex: "(19|20)[0-9]{2}"}, '
        '{name: kind, text: "Photo or drawing?", choices: [photo, drawing, screenshot], '
        f"choice_mode: {choice_mode}}}, "
        "{name: caption, text: Describe this image.}]"
    )


def constrained_job(work: Path) -> dict:
    prompts = constrained_prompts("score")
    return compared(work, "constrained", prompts, "{max_new_tokens: 48}", same_required=True)


def fast_paths_job(work: Path) -> dict:
    """The constrained job's prompts, greedy, keeping their tokens' log-probabilities, in fp32 on the device
    with every fast path on (decode graphs; overlapped steps, which mask the constrained rows, compute the
    log-probabilities and score the choices on the device and read them a step late; fused kernels)
    against the CPU's eager run: texts equal."""
    engine = "{" + ", ".join(f"{path}: true" for path in FAST_PATHS) + "}"
    sampling = "{max_new_tokens: 48, logprobs: true, top_logprobs: 2}"
    prompts = constrained_prompts("score")
    return compared(work, "fast", prompts, sampling, same_required=True, engine=engine)


def host_step(work: Path, requests: int = 256, fast: bool = False) -> dict:
    """benchmarks/host_step.py at Qwen2-VL-2B's full size, `requests` long decodes a step (256: the figure
    the earlier runs give; 1,024: what `engine.max_num_seqs: auto` gives a GPU of 70 GiB or more); `fast`:
    with decode graphs and overlapped steps."""
    name = "host_step" + ("" if requests == 256 else f"_{requests}") + ("_fast" if fast else "")
    out = work / f"{name}.json"
    workload = ["--steps", "10", "--requests", "64", "--prompt", "100"]  # the CPU's trial: the tiny model
    if not ON_CPU:
        workload = ["--size", "2b", "--requests", str(requests)]
    command = [sys.executable, "benchmarks/host_step.py", "--device", DEVICE, "--profile", "--json", str(out)]
    # and the serial steps with the engine's loop of layers against transformers' (a second or two)
    command += workload + (["--overlap", "--cuda-graphs"] if fast else ["--transformers-loop-too"])
    result = run(command, 120)
    result.pop("stdout", None)
    return {"ok": result["rc"] == 0, **result, **(json.loads(out.read_text()) if out.exists() else {})}


def cuda_benchmark(work: Path, name: str, timeout_s: int) -> dict:
    """benchmarks/<name>.py, a benchmark of Triton kernels that needs CUDA: its table and its JSON."""
    out = work / f"{name}.json"
    result = run([sys.executable, f"benchmarks/{name}.py", "--json", str(out)], timeout_s)
    stdout = result.pop("stdout", "")
    if ON_CPU and result["rc"] == 2:  # the benchmark needs CUDA: it says so and exits 2
        return {"ok": True, "skipped": result.pop("output_tail", "").strip(), **result}
    if not out.exists():
        return {"ok": False, **result}
    return {"ok": result["rc"] == 0, **result, "table": stdout.splitlines()}


def reported_run(command: list[str], out: Path, limit_s: float, table_lines: int | None = None) -> dict:
    """A benchmark that writes its report to `out`, `run`: its result and its report, and the last
    `table_lines` lines of the table it printed (all of them with None); ok where it exited 0 and wrote
    a report."""
    result = run(command, limit_s)
    table = result.pop("stdout", "").splitlines()
    report = json.loads(out.read_text()) if out.exists() else {}
    table = table[-table_lines:] if table_lines else table
    return {"ok": result["rc"] == 0 and bool(report), **result, "table": table, **report}


def vision_call(work: Path) -> dict:
    """benchmarks/vision_call.py: Qwen2-VL-2B's vision call at 4,096 to 32,768 patches (and at the largest
    on the 2B job's image mix), without and with the fused kernels, then with them replayed as a graph and
    with them and its attention by SDPA: its wall, its staging and its kernels' time, the kernels with the
    most of it and its TFLOP/s (where a 2B job's vision time goes)."""
    out = work / "vision_call.json"
    workload = ["--size", "tiny", "--patches", "256,512", "--calls", "2"] if ON_CPU else ["--size", "2b"]
    command = [sys.executable, "benchmarks/vision_call.py", "--device", DEVICE, "--json", str(out)]
    return reported_run([*command, *workload], out, 150, table_lines=24)


def input_rate(work: Path) -> dict:
    """benchmarks/input_rate.py on this machine's host: the samples a second its preprocessing workers get
    to an engine thread that is idle and to one busy in Python, as a GPU engine's thread is, with the job's
    input settings and with torch's and Python's defaults (the handoffs alone, which the CPU measured between
    them, left out for the window's minutes): whether the input bounds a job here."""
    out = work / "input_rate.json"
    samples = "60" if ON_CPU else "300"
    command = [sys.executable, "benchmarks/input_rate.py", "--samples", samples, "--settings", "job,defaults"]
    command += ["--json", str(out)]
    return reported_run(command, out, 120)  # its whole table: a row per workload, engine thread and settings


def fused_elementwise(work: Path) -> dict:
    return cuda_benchmark(work, "fused_elementwise", 90)


def launch_overhead(work: Path) -> dict:
    """benchmarks/launch_overhead.py on this machine's host: what a launch of each Triton kernel costs it in
    Python, the engine's launch function's and Triton's dispatch apart (kernels compiled offline, nothing
    run): with `fused_elementwise`'s calls at one row, how much of a launch is Python on this host."""
    out = work / "launch_overhead.json"
    command = [sys.executable, "benchmarks/launch_overhead.py", "--calls", "500" if ON_CPU else "2000"]
    return reported_run([*command, "--json", str(out)], out, 90)


def decode_attention(work: Path) -> dict:
    return cuda_benchmark(work, "decode_attention", 90)


def sampling(work: Path) -> dict:
    """benchmarks/sampling.py on DEVICE: a step's sampled picks drawn on the device against one by one on
    the host (on the CPU, a few rows)."""
    out = work / "sampling.json"
    rows = ["--rows", "1,4"] if ON_CPU else []
    command = [sys.executable, "benchmarks/sampling.py", "--device", DEVICE, *rows, "--json", str(out)]
    return reported_run(command, out, 90, table_lines=9)


def prefill_attention(work: Path) -> dict:
    return cuda_benchmark(work, "prefill_attention", 90)


def throughput(work: Path, size: str) -> dict:
    out = work / f"throughput-{size}.json"
    dtype = "float32" if ON_CPU else "bfloat16"
    # `wide` writes a 2B-parameter model and runs generate twice before batchvl: 128 samples did not fit
    # its stage on an H200, 64 leave batchvl its share of the time
    samples = "128" if size == "small" else "64"
    workload = ["--samples", "4", "--max-tokens", "8"] if ON_CPU else ["--samples", samples]
    command = [sys.executable, "benchmarks/throughput.py", "--device", DEVICE, "--methods", "b,c"]
    command += ["--dtypes", dtype, "--size", size, "--json", str(out), *workload]
    result = run(command, 150 if size == "small" else 300)
    result.pop("stdout", None)
    if not out.exists():
        return {"ok": False, **result}
    runs = json.loads(out.read_text())["runs"][dtype]
    keep = ("samples_per_s", "samples_per_s_warm", "output_tokens_per_s", "wall_s", "peak_rss_mb")
    summary = {method: {k: run[k] for k in keep if k in run} for method, run in runs.items()}
    batchvl = runs["c"]
    summary["c"] |= {
        "speedup_vs_generate": batchvl.get("speedup_vs_b"),
        "warm_speedup_vs_generate": batchvl.get("warm_speedup_vs_b"),
        "busy_share": round(1 - batchvl["engine_idle_share"], 3),
        "input_wait_share": batchvl["input_wait_share"],
    }
    return {"ok": result["rc"] == 0, "seconds": result["seconds"], "size": size, "runs": summary}


FAST_PATHS = (
    "cuda_graphs",
    "overlap",
    "fused_kernels",
)  # on CUDA on by default (auto): the baseline names them off
# a sampled captioning job's settings (`gpu_throughput_2b_fast_sampled`)
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.9


def gpu_throughput(
    work: Path,
    size: str,
    fast_paths: tuple[str, ...] = (),
    max_num_seqs: int | None = None,
    labels: bool = False,
    vision_attention: str | None = None,
    sampled: bool = False,
    launch_settings: dict | None = None,
) -> dict:
    """The captioning benchmark (with `labels`, its JSON-schema labeling workload) at a real size, with the
    engine's `fast_paths` on (and the kernels' `launch_settings` beside their defaults); its whole row is the
    stage's report, with the share of samples whose text equals the same workload's run without fast paths
    and, for other launch settings or vision attention, with every fast path and the defaults (where those
    ran before in this check). 1,000 samples: at the 13 samples/s batchvl's eager engine reached at
    Qwen2-VL-2B's widths on an H200, about 75 s of the stage's 240 (the model is made in seconds; the rest is
    the warm-up job and the FLOP count)."""
    base = f"gpu_throughput-{size}" + ("-labels" if labels else "")
    named = [
        *([f"{max_num_seqs}seqs"] if max_num_seqs else []),
        *([f"{vision_attention}-vision"] if vision_attention else []),
        *(["sampled"] if sampled else []),
        *(["tuned"] if launch_settings else []),
    ]
    name = "-".join([base, *fast_paths, *named])
    out, texts = work / f"{name}.json", work / f"{name}.texts"  # (not *.json: not kept beside the report)
    workload = ["--size", "tiny", "--samples", "8"] if ON_CPU else ["--size", size, "--samples", "1000"]
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--device", DEVICE, "--json", str(out)]
    command += ["--texts", str(texts), *(f"--{path.replace('_', '-')}" for path in fast_paths)]
    command += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
    command += ["--labels"] if labels else []
    command += ["--vision-attention", vision_attention] if vision_attention else []
    command += ["--temperature", str(SAMPLED_TEMPERATURE), "--top-p", str(SAMPLED_TOP_P)] if sampled else []
    command += ["--launch-settings", json.dumps(launch_settings)] if launch_settings else []
    result = run([*command, *workload], {"thin": 120, "2b": 240}.get(size, 300))
    result.pop("stdout", None)
    row = json.loads(out.read_text()) if out.exists() else {}
    baselines = {}
    if (fast_paths or named) and not sampled:
        baselines["same_text_share_vs_eager"] = work / f"{base}.texts"
    if vision_attention or launch_settings or set(fast_paths) - set(FAST_PATHS):
        baselines["same_text_share_vs_default_launch"] = work / ("-".join([base, *FAST_PATHS]) + ".texts")
    for key, baseline in baselines.items():
        if (share := same_text_share(texts, baseline)) is not None:
            row[key] = share
    return {"ok": result["rc"] == 0 and bool(row), **result, **row}


def same_text_share(texts: Path, other: Path) -> float | None:
    """The share of `other`'s samples whose text `texts` has too (JSON files by key); None where either is
    missing."""
    if not (texts.exists() and other.exists()):
        return None
    mine, theirs = json.loads(texts.read_text()), json.loads(other.read_text())
    same = sum(mine.get(key) == text for key, text in theirs.items())
    return round(same / max(len(theirs), 1), 4)


def gpu_throughput_tuned(work: Path) -> dict:
    """The 2B job with every fast path, the fastest launch settings `fused_elementwise` and
    `decode_attention` timed and the tower's attention `vision_call` found fastest, each where it beat the
    defaults (`benchmarks/launch_settings.py`; the stages run before it in the same call); skipped where
    nothing did, or none of them ran."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from launch_settings import fastest_of, fastest_vision_attention

    def report(name: str) -> dict | None:
        path = work / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    found = {name: report(name) for name in ("fused_elementwise", "decode_attention", "vision_call")}
    readings = [name for name, content in found.items() if content is not None]
    launches = fastest_of(found)
    attention = fastest_vision_attention(found["vision_call"]) if found["vision_call"] else None
    if not launches and attention is None:
        where = ", ".join(readings) or "no kernel benchmark of this check (run them before it)"
        return {"ok": True, "skipped": f"nothing beat the defaults in {where}"}
    tuned = {"launch_settings": launches, "vision_attention": attention, "tuned_from": readings}
    outcome = gpu_throughput(work, "2b", FAST_PATHS, vision_attention=attention, launch_settings=launches)
    return {**tuned, **outcome}


def two_processes(work: Path) -> dict:
    """benchmarks/node_scaling.py: the same job by one engine process and by two sharing the device
    (`--processes 2`), then on a GPU machine by one process per GPU (`--gpus all`), rows equal (the
    benchmark fails otherwise), samples/s and each process's input wait."""
    out = work / "node_scaling.json"
    workload = ["--samples", "8", "--shards", "4", "--new-tokens", "4"]
    if not ON_CPU:
        workload = ["--samples", "64", "--shards", "8", "--new-tokens", "32", "--dtype", "bfloat16"]
        workload += ["--then-gpus-all"]
    command = [sys.executable, "benchmarks/node_scaling.py", "--device", DEVICE, "--rounds", "1"]
    return reported_run([*command, *workload, "--json", str(out)], out, 150, table_lines=4)


# Correctness first, then speed: where the budget runs short, the throughput runs (the longest stages) are
# what is left out, not the jobs that say whether the engine's outputs are right on this device.
STAGES = [
    ("environment", environment),
    ("parity", parity),
    ("fast_paths_job", fast_paths_job),
    ("gpu_throughput_2b", lambda work: gpu_throughput(work, "2b")),
    ("gpu_throughput_2b_fast", lambda work: gpu_throughput(work, "2b", FAST_PATHS)),
    # some 2-3 min: the goal's second model, as users run it (every fast path on by default), after its
    # baseline where a call names that (optional: a minute or two more)
    ("gpu_throughput_7b", lambda work: gpu_throughput(work, "7b")),
    ("gpu_throughput_7b_fast", lambda work: gpu_throughput(work, "7b", FAST_PATHS)),
    # some 30 s: the same job on the tiny model's layers at the real images' sizes, every kernel small: the
    # rate the host allows this workload (input, scheduling, launches)
    ("gpu_throughput_thin_fast", lambda work: gpu_throughput(work, "thin", FAST_PATHS)),
    # some 60 s on the host alone: whether the input keeps up with a busy engine thread
    ("input_rate", input_rate),
    ("vision_call", vision_call),  # some 60 s: the 2B tower made on the GPU, 12 calls' sizes and kernels
    # some 20-40 s: 8 prompt cases, 8 vision ones, 50 calls each; what the 2B runs' prefill and vision
    # time may go to, measured beside them
    ("prefill_attention", prefill_attention),
    ("fast_paths_parity", fast_paths_parity),
    ("sampled_job", sampled_job),
    ("constrained_job", constrained_job),
    ("two_processes", two_processes),  # about a minute, more with --gpus all: each process starts CUDA
    ("vit_dp", vit_dp),
    ("host_step", host_step),
    ("host_step_1024", lambda work: host_step(work, 1024)),  # some 20 s
    ("host_step_1024_fast", lambda work: host_step(work, 1024, fast=True)),  # the same, and the captures
    # some 20-60 s: compiling the kernels, 56 timed ops and 17 other launch settings
    ("fused_elementwise", fused_elementwise),
    # some 15 s on the host alone: the Python of each Triton kernel's launch, against the launches timed above
    ("launch_overhead", launch_overhead),
    # some 25-70 s: 8 cases of two kernels and four split counts (each compiled), 50 calls each, and 16
    # launch settings (8 at each of two cases)
    ("decode_attention", decode_attention),
    ("sampling", sampling),  # some 15 s: 24 steps of picks on the device, 12 drawn on the host
    # every fast path with what the three kernel benchmarks above found faster than the defaults, where they
    # ran before it in the same call: what their winners give a whole job
    ("gpu_throughput_2b_tuned", gpu_throughput_tuned),
    ("throughput_small", lambda work: throughput(work, "small")),
    *(
        (f"gpu_throughput_2b_{path}", lambda work, path=path: gpu_throughput(work, "2b", (path,)))
        for path in FAST_PATHS
    ),
    # the same with the CPU's 256 sequences a step, against the 1,024 `auto` gives a large GPU
    ("gpu_throughput_2b_256_seqs", lambda work: gpu_throughput(work, "2b", max_num_seqs=256)),
    # every fast path, the tower's attention by SDPA over each size's images (cuDNN's kernel first)
    (
        "gpu_throughput_2b_fast_sdpa_vision",
        lambda work: gpu_throughput(work, "2b", FAST_PATHS, vision_attention="sdpa"),
    ),
    # every fast path and the vision calls replayed as CUDA graphs (`engine.vision_graphs`, off by default
    # until this has measured it); and the same on the thin model, the rate the host then allows
    (
        "gpu_throughput_2b_fast_vision_graphs",
        lambda work: gpu_throughput(work, "2b", (*FAST_PATHS, "vision_graphs")),
    ),
    (
        "gpu_throughput_thin_fast_vision_graphs",
        lambda work: gpu_throughput(work, "thin", (*FAST_PATHS, "vision_graphs")),
    ),
    # every fast path, each caption sampled (temperature 0.8, top-p 0.9: a sort of every row's vocabulary a
    # step) where the others are greedy: the draws on the device, steps overlapped
    (
        "gpu_throughput_2b_fast_sampled",
        lambda work: gpu_throughput(work, "2b", FAST_PATHS, sampled=True),
    ),
    # a labeling workload (a JSON schema's grammar masks every row): serial steps, then overlapped ones
    ("gpu_throughput_2b_labels", lambda work: gpu_throughput(work, "2b", labels=True)),
    ("gpu_throughput_2b_labels_overlap", lambda work: gpu_throughput(work, "2b", ("overlap",), labels=True)),
    ("throughput_wide", lambda work: throughput(work, "wide")),
]
# Run only when GPU_CHECK_STAGES names them: the whole check's minutes go to the 2B runs without and with
# every fast path first; one fast path alone, to tell their gains apart, is a later call's
OPTIONAL = {
    "throughput_wide",
    "gpu_throughput_7b",
    "gpu_throughput_2b_256_seqs",
    "gpu_throughput_2b_fast_sdpa_vision",
    "gpu_throughput_2b_fast_vision_graphs",
    "gpu_throughput_thin_fast_vision_graphs",
    "gpu_throughput_2b_fast_sampled",
    "gpu_throughput_2b_labels",
    "gpu_throughput_2b_labels_overlap",
    "gpu_throughput_2b_tuned",
    *(f"gpu_throughput_2b_{path}" for path in FAST_PATHS),
}
MIN_STAGE_S = 20  # a stage started with less time left could not finish


def chosen_stages() -> list:
    """STAGES but the OPTIONAL ones, or those GPU_CHECK_STAGES names (comma-separated, in STAGES' order):
    a rerun of what failed fits a device's remaining minutes."""
    names = os.environ.get("GPU_CHECK_STAGES", "")
    if not names:
        return [(name, stage) for name, stage in STAGES if name not in OPTIONAL]
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    unknown = wanted - {name for name, _ in STAGES}
    if unknown:
        known = ", ".join(name for name, _ in STAGES)
        sys.exit(f"GPU_CHECK_STAGES: no stage {', '.join(sorted(unknown))}; the stages are {known}")
    return [(name, stage) for name, stage in STAGES if name in wanted]


def main() -> None:
    report: dict = {"device": DEVICE, "budget_s": BUDGET_S, "stages": {}}
    with tempfile.TemporaryDirectory(prefix="batchvl-gpu-check-") as tmp:
        work = Path(tmp)
        for name, stage in chosen_stages():
            if left_s() < MIN_STAGE_S:
                report["stages"][name] = {"ok": False, "skipped": "the time budget ran out"}
                continue
            started = time.monotonic()
            try:
                outcome = stage(work)
            except Exception as error:  # a stage's own set-up failed: report it, run the next
                outcome = {"ok": False, "exception": f"{type(error).__name__}: {error}"[:SHOWN]}
            outcome.setdefault("seconds", round(time.monotonic() - started, 1))
            report["stages"][name] = outcome
            print(f"{name}: {'ok' if outcome['ok'] else 'FAILED'} ({outcome['seconds']} s)", file=sys.stderr)
            write(report)  # after every stage: a run cut short still leaves what it found
            for benchmark in work.glob("*.json"):  # the benchmarks' own full reports, beside this one
                benchmark_copy(benchmark.name).write_text(benchmark.read_text())
    report["ok"] = all(stage["ok"] for stage in report["stages"].values())
    print(write(report))
    sys.exit(0 if report["ok"] else 1)


def benchmark_copy(name: str) -> Path:
    """Where a benchmark's full report `name` is copied: beside the report, named after it."""
    return REPORT.with_name(f"{REPORT.stem}-{name}")


def write(report: dict) -> str:
    report["seconds"] = round(time.monotonic() - STARTED, 1)
    text = json.dumps(report, indent=2, default=str)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(text)
    return text


if __name__ == "__main__":
    main()
