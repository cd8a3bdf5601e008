"""A stop loses at most the shards in flight: with the default look-ahead, the engine admits the oldest
open shard's requests first, so shards finish (and commit) in input order. The counts a stopped run
reports are the same figures a finished run's would be."""

import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.config import job_config_from_dict
from batchvl.errors import StoppedBySignal
from batchvl.pipeline.runner import JobRunner
from tests.conftest import png_bytes, random_image

NUM_SHARDS = 8
PROMPTS = [{"name": "caption", "text": "Describe this image."}, {"name": "short", "text": "One word."}]


def test_a_stop_halfway_has_committed_about_half_of_the_shards(tmp_path, tiny_model_dir, loaded_fp32):
    (tmp_path / "data").mkdir()
    for number in range(NUM_SHARDS):
        # A big and a small image per shard: cheapest-first alone would run every shard's small image
        # first and leave every shard open.
        images = [png_bytes(random_image(side, side, seed=number)) for side in (120, 28)]
        pq.write_table(pa.table({"image": images}), tmp_path / "data" / f"part-{number}.parquet")
    cfg = job_config_from_dict(
        {
            "model": {"path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            "input": {"paths": ["data/*.parquet"]},
            "prompts": PROMPTS,
            "sampling": {"max_new_tokens": 4, "ignore_eos": True},
            # Default look-ahead and sequence limit; a small step budget spreads admission over steps. One
            # engine: replicas each admit in shard order too, but hold a window each, so more shards are
            # in flight at a stop (those the bound below counts).
            "engine": {"max_num_batched_tokens": 96, "replicas": 1},
            "preprocess": {"workers": 0},
            "output": {"dir": "out"},
        },
        tmp_path,
    )
    runner = JobRunner(cfg, loaded_fp32, show_progress=False)
    total_requests = NUM_SHARDS * 2 * len(PROMPTS)
    step = runner._step

    def step_then_stop_halfway(*args):
        step(*args)
        if runner.stats.requests >= total_requests // 2:
            runner.stop.signum = signal.SIGTERM  # as the signal handler records it

    runner._step = step_then_stop_halfway
    with pytest.raises(StoppedBySignal) as stopped:
        runner.run()
    stats = stopped.value.summary.stats
    assert stats["shards_committed"] >= NUM_SHARDS // 2 - 1, stats
    rows_done = stats["requests"]
    assert stats["rows_not_committed"] == rows_done - 2 * len(PROMPTS) * stats["shards_committed"]
    assert stats["rows_not_committed"] <= 2 * len(PROMPTS) * 2  # the shards in flight, no more
    # A sample counts once all its rows are done: never more samples than finished rows allow.
    assert stats["samples"] <= rows_done // len(PROMPTS)
    assert stats["samples"] >= 2 * stats["shards_committed"]
    # The rate is that count over the processing time, as the progress bar shows it.
    assert stats["samples_per_s"] == pytest.approx(stats["samples"] / stats["processing_s"], rel=1e-2)


def test_a_stop_after_the_last_commit_ends_the_run_as_finished(tmp_path, tiny_model_dir, loaded_fp32):
    """A signal that arrives as the last step ends (a scheduler's SIGTERM at the end of a job) stops
    nothing: every shard is committed, and the run returns as a finished one instead of exiting 128+15."""
    (tmp_path / "data").mkdir()
    for number in range(2):
        images = [png_bytes(random_image(40, 40, seed=number))]
        pq.write_table(pa.table({"image": images}), tmp_path / "data" / f"part-{number}.parquet")
    cfg = job_config_from_dict(
        {
            "model": {"path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            "input": {"paths": ["data/*.parquet"]},
            "prompts": PROMPTS[:1],
            "sampling": {"max_new_tokens": 2, "ignore_eos": True},
            "engine": {"replicas": 1},
            "preprocess": {"workers": 0},
            "output": {"dir": "out"},
        },
        tmp_path,
    )
    runner = JobRunner(cfg, loaded_fp32, show_progress=False)
    step = runner._step

    def step_then_stop_at_the_end(*args):
        step(*args)
        if runner.stats.requests == 2:  # every row done: the stop lands after the last one
            runner.stop.signum = signal.SIGTERM

    runner._step = step_then_stop_at_the_end
    stats = runner.run().stats
    assert stats["stopped_by"] == "SIGTERM" and stats["shards_committed"] == 2
    assert stats["rows_not_committed"] == 0
