"""The GPU fast paths' `auto` (their default): each on on CUDA, off elsewhere; a value given stays."""

import pytest
import torch

from batchvl.config import EngineConfig, job_config_from_dict
from batchvl.engine.engine import Engine
from batchvl.engine.fast_paths import FAST_PATHS, fast_paths_resolved

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_each_is_auto_by_default_and_resolves_by_the_device():
    config = EngineConfig()
    assert [getattr(config, name) for name in FAST_PATHS] == ["auto"] * 3
    assert [getattr(fast_paths_resolved(config, CUDA), name) for name in FAST_PATHS] == [True] * 3
    assert [getattr(fast_paths_resolved(config, CPU), name) for name in FAST_PATHS] == [False] * 3


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_a_value_given_is_kept_on_every_device(device):
    config = fast_paths_resolved(EngineConfig(cuda_graphs=False, overlap=True, fused_kernels=False), device)
    assert (config.cuda_graphs, config.overlap, config.fused_kernels) == (False, True, False)


def test_a_job_file_takes_true_false_and_auto_and_refuses_other_words(tmp_path):
    def engine(settings: dict) -> EngineConfig:
        job = {
            "model": {"path": str(tmp_path)},
            "input": {"paths": [str(tmp_path / "*.parquet")]},
            "prompts": [{"name": "caption", "text": "Describe."}],
            "output": {"dir": str(tmp_path / "out")},
            "engine": settings,
        }
        return job_config_from_dict(job).engine

    assert engine({"overlap": False, "cuda_graphs": "auto"}).overlap is False
    assert engine({"cuda_graphs": "auto"}).cuda_graphs == "auto"
    with pytest.raises(Exception, match="cuda_graphs"):
        engine({"cuda_graphs": "sometimes"})
    assert engine({"vision_graphs": True}).vision_graphs is True
    assert engine({}).vision_graphs == "auto"
    with pytest.raises(Exception, match="vision_graphs"):
        engine({"vision_graphs": "sometimes"})


def test_the_engine_on_the_cpu_runs_serial_steps_by_default(loaded_fp32):
    engine = Engine(
        loaded_fp32.adapter, loaded_fp32.processor.tokenizer, EngineConfig(), loaded_fp32.eos_token_ids()
    )
    if loaded_fp32.adapter.device.type == "cpu":
        assert (engine.config.cuda_graphs, engine.config.overlap, engine.config.fused_kernels) == (False,) * 3
        assert engine.runner.decode_graphs is None
    else:  # the test device is a GPU: every fast path on
        assert (engine.config.cuda_graphs, engine.config.overlap) == (True, True)
        assert engine.runner.decode_graphs is not None
