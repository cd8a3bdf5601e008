"""A step's sampled picks at Qwen2-VL's 151,936-token vocabulary: the engine's (`sampler.step_picks`: every
sampled row filtered and drawn at once on the logits' device, from one number of each request's generator)
against the rows drawn one by one on the host as `generate` draws them (one copy of the rows to the CPU,
then for each its warpers, its softmax and `torch.multinomial` on its CPU generator: what batchvl did
before), at temperature 0.8 alone and with top-p 0.9 (a sort of each row), for 1 to 1,024 rows a step (the
host's draws up to HOST_ROWS rows: they cost the same per row at any count).

Each figure is the median of a few steps' wall times, the device synchronized after each; it prints a table
and writes the rows as JSON. On a GPU the engine's draw is the whole cost of a sampled step's picks beside
its forward; on a CPU both run on the same cores as the model.

    python benchmarks/sampling.py [--device cpu|cuda] [--rows 1,16,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from workloads import write_json

from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.sampler import filtered_logits, make_generator, step_picks

VOCAB = 151936
SETTINGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
}
STEPS = 5  # timed steps per figure (and one before them, not timed)
# the most rows a step drawn on the host is timed at: its cost is per row (some 2.4 and 13 ms a row on a CPU)
HOST_ROWS = 64
WIDTHS = (12, 6, 11, 10, 12, 10, 7)


def host_draws(logits: torch.Tensor, params: SamplingParams, seeds: list[int]) -> list[int]:
    """`generate`'s draw, row by row on the CPU, after one copy of the rows there, each by a torch
    generator of its own."""
    rows = logits.cpu()
    return [
        int(torch.multinomial(torch.softmax(filtered_logits(row, params), -1), 1, generator=seeded(seed)))
        for row, seed in zip(rows, seeds, strict=True)
    ]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def engine_draws(logits: torch.Tensor, params: SamplingParams, seeds: list[int]) -> list:
    return step_picks(logits, [params] * len(seeds), list(map(make_generator, seeds))).tolist()


def step_ms(draw, logits: torch.Tensor, params: SamplingParams) -> float:
    """The median wall time of a step's draws, in ms."""
    seeds = list(range(len(logits)))
    times = []
    for _ in range(STEPS + 1):
        if logits.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        draw(logits, params, seeds)
        if logits.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--rows", default=None, help="Rows a step, comma-separated (default: 1,16,64 on a CPU)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    default_rows = "1,64,256,1024" if device.type == "cuda" else "1,16,64"
    counts = [int(count) for count in (args.rows or default_rows).split(",")]
    results = []
    header = ("setting", "rows", "engine ms", "host ms", "engine/row", "host/row", "x")
    print("".join(f"{text:>{width}}" for text, width in zip(header, WIDTHS, strict=True)))
    for name, params in SETTINGS.items():
        for rows in counts:
            logits = (
                torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)).mul_(3).to(device)
            )
            engine = step_ms(engine_draws, logits, params)
            host = step_ms(host_draws, logits, params) if rows <= HOST_ROWS else None
            row = {
                "setting": name,
                "rows": rows,
                "engine_ms": round(engine, 3),
                "host_ms": round(host, 3) if host else None,
                "engine_ms_per_row": round(engine / rows, 4),
                "host_ms_per_row": round(host / rows, 4) if host else None,
                "speedup": round(host / engine, 2) if host else None,
            }
            results.append(row)
            print(
                "".join(
                    f"{value if value is not None else '-':>{width}}"
                    for value, width in zip((name, *list(row.values())[1:]), WIDTHS, strict=True)
                )
            )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": name,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "vocab": VOCAB,
        "steps": STEPS,
        "results": results,
    }
    write_json(args.json, report)


if __name__ == "__main__":
    main()
