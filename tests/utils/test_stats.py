"""Counters add field by field, so a run's stats are the sum of what its components counted."""

import pytest

from batchvl.engine.stats import EngineStats
from batchvl.preprocess.pool import PoolStats
from batchvl.utils.stats import RunStats


def test_engine_stats_add_every_field_and_per_rank_lists_rank_by_rank():
    a = EngineStats(images_total=3, encode_s=0.5, output_tokens=10, patches_encoded_per_rank=[4, 6])
    b = EngineStats(images_total=2, encode_s=0.25, steps=7, patches_encoded_per_rank=[1, 2, 3])
    total = a + b
    assert total.images_total == 5
    assert total.encode_s == 0.75
    assert total.output_tokens == 10
    assert total.steps == 7
    assert total.patches_encoded_per_rank == [5, 8, 3]
    assert a.images_total == 3 and a.patches_encoded_per_rank == [4, 6]  # the parts are left as they were


def test_pool_stats_add_and_refuse_other_counters():
    total = PoolStats(worker_restarts=1, samples_crashed=2) + PoolStats(
        samples_crashed=1, samples_timed_out=4
    )
    assert total == PoolStats(worker_restarts=1, samples_crashed=3, samples_timed_out=4)
    with pytest.raises(TypeError):
        PoolStats() + EngineStats()


def test_run_stats_flatten_their_components_with_the_rates():
    run = RunStats(samples=8, processing_s=2.0)
    out = run.to_dict(EngineStats(output_tokens=40, steps=3), PoolStats(worker_restarts=1))
    assert out["samples_per_s"] == 4.0
    assert out["output_tokens_per_s"] == 20.0
    assert out["steps"] == 3 and out["worker_restarts"] == 1
