"""Synthetic workloads shared by the benchmarks (random pixels: no download, same on every machine), the
table they print, and the JSON report they write."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

# The captioning workload's images on a GPU (`gpu_throughput.py`, and `vision_call.py`'s calls of its mix):
# 448x448, 1,024 patches (256 image tokens) at Qwen2-VL's sizes, and every fifth 896x672, 3,072 patches
BASE_SIDE, LARGE = 448, (896, 672)
LARGE_EVERY = 5


def caption_image_size(index: int) -> tuple[int, int]:
    """(width, height) of the captioning workload's image `index`."""
    return LARGE if index % LARGE_EVERY == LARGE_EVERY - 1 else (BASE_SIDE, BASE_SIDE)


def mixed_size_images(count: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        side = float(np.clip(rng.lognormal(np.log(220), 0.6), 64, 800))  # long tail of large images
        aspect = rng.uniform(0.5, 2.0)
        height, width = int(side), int(np.clip(side * aspect, 64, 1200))
        images.append(Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)))
    return images


def tiny_model(device: str, family: str = "qwen2_vl", size: str = "tiny"):
    """The family's `tiny` random-weight model (or another of the builder's sizes), built in a temporary
    folder and loaded in fp32 on `device`: the engine benchmarks that measure its host work rather than its
    matmuls."""
    import tempfile
    from pathlib import Path

    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.models.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / size, family=family, size=size)
        return load_model(str(folder), dtype="float32", device=device)


def sized_model(size: str, device: str, family: str = "qwen2_vl"):
    """The family's `tiny_model` (`deep`: its widths at Qwen2-VL-2B's depth), or at `2b` or `7b` Qwen2-VL-2B
    or -7B made on `device` in bf16 (no checkpoint)."""
    if size in ("tiny", "deep"):
        return tiny_model(device, family, size)
    if family != "qwen2_vl":
        raise SystemExit(f"--size {size} is Qwen2-VL's; another family runs at --size tiny")
    import tempfile
    from pathlib import Path

    from batchvl.demo.device_model import build_on_device

    with tempfile.TemporaryDirectory() as tmp:  # the processor is read from it before it goes
        return build_on_device(Path(tmp) / size, size, device)


def markdown_table(rows: list[dict]) -> str:
    """Rows of equal keys as a Markdown table, the keys as its header."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, report) -> None:
    """The benchmark's report as indented JSON at `path` (its folder made), where a path is given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
