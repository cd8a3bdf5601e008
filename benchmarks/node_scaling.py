"""One engine process against several on the same machine: `batchvl run --processes N` (or `--gpus N`),
the node launcher's scaling and each process's wait for input.

The workload: `--samples` images of mixed sizes (random pixels, 64 to 800 px) in `--shards` Parquet shards,
one caption prompt, exactly `--new-tokens` tokens (EOS ignored), on the `small` random-weight model written
as a checkpoint (each process loads it). Each process count runs the same job into a fresh folder, in
alternating order over `--rounds` rounds (these machines' speed moves from minute to minute); each run's
rows must equal the one-process run's, or the benchmark fails. Reported per run: samples/s over the node's
processing time, the wall time, and per process its samples and the share of its processing time it waited
for input (the figure that says whether preprocessing keeps up with the engines).

On a GPU machine, `--device cuda` runs the processes on the job's one GPU (`--processes`: they share it) or,
with `--gpus`, one per GPU; `--then-gpus-all` adds, after the rounds, a run of `--gpus all` (a process per
GPU the machine has), whose rows must equal the first run's as well.

    python benchmarks/node_scaling.py [--device cpu] [--counts 1,2] [--samples 96] [--shards 8]
        [--new-tokens 16] [--rounds 2] [--dtype float32] [--gpus] [--then-gpus-all] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from workloads import mixed_size_images, write_json


def write_shards(folder: Path, samples: int, shards: int) -> None:
    folder.mkdir(parents=True)
    images = mixed_size_images(samples, seed=1)
    for number in range(shards):
        picked = range(number, samples, shards)
        encoded = []
        for i in picked:
            buffer = io.BytesIO()
            images[i].save(buffer, format="PNG")
            encoded.append(buffer.getvalue())
        keys = [f"s{i}" for i in picked]
        pq.write_table(pa.table({"key": keys, "image": encoded}), folder / f"part-{number}.parquet")


def job(model_dir: Path, data: Path, out: Path, args) -> dict:
    return {
        "model": {"path": str(model_dir), "dtype": args.dtype, "device": args.device},
        "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
        "prompts": [{"name": "caption", "text": "Describe this image in one sentence."}],
        "sampling": {"max_new_tokens": args.new_tokens, "ignore_eos": True},
        "output": {"dir": str(out)},
    }


def run_once(launch: dict, model_dir: Path, data: Path, out: Path, args) -> tuple[dict, list]:
    """The job launched as `launch` says (`{"processes": N}` or `{"gpus": N or "all"}`): its run's figures
    and its rows."""
    import batchvl

    shutil.rmtree(out, ignore_errors=True)
    results = batchvl.run(job(model_dir, data, out, args), progress=False, **launch)
    rows = sorted((row["key"], row["status"], row["text"]) for row in results.dataset.to_list())
    stats = results.stats
    processes = stats.get("processes") or [
        {"device": args.device, "samples": stats["samples"], "input_wait_share": stats["input_wait_share"]}
    ]
    return {
        "launch": " ".join(f"--{key} {value}" for key, value in launch.items()),
        "processes": len(processes),
        "samples_per_s": stats["samples_per_s"],
        "wall_s": stats["wall_s"],
        "processing_s": stats["processing_s"],
        "per_process": [
            {key: process.get(key) for key in ("device", "samples", "input_wait_share", "preprocess_workers")}
            for process in processes
        ],
    }, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--counts", default="1,2", help="Process counts, comma-separated")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gpus", action="store_true", help="--gpus N (a process per GPU), not --processes N")
    parser.add_argument(
        "--then-gpus-all",
        action="store_true",
        help="After the rounds, one run with --gpus all (a process per GPU here), its rows checked too",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [int(count) for count in args.counts.split(",")]
    if min(counts) < 1 or args.samples < args.shards or args.rounds < 1:
        sys.exit("error: counts 1 or more, --samples at least --shards, --rounds 1 or more")
    import torch

    from batchvl.demo.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="batchvl-node-scaling-"))
    try:
        model_dir = build_tiny_model(work / "model", size="small", seed=0)
        write_shards(work / "data", args.samples, args.shards)
        runs, reference = [], None
        for number in range(args.rounds):
            order = counts if number % 2 == 0 else counts[::-1]
            launches = [{"gpus": count} if args.gpus else {"processes": count} for count in order]
            if args.then_gpus_all and number == args.rounds - 1:
                launches.append({"gpus": "all"})
            for launch in launches:
                (value,) = launch.values()
                run, rows = run_once(launch, model_dir, work / "data", work / f"out-{value}", args)
                if reference is None:
                    reference = rows
                if {status for _, status, _ in rows} != {"ok"}:
                    sys.exit(f"error: {run['launch']} wrote error rows: the workload must run whole")
                if rows != reference:
                    sys.exit(f"error: {run['launch']} wrote other rows than the first run")
                runs.append({"round": number, **run})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"\n{args.device}, CPU capability {capability}, {args.samples} samples in {args.shards} shards")
    print(f"{'round':<7}{'launch':>15}{'samples/s':>11}{'wall, s':>9}  input-wait share per process")
    for run in runs:
        waits = " ".join(f"{process['input_wait_share']}" for process in run["per_process"])
        print(f"{run['round']:<7}{run['launch']:>15}{run['samples_per_s']:>11}{run['wall_s']:>9}  {waits}")
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "cpu_capability": capability,
        "samples": args.samples,
        "shards": args.shards,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "launch": "gpus" if args.gpus else "processes",
        "rows_equal": True,
        "runs": runs,
    }
    write_json(args.json, report)


if __name__ == "__main__":
    main()
