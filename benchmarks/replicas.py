"""One engine against engine replicas: the same `batchvl run` jobs in one process, alternating between
`engine.replicas: 1` (one engine on all torch's threads) and replicas, as many as `auto` runs for a job of
many requests (one engine of one thread per core; for a job of a few `auto` runs one engine), warm (a pass of
each first builds oneDNN's kernels), on the throughput benchmark's held-out style workload (the `small` model
or Qwen2-VL-2B's widths with `--size wide`; images 64 to 800 px with a quarter repeating an earlier one, one
prompt, exactly 32 new tokens). Each pair's ratio is taken within the pair, the order alternating between
pairs, since these machines' speed moves from minute to minute.

`--isa` runs it as on another kind of CPU, on this one: `avx2` sets torch's kernels and oneDNN to AVX2
(the fp32 machines), `avx512` caps oneDNN below AMX (an AVX-512 CPU without the tiles: batchvl then
chooses its kernels as there too). The silicon stays this machine's: its cores, caches and their speeds.

    python benchmarks/replicas.py [--samples 128] [--size small|wide] [--dtype bfloat16] [--pairs 3]
        [--isa native|avx2|avx512] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from workloads import write_json  # (numpy and Pillow: nothing that reads the settings below)

# Read by torch and oneDNN when they load: set before anything imports torch.
ISA_ENVIRONMENT = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument(
        "--size", default="small", choices=["small", "wide"], help="wide: Qwen2-VL-2B's widths and depth"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--pairs", type=int, default=3, help="Pairs of warm passes, one engine and replicas")
    parser.add_argument("--isa", default="native", choices=list(ISA_ENVIRONMENT))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.pairs < 1 or args.samples < 1:
        print("error: --pairs and --samples must be 1 or more", file=sys.stderr)
        raise SystemExit(2)
    os.environ.update(ISA_ENVIRONMENT[args.isa])
    import batchvl  # noqa: F401 - before torch: it sets torch's CPU library defaults, read when they load

    work = Path(tempfile.mkdtemp(prefix="batchvl-replicas-"))
    try:
        report = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, report)


def measure(args, work: Path) -> dict:
    import torch
    from batchvl_method import batchvl_job
    from throughput import round_orders
    from throughput_workload import PARTS, write_workload

    from batchvl.config import EngineConfig
    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.engine.parallel.replicas import replica_count
    from batchvl.layers.cpu_features import has_amx
    from batchvl.models.loader import load_model
    from batchvl.pipeline.runner import run_job

    model_dir = build_tiny_model(work / "model", size=args.size, seed=0)
    write_workload(work, args.samples, 0.25, 32, 32, two_prompt_share=0)
    loaded = load_model(str(model_dir), dtype=args.dtype, device="cpu")
    model = {"path": str(model_dir), "dtype": args.dtype, "device": "cpu"}

    def seconds(replicas, tag: str) -> float:
        job = batchvl_job(
            work / "data" / "one_prompt", PARTS["one_prompt"], work / tag, model, {"replicas": replicas}
        )
        stats = run_job(job, loaded=loaded, show_progress=False).stats
        if (stats["ok"], stats["errors"]) != (args.samples, 0):
            raise SystemExit(
                f"error: {tag} wrote {stats['ok']} ok and {stats['errors']} error rows of {args.samples}"
            )
        return stats["wall_s"]

    # `auto`'s count for a job of many requests, named: `auto` runs one engine for a job of a few
    count = replica_count(EngineConfig(), torch.device("cpu"), under_torchrun=False)
    seconds(1, "warm-one")
    seconds(count, "warm-replicas")
    one, replicas = [], []
    for pair, order in enumerate(round_orders([1, count], args.pairs)):
        for setting in order:
            (one if setting == 1 else replicas).append(seconds(setting, f"pair{pair}-{setting}"))
    speedups = [round(a / b, 2) for a, b in zip(one, replicas, strict=True)]
    print(
        f"\n{args.dtype}, CPU capability {torch.backends.cpu.get_cpu_capability()}, AMX {has_amx()}, "
        f"{torch.get_num_threads()} threads, {count} replicas (auto); {args.samples} samples per job, "
        f"the {args.size} model"
    )
    print(f"{'pair':<6}{'one engine, s':>16}{'replicas, s':>14}{'speed-up':>11}")
    for pair, (a, b, ratio) in enumerate(zip(one, replicas, speedups, strict=True)):
        print(f"{pair + 1:<6}{a:>16.2f}{b:>14.2f}{f'x{ratio}':>11}")
    return {
        "dtype": args.dtype,
        "isa": args.isa,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_amx": has_amx(),
        "torch_threads": torch.get_num_threads(),
        "replicas": count,
        "samples": args.samples,
        "size": args.size,
        "one_engine_s": one,
        "replicas_s": replicas,
        "speedup_per_pair": speedups,
    }


if __name__ == "__main__":
    main()
