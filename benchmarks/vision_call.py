"""One vision call at a real size, taken apart: where a Qwen2-VL tower's call spends its time on a GPU.

The captioning benchmark gives vision calls most of a 2B job's wall time on an H200 (10.7 of 16.6 s with
every fast path; 63% of the job's FLOPs), at about a quarter of the measured matmul peak. This times the
engine's own vision call (`model_runner.encode_images`: the pixels staged from the host, the tower, the
merger) on 448x448 images (1,024 patches each at Qwen2-VL's sizes) in calls of each `--patches` size, and
at the largest size on the captioning workload's mix too (`gpu_throughput.py`'s: every fifth image 896x672,
3,072 patches, whose attention costs three times a 448x448 image's per patch; rows with `image_mix` "job",
the others' "448x448"), so that the tower's attention is chosen on the calls a job makes: per
call its wall time (synchronized, the median of `--calls`) and that of its staging alone and its three
steps (the 8-bit pixels the preprocessing workers send in a job into one page-locked tensor, onto the
device, normalized there into the tower's input) and the staging of the tower's input itself in its
dtype, as the workers sent it before; on CUDA the kernels' summed time within one call (torch's profiler,
overlaps counted once) and the kernels with the most of it (by name: calls and ms), and its TFLOP/s
against the tower's FLOPs (`flops.py`). On CUDA each size runs without the fused kernels, then with them
(`engine.fused_kernels`, swapped into the same model), then with them and the call replayed as a CUDA graph
(`engine.vision_graphs`: its rows padded to the graph's, captured before the timed calls), then with the
fused kernels and the tower's attention by SDPA over each size's images, cuDNN's kernel first
(`engine.vision_attention: sdpa`), instead of one flash varlen call a layer. A wall well above the kernels'
time says the host bounds the call (launches, staging); kernels' time well above the FLOPs at the matmul
peak says the kernels do, and the top kernels say which.

    python benchmarks/vision_call.py --device cuda --size 2b [--patches 4096,8192,16384,32768] [--json PATH]
    python benchmarks/vision_call.py --device cpu --size tiny --patches 256,512   (a trial: no kernel figures)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from flops import FlopCounter
from step_timing import kernel_summary
from workloads import caption_image_size, markdown_table, write_json

IMAGE_SIDE = 448
UNIFORM_MIX = f"{IMAGE_SIDE}x{IMAGE_SIDE}"  # a row's `image_mix` where its call's images are all that size
# Untimed calls of each size first: the first compiles and caches; with vision graphs it runs eagerly at
# the graph's shape and the second captures the graph (`qwen_vision_graphs.CAPTURE_ON_NEED`)
WARMUP_CALLS = 2


def built_model(size: str, device: str, folder: Path):
    """Qwen2-VL at `size` on `device` (bf16, made there) or the tiny one (fp32), and its config's folder."""
    if size == "tiny":
        from batchvl.demo.tiny_model import build_tiny_model
        from batchvl.models.loader import load_model

        path = build_tiny_model(folder / "tiny", family="qwen2_vl", size="tiny")
        return load_model(str(path), dtype="float32", device=device), path
    from batchvl.demo.device_model import build_on_device

    return build_on_device(folder / size, size, device), folder / size


def images(loaded, count: int, job_mix: bool = False) -> list:
    """`count` distinct images of random pixels, prepared as a job's workers do: IMAGE_SIDE-square, or with
    `job_mix` the captioning workload's sizes."""
    from PIL import Image

    from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image

    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    generator = np.random.default_rng(0)
    prepared = []
    for index in range(count):
        width, height = caption_image_size(index) if job_mix else (IMAGE_SIDE, IMAGE_SIDE)
        pixels = generator.integers(0, 256, (height, width, 3), dtype=np.uint8)
        prepared.append(prepare_image(Image.fromarray(pixels), spec))
    return prepared


