"""Reading an overlapped step's picks: on a GPU they go to page-locked memory in a copy that does not block,
and the host waits for the event recorded behind that copy alone (CUDA faked); on the CPU they are read
as they are."""

import torch

from batchvl.engine.device.host_copy import HostCopy
from tests.fake_cuda import FakeCudaTensor


def test_picks_on_a_gpu_are_read_after_their_copys_event_alone(monkeypatch):
    calls = []

    class Event:
        def record(self, stream):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append("wait for the event")

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append("wait for everything"))
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *args, pin_memory=False, **kw: calls.append(("page-locked", pin_memory)) or empty(*args, **kw),
    )
    copy = HostCopy(torch.tensor([4, 2, 7]).as_subclass(FakeCudaTensor))
    assert calls == [("page-locked", True), ("record", "stream of cuda:0")]
    assert copy.tolist() == [4, 2, 7]
    assert calls[2:] == ["wait for the event"]


def test_picks_on_the_cpu_are_read_as_they_are(monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "Event", lambda: (_ for _ in ()).throw(AssertionError("an event on the CPU"))
    )
    assert HostCopy(torch.tensor([3, 1])).tolist() == [3, 1]
