"""The input's rate: prepared samples a second that reach a job's engine thread from the preprocessing pool.

The samples are `gpu_throughput.py`'s (unique 448x448 images, every fifth 896x672, prepared as a Qwen2-VL-2B
job's workers prepare them: 8-bit patch rows, normalized later by the vision call). The engine thread is a
stand-in that takes every sample ready and then either sleeps 1 ms (`idle`: what the workers and the
transport can deliver) or spins in Python for `--busy-ms` (`busy`: a GPU engine's thread, which holds the
GIL while it launches kernels, between each launch). Each runs with the job's input settings (the workers'
pixels sent as shared-memory files opened by name, GIL handoffs every 1 ms: `preprocess/shared_pixels.py`,
`utils/background.py`), with the handoffs alone, and with torch's and Python's defaults (file descriptors
fetched from the workers, 5 ms), so that the table says what each buys where the engine is busy. The rate
is taken over the second half of the samples: the first fill the queues between the workers and the engine
thread (some 80 with 8 workers) while the workers start, which is not the input's rate.

`transport` rows send the first sample's media again for every sample, prepared once: the workers then cost
next to nothing, and the rate is what the transport and the engine thread's GIL allow.

On a GPU machine's host (`make gpu-check`'s `input_rate` stage) it says whether the input bounds a job:
where a busy engine's thread gets fewer samples a second than the GPU could caption, the input does.

    python benchmarks/input_rate.py [--samples 300] [--workers N] [--busy-ms 20] [--settings job,...]
                                    [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gpu_throughput import write_images
from workloads import write_json

from batchvl.config import EngineConfig, InputConfig, PreprocessConfig, PromptConfig
from batchvl.demo.tiny_model import SIZES, qwen_parts
from batchvl.inputs.parquet import ParquetSource
from batchvl.models.registry import model_family
from batchvl.pipeline.runner import feed_size
from batchvl.preprocess.pool import PreprocessPool, default_workers
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.sample import PreparedSample, SampleProcessor
from batchvl.utils.background import END, BackgroundIterator, prompt_handoffs

PREFETCH = PreprocessConfig().prefetch
LOOKAHEAD = EngineConfig().lookahead  # the engine's input window, which the job's feed holds
# (name, pixels as files opened by name, GIL handoffs every 1 ms): the job's, the handoffs alone, neither
SETTINGS = (("job", True, True), ("handoffs_only", False, True), ("defaults", False, False))


def sample_processor(size: str) -> SampleProcessor:
    """What a job's workers run per sample for Qwen2-VL at `size`: its media, one caption."""
    parts = qwen_parts("qwen2_vl", SIZES[size], seed=0)
    family = model_family("qwen2_vl")
    media = family.media_preparer(parts.processor, parts.config, PreprocessConfig())
    prompts = [PromptConfig("caption", "Describe this image in one sentence.")]
    return SampleProcessor(PromptRenderer(parts.processor), media, prompts)


@dataclass
class PreparedOnce:
    """A sample processor that prepares the first sample and hands its media and prompts out again for every
    later one: the workers cost next to nothing, and the rate is the transport's."""

    processor: SampleProcessor
    first: PreparedSample | None = None

    def __call__(self, sample) -> PreparedSample:
        if self.first is None:
            self.first = self.processor(sample)
        # pixels of their own, as every sample has: torch's sharing would send one tensor once, then a handle
        # the receiver has seen
        images = [dataclasses.replace(m, pixel_values=np.copy(m.pixel_values)) for m in self.first.images]
        return dataclasses.replace(
            self.first, shard=sample.shard, index=sample.index, key=sample.key, images=images
        )


def spin(seconds: float) -> None:
    """Python work holding the GIL, as an engine thread launching a GPU's kernels does."""
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        for i in range(100):
            total += i


def delivery_rate(
    data: Path, processor: SampleProcessor, workers: int, busy_s: float, files: bool, handoffs: bool
) -> dict:
    """Samples a second taken by the stand-in engine thread, over the second half of them."""
    source = ParquetSource(InputConfig(paths=[str(data / "*.parquet")], key_column="key"))
    shards = source.list_shards()
    pool = PreprocessPool(source, shards, processor, workers, PREFETCH, 120.0)
    if not files:
        pool.pixels_prefix = None  # the workers send torch's way
    feed = BackgroundIterator(pool, maxsize=feed_size(workers, LOOKAHEAD))  # as the job's runner makes it
    try:
        with prompt_handoffs() if handoffs else contextlib.nullcontext():
            times = consume(feed, busy_s)
    finally:
        feed.close()
    start = len(times) // 2
    rate = (len(times) - 1 - start) / (times[-1] - times[start])
    return {"samples": len(times), "samples_per_s": round(rate, 1)}


def consume(feed: BackgroundIterator, busy_s: float) -> list[float]:
    """When each sample was taken: every ready one, then a step's work (busy) or a short sleep (idle)."""
    times: list[float] = []
    while True:
        with contextlib.suppress(queue.Empty):
            while (item := feed.get(block=False)) is not END:
                if isinstance(item, PreparedSample):  # (not a shard's end)
                    if item.error is not None:
                        raise SystemExit(f"sample {item.key} failed: {item.error.message}")
                    times.append(time.perf_counter())
            return times
        if busy_s:
            spin(busy_s)
        else:
            time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--workers", type=int, default=None, help="Preprocessing workers (a job's default)")
    parser.add_argument("--busy-ms", type=float, default=20.0, help="The busy engine thread's step, in ms")
    parser.add_argument("--size", choices=("2b", "7b"), default="2b", help="Whose image processor")
    parser.add_argument(
        "--settings",
        type=lambda text: [name.strip() for name in text.split(",")],
        default=[name for name, *_ in SETTINGS],
        help=f"Which of the settings to run, comma-separated ({', '.join(name for name, *_ in SETTINGS)})",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    unknown = set(args.settings) - {name for name, *_ in SETTINGS}
    if unknown:
        parser.error(f"--settings: no setting {', '.join(sorted(unknown))}")
    chosen = [setting for setting in SETTINGS if setting[0] in args.settings]
    workers = default_workers() if args.workers is None else args.workers
    processor = sample_processor(args.size)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "data"
        write_images(data, args.samples)
        for workload, preparing in (("samples", processor), ("transport", PreparedOnce(processor))):
            for engine, busy_s in (("idle", 0.0), ("busy", args.busy_ms / 1e3)):
                for settings, files, handoffs in chosen:
                    measured = delivery_rate(data, preparing, workers, busy_s, files, handoffs)
                    rows.append({"workload": workload, "engine": engine, "settings": settings, **measured})
                    print(f"{workload:9} {engine:5} {settings:13} {measured['samples_per_s']:8.1f} samples/s")
    result = {
        "size": args.size,
        "workers": workers,
        "cpu_count": os.cpu_count(),
        "busy_ms": args.busy_ms,
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(args.json, result)


if __name__ == "__main__":
    main()