def call_of(prepared: list, patches: int) -> list:
    """The first of `prepared` that a call of `patches` patches holds (at least one)."""
    batch, total = [], 0
    for image in prepared:
        if batch and total + image.num_patches > patches:
            break
        batch.append(image)
        total += image.num_patches
    return batch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(loaded, batch: list, patches: int) -> float:
    """Seconds of one vision call over `batch`, its kernels done."""
    from batchvl.engine.model_runner import encode_images

    device = loaded.adapter.device
    synchronize(device)
    started = time.perf_counter()
    encode_images(loaded.adapter, batch, patches)
    synchronize(device)
    return time.perf_counter() - started


def timed_staging(loaded, batch: list) -> tuple[float, float, float]:
    """Seconds of the call's first part alone, in its three steps: its 8-bit pixels copied into one
    page-locked tensor (`host_stack`), sent to the device, and normalized there into the tower's input
    (`tower_input`: the normalization, a still image's repeat, the cast, the padding rows). Items that are
    the tower's input already (no normalization) are stacked in its dtype and sent: nothing is left for the
    third step."""
    from batchvl.engine.device.pixel_staging import host_stack, tower_input

    adapter = loaded.adapter
    rows = adapter.vision_call_rows(sum(len(image.pixel_values) for image in batch))
    synchronize(adapter.device)
    started = time.perf_counter()
    stacked = host_stack(batch, rows, adapter.dtype, adapter.device)
    stacked_at = time.perf_counter()
    sent = stacked.to(adapter.device, non_blocking=True)
    synchronize(adapter.device)
    sent_at = time.perf_counter()
    tower_input(sent, batch, rows, adapter.dtype)
    synchronize(adapter.device)
    return stacked_at - started, sent_at - stacked_at, time.perf_counter() - sent_at


def as_tower_input(loaded, batch: list) -> list:
    """`batch` with each item's pixels the tower's input itself, in its dtype (no normalization left): what
    the preprocessing workers sent before they sent 8-bit pixels."""
    from batchvl.engine.device.pixel_staging import stage_pixels

    adapter = loaded.adapter
    inputs = stage_pixels(
        batch, sum(len(image.pixel_values) for image in batch), adapter.dtype, torch.device("cpu")
    )
    items, offset = [], 0
    for image in batch:
        rows = len(image.pixel_values)
        items.append(
            dataclasses.replace(
                image, pixel_values=inputs[offset : offset + rows].clone(), normalization=None
            )
        )
        offset += rows
    return items


