"""Bad input is data: each kind of broken sample becomes an error row while every other sample completes."""

import io
import json
import os
import struct
import tarfile
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from batchvl.config import job_config_from_dict
from batchvl.pipeline.runner import run_job
from tests.conftest import random_image, video_bytes


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def animated_gif() -> tuple[bytes, bytes]:
    frames = [random_image(40, 50, seed).convert("P") for seed in (1, 2, 3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue(), encode(frames[0], "PNG")


def exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 8  # rotate 90 degrees counter-clockwise to display
    return encode(random_image(40, 90, 4), "JPEG", exif=exif)


def palette_with_transparency() -> bytes:
    image = random_image(32, 48, 5).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    return encode(image, "PNG", transparency=0)


def sixteen_bit_png() -> bytes:
    return encode(Image.fromarray(np.linspace(0, 65535, 40 * 60).reshape(40, 60).astype(np.uint16)), "PNG")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixel data is absent): opening it reads the header
    only, so a 20000x20000 image costs nothing to make."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


GOOD_JPEG = encode(random_image(60, 80, 0), "JPEG")
GOOD_PNG = encode(random_image(50, 70, 1), "PNG")
GIF, GIF_FIRST_FRAME = animated_gif()
LONG_QUESTION = " ".join(f"word{i}" for i in range(40_000))

# (key, image bytes, question, expected status or error type of the "ask" prompt, of the "caption" prompt)
MATRIX = [
    ("good-jpeg", GOOD_JPEG, "what?", "ok", "ok"),
    ("zero-bytes", b"", "what?", "empty_image", "empty_image"),
    ("random-bytes", os.urandom(3000), "what?", "image_decode_error", "image_decode_error"),
    ("truncated-jpeg", GOOD_JPEG[: len(GOOD_JPEG) // 2], "what?", "image_decode_error", "image_decode_error"),
    ("truncated-png", GOOD_PNG[: len(GOOD_PNG) // 2], "what?", "image_decode_error", "image_decode_error"),
    ("bomb", encode(Image.new("L", (3000, 3000)), "PNG"), "what?", "image_too_large", "image_too_large"),
    # Past twice the limit Pillow's own guard fires inside Image.open: still too large, not undecodable.
    ("huge-png", png_header_only(20000, 20000), "what?", "image_too_large", "image_too_large"),
    ("one-pixel", encode(random_image(1, 1, 2), "PNG"), "what?", "ok", "ok"),
    (
        "aspect-1x2000",
        encode(random_image(1, 2000, 3), "PNG"),
        "what?",
        "extreme_aspect_ratio",
        "extreme_aspect_ratio",
    ),
    ("cmyk-jpeg", encode(random_image(50, 40, 6).convert("CMYK"), "JPEG"), "what?", "ok", "ok"),
    ("sixteen-bit-png", sixteen_bit_png(), "what?", "ok", "ok"),
    ("palette-transparency", palette_with_transparency(), "what?", "ok", "ok"),
    ("animated-gif", GIF, "what?", "ok", "ok"),
    ("gif-first-frame", GIF_FIRST_FRAME, "what?", "ok", "ok"),
    ("exif-rotated", exif_rotated_jpeg(), "what?", "ok", "ok"),
    ("no-question", GOOD_PNG, None, "missing_field", "ok"),
    ("prompt-too-long", GOOD_PNG, LONG_QUESTION, "context_too_long", "ok"),
    ("good-png", GOOD_PNG, "what?", "ok", "ok"),
]


def job(tmp_path, model_path, paths, fmt="parquet", **input_keys):
    return job_config_from_dict(
        {
            "model": {"path": str(model_path), "dtype": "float32"},
            "input": {
                "paths": paths,
                "format": fmt,
                "key_column": "key" if fmt == "parquet" else None,
                **input_keys,
            },
            "prompts": [
                {"name": "caption", "text": "Describe this image."},
                {"name": "ask", "text": "{question}"},
            ],
            "sampling": {"max_new_tokens": 4},
            "engine": {"max_num_batched_tokens": 256, "kv_cache_mb": 8},
            "preprocess": {"max_image_pixels": 4_000_000, "workers": 1},
            "output": {"dir": str(tmp_path / "out")},
        },
        tmp_path,
    )


def rows_by_key(out_dir, name):
    table = pq.read_table(os.path.join(out_dir, name)).to_pylist()
    return {(r["key"], r["prompt"]): r for r in table}


def test_every_bad_image_is_an_error_row_and_the_rest_complete(tmp_path, loaded_fp32):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(
        pa.table(
            {
                "key": [m[0] for m in MATRIX],
                "image": [m[1] for m in MATRIX],
                "question": [m[2] for m in MATRIX],
            }
        ),
        data / "matrix.parquet",
    )
    cfg = job(tmp_path, loaded_fp32.path, [str(data / "*.parquet")])
    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_by_key(cfg.output.dir, "matrix.parquet")
    assert len(rows) == 2 * len(MATRIX)
    for key, _, _, ask, caption in MATRIX:
        for prompt, expected in (("ask", ask), ("caption", caption)):
            row = rows[(key, prompt)]
            got = row["status"] if row["status"] == "ok" else row["error_type"]
            assert got == expected, (key, prompt, row["error_message"])
            if row["status"] == "ok":
                assert row["text"] is not None and row["num_output_tokens"] > 0
            else:
                assert row["text"] is None and row["error_message"]
    # animated GIF: its first frame, so the same output as that frame on its own
    assert rows[("animated-gif", "caption")]["text"] == rows[("gif-first-frame", "caption")]["text"]
    assert "preprocess.max_image_pixels" in rows[("bomb", "caption")]["error_message"]
    assert "400000000 pixels, over preprocess.max_image_pixels" in rows[("huge-png", "ask")]["error_message"]
    assert "question" in rows[("no-question", "ask")]["error_message"]
    assert summary.stats["errors"] == sum((m[3] != "ok") + (m[4] != "ok") for m in MATRIX)


def test_bad_paths_and_truncated_tar_through_a_job(tmp_path, loaded_fp32):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(GOOD_PNG)
    (tmp_path / "secret.png").write_bytes(GOOD_PNG)
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    (root / "clip.mp4").write_bytes(os.urandom(2000))
    (root / "empty.jpg").write_bytes(b"")
    (root / "empty.mp4").write_bytes(b"")
    (root / "folder.png").mkdir()
    os.mkfifo(root / "pipe.png")  # opening it for reading would block forever
    (root / "good.mp4").write_bytes(video_bytes(12, 10))
    paths = [
        "ok.png",
        "good.mp4",
        "empty.jpg",
        "empty.mp4",
        "folder.png",
        "pipe.png",
        "missing.png",
        "../../etc/passwd",
        "/etc/passwd",
        "escape.png",
        "clip.mp4",
    ]
    pq.write_table(
        pa.table({"key": paths, "image": paths, "question": ["q"] * len(paths)}), root / "paths.parquet"
    )
    cfg = job(tmp_path, loaded_fp32.path, [str(root / "paths.parquet")])
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_by_key(cfg.output.dir, "paths.parquet")
    errors = {key: rows[(key, "caption")]["error_type"] for key in paths}
    assert errors == {
        "ok.png": None,
        "good.mp4": None,
        "empty.jpg": "empty_image",
        "empty.mp4": "empty_video",
        "folder.png": "not_a_file",
        "pipe.png": "not_a_file",
        "missing.png": "file_not_found",
        "../../etc/passwd": "path_outside_root",
        "/etc/passwd": "path_outside_root",
        "escape.png": "path_outside_root",
        "clip.mp4": "video_decode_error",
    }
    assert "a named pipe (FIFO), not a file" in rows[("pipe.png", "caption")]["error_message"]
    assert "a directory, not a file" in rows[("folder.png", "caption")]["error_message"]

    members = []
    for i in range(5):
        members += [
            (f"s{i}.png", GOOD_PNG if i % 2 else GOOD_JPEG),
            (f"s{i}.json", json.dumps({"question": "q"}).encode()),
        ]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    full = buffer.getvalue()
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "cut.tar").write_bytes(full[: int(len(full) * 0.6)])
    cfg = job(tmp_path, loaded_fp32.path, [str(tmp_path / "tars" / "*.tar")], fmt="webdataset")
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    table = pq.read_table(os.path.join(cfg.output.dir, "cut.parquet")).to_pylist()
    statuses = [(r["key"], r["prompt"], r["status"], r["error_type"]) for r in table]
    last = statuses[-1][0]
    assert all(s[2] == "ok" for s in statuses if s[0] != last)
    assert {s[3] for s in statuses if s[0] == last} == {"truncated_shard"}
    assert len(statuses) >= 4  # at least the first two samples were readable


def test_a_crashing_worker_costs_one_sample_in_a_job(tmp_path, loaded_fp32, monkeypatch):
    import batchvl.preprocess.qwen_vision as qwen_vision

    images = [encode(random_image(40 + i, 50, 10 + i), "PNG") for i in range(8)]
    real_decode = qwen_vision.decode_image

    def decode(data, path, limit):
        if data == images[5]:
            os._exit(9)  # the worker process dies, as in a native decoder crash
        return real_decode(data, path, limit)

    monkeypatch.setattr(qwen_vision, "decode_image", decode)  # inherited by the forked workers
    data = tmp_path / "data"
    data.mkdir()
    keys = [f"k{i}" for i in range(8)]
    pq.write_table(pa.table({"key": keys, "image": images, "question": ["q"] * 8}), data / "c.parquet")
    cfg = job(tmp_path, loaded_fp32.path, [str(data / "*.parquet")])
    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_by_key(cfg.output.dir, "c.parquet")
    assert len(rows) == 16
    failed = {key for (key, _), row in rows.items() if row["status"] != "ok"}
    assert failed == {"k5"} and rows[("k5", "caption")]["error_type"] == "preprocess_crash"
    assert summary.stats["worker_restarts"] == 1 and summary.stats["samples_crashed"] == 1


def test_a_damaged_parquet_row_group_costs_its_rows_only(tmp_path, loaded_fp32):
    """A page of the middle row group overwritten (the footer intact): its rows are error rows keyed by
    their index, the groups around it and the next file are captioned, and the job completes."""
    data = tmp_path / "data"
    data.mkdir()
    images = [encode(random_image(30, 40, seed), "PNG") for seed in range(6)]
    damaged = data / "a.parquet"
    pq.write_table(
        pa.table({"key": [f"a{i}" for i in range(6)], "image": images, "question": ["what?"] * 6}),
        damaged,
        row_group_size=2,
    )
    page = pq.ParquetFile(damaged).metadata.row_group(1).column(1).data_page_offset
    content = bytearray(damaged.read_bytes())
    content[page : page + 200] = b"\xab" * 200
    damaged.write_bytes(bytes(content))
    pq.write_table(pa.table({"key": ["b0"], "image": images[:1], "question": ["what?"]}), data / "b.parquet")
    cfg = job(tmp_path, loaded_fp32.path, [str(data / "*.parquet")])
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_by_key(cfg.output.dir, "a.parquet")
    statuses = {key: row["error_type"] or row["status"] for (key, _), row in rows.items()}
    assert statuses == {"a0": "ok", "a1": "ok", "2": "unreadable_rows", "3": "unreadable_rows"} | {
        "a4": "ok",
        "a5": "ok",
    }
    assert len(rows) == 12  # two prompts a row
    assert "row group 1 of" in rows[("2", "caption")]["error_message"]
    assert {row["status"] for row in rows_by_key(cfg.output.dir, "b.parquet").values()} == {"ok"}
