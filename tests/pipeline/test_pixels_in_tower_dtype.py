"""A bfloat16 job's pixels are cast to bfloat16 by the preprocessing workers and cross shared memory that
way: the engine stages bfloat16 tensors, and the rows equal those of the same job whose workers send
float32 pixels for the engine to cast (the tower takes the same values either way)."""

import pytest
import torch

import batchvl.engine.model_runner as model_runner
import batchvl.pipeline.launch as launch
from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from tests.conftest import caption_job_yaml, output_rows, write_image_shards

SHARD_SIZES = [3]


def staged_dtypes(monkeypatch) -> list:
    """The dtype of every item the engine stages for a vision call, as the job runs."""
    dtypes = []
    stage = model_runner.stage_pixels

    def recording(items, *args):
        dtypes.extend(torch.as_tensor(item).dtype for item in items)
        return stage(items, *args)

    monkeypatch.setattr(model_runner, "stage_pixels", recording)
    return dtypes


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


def test_workers_send_bfloat16_pixels_and_the_rows_are_the_same(job_dir, monkeypatch):
    dtypes = staged_dtypes(monkeypatch)
    cast_in_workers = rows_of(job_dir, "out-workers")
    assert dtypes and set(dtypes) == {torch.bfloat16}
    dtypes.clear()
    with monkeypatch.context() as uncast:
        uncast.setattr(launch, "PixelsInDtype", lambda prepare, dtype: prepare)
        cast_in_engine = rows_of(job_dir, "out-engine")
    assert dtypes and set(dtypes) == {torch.float32}
    assert [row["status"] for row in cast_in_workers] == ["ok"] * sum(SHARD_SIZES)
    assert cast_in_workers == cast_in_engine
