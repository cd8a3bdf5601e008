"""Host work per sample: what a captioning job's process spends on each sample outside the model.

On a fast GPU the job process's own work (taking a sample in, its positions, staging its pixels, scheduling,
bookkeeping, writing its row) bounds the samples per second whatever the kernels do: at 185 samples/s, the
goal for Qwen2-VL-2B on one H100, a sample may cost the process at most 5.4 ms. This runs the captioning
workload of `gpu_throughput.py` (448x448 images, every fifth 896x672, 64 new tokens) through a `batchvl
run` job on the CPU with one engine and the `tiny` model, so that the model's own time is small, and
reports the wall time less the vision calls', the forwards' and the input wait, per sample. On a CPU the
model is slower than a GPU's and shares the cores with the preprocessing workers, so the figure is the host
work of this CPU, not of a GPU machine's; compare it between commits in the same run.

`--profile` adds the functions of batchvl and transformers with the most own time in the measured job
(cProfile on the job's thread, which slows Python code, so its times are not the row's).

    python benchmarks/host_per_sample.py [--samples 300] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import tempfile
from pathlib import Path

import torch
from gpu_throughput import caption_job, job_config, write_images
from workloads import write_json

WARMUP_SAMPLES = 16
PROFILE_ROWS = 15


def own_time_by_function(profile: cProfile.Profile, rows: int) -> list[dict]:
    """The functions of batchvl and transformers with the most own time, with their calls."""
    stats = pstats.Stats(profile)
    found = []
    for (path, line, name), (_, calls, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "batchvl/" in path or "transformers/" in path:
            before, _, inside = path.rpartition("site-packages/")
            site = inside if before else "batchvl/" + path.rpartition("/batchvl/")[2]
            found.append({"function": f"{site}:{line}({name})", "calls": calls, "own_s": round(own, 4)})
    return sorted(found, key=lambda row: -row["own_s"])[:rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="Also list where the job's own time went")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.samples < 1:
        parser.exit(2, f"error: --samples {args.samples} runs nothing; give 1 or more\n")

    from batchvl.demo.device_model import build_on_device

    with tempfile.TemporaryDirectory(prefix="batchvl-host-per-sample-") as folder:
        work = Path(folder)
        loaded = build_on_device(work / "model", "tiny", "cpu", fused_kernels=False)
        write_images(work / "warmup", WARMUP_SAMPLES, first=args.samples)
        write_images(work / "data", args.samples)
        engine = {"replicas": 1}  # one engine, as on a GPU

        def job(name: str):
            return job_config(work, name, loaded, "cpu", engine, False, work / "out" / name, sampling={})

        caption_job(job("warmup"), loaded, "cpu")
        profile = cProfile.Profile() if args.profile else None
        with profile if profile else contextlib.nullcontext():
            run = caption_job(job("data"), loaded, "cpu")
    stats = run["stats"]
    if sum(row["status"] == "ok" for row in run["rows"]) != args.samples:
        raise SystemExit(f"not every one of the {args.samples} rows is ok; no figure")
    model_s = stats["encode_s"] + stats["forward_s"]
    host_s = stats["wall_s"] - model_s - stats["input_wait_s"]
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "samples": args.samples,
        "wall_s": round(stats["wall_s"], 3),
        "vision_s": round(stats["encode_s"], 3),
        "forward_s": round(stats["forward_s"], 3),
        "input_wait_s": round(stats["input_wait_s"], 3),
        "host_s": round(host_s, 3),
        "host_ms_per_sample": round(1000 * host_s / args.samples, 3),
        "profiled": args.profile,
    }
    if profile:
        result["own_time"] = own_time_by_function(profile, PROFILE_ROWS)
    columns = ("samples", "wall_s", "vision_s", "forward_s", "input_wait_s", "host_ms_per_sample")
    print(" ".join(f"{name:>18}" for name in columns))
    print(" ".join(f"{result[name]:>18}" for name in columns))
    for row in result.get("own_time", []):
        print(f"  {row['own_s']:>8.3f} s {row['calls']:>7} calls  {row['function']}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