def kernels_of_one_call(loaded, batch: list, patches: int) -> dict:
    """The CUDA kernels of one call: their busy time, how many, and the TOP_KERNELS by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        timed_call(loaded, batch, patches)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        return kernel_summary(json.loads(trace.read_text()).get("traceEvents", []))


def measure(
    loaded,
    prepared: list,
    patches: int,
    calls: int,
    counter: FlopCounter,
    fused: bool,
    attention: str,
    graphs: bool = False,
) -> dict:
    """One call size's row. The call's images are as a job's preprocessing workers send them (8-bit, the
    call normalizes them); the staging of the tower's input itself, in its dtype, as the workers sent it
    before, is timed beside it."""
    batch = call_of(prepared, patches)
    for _ in range(WARMUP_CALLS):  # kernels compiled, the allocator's blocks cached, a graph captured
        timed_call(loaded, batch, patches)
    wall = statistics.median(timed_call(loaded, batch, patches) for _ in range(calls))
    stagings = [timed_staging(loaded, batch) for _ in range(calls)]
    stacking, upload, normalizing = (statistics.median(times) for times in zip(*stagings, strict=True))
    tower_input = as_tower_input(loaded, batch)
    of_tower_input = statistics.median(sum(timed_staging(loaded, tower_input)) for _ in range(calls))
    flops = sum(counter.image(image.num_patches) for image in batch)
    row = {
        "patches": sum(image.num_patches for image in batch),
        "images": len(batch),
        "image_mix": "job" if len({image.num_patches for image in prepared}) > 1 else UNIFORM_MIX,
        "fused_kernels": fused,
        "vision_attention": attention,
        "vision_graphs": graphs,
        "wall_ms": round(wall * 1e3, 3),
        "staging_ms": round((stacking + upload + normalizing) * 1e3, 3),
        # its steps: the 8-bit pixels into one page-locked tensor on the host, the upload, the normalization
        # into the tower's input on the device
        "staging_host_ms": round(stacking * 1e3, 3),
        "staging_upload_ms": round(upload * 1e3, 3),
        "staging_normalize_ms": round(normalizing * 1e3, 3),
        "staged_mb": round(sum(image.pixel_values.nbytes for image in batch) / 1e6, 2),
        # the tower's input itself staged in its dtype, as the workers sent it before (normalized there)
        "staging_of_tower_input_ms": round(of_tower_input * 1e3, 3),
        "staged_mb_of_tower_input": round(sum(image.pixel_values.nbytes for image in tower_input) / 1e6, 2),
        "tflop_per_s": round(flops / wall / 1e12, 2),
        "kernel_ms": None,
        "kernel_share": None,
        "kernels": None,
        "top_kernels": None,
    }
    if loaded.adapter.device.type == "cuda":
        row.update(kernels_of_one_call(loaded, batch, patches))
        row["kernel_share"] = round(row["kernel_ms"] / row["wall_ms"], 3)
    return row


def attend_by_sdpa(model: torch.nn.Module) -> None:
    """The tower's attention by SDPA over each size's images from now on, as `engine.vision_attention: sdpa`
    makes it."""
    from batchvl.layers.qwen_vision_attention import QwenVisionAttention
    from batchvl.layers.vision_attention import VARLEN_ATTRIBUTE

    for module in model.modules():
        if isinstance(module, QwenVisionAttention):
            setattr(module, VARLEN_ATTRIBUTE, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("tiny", "2b", "7b"), default="2b")
    parser.add_argument("--patches", default="4096,8192,16384,32768", help="Patches a call, comma-separated")
    parser.add_argument("--calls", type=int, default=5, help="Timed calls of each size (their median)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        sizes = [int(value) for value in args.patches.split(",") if value.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or args.calls < 1:
        raise SystemExit("--patches takes whole numbers of 1 or more, comma-separated; --calls 1 or more")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} but no CUDA device is available; use --device cpu")

    from batchvl.engine.device.graph_capture import graph_capture
    from batchvl.layers.fused_kernels import use_fused_kernels

    with tempfile.TemporaryDirectory() as tmp:
        loaded, folder = built_model(args.size, args.device, Path(tmp))
        counter = FlopCounter(str(folder))
        per_image = images(loaded, 1)[0].num_patches
        prepared = images(loaded, max(1, max(sizes) // per_image))
        job_mix = images(loaded, max(1, max(sizes) // per_image), job_mix=True)

        def rows_of(fused: bool, attention: str, graphs: bool = False) -> list[dict]:
            calls = [(prepared, patches) for patches in sizes] + [(job_mix, max(sizes))]
            return [
                measure(loaded, source, patches, args.calls, counter, fused, attention, graphs)
                for source, patches in calls
            ]

        rows = rows_of(False, "flash_varlen")
        if loaded.adapter.device.type == "cuda":
            use_fused_kernels(loaded.adapter.model)
            rows += rows_of(True, "flash_varlen")
            if loaded.adapter.use_vision_graphs(graph_capture(loaded.adapter.device), max(sizes)):
                rows += rows_of(True, "flash_varlen", graphs=True)
            loaded.adapter.use_vision_graphs(None, 0)
            attend_by_sdpa(loaded.adapter.model)
            rows += rows_of(True, "sdpa")
    table = [{key: value for key, value in row.items() if key != "top_kernels"} for row in rows]
    print(markdown_table(table))
    report = {
        "device": torch.cuda.get_device_name(loaded.adapter.device) if args.device != "cpu" else "cpu",
        "size": args.size,
        "dtype": str(loaded.adapter.dtype).removeprefix("torch."),
        "image_side": IMAGE_SIDE,
        "calls": args.calls,
        "rows": rows,
    }
    write_json(args.json, report)


if __name__ == "__main__":
    main()
