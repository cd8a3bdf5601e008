"""Which device a process runs on and how ViT data-parallel ranks join their group, decided from the
resolved device (not the job file's word for it), on machines whose GPUs are faked: torch.cuda's queries
and the process group's calls are replaced, so these run without a GPU and check what a GPU machine does.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from batchvl.config import job_config_from_dict
from batchvl.engine.device.placement import resolve_device
from batchvl.engine.parallel.ranks import in_launched_processes
from batchvl.errors import ConfigError, UserError


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)`: this machine has n CUDA devices; returns the devices `set_device` was called with."""
    current = []

    def have(count: int) -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device)))
        return current

    return have


@pytest.fixture
def torchrun(monkeypatch):
    """`torchrun(rank, ranks)`: this process is that local rank of a one-machine torchrun launch; the
    process group is faked and records its backend."""
    backends = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(backends))
    monkeypatch.setattr(dist, "init_process_group", lambda backend: backends.append(backend))
    monkeypatch.setattr(dist, "scatter_object_list", lambda *args, **kwargs: None)  # rank 0's "stop"
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)

    def launch(rank: int, ranks: int) -> list:
        for name, value in {"WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks, "LOCAL_RANK": rank}.items():
            monkeypatch.setenv(name, str(value))
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: ranks)
        return backends

    return launch


def join(device: str) -> str:
    """A serving rank's start of a `vit_parallel: data` job; returns the rank's role."""
    config = SimpleNamespace(vit_parallel="data")
    return in_launched_processes(config, device, lambda context: "driver", lambda context: "server")


def test_auto_on_a_machine_with_gpus_puts_each_rank_on_its_own_gpu_over_nccl(gpus, torchrun):
    current, backends = gpus(2), torchrun(1, 2)
    assert join("auto") == "server"
    assert current == [torch.device("cuda", 1)]  # not every rank's model on GPU 0
    assert backends == ["nccl"]


def test_more_ranks_than_gpus_share_them_over_gloo(gpus, torchrun):
    # NCCL refuses two ranks of a group on one GPU: rank 1 shares GPU 0 with rank 0, over gloo.
    current, backends = gpus(1), torchrun(1, 2)
    join("cuda")
    assert current == [torch.device("cuda", 0)]
    assert backends == ["gloo"]
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 0)


def test_a_named_gpu_is_every_ranks_gpu(gpus, torchrun):
    current, backends = gpus(2), torchrun(0, 2)
    assert join("cuda:1") == "driver"
    assert current == [torch.device("cuda", 1)]
    assert backends == ["gloo"]


def test_cpu_ranks_use_gloo_and_no_gpu(gpus, torchrun):
    current, backends = gpus(2), torchrun(1, 2)
    join("cpu")
    assert current == [] and backends == ["gloo"]


def test_a_plain_run_resolves_its_device_with_an_index(gpus):
    gpus(2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match=r"has 2 CUDA device\(s\), cuda:0 to cuda:1; name one of those"):
        resolve_device("cuda:2")
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="no CUDA device is available; use 'cpu' or 'auto'"):
        resolve_device("cuda:0")


def test_the_job_file_names_a_gpu_by_its_index_and_refuses_other_words(tmp_path):
    def model(device: str) -> dict:
        return {
            "model": {"path": "m", "device": device},
            "input": {"paths": ["d/*.parquet"]},
            "output": {"dir": "o"},
        }

    assert job_config_from_dict(model("cuda:1"), tmp_path).model.device == "cuda:1"
    for wrong in ("gpu", "cuda:", "cuda:x", "CUDA"):
        with pytest.raises(ConfigError, match="'model.device' must be cpu, cuda, cuda:N or auto"):
            job_config_from_dict(model(wrong), tmp_path)
