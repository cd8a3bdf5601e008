"""Vision encode throughput (patches/s) on mixed-size images: batchvl's grouped encoder vs stock transformers.

Same model, same preprocessed images (sizes from ~64 to ~800 px with a long tail, the model
processor's own pixel limits), three ways:
- `per_image`: transformers as shipped (SDPA), one `get_image_features` call per image;
- `stock_packed`: transformers as shipped, all images in one call (its attention loops over images);
- `batchvl`: images sorted by patch count into calls of at most `max_patches_per_encode` patches, the
  vision attention batching runs of equal-size neighbours, in bf16 as blocked bf16 matmuls (what the
  engine does).

The process uses the job loop's heap policy (`keep_freed_memory`), as a `batchvl run` does; it applies to
all three ways alike.

    python benchmarks/encode.py --json benchmarks/results/encode.json [--images 48] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from workloads import mixed_size_images, write_json


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: kernel selection and allocator pools
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from batchvl.utils.memory import keep_freed_memory

    keep_freed_memory()
    results = [measure(dtype, args.images, args.repeats) for dtype in args.dtypes.split(",")]
    write_json(args.json, {"images": args.images, "results": results})


def measure(dtype_name: str, count: int, repeats: int) -> dict:
    from transformers import AutoModelForImageTextToText

    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.engine.model_runner import encode_batches
    from batchvl.models.loader import load_model
    from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "small", size="small")
        loaded = load_model(str(path), dtype=dtype_name, device="cpu")
        dtype = loaded.adapter.dtype
        stock = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    prepared = [prepare_image(image, spec) for image in mixed_size_images(count)]
    patches = sum(p.num_patches for p in prepared)

    def per_image():
        with torch.inference_mode():
            for p in prepared:
                stock.model.get_image_features(torch.from_numpy(p.pixel_values), torch.tensor([p.grid_thw]))

    def stock_packed():
        with torch.inference_mode():
            pixel_values = torch.cat([torch.from_numpy(p.pixel_values) for p in prepared])
            stock.model.get_image_features(pixel_values, torch.tensor([p.grid_thw for p in prepared]))

    def batchvl(max_patches: int):
        def run():
            for batch in encode_batches(prepared, max_patches):
                pixel_values = torch.from_numpy(np.concatenate([p.pixel_values for p in batch]))
                loaded.adapter.encode("image", pixel_values, torch.tensor([p.grid_thw for p in batch]))

        return run

    runs = {"per_image": per_image, "stock_packed": stock_packed}
    for cap in (1024, 4096, 16384):
        runs[f"batchvl (max {cap} patches/call)"] = batchvl(cap)
    rows = []
    for name, fn in runs.items():
        seconds = timed(fn, repeats)
        rows.append({"method": name, "seconds": round(seconds, 3), "patches_per_s": round(patches / seconds)})
    base = rows[0]["patches_per_s"]
    print(f"{count} images, {patches} patches, {dtype}, {torch.get_num_threads()} threads")
    print("| method | seconds | patches/s | vs per_image |")
    print("|---|---|---|---|")
    for row in rows:
        row["speedup_vs_per_image"] = round(row["patches_per_s"] / base, 2)
        cells = [row["method"], row["seconds"], row["patches_per_s"], f"x{row['speedup_vs_per_image']}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    return {"dtype": dtype_name, "patches": patches, "threads": torch.get_num_threads(), "rows": rows}


if __name__ == "__main__":
    main()
