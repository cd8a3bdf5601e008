"""The decode attention kernels on a CUDA device: the per-head Triton kernel (one program per sequence and
query head, each KV head read once per query head of its group) against the grouped one (one program per
sequence and KV head, its keys split over programs when sequences are few), per call of one layer, at
Qwen2-VL-2B's heads (12 query, 2 KV, head size 128) and 7B's (28/4/128), in a paged bf16 cache of 16-slot
pages. Each case also gives the grouped kernel's splits, the KV bytes it reads per second, and the largest
difference between the two kernels' outputs; and the grouped kernel's time at each split count up to 8
forced, whose fastest says whether `split_count`'s choice (no split while the step's programs fill the
GPU) leaves bandwidth unused. At `SWEPT_CASES`, the grouped kernel is timed again under other launch
settings (`LAUNCHES`: keys a block, warps and pipelining stages a program, `triton_grouped_decode`'s
settings read at each launch), each row with its `launch`, its time against the default's and its output's
difference from the per-head kernel's: the settings that pay can then become the defaults.

    python benchmarks/decode_attention.py [--json out.json] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from unittest import mock

import torch
from cuda_timing import per_call_us, require_cuda, write_report

SHAPES = {"2b": (12, 2, 128), "7b": (28, 4, 128)}  # query heads, KV heads, head size
# (sequences, keys each): a decode step at 256 sequences of short and long captions' contexts, and few
# sequences of long contexts, where the grouped kernel splits the keys
CASES = [(256, 600), (256, 2000), (1024, 600), (8, 16384)]  # 1,024: `max_num_seqs: auto` on a large GPU
FORCED_SPLITS = (1, 2, 4, 8)
# launch settings timed beside the defaults, at a captioning job's decode steps of 2B's heads
SWEPT_CASES = {("2b", 256, 600), ("2b", 1024, 600)}
LAUNCHES = (
    {"BLOCK_KEYS": 32},
    {"BLOCK_KEYS": 128},
    {"DECODE_WARPS": 8},
    {"BLOCK_KEYS": 128, "DECODE_WARPS": 8},
    {"DECODE_STAGES": 2},  # (4 compiles as the default's 3: the same registers and shared memory)
    # fewer buffered blocks or warps a program: more programs resident on an SM at once
    {"DECODE_STAGES": 1},
    {"DECODE_WARPS": 2},
    {"BLOCK_KEYS": 32, "DECODE_STAGES": 2},
)
PAGE_SIZE = 16


def decode_step(
    heads: int, kv_heads: int, head_dim: int, sequences: int, keys: int, dtype: torch.dtype, device="cuda"
):
    """A cache layer whose sequences' pages are scattered, their queries, and the decode call's arguments."""
    pages_each = -(-keys // PAGE_SIZE)
    kv = torch.randn(2, kv_heads, sequences * pages_each * PAGE_SIZE, head_dim, device=device, dtype=dtype)
    pages = torch.randperm(sequences * pages_each, device=device)
    starts = torch.arange(sequences, device=device) * pages_each
    lengths = torch.full((sequences,), keys, device=device)
    rows = torch.arange(sequences, device=device)
    query = torch.randn(heads, sequences, head_dim, device=device, dtype=dtype)
    return query, kv, (rows, pages, starts, lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    require_cuda("decode_attention.py")

    from batchvl.layers.triton_attention import per_head_decode_attention
    from batchvl.layers.triton_grouped_decode import grouped_decode_attention, split_count

    dtype = getattr(torch, args.dtype)
    results = []
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for sequences, keys in CASES:
            query, kv, metadata = decode_step(heads, kv_heads, head_dim, sequences, keys, dtype)
            scale = head_dim**-0.5
            outputs = [torch.zeros(sequences, heads, head_dim, device="cuda", dtype=dtype) for _ in range(2)]

            arguments = (query, kv, *metadata, scale, PAGE_SIZE)
            per_head = functools.partial(per_head_decode_attention, outputs[0], *arguments)
            grouped = functools.partial(grouped_decode_attention, outputs[1], *arguments)
            per_head_us, grouped_us = per_call_us(per_head), per_call_us(grouped)
            forced = {
                splits: round(per_call_us(functools.partial(grouped, splits=splits)), 1)
                for splits in FORCED_SPLITS
            }
            kv_bytes = 2 * kv_heads * sequences * keys * head_dim * kv.element_size()
            row = {
                "shape": shape,
                "sequences": sequences,
                "keys": keys,
                "per_head_us": round(per_head_us, 1),
                "grouped_us": round(grouped_us, 1),
                "speedup": round(per_head_us / grouped_us, 2),
                "grouped_splits": split_count(sequences, kv_heads, -(-keys // PAGE_SIZE) * PAGE_SIZE),
                "grouped_kv_gb_per_s": round(kv_bytes / grouped_us / 1e3, 1),
                "max_abs_diff": (outputs[0].float() - outputs[1].float()).abs().max().item(),
                "grouped_us_by_splits": forced,
                "fastest_splits": min(forced, key=forced.get),
            }
            results.append(row)
            if (shape, sequences, keys) in SWEPT_CASES:
                results += launch_sweep(row, grouped, outputs, kv_bytes)
            print(
                f"{shape} {sequences:4} seqs x {keys:6} keys  per-head {per_head_us:9.1f} us  grouped "
                f"{grouped_us:9.1f} us ({row['grouped_splits']} splits, {row['grouped_kv_gb_per_s']} GB/s)  "
                f"x{row['speedup']}  diff {row['max_abs_diff']:.2e}  forced splits {forced}"
            )
    write_report(args.json, args.dtype, results, page_size=PAGE_SIZE)


def launch_sweep(row: dict, grouped, outputs: list[torch.Tensor], kv_bytes: int) -> list[dict]:
    """The grouped call timed under each of `LAUNCHES` (set on the kernel's module and put back): its time,
    the KV bytes it reads a second, its speed against the defaults' and its output against the per-head
    kernel's (`outputs[0]`; the grouped call writes `outputs[1]`)."""
    from batchvl.layers import triton_grouped_decode

    swept = []
    for launch in LAUNCHES:
        with mock.patch.multiple(triton_grouped_decode, **launch):
            grouped_us = per_call_us(grouped)
        difference = (outputs[0].float() - outputs[1].float()).abs().max().item()
        speedup = round(row["grouped_us"] / grouped_us, 2)
        swept.append(
            {key: row[key] for key in ("shape", "sequences", "keys")}
            | {"launch": launch, "grouped_us": round(grouped_us, 1), "speedup_over_default_launch": speedup}
            | {"grouped_kv_gb_per_s": round(kv_bytes / grouped_us / 1e3, 1), "max_abs_diff": difference}
        )
        print(f"  {launch}  grouped {grouped_us:9.1f} us  x{speedup}  diff {difference:.2e}")
    return swept


if __name__ == "__main__":
    main()
