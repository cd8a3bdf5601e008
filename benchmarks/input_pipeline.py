"""Input pipeline benchmark: does memory stay flat as the job grows, and is the engine ever starved?

Runs `batchvl run` in a subprocess per configuration on generated Parquet shards of random photos
(about 200-700 px, PNG and JPEG) and reports, per run: samples, wall time, samples/s after model load,
the share of that time the engine waited for input, and peak RSS of the main process and of the whole
process tree (main + preprocessing workers). Memory: the same job over N and 10N samples (same shard
size). Starvation: a job where the engine is the bottleneck (the `small` model), workers 0 and 1.

Resident memory warms up over the first thousand or two samples of any job (allocator pools and oneDNN's
compiled kernels, one per layer shape and row bucket) and then stays flat, so N must be past that
warm-up for the comparison to mean anything (default 1000).

    python benchmarks/input_pipeline.py --json input_pipeline.json [--samples 100]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image
from workloads import write_json

SHARD_SIZE = 50


def photo(rng: np.random.Generator) -> bytes:
    height, width = (int(v) for v in rng.integers(200, 700, size=2))
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x % 256, y % 256, (x * y) % 256], axis=-1) + rng.integers(
        0, 60, size=(height, width, 3)
    )
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG" if rng.random() < 0.5 else "PNG")
    return buffer.getvalue()


def write_dataset(folder: Path, num_samples: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    pool = [photo(rng) for _ in range(min(num_samples, 40))]  # distinct bytes are not needed to test memory
    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, num_samples, SHARD_SIZE)):
        count = min(SHARD_SIZE, num_samples - start)
        images = [pool[(start + i) % len(pool)] for i in range(count)]
        keys = [f"s{start + i:07d}" for i in range(count)]
        pq.write_table(pa.table({"key": keys, "image": images}), folder / f"part-{shard:05d}.parquet")


def run(model: Path, data: Path, out: Path, workers: int, max_new_tokens: int) -> dict:
    job = {
        "model": {"path": str(model), "dtype": "auto"},
        "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
        "prompts": [{"name": "caption", "text": "Describe this image."}],
        "sampling": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "kv_cache_mb": 256},
        "preprocess": {"workers": workers},
        "output": {"dir": str(out), "overwrite": True},
    }
    job_path = out.parent / f"{out.name}.yaml"
    job_path.write_text(yaml.safe_dump(job))
    process = subprocess.Popen(
        [sys.executable, "-m", "batchvl", "run", str(job_path), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    timeline: list[tuple[float, int, int]] = []  # (seconds, main RSS, tree RSS)
    parent = psutil.Process(process.pid)
    started = time.perf_counter()
    while process.poll() is None:
        try:
            main = parent.memory_info().rss
            tree = main + sum(c.memory_info().rss for c in parent.children(recursive=True))
        except psutil.NoSuchProcess:
            break
        timeline.append((time.perf_counter() - started, main, tree))
        time.sleep(0.05)
    if process.wait() != 0:
        raise SystemExit(f"batchvl run failed:\n{process.stderr.read()}")
    stats_file = max((out / "_batchvl" / "stats").glob("*.json"), key=os.path.getmtime)
    stats = json.loads(stats_file.read_text())
    processing = stats["wall_s"] - stats["model_load_s"]
    end = timeline[-1][0]
    first_half = [main for t, main, _ in timeline if t <= end / 2]
    return {
        "samples": stats["samples"],
        "workers": workers,
        "wall_s": stats["wall_s"],
        "samples_per_s_after_load": round(stats["samples"] / processing, 2),
        "input_wait_share": stats["input_wait_share"],
        "engine_s": stats["engine_s"],
        "preprocess_s": stats["preprocess_s"],
        "peak_rss_main_mb": round(max(m for _, m, _ in timeline) / 2**20),
        "peak_rss_main_first_half_mb": round(max(first_half) / 2**20),
        "peak_rss_tree_mb": round(max(t for _, _, t in timeline) / 2**20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000, help="N: the memory runs use N and 10N samples")
    parser.add_argument("--starvation-samples", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from batchvl.demo.tiny_model import build_tiny_model

    results: dict[str, list[dict]] = {"memory": [], "starvation": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = build_tiny_model(tmp / "tiny", size="tiny")
        small = build_tiny_model(tmp / "small", size="small")
        for n in (args.samples, 10 * args.samples):
            write_dataset(tmp / f"data-{n}", n)
            results["memory"].append(run(tiny, tmp / f"data-{n}", tmp / f"out-mem-{n}", 1, 4))
        write_dataset(tmp / "data-starve", args.starvation_samples, seed=1)
        for workers in (0, 1):
            results["starvation"].append(
                run(small, tmp / "data-starve", tmp / f"out-starve-{workers}", workers, 32)
            )

    columns = list(results["memory"][0])
    print("| run | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, rows in results.items():
        model = "tiny" if name == "memory" else "small"
        for row in rows:
            print(f"| {name} ({model}) | " + " | ".join(str(row[c]) for c in columns) + " |")
    small_run, large_run = results["memory"]
    growth = large_run["peak_rss_main_mb"] / small_run["peak_rss_main_mb"]
    print(
        f"\npeak RSS (main process), {large_run['samples']} vs {small_run['samples']} samples: x{growth:.2f}"
    )
    results["peak_rss_growth_10x"] = round(growth, 3)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
