"""A graph backend for tests on the CPU, and a guard against host synchronisation where a graph records.

`FakeGraphCapture` does what `CudaGraphCapture` does with the callable it is given, on CPU tensors: capture
runs it once (the warm-up) and keeps it; a replay calls it again, over the same static buffers, so that a
buffer a step forgot to fill is read with the previous step's values, as a CUDA graph would read it. Both
run under `NoHostSync`, which raises on every operation that makes a GPU's host wait for the device: reading
a value (`item`, `bool`, `tolist`, a copy to the host) or making a tensor whose size depends on values
(`nonzero`, boolean indexing, `unique`). None of them can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result the host must wait for: a value read on the host, or an output sized by values
# (`item` itself under inference mode, which the engine's steps run in; its decomposition outside it)
VALUE_READS = {aten.item, aten._local_scalar_dense, aten.equal, aten.is_nonzero}
VALUE_SIZED = {
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave,
}
HOST_COPIES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


class HostSync(AssertionError):
    pass


class _NoValueReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in VALUE_READS or packet in VALUE_SIZED:
            raise HostSync(f"{func} waits for the device")
        if packet is aten.index and any(
            index is not None and index.dtype == torch.bool for index in args[1]
        ):  # boolean indexing: a nonzero inside
            raise HostSync("indexing with a boolean tensor waits for the device")
        return func(*args, **(kwargs or {}))


class _NoHostCopies(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES:
            raise HostSync(f"{func.__name__} copies to the host and waits for the device")
        return func(*args, **(kwargs or {}))


class NoHostSync:
    """A context in which an operation that would make a GPU's host wait raises `HostSync`."""

    def __enter__(self):
        self._modes = [_NoHostCopies(), _NoValueReads()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def guard_host_reads(monkeypatch, owner, name: str) -> None:
    """Run `owner.<name>` (a method or module forward) under `NoHostSync` for the rest of the test."""
    method = getattr(owner, name)

    def guarded(*args, **kwargs):
        with NoHostSync():
            return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, guarded)


class FakeGraphCapture:
    """Counts its captures and replays."""

    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.warmups: list[int] = []  # the warm-up runs each capture asked for

    def capture(self, forward: Callable[[], None], warmups: int = 2) -> Callable[[], None]:
        with NoHostSync():
            forward()  # the recording: a CUDA capture runs the callable's Python once, its kernels not
        self.captures += 1
        self.warmups.append(warmups)

        def replay() -> None:
            self.replays += 1
            with NoHostSync():
                forward()

        return replay
