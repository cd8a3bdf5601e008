"""A job's preprocessing workers send 8-bit pixels, and the vision call normalizes them where the tower is:
the engine stages uint8 items, and the rows equal those of the same job whose workers send the tower's
input itself, normalized by the image processors' arithmetic (numpy, float32, as the workers made it
before)."""

import dataclasses

import numpy as np
import pytest
import torch

import batchvl.engine.model_runner as model_runner
import batchvl.preprocess.qwen_vision as qwen_vision
from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from tests.conftest import caption_job_yaml, output_rows, write_image_shards

SHARD_SIZES = [3]


def staged(monkeypatch) -> tuple[list, list]:
    """The dtype of every item the engine stages for a vision call as the job runs, and the tower's input
    made of each (its bytes)."""
    dtypes, inputs = [], []
    stage = model_runner.stage_pixels

    def recording(items, *args):
        dtypes.extend(torch.as_tensor(item.pixel_values).dtype for item in items)
        stacked = stage(items, *args)
        offset = 0
        for item in items:
            inputs.append(stacked[offset : offset + len(item.pixel_values)].float().numpy().tobytes())
            offset += len(item.pixel_values)
        return stacked

    monkeypatch.setattr(model_runner, "stage_pixels", recording)
    return dtypes, inputs


def normalized_in_the_worker(image, spec):
    """`prepare_image`'s media with the tower's input itself: the frame normalized by numpy in float32 and
    repeated into the temporal patch, no normalization left to the vision call."""
    media = prepare_image(image, spec)
    norm = media.normalization
    rows = media.pixel_values.reshape(len(media.pixel_values), 3, 1, -1).astype(np.float32)
    rows = rows * np.float32(norm.rescale_factor)
    rows -= np.asarray(norm.image_mean, dtype=np.float32).reshape(1, 3, 1, 1)
    rows /= np.asarray(norm.image_std, dtype=np.float32).reshape(1, 3, 1, 1)
    rows = np.broadcast_to(rows, (len(rows), 3, norm.repeat, rows.shape[-1])).reshape(len(rows), -1)
    return dataclasses.replace(media, pixel_values=np.ascontiguousarray(rows), normalization=None)


prepare_image = qwen_vision.prepare_image


def rows_of(tmp_path, out: str) -> list[dict]:
    config = load_job_config(
        tmp_path / "job.yaml",
        [f"output.dir={tmp_path / out}", "model.dtype=bfloat16", "preprocess.workers=1"],
    )
    run_job(config, show_progress=False)
    return output_rows(tmp_path / out, len(SHARD_SIZES))


@pytest.fixture
def job_dir(tmp_path, tiny_model_dir):
    write_image_shards(tmp_path / "data", SHARD_SIZES)
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    return tmp_path


def test_workers_send_8_bit_pixels_and_the_rows_are_those_of_pixels_normalized_in_the_workers(
    job_dir, monkeypatch
):
    dtypes, inputs = staged(monkeypatch)
    normalized_in_the_call = rows_of(job_dir, "out-call")
    assert dtypes and set(dtypes) == {torch.uint8}
    tower_inputs = sorted(inputs)
    dtypes.clear()
    inputs.clear()
    with monkeypatch.context() as workers_normalize:
        workers_normalize.setattr(qwen_vision, "prepare_image", normalized_in_the_worker)
        normalized_in_the_workers = rows_of(job_dir, "out-workers")
    assert dtypes and set(dtypes) == {torch.float32}
    assert tower_inputs == sorted(inputs)  # the same bfloat16 values for the tower, bit for bit
    assert [row["status"] for row in normalized_in_the_call] == ["ok"] * sum(SHARD_SIZES)
    assert normalized_in_the_call == normalized_in_the_workers
