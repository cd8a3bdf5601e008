"""How many preprocessing workers a run starts: by default half the cores it may use (a Slurm task's or a
container's share, not the machine's), and a count set above those cores is warned of, once, as the run
starts."""

import logging

import pytest

import batchvl.preprocess.pool as pool
from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from tests.conftest import caption_job_yaml, write_image_shards


@pytest.mark.parametrize("usable,workers", [(1, 1), (2, 1), (5, 2), (16, 8), (64, 8)])
def test_the_default_is_half_the_cores_this_process_may_use(monkeypatch, usable, workers):
    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: set(range(usable)))
    monkeypatch.setattr(pool.os, "cpu_count", lambda: 128)  # the machine's: not the run's
    assert pool.default_workers() == workers


def test_more_workers_than_usable_cores_are_warned_of_in_one_line_with_the_fix(caplog):
    with caplog.at_level(logging.WARNING, logger=pool.__name__):
        assert not pool.warn_if_oversubscribed(2, cores=2)
        assert pool.warn_if_oversubscribed(3, cores=2)
    (record,) = caplog.records
    assert record.getMessage() == (
        "preprocess.workers is 3, more than the 2 CPU core(s) this run may use: the workers share them with "
        "each other and the engine; set preprocess.workers to 2 or fewer (or leave it unset: half the cores)"
    )


@pytest.mark.parametrize("setting,warned", [("preprocess.workers=2", True), ("preprocess.workers=1", False)])
def test_a_run_warns_of_a_count_set_above_its_cores(
    tmp_path, tiny_model_dir, monkeypatch, caplog, setting, warned
):
    write_image_shards(tmp_path / "data", [2])
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    job = load_job_config(tmp_path / "job.yaml", [f"output.dir={tmp_path / 'out'}", setting])
    monkeypatch.setattr(pool, "usable_cores", lambda: 1)
    with caplog.at_level(logging.WARNING, logger=pool.__name__):
        run_job(job, show_progress=False)
    assert any("more than the 1 CPU core(s)" in r.getMessage() for r in caplog.records) is warned
