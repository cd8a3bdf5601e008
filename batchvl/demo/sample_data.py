"""A small demo dataset of real photos, with no download: scikit-image ships sample images in its wheel.

Images are re-encoded at varied sizes and modes (RGB, grayscale, palette, RGBA); one is repeated (to show
the encoder cache) and one row holds bytes that are not an image (to show an error row).
"""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from batchvl.errors import UserError

# (file in skimage/data, longest side in pixels, format)
SAMPLES = [
    ("astronaut.png", 512, "PNG"),
    ("chelsea.png", 300, "JPEG"),
    ("coffee.png", 400, "JPEG"),
    ("rocket.jpg", 220, "JPEG"),
    ("horse.png", 160, "PNG"),
    ("camera.png", 256, "PNG"),
    ("hubble_deep_field.jpg", 640, "JPEG"),
    ("motorcycle_left.png", 350, "JPEG"),
    ("page.png", 380, "PNG"),
    ("logo.png", 200, "PNG"),
    ("retina.jpg", 280, "JPEG"),
    ("chelsea.png", 300, "JPEG"),  # a duplicate of an earlier row: encoded once
]


def _skimage_data_dir() -> Path:
    try:
        import skimage.data
    except ImportError:
        raise UserError("the sample data needs scikit-image: pip install 'batchvl[demo]'") from None
    return Path(skimage.data.__file__).parent


def _encode(path: Path, longest: int, fmt: str) -> bytes:
    image = Image.open(path)
    image.thumbnail((longest, longest))
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_sample_data(out_dir: str | Path, num_shards: int = 2) -> list[Path]:
    data_dir = _skimage_data_dir()
    rows = [
        {"key": f"{i:03d}-{Path(name).stem}", "image": _encode(data_dir / name, longest, fmt), "source": name}
        for i, (name, longest, fmt) in enumerate(SAMPLES)
    ]
    rows.append({"key": f"{len(rows):03d}-not-an-image", "image": b"this is not an image", "source": "none"})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        part = rows[shard::num_shards]
        path = out / f"part-{shard:03d}.parquet"
        pq.write_table(pa.Table.from_pylist(part), path)
        paths.append(path)
    return paths
