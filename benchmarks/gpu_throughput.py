"""Captioning throughput at the real sizes on a GPU, against the workload's own limit.

The model: Qwen2-VL at `--size 2b` or `7b` (the real configurations, vocabularies of 151,936 and 152,064),
random weights made on the device in bf16 (`batchvl.demo.device_model`: no checkpoint written or read);
`--size thin` is the tiny model's layers with the real pixel limits (the 2B's patches and prompt tokens,
every kernel small): its rate is what the host allows for this workload.
The workload: `--samples` images (1,000 by default), each unique, 448x448 with every fifth one 896x672,
one short prompt, 64 new tokens with EOS ignored, through a `batchvl run` job on the engine's default
settings (the fused elementwise kernels with `--fused-kernels`); a job of a few samples runs first, so
that the kernels' first-use costs are outside the clock.

One JSON row: samples/s (over the job's wall time); the workload's limit, its FLOPs (vision tower, prefill
and decode, counted from the model's layers) and its memory traffic (each decode's KV reads and every
token's KV write, and the decode weights read once a step for `max_num_seqs` sequences) against the
datasheet's bf16 peak and bandwidth, and against the matmul peak measured here; the share of that limit
reached; the GPU's idle time between steps and its time in each over the whole timed job, from two CUDA
events a step (`gpu_timeline.py`); the GPU's kernel time over wall time on a window of steps
(`step_timing.py` says how), and where the host waited for the GPU in the steps after it (`sync_audit.py`),
both from a second run of the same job up to the end of those windows (the profiler costs the host so much
that the timed job runs without it); and the split between vision (the vision calls' synchronized time),
steps with prompt chunks, and steps of decodes only, in seconds and in FLOPs. The engine's settings and
which fast paths were on are recorded with it.

`--temperature` (with `--top-p`) samples each caption instead of choosing greedily: the draws are made on
the device, so that a sampled job's steps overlap as a greedy one's do.

`--launch-settings` runs the job with kernel launch settings other than the defaults (`launch_settings.py`:
what a window's kernel benchmarks found faster, before they become the defaults).

`--labels` makes it a labeling workload instead: the same images, each with `constrained.py`'s five-field
JSON-schema prompt generated under its grammar (up to 256 tokens; the grammar ends each answer), so that
the grammar's host work per step (a bitmask a step for every row, filled on the host) is measured with
overlapped steps and without.

On a CPU (`--device cpu`, e.g. `--size tiny --samples 8`) the same runs, with the GPU's figures null.

    python benchmarks/gpu_throughput.py --device cuda --size 2b [--samples 1000] [--labels] [--cuda-graphs]
        [--overlap] [--fused-kernels] [--vision-graphs] [--max-num-seqs N] [--temperature T [--top-p P]]
        [--launch-settings JSON] [--json PATH] [--texts PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from batchvl_method import batchvl_job
from constrained import SCHEMA
from flops import FlopCounter
from gpu_timeline import GpuTimeline
from launch_settings import applied
from launch_settings import problem as launch_problem
from matmul_probe import matmul_peak
from PIL import Image
from step_timing import TRACE_COLUMNS, StepTimer, WindowsDone
from workloads import BASE_SIDE, LARGE, LARGE_EVERY, caption_image_size, write_json

SIZES = ("tiny", "thin", "small", "2b", "7b")
NEW_TOKENS = 64
LABEL_MAX_TOKENS = 256  # above the longest compact JSON the schema allows: the grammar ends each answer
WARMUP_SAMPLES = 16
# bf16 dense FLOP/s and memory bytes/s from NVIDIA's datasheets, by a part of the name torch gives the
# device, the more specific first
DATASHEETS = [
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),  # SXM, "NVIDIA H100 80GB HBM3"
    ("H200", 989e12, 4.8e12),
]


def decode_kernel(loaded, on_gpu: bool) -> str:
    """The decode attention kernel the engine's steps take: on a GPU Triton's for the model's heads
    ("grouped": each KV head read once for its query heads; "per_head"), on the CPU the native one."""
    if not on_gpu:
        return "native"
    from batchvl.layers.triton_attention import decode_kernel_name

    text = loaded.adapter.model.config.text_config
    return "triton_" + decode_kernel_name(text.num_attention_heads, text.num_key_value_heads)


def datasheet(device_name: str) -> tuple[float, float] | None:
    """(bf16 FLOP/s, bytes/s) of the GPU named, or None for one not in DATASHEETS (or a CPU)."""
    for part, flops, bandwidth in DATASHEETS:
        if part in device_name:
            return flops, bandwidth
    return None


def write_images(folder: Path, samples: int, first: int = 0) -> list[tuple[int, int]]:
    """One Parquet of `samples` unique images (keys from `first`) with their output budget; their sizes."""
    rng = np.random.default_rng(first)
    keys, images, sizes = [], [], []
    for i in range(first, first + samples):
        width, height = caption_image_size(i)
        # smooth random colours: unique (no encoder or prefix cache hits) and small as JPEG
        coarse = Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8))
        buffer = io.BytesIO()
        coarse.resize((width, height), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
        keys.append(f"s{i}")
        images.append(buffer.getvalue())
        sizes.append((height, width))
    folder.mkdir(parents=True)
    budgets = [NEW_TOKENS] * samples
    pq.write_table(pa.table({"key": keys, "image": images, "budget": budgets}), folder / "part-0.parquet")
    return sizes


def job_config(
    root: Path, name: str, loaded, device: str, engine_keys: dict, labels: bool, output: Path, sampling: dict
):
    """The job over `root/name` into `output` with `engine_keys` in its engine section and `sampling` in
    its sampling section (with `labels`, the JSON-schema prompt instead of the caption)."""
    from batchvl.config import job_config_from_dict

    model = {"path": loaded.path, "dtype": "bfloat16", "device": device}
    if not labels:
        return batchvl_job(root / name, ["caption"], output, model, engine_keys, sampling)
    # batchvl_job holds each caption to its budget, EOS ignored; a label ends by its grammar
    prompt = {"name": "labels", "text": "Describe the image as JSON.", "json_schema": SCHEMA}
    return job_config_from_dict(
        {
            "model": model,
            "input": {"paths": [str(root / name / "*.parquet")], "key_column": "key"},
            "prompts": [prompt],
            "sampling": {"max_new_tokens": LABEL_MAX_TOKENS, **sampling},
            "output": {"dir": str(output), "overwrite": True},
            "engine": engine_keys,
        }
    )


def caption_job(job, loaded, device: str, timer: StepTimer | None = None) -> dict:
    """The job (`job_config`'s) run on `loaded`, timed by `timer` where given: its stats, rows, engine
    settings and the allocator's counts over it."""
    from batchvl.pipeline.runner import run_job

    before = allocator_counts(device)
    with timer.installed() if timer else contextlib.nullcontext():
        stats = run_job(job, loaded=loaded, show_progress=False).stats
    after = allocator_counts(device)
    paths = sorted(Path(job.output.dir).glob("*.parquet"))
    rows = [row for path in paths for row in pq.read_table(path).to_pylist()]
    allocator = {key: round(after[key] - before[key], 3) for key in after}
    return {"stats": stats, "rows": rows, "engine": job.engine, "allocator": allocator}


def profiled_job(job, loaded, timer: StepTimer) -> None:
    """The job run again under a profiling `timer`, up to the end of its windows."""
    from batchvl.pipeline.runner import run_job

    # (a job too short for the windows ends by itself)
    with timer.installed(), contextlib.suppress(WindowsDone):
        run_job(job, loaded=loaded, show_progress=False)


def allocator_counts(device: str) -> dict[str, float]:
    """torch's CUDA allocator counters that mean a wait for the device: its retries after an allocation
    failed (every cached block freed, the device synchronized) and its cudaMalloc/cudaFree calls; and the
    page-locked host allocator's new allocations and their milliseconds (pixels and picks are staged in
    page-locked memory). Empty on the CPU."""
    if device == "cpu":
        return {}
    stats = torch.cuda.memory_stats(device)
    counts = {
        key: float(stats.get(key, 0)) for key in ("num_alloc_retries", "num_device_alloc", "num_device_free")
    }
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    counts["num_host_alloc"] = float(host.get("num_host_alloc", 0))
    counts["host_alloc_ms"] = float(host.get("host_alloc_time.total", 0)) / 1e3  # recorded in microseconds
    return counts


def workload_limits(counter: FlopCounter, rows: list[dict], patches: dict, max_num_seqs: int) -> dict:
    """The workload's FLOPs by phase, and the bytes its decodes must move at the least (bf16)."""
    flops = {"vision": 0.0, "prefill": 0.0, "decode": 0.0}
    kv_bytes = 2 * counter.kv_values_per_token
    weight_bytes = counter.lm_per_token + counter.head_per_token  # 2 FLOPs a token and 2 bytes per weight
    moved = 0.0
    for row in rows:
        prompt, generated = row["num_prompt_tokens"], row["num_output_tokens"]
        flops["vision"] += counter.image(patches[row["key"]])
        flops["prefill"] += counter.prefill(0, prompt)
        flops["decode"] += counter.decode(prompt, generated)
        fed = max(generated - 1, 0)
        keys_read = fed * prompt + fed * (fed + 1) / 2
        moved += kv_bytes * (keys_read + prompt + fed) + weight_bytes * fed / max_num_seqs
    return {"flops": flops, "bytes": moved}


def measure(args, work: Path) -> dict:
    from batchvl.demo.device_model import build_on_device
    from batchvl.preprocess.qwen_vision import QwenVisionSpec, smart_resize

    on_gpu = args.device != "cpu"
    started = _clock(args.device)
    build_phases: dict[str, float] = {}
    loaded = build_on_device(
        work / "model",
        args.size,
        args.device,
        fused_kernels=args.fused_kernels,
        vision_attention=args.vision_attention,
        phases_s=build_phases,
    )
    build_s = _clock(args.device) - started
    write_images(work / "warmup", min(WARMUP_SAMPLES, args.samples), first=args.samples)
    sizes = write_images(work / "data", args.samples)
    engine_keys = {
        "cuda_graphs": args.cuda_graphs,
        "overlap": args.overlap,
        "vision_graphs": args.vision_graphs,
        "max_num_seqs": args.max_num_seqs,
        "vision_attention": args.vision_attention,  # (the model is made with it: recorded in the job too)
    }
    sampling = sampling_keys(args)

    def job(data: str, output: str):
        return job_config(
            work, data, loaded, args.device, engine_keys, args.labels, work / "out" / output, sampling
        )

    caption_job(job("warmup", "warmup"), loaded, args.device)
    # timed without the profiler, whose costs would be the job's (`step_timing.py`), then profiled apart
    timeline = GpuTimeline(torch.device(args.device)) if on_gpu else None
    timer = StepTimer(args.profile_after, args.profile_steps, timeline=timeline)
    run = caption_job(job("data", "data"), loaded, args.device, timer)
    vision_graphs = vision_graph_counts(loaded.adapter)  # the timed job's, before the profiled one's
    profiled = StepTimer(args.profile_after, args.profile_steps, args.audit_steps, profiling=True)
    if on_gpu and args.profile_steps:
        profiled_job(job("data", "data-profiled"), loaded, profiled)
    stats, rows, engine = run["stats"], run["rows"], run["engine"]
    resolved = timer.engine.config if timer.engine is not None else engine
    # A label may be generated in full and still fail JSON's parse: xgrammar admits the byte tokens of raw
    # control characters inside strings (docs/benchmarks.md), which a random model writes now and then
    invalid = sum(row["status"] == "error" and row["error_type"] == "invalid_output" for row in rows)
    answered = sum(row["status"] == "ok" for row in rows) + (invalid if args.labels else 0)
    if answered != args.samples or len(rows) != args.samples:
        errors = [row["error_message"] for row in rows if row["status"] != "ok"][:3]
        written = len(rows)
        raise SystemExit(f"{answered} of {args.samples} rows answered ({written} written), no rate: {errors}")
    if args.texts:  # for a comparison of the outputs of runs with other fast paths
        args.texts.write_text(json.dumps({row["key"]: row["text"] for row in rows}))

    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    patches = {}
    for i, (height, width) in enumerate(sizes):
        resized = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
        patches[f"s{i}"] = resized[0] * resized[1] // spec.patch_size**2
    counter = FlopCounter(loaded.path)
    work_done = workload_limits(counter, rows, patches, resolved.max_num_seqs)
    flops = work_done["flops"]
    total_flops = sum(flops.values())
    wall = stats["wall_s"]
    samples_per_s = args.samples / wall
    name = torch.cuda.get_device_name(args.device) if on_gpu else "cpu"
    measured_peak = matmul_peak(torch.bfloat16, args.device, size=8192) if on_gpu else None
    sheet = datasheet(name) if on_gpu else None

    def limit(peak: float | None) -> float | None:
        """Samples/s were the workload's FLOPs at `peak` and its bytes at the datasheet's bandwidth."""
        if peak is None or sheet is None:
            return None
        return round(args.samples / max(total_flops / peak, work_done["bytes"] / sheet[1]), 1)

    limits = {"datasheet": limit(sheet[0] if sheet else None), "measured_matmul_peak": limit(measured_peak)}
    window = profiled.window
    if window is not None and timer.window is not None:
        # the same steps of the timed job, without the profiler: its share of their wall is an estimate
        # (input arrives at other moments in the two jobs, so their steps may differ a little)
        window["wall_s_unprofiled"] = timer.window["wall_s"]
    return {
        "device": name,
        "size": args.size,
        "dtype": "bfloat16",
        "samples": args.samples,
        "image_sizes": {
            f"{BASE_SIDE}x{BASE_SIDE}": args.samples - args.samples // LARGE_EVERY,
            f"{LARGE[0]}x{LARGE[1]}": args.samples // LARGE_EVERY,
        },  # fmt: skip
        "workload": "labels" if args.labels else "captions",
        "sampling": sampling or "greedy",
        # captions: each its 64 tokens; labels: as many as the grammar took
        "new_tokens_per_sample": round(stats["output_tokens"] / args.samples, 1),
        "grammar_s": round(stats["grammar_s"], 2),
        "rows_invalid_output": invalid,
        "model_build_s": round(build_s, 2),
        # (the second window's 2B builds took 17-19 s of a stage's minute: where they go)
        "model_build_phases_s": {phase: round(seconds, 2) for phase, seconds in build_phases.items()},
        "wall_s": round(wall, 2),
        "samples_per_s": round(samples_per_s, 3),
        "samples_per_s_processing": round(args.samples / stats["processing_s"], 3),
        "output_tokens_per_s": round(stats["output_tokens"] / wall, 1),
        "workload_tflop_per_sample": round(total_flops / args.samples / 1e12, 4),
        "workload_gb_moved_per_sample": round(work_done["bytes"] / args.samples / 1e9, 4),
        "datasheet_bf16_tflops": sheet[0] / 1e12 if sheet else None,
        "datasheet_bandwidth_tb_s": sheet[1] / 1e12 if sheet else None,
        "measured_matmul_peak_tflops": round(measured_peak / 1e12, 1) if measured_peak else None,
        "limit_samples_per_s": limits,
        "share_of_limit": {
            key: round(samples_per_s / value, 4) if value else None for key, value in limits.items()
        },
        "kernel_time_share": round(window["kernel_s"] / window["wall_s"], 4) if window else None,
        "kernel_time_share_of_unprofiled_wall": (
            round(window["kernel_s"] / window["wall_s_unprofiled"], 4)
            if window and "wall_s_unprofiled" in window
            else None
        ),
        "kernel_window": window,
        "host_waits": profiled.audit,
        "split_s": {
            "vision": round(stats["encode_s"], 2),
            "prefill_steps": round(timer.seconds["prefill"], 2),
            "decode_steps": round(timer.seconds["decode"], 2),
        },
        "split_steps": timer.steps,
        # the timed job's steps one by one: how the job ramps up, how full its steps are, where they wait
        "step_trace": {"columns": list(TRACE_COLUMNS), "rows": timer.trace},
        # the GPU's idle time between steps and its time in them, per step too (`gpu_timeline.py`)
        "gpu_timeline": timeline.figures() if timeline is not None else None,
        # the host's time in the engine's steps by what it did, and the job's processing time outside them
        # (taking inputs, writing rows): with overlapped steps, little time waiting for picks says the host
        # bounds the job (`step_timing.py`)
        "host_split_s": {key: round(value, 2) for key, value in timer.host_split.items()},
        "outside_steps_s": (  # (the CPU's engine replicas step in threads: their seconds are summed)
            round(stats["processing_s"] - sum(timer.host_split.values()), 2)
            if stats["engine_replicas"] == 1
            else None
        ),
        "allocator": run["allocator"],
        # the job's wall outside its processing, and in it the wait for the workers' forks and the engine's
        # build, by part (`step_timing.START_PHASES`: the last two are parts of `engine_build`)
        "outside_processing_s": round(wall - stats["processing_s"], 2),
        "start_s": {
            "workers": stats["workers_start_s"],
            "engine": stats["engine_start_s"],
            **{key: round(value, 3) for key, value in timer.start_split.items()},
        },
        # the host's time capturing decode graphs in the measured job (its wall time includes it)
        "graph_capture_s": graph_capture_seconds(timer.engine),
        "vision_graph_use": vision_graphs,  # shapes captured, capture time, calls replayed and run eagerly
        # overlapped steps are not waited for: their vision, prefill and decode seconds are launch times
        "split_s_is_launch_time": engine.overlap,
        "engine_replicas": stats["engine_replicas"],  # the CPU's replicas' seconds are summed
        "split_flops_share": {key: round(value / total_flops, 4) for key, value in flops.items()},
        "input_wait_s": round(stats["input_wait_s"], 2),
        # the input's capacity, workers over a sample's preprocessing: above samples/s, input is no bound
        "preprocess_workers": stats["preprocess_workers"],
        "preprocess_ms_per_sample": round(1e3 * stats["preprocess_s"] / args.samples, 2),
        "engine": {
            # as the engine resolved `auto` on this device
            "max_num_seqs": resolved.max_num_seqs,
            "max_num_batched_tokens": resolved.max_num_batched_tokens,
            "max_patches_per_encode": resolved.max_patches_per_encode,
            "prefix_caching": engine.prefix_caching,
            "kv_cache_mb": engine.kv_cache_mb,
            "cuda_graphs": engine.cuda_graphs,
            "overlap": engine.overlap,
            "fused_kernels": has_fused_kernels(loaded.adapter.model),
            "vision_graphs": engine.vision_graphs,
            "vision_attention": engine.vision_attention,
            "decode_kernel": decode_kernel(loaded, on_gpu),
            "launch_settings": args.launch_settings,  # beside the kernels' defaults
        },
    }


def vision_graph_counts(adapter) -> dict | None:
    """The timed job's vision graphs (`engine.vision_graphs`): the shapes captured, the host's seconds in
    their captures, the calls replayed and those run eagerly at a graph's shape (a shape's first, or after
    a failed capture); None without them."""
    graphs = getattr(adapter, "vision_graphs", None)
    if graphs is None:
        return None
    return {
        "shapes": len(graphs.captured),
        "capture_s": round(graphs.capture_s, 2),
        "replays": graphs.replays,
        "eager_calls": graphs.eager_calls,
    }


def graph_capture_seconds(engine) -> float | None:
    """Seconds the engine's decode graphs took to capture; None without graphs (or without a step)."""
    graphs = getattr(getattr(engine, "runner", None), "decode_graphs", None)
    return None if graphs is None else round(graphs.capture_s, 2)


def has_fused_kernels(model: torch.nn.Module) -> bool:
    """Whether the model runs the fused elementwise kernels (its norms are the Triton ones)."""
    from batchvl.layers.triton_modules import TritonRMSNorm

    return any(isinstance(module, TritonRMSNorm) for module in model.modules())


def _clock(device: str) -> float:
    """perf_counter once the device's queued work is done."""
    import time

    if device != "cpu":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def sampling_keys(args) -> dict:
    """The job's sampling keys beside its token budget: greedy, or `--temperature` with `--top-p` (each
    request's generator seeded from the job's seed, its shard, key and prompt)."""
    if not args.temperature:
        return {}
    return {"temperature": args.temperature, "top_p": args.top_p}


def json_argument(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None


def argument_problem(args) -> str | None:
    """What is wrong with the arguments, in one line with its fix; None when nothing is."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        return f"--device {args.device} is not a device; use cpu, cuda or cuda:N"
    if args.device != "cpu" and not torch.cuda.is_available():
        return f"--device {args.device} but no CUDA device is available; use --device cpu"
    if args.samples < 1:
        return f"--samples {args.samples} runs nothing; give 1 or more"
    if args.max_num_seqs != "auto" and args.max_num_seqs < 1:
        return f"--max-num-seqs {args.max_num_seqs} runs nothing; give 1 or more, or auto"
    if (problem := launch_problem(args.launch_settings)) is not None:
        return problem
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        return (
            f"--temperature {args.temperature} --top-p {args.top_p}: give a temperature >= 0, top-p in (0, 1]"
        )
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a trial: GPU figures null)")
    parser.add_argument("--size", choices=SIZES, default="2b")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument(
        "--profile-after",
        type=int,
        default=10,
        help="Engine steps before the kernel window (at 1,000 samples the first 60 or so hold prompts)",
    )
    parser.add_argument("--profile-steps", type=int, default=20, help="Engine steps in the kernel window")
    parser.add_argument(
        "--labels",
        action="store_true",
        help="A JSON-schema labeling prompt, generated under its grammar, instead of the caption",
    )
    parser.add_argument(
        "--audit-steps",
        type=int,
        default=20,
        help="Engine steps after the kernel window in which the host's waits for the GPU are counted by site",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Replay decode-only steps as CUDA graphs (engine.cuda_graphs; ignored on the CPU)",
    )
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="engine.overlap: each engine step launched before the previous step's picks are read",
    )
    parser.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="RMSNorm, LayerNorm, SiLU*mul, QuickGELU and rotary as Triton kernels (engine.fused_kernels)",
    )
    parser.add_argument(
        "--vision-graphs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="The Qwen-VL towers' vision calls as CUDA graphs (engine.vision_graphs; ignored on the CPU)",
    )
    parser.add_argument(
        "--vision-attention",
        choices=("auto", "flash_varlen", "sdpa"),
        default="auto",
        help="engine.vision_attention: the tower's attention by one flash varlen call a layer, or by SDPA",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=lambda text: text if text == "auto" else int(text),
        default="auto",
        help="engine.max_num_seqs (auto: the engine's choice, 1024 on a GPU of 70 GiB or more)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Sample at this temperature (0: greedy), each request from its own seeded generator",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="With --temperature: top-p (1: all tokens)")
    parser.add_argument(
        "--launch-settings",
        type=json_argument,
        default={},
        help="Kernel launch settings beside the defaults, as JSON (launch_settings.py), e.g. "
        '{"triton_grouped_decode": {"BLOCK_KEYS": 128}}',
    )
    parser.add_argument("--json", type=Path, help="Write the row here.")
    parser.add_argument("--texts", type=Path, help="Write each sample's output text here (JSON, by key).")
    args = parser.parse_args()
    problem = argument_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    with (
        tempfile.TemporaryDirectory(prefix="batchvl-gpu-throughput-") as folder,
        applied(args.launch_settings),
    ):
        row = measure(args, Path(folder))
    print(json.dumps(row, indent=2))
    write_json(args.json, row)


if __name__ == "__main__":
    main()
