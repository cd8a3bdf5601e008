"""A CUDA device's free memory is read after a garbage collection: an earlier job's engine, held only in
reference cycles, gives its KV cache back first (the GPU is faked: free memory is whatever the fake says
while the held object lives)."""

import gc
import weakref

import torch

from batchvl.engine.device.free_memory import free_cuda_bytes


class CycleHeldCache:
    """Stands for an ended job's engine: unreachable, but in a cycle, so freed only by the collector."""

    def __init__(self):
        self.itself = self


def test_an_unreachable_engine_in_a_cycle_is_collected_before_the_free_memory_is_read(monkeypatch):
    held = CycleHeldCache()
    alive = weakref.ref(held)
    del held
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device):
        calls.append(device)
        return (10 if alive() is not None else 100), 200  # the held cache takes 90 while it lives

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    enabled = gc.isenabled()
    gc.disable()  # no collection but the one under test
    try:
        assert alive() is not None
        assert free_cuda_bytes(torch.device("cuda", 1)) == 100
    finally:
        if enabled:
            gc.enable()
    assert calls == ["empty_cache", torch.device("cuda", 1)]
