"""The preprocessing workers start before the engine is built, so that the first samples are prepared while
it is (`pipeline/engine_setup.py`), but are all forked before the engine's start launches a subprocess; an
engine that cannot be built still stops them and lets go of the shards they claimed."""

import multiprocessing
import signal
import threading
import time

import pytest
import torch.utils.data

import batchvl.pipeline.launch as launch
import batchvl.pipeline.runner as runner
from batchvl.config import load_job_config
from batchvl.errors import StoppedBySignal, UserError
from batchvl.models.loader import ModelParts
from batchvl.pipeline.runner import run_job
from batchvl.utils.background import BackgroundIterator
from tests.conftest import caption_job_yaml, output_rows, write_image_shards

SHARD_SIZES = [2, 2]
FIRST_SAMPLE_WAIT_S = 60.0
FORKS_DELAY_S, BUILD_DELAY_S = 0.6, 1.5  # apart enough that one counted as the other fails


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    write_image_shards(tmp_path / "data", SHARD_SIZES)
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    return load_job_config(tmp_path / "job.yaml", [f"output.dir={tmp_path / 'out'}", "preprocess.workers=2"])


def first_item_arrives(monkeypatch) -> threading.Event:
    """Set once the job process receives its first prepared item from the workers."""
    arrived = threading.Event()
    put = BackgroundIterator._put

    def recording(self, item):
        arrived.set()
        return put(self, item)

    monkeypatch.setattr(BackgroundIterator, "_put", recording)
    return arrived


def fork_late(monkeypatch, seconds: float) -> None:
    """The pool's workers forked `seconds` late (their loader's iteration starts that late)."""
    iterate = torch.utils.data.DataLoader.__iter__

    def late(self):
        time.sleep(seconds)
        return iterate(self)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", late)


def test_the_first_samples_are_prepared_while_the_engine_is_built(job, monkeypatch, tmp_path):
    arrived = first_item_arrives(monkeypatch)
    build = launch.build_engine
    seen_before_build = []

    def waiting_build(*args, **kwargs):
        # workers started after the engine would prepare nothing in this wait
        seen_before_build.append(arrived.wait(FIRST_SAMPLE_WAIT_S))
        return build(*args, **kwargs)

    monkeypatch.setattr(launch, "build_engine", waiting_build)
    summary = run_job(job, show_progress=False)
    assert seen_before_build == [True]
    assert [row["status"] for row in output_rows(tmp_path / "out", len(SHARD_SIZES))] == ["ok"] * 4
    # processing counts from the engine's start: the wait above is not in it
    assert summary.stats["processing_s"] < summary.stats["wall_s"]


def test_the_workers_prepare_the_first_samples_while_the_weights_load(job, monkeypatch, tmp_path):
    """The workers need the model's parts alone (its processor, config and dtype): they are forked before
    the weights load, from a process without them, and deliver while they load."""
    arrived = first_item_arrives(monkeypatch)
    load, seen_before_load, parts_given = launch.load_model, [], []

    def slow_load(*args):
        seen_before_load.append(arrived.wait(FIRST_SAMPLE_WAIT_S))
        parts_given.append(args[-1])
        time.sleep(BUILD_DELAY_S)
        return load(*args)

    monkeypatch.setattr(launch, "load_model", slow_load)
    stats = run_job(job, show_progress=False).stats
    assert seen_before_load == [True]
    assert [row["status"] for row in output_rows(tmp_path / "out", len(SHARD_SIZES))] == ["ok"] * 4
    assert isinstance(parts_given[0], ModelParts)  # the processor read once, not again with the weights
    # the weights' load is the model's, neither the engine's build nor processing
    assert stats["model_load_s"] >= BUILD_DELAY_S > stats["engine_start_s"]


def test_a_stop_while_the_weights_load_ends_the_run_with_nothing_lost(job, monkeypatch, tmp_path):
    """The workers run while the weights load: a stop then ends the run once the engine is up, its claims
    released and its workers gone, and the rerun does every sample."""
    runner_ = runner.JobRunner(job, show_progress=False)
    load = launch.load_model

    def stopped_load(*args):
        runner_.stop.signum = signal.SIGTERM  # as the signal handler records it
        return load(*args)

    monkeypatch.setattr(launch, "load_model", stopped_load)
    with pytest.raises(StoppedBySignal):
        runner_.run()
    assert multiprocessing.active_children() == []
    out = tmp_path / "out"
    assert not list(out.rglob("*.lock"))
    monkeypatch.setattr(launch, "load_model", load)
    run_job(job, show_progress=False)
    assert [row["status"] for row in output_rows(out, len(SHARD_SIZES))] == ["ok"] * 4


def test_the_stats_give_the_workers_and_the_engines_start_apart_from_processing(job, monkeypatch):
    build = launch.build_engine

    def slow_build(*args, **kwargs):
        time.sleep(BUILD_DELAY_S)
        return build(*args, **kwargs)

    fork_late(monkeypatch, FORKS_DELAY_S)
    monkeypatch.setattr(launch, "build_engine", slow_build)
    started = time.perf_counter()
    stats = run_job(job, show_progress=False).stats
    wall = time.perf_counter() - started
    assert FORKS_DELAY_S <= stats["workers_start_s"] < FORKS_DELAY_S + BUILD_DELAY_S
    assert BUILD_DELAY_S <= stats["engine_start_s"] < BUILD_DELAY_S + FORKS_DELAY_S
    starts = stats["workers_start_s"] + stats["engine_start_s"]
    assert stats["processing_s"] + starts <= stats["wall_s"] <= wall


def test_an_engine_that_cannot_be_built_stops_the_workers_and_releases_their_claims(
    job, monkeypatch, tmp_path
):
    arrived = first_item_arrives(monkeypatch)

    def failing_build(*args, **kwargs):
        assert arrived.wait(FIRST_SAMPLE_WAIT_S)  # the workers are running, and have claimed a shard
        raise UserError("engine.kv_cache_mb is auto, but cpu leaves 0 MiB for the KV cache")

    monkeypatch.setattr(launch, "build_engine", failing_build)
    with pytest.raises(UserError, match="leaves 0 MiB"):
        run_job(job, show_progress=False)
    assert multiprocessing.active_children() == []
    out = tmp_path / "out"
    assert not list(out.rglob("*.lock")) and not list(out.glob("*.parquet"))


def test_the_engine_starts_once_every_worker_is_forked(job, monkeypatch):
    """A worker forked while the engine's start launches a subprocess (a server, a kernel compiler) would
    hold the pipe through which that subprocess reports its exec, and the start would wait on it forever:
    the engine starts only once the workers are forked, however late the input thread forks them."""
    fork_late(monkeypatch, 1.0)
    forks, start = [], multiprocessing.process.BaseProcess.start
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda p: forks.append(p) or start(p))
    load, forks_at_start = runner.load_job_model, []

    def counting_load(*args, **kwargs):  # the engine's start begins by loading the model
        forks_at_start.append(len(forks))
        return load(*args, **kwargs)

    monkeypatch.setattr(runner, "load_job_model", counting_load)
    run_job(job, show_progress=False)
    # both workers (preprocess.workers=2), counted as forked (a worker whose samples are done may have left)
    assert forks_at_start == [2]
