"""The encoder disk cache through whole jobs: a second run over the same images runs the vision tower on
none of them and writes the same rows, a damaged entry is encoded again, two runs started together
share the folder, and a folder an earlier version filled is read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchvl.config import job_config_from_dict
from batchvl.engine.encoder_cache.disk_layout import MARKER, MARKER_TEXT
from batchvl.pipeline.runner import run_job
from tests.conftest import TEST_DEVICE, output_rows, two_prompt_job_yaml, write_image_shards

SHARD_SIZES = [3, 2]
NUM_IMAGES = sum(SHARD_SIZES)  # all distinct


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("disk-cache-input") / "data"
    write_image_shards(folder, SHARD_SIZES)
    return folder


@pytest.fixture
def vision_calls(loaded_fp32, monkeypatch) -> list[int]:
    """The number of images in each call of the vision tower."""
    calls = []
    encode = loaded_fp32.adapter.encode

    def counted(kind, pixel_values, grid_thw):
        calls.append(len(grid_thw))
        return encode(kind, pixel_values, grid_thw)

    monkeypatch.setattr(loaded_fp32.adapter, "encode", counted)
    return calls


def run(loaded, images: Path, out: Path, cache: Path | None) -> dict:
    cfg = job_config_from_dict(
        {
            "model": {"path": str(loaded.path), "dtype": "float32", "device": TEST_DEVICE},
            "input": {"paths": [str(images / "*.parquet")], "key_column": "key"},
            "prompts": [
                {"name": "caption", "text": "Describe this image."},
                {"name": "kind", "text": "Photo or drawing?", "choices": ["photo", "drawing"]},
            ],
            "sampling": {"max_new_tokens": 6, "logprobs": True},
            "engine": {"kv_cache_mb": 8, "block_size": 4, "encoder_cache_dir": str(cache) if cache else None},
            "preprocess": {"workers": 0},
            "output": {"dir": str(out)},
        },
        out.parent,
    )
    return run_job(cfg, loaded=loaded, show_progress=False).stats


def entries(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.emb"))


def test_a_second_run_reads_every_image_from_the_folder_and_writes_the_same_rows(
    tmp_path, loaded_fp32, images, vision_calls
):
    cache = tmp_path / "cache"
    run(loaded_fp32, images, tmp_path / "bare", None)
    bare = output_rows(tmp_path / "bare", len(SHARD_SIZES))
    assert sum(vision_calls) == NUM_IMAGES and not cache.exists()

    vision_calls.clear()
    first = run(loaded_fp32, images, tmp_path / "first", cache)
    assert sum(vision_calls) == NUM_IMAGES
    assert (first["encoder_disk_writes"], first["encoder_disk_hits"]) == (NUM_IMAGES, 0)
    assert len(entries(cache)) == NUM_IMAGES

    vision_calls.clear()
    second = run(loaded_fp32, images, tmp_path / "second", cache)
    assert vision_calls == []  # the vision tower ran on no image
    assert second["images_encoded"] == 0 and second["encode_s"] == 0
    assert (second["encoder_disk_hits"], second["encoder_disk_writes"]) == (NUM_IMAGES, 0)
    assert output_rows(tmp_path / "first", len(SHARD_SIZES)) == bare
    assert output_rows(tmp_path / "second", len(SHARD_SIZES)) == bare  # every column but latency


def test_a_corrupt_and_a_truncated_entry_are_encoded_again(tmp_path, loaded_fp32, images, vision_calls):
    cache = tmp_path / "cache"
    run(loaded_fp32, images, tmp_path / "first", cache)
    corrupt, truncated = entries(cache)[:2]
    data = corrupt.read_bytes()
    corrupt.write_bytes(data[:-100] + bytes([data[-100] ^ 0x40]) + data[-99:])  # one payload bit
    truncated.write_bytes(truncated.read_bytes()[:-1000])

    vision_calls.clear()
    again = run(loaded_fp32, images, tmp_path / "again", cache)
    assert sum(vision_calls) == 2  # only the two damaged images
    assert (again["encoder_disk_hits"], again["encoder_disk_writes"]) == (NUM_IMAGES - 2, 2)
    assert output_rows(tmp_path / "again", len(SHARD_SIZES)) == output_rows(
        tmp_path / "first", len(SHARD_SIZES)
    )
    assert corrupt.read_bytes() == data  # written whole again


def test_a_folder_an_earlier_version_filled_is_adopted_and_read(tmp_path, loaded_fp32, images, vision_calls):
    """Before the marker, the folder held entries and digests remembered without a check: a run marks it,
    computes the digest again (the same) and reads every entry."""
    cache = tmp_path / "cache"
    run(loaded_fp32, images, tmp_path / "first", cache)
    os.remove(cache / MARKER)
    for remembered in (cache / "digests").iterdir():
        remembered.write_text(remembered.read_text()[:32])

    vision_calls.clear()
    again = run(loaded_fp32, images, tmp_path / "again", cache)
    assert vision_calls == [] and again["encoder_disk_hits"] == NUM_IMAGES
    assert (cache / MARKER).read_text() == MARKER_TEXT


def test_two_runs_started_together_share_the_folder(tmp_path, tiny_model_dir, images):
    """Two `batchvl run` processes over the same images, one cache folder: both end with every row, the
    same rows, and every image either encoded or read whole from the folder."""
    cache = tmp_path / "cache"
    engine = f"{{kv_cache_mb: 8, block_size: 4, encoder_cache_dir: {cache}}}"
    processes = []
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "data").symlink_to(images)
        (folder / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, engine))
        command = [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress"]
        env = {**os.environ, "BATCHVL_DEBUG": "1"}
        processes.append(subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert all("encoder disk cache:" in output for output in outputs)  # the summary says it
    rows = [output_rows(tmp_path / name / "out", len(SHARD_SIZES)) for name in ("one", "two")]
    assert rows[0] == rows[1] and all(row["status"] == "ok" for row in rows[0])
    for name in ("one", "two"):
        (stats_file,) = (tmp_path / name / "out" / "_batchvl" / "stats").glob("run-*.json")
        stats = json.loads(stats_file.read_text())
        assert stats["encoder_disk_hits"] + stats["images_encoded"] == NUM_IMAGES
    assert len(entries(cache)) == NUM_IMAGES


def test_turning_the_folder_on_over_committed_shards_is_no_change_of_config(tmp_path, loaded_fp32, images):
    run(loaded_fp32, images, tmp_path / "out", None)
    again = run(loaded_fp32, images, tmp_path / "out", tmp_path / "cache")  # not refused as another config
    assert again["shards_skipped"] == len(SHARD_SIZES) and again["shards_committed"] == 0
