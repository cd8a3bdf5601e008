"""A decode step's inputs go to the model's device in as many copies at 24 decodes as at 4: each sequence's
cache slots were uploaded on their own (and on the torch attention path copied back to the CPU and
uploaded again), some 40 us a copy on a GPU: 11.7 ms of host work a step at 256 decodes on an H100."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import batchvl.layers.attention as attention
import batchvl.utils.page_locked as page_locked
from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams


class DeviceCopies(TorchFunctionMode):
    """Counts `Tensor.to` calls that name a device (on the CPU they copy nothing, but on a GPU each is a
    transfer)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and torch._C._nn._parse_to(*args[1:], **kwargs)[0] is not None:
            self.count += 1
        return func(*args, **kwargs)


def copies_in_a_decode_step(loaded, decodes: int) -> int:
    engine = Engine(
        loaded.adapter, loaded.processor.tokenizer, EngineConfig(prefix_caching=False), loaded.eos_token_ids()
    )
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(EngineRequest(list(range(100 + i, 140 + 3 * i)), [], sampling, tag=i))
    while engine.scheduler.waiting or any(not r.is_prefill_done for r in engine.scheduler.running):
        engine.step()
    counter = DeviceCopies()
    with counter:
        assert not engine.step()  # every request decodes, none finishes
    return counter.count


@pytest.mark.parametrize("in_place", [False, True], ids=["torch-attention", "native-attention"])
def test_a_decode_steps_copies_do_not_grow_with_its_sequences(loaded_fp32, monkeypatch, in_place):
    if not in_place:
        monkeypatch.setattr(attention, "reads_cache_in_place", lambda layer: False)
    assert copies_in_a_decode_step(loaded_fp32, 4) == copies_in_a_decode_step(loaded_fp32, 24)


def test_integer_metadata_goes_to_a_device_in_one_copy_and_keeps_its_shapes():
    # "meta" stands for a GPU here: a device of its own, shapes without values
    tensors = [torch.arange(5), torch.zeros(3, 4, dtype=torch.int32), torch.tensor([7])]
    counter = DeviceCopies()
    with counter:
        moved = attention.uploaded(tensors, torch.device("meta"))
    assert counter.count == 1
    assert [(t.device.type, t.shape) for t in moved] == [("meta", t.shape) for t in tensors]
    assert attention.uploaded(tensors, torch.device("cpu")) == tensors  # the CPU's own, no copy


class Staging(TorchFunctionMode):
    """Records the host buffers asked for page-locked (made plain: a CPU build cannot lock pages) and
    whether each copy to a device waits."""

    def __init__(self):
        super().__init__()
        self.pinned_sizes: list = []
        self.copies_non_blocking: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("pin_memory"):
            self.pinned_sizes.append(args)
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and torch._C._nn._parse_to(*args[1:], **kwargs)[0] is not None:
            self.copies_non_blocking.append(torch._C._nn._parse_to(*args[1:], **kwargs)[2])
        return func(*args, **kwargs)


def test_an_upload_is_staged_in_page_locked_memory_and_does_not_wait(monkeypatch):
    """Towards a GPU, a step's metadata is packed in page-locked memory and copied without the host waiting
    (from pageable memory the driver stages the copy and the host waits: some 80 us a copy on an H200).
    "meta" stands for the GPU: its memory is page-locked as a CUDA device's is."""
    monkeypatch.setattr(page_locked, "locks_pages_for", lambda device: torch.device(device).type == "meta")
    tensors = [torch.arange(5), torch.zeros(3, 4, dtype=torch.int32)]
    staging = Staging()
    with staging:
        moved = attention.uploaded(tensors, torch.device("meta"))
    assert staging.pinned_sizes == [(17,)]
    assert staging.copies_non_blocking == [True]
    assert [(t.device.type, t.shape) for t in moved] == [("meta", t.shape) for t in tensors]


@pytest.mark.parametrize(
    "device, locked",
    [("cuda", True), ("cuda:1", True), (torch.device("cuda:0"), True), ("cpu", False), ("meta", False)],
)
def test_host_memory_is_page_locked_for_a_cuda_device_alone(device, locked):
    """The one rule of every copy's host memory: the device at the other end, not whether CUDA is present (a
    CPU engine on a GPU machine would lock pages for nothing)."""
    assert page_locked.locks_pages_for(device) is locked


def test_a_cpu_engines_upload_locks_no_pages_where_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    staging = Staging()
    with staging:
        page_locked.host_empty(5, torch.long, "cpu")
    assert staging.pinned_sizes == []
