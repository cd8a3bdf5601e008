"""The encoder and prefix caches through whole jobs: duplicates encoded once, outputs unchanged."""

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.config import job_config_from_dict
from batchvl.pipeline.runner import run_job
from tests.conftest import random_image

UNIQUE_IMAGES = 3
COPIES = 3  # each image appears this often, spread over samples and both shards


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(60 + 10 * seed, 90 - 10 * seed, seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def duplicated_input(tmp_path_factory):
    data = tmp_path_factory.mktemp("dup")
    images = [png(seed) for seed in range(UNIQUE_IMAGES)] * COPIES
    half = len(images) // 2
    for shard, part in (("a", images[:half]), ("b", images[half:])):
        keys = [f"{shard}{i}" for i in range(len(part))]
        pq.write_table(pa.table({"key": keys, "image": part}), data / f"{shard}.parquet")
    return data


def job(tmp_path, model_path, data, **engine):
    return job_config_from_dict(
        {
            "model": {"path": str(model_path), "dtype": "float32"},
            "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
            "prompts": [
                {"name": "caption", "text": "Describe this image."},
                {"name": "colors", "text": "Which colors do you see?"},
            ],
            "sampling": {"max_new_tokens": 6},
            "engine": {"max_num_batched_tokens": 64, "kv_cache_mb": 8, "block_size": 4, **engine},
            "preprocess": {"workers": 1},
            "output": {"dir": str(tmp_path / "out")},
        },
        tmp_path,
    )


def texts(out_dir):
    rows = []
    for name in ("a.parquet", "b.parquet"):
        rows += pq.read_table(os.path.join(out_dir, name)).to_pylist()
    assert all(r["status"] == "ok" for r in rows)
    return {(r["key"], r["prompt"]): r["text"] for r in rows}


def test_duplicate_images_are_encoded_once_and_caches_do_not_change_outputs(
    tmp_path, loaded_fp32, duplicated_input
):
    cached = job(tmp_path / "cached", loaded_fp32.path, duplicated_input)
    stats = run_job(cached, loaded=loaded_fp32, show_progress=False).stats
    num_requests = 2 * UNIQUE_IMAGES * COPIES
    assert stats["images_encoded"] == UNIQUE_IMAGES
    assert stats["prefix_cache_hit_tokens"] > 0

    uncached = job(
        tmp_path / "uncached", loaded_fp32.path, duplicated_input, encoder_cache_mb=0, prefix_caching=False
    )
    bare = run_job(uncached, loaded=loaded_fp32, show_progress=False).stats
    assert bare["prefix_cache_hit_tokens"] == 0
    assert bare["images_encoded"] > UNIQUE_IMAGES  # nothing kept once no request holds it
    assert (
        bare["prefill_tokens_computed"] == stats["prefill_tokens_computed"] + stats["prefix_cache_hit_tokens"]
    )
    results = texts(cached.output.dir)
    assert len(results) == num_requests
    assert results == texts(uncached.output.dir)
