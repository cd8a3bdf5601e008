"""The KV cache's memory: `engine.kv_cache_mb` as given, or with `auto` 1024 MiB on the CPU and, on CUDA,
a share of what the GPU has free after the model, less a reserve; the GPU's free memory is faked."""

import pytest
import torch

from batchvl.config import EngineConfig, job_config_from_dict
from batchvl.engine.kv_budget import ACTIVATION_RESERVE_MB, MB, kv_cache_bytes
from batchvl.errors import ConfigError, UserError

GPU = torch.device("cuda", 1)


@pytest.fixture
def free_on_gpu(monkeypatch):
    """`free_on_gpu(mib)`: the GPU has that much free; returns the devices `mem_get_info` was asked about."""
    asked = []

    def have(mib: float) -> list:
        def mem_get_info(device):
            asked.append(device)
            return int(mib * MB), 80 * 1024 * MB

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        return asked

    return have


def test_auto_on_cuda_takes_a_share_of_the_memory_free_after_the_model(free_on_gpu):
    asked = free_on_gpu(60_000)
    reserve = ACTIVATION_RESERVE_MB + 512  # and the default encoder cache
    assert kv_cache_bytes(EngineConfig(), GPU) == int((60_000 - reserve) * MB * 0.9)
    assert asked == [GPU]  # the model's GPU, not GPU 0
    config = EngineConfig(gpu_memory_utilization=0.5, encoder_cache_mb=0)
    assert kv_cache_bytes(config, GPU) == int((60_000 - ACTIVATION_RESERVE_MB) * MB * 0.5)


def test_auto_on_the_cpu_and_a_given_size_anywhere_are_what_they_were(free_on_gpu):
    asked = free_on_gpu(60_000)
    assert kv_cache_bytes(EngineConfig(), torch.device("cpu")) == 1024 * MB
    assert kv_cache_bytes(EngineConfig(kv_cache_mb=300), GPU) == 300 * MB
    assert kv_cache_bytes(EngineConfig(kv_cache_mb=0.5), torch.device("cpu")) == MB // 2
    assert asked == []


def test_a_gpu_without_room_for_the_cache_is_a_one_line_mistake(free_on_gpu):
    free_on_gpu(ACTIVATION_RESERVE_MB + 100)
    with pytest.raises(UserError) as info:
        kv_cache_bytes(EngineConfig(), GPU)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("engine.kv_cache_mb is auto, but cuda:1 has 2148 MiB free after the model")
    assert message.endswith("set engine.kv_cache_mb, or lower engine.encoder_cache_mb")


def test_the_job_file_takes_auto_or_a_size_and_a_share_up_to_one(tmp_path):
    def engine(**keys) -> EngineConfig:
        data = {"model": {"path": "m"}, "input": {"paths": ["d/*.parquet"]}, "output": {"dir": "o"}}
        return job_config_from_dict({**data, "engine": keys}, tmp_path).engine

    assert engine().kv_cache_mb == "auto" and engine().gpu_memory_utilization == 0.9
    assert engine(kv_cache_mb=2048).kv_cache_mb == 2048.0
    assert engine(kv_cache_mb="auto", gpu_memory_utilization=1).gpu_memory_utilization == 1.0
    with pytest.raises(ConfigError, match="'engine.kv_cache_mb' must be float or auto, got 'lots'"):
        engine(kv_cache_mb="lots")
    with pytest.raises(ConfigError, match="'engine.kv_cache_mb' must be positive"):
        engine(kv_cache_mb=0)
    with pytest.raises(ConfigError, match=r"'engine.gpu_memory_utilization' must be in \(0, 1\]"):
        engine(gpu_memory_utilization=1.5)
