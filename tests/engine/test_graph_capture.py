"""CUDA graph capture as torch documents it, checked against a recording stand-in for `torch.cuda`: the step
warmed up on a side stream that waits for the current one, then recorded once, every graph in one pool."""

import torch

from batchvl.engine.device import graph_capture as graph_capture_module
from batchvl.engine.device.graph_capture import WARMUP_RUNS, CudaGraphCapture, graph_capture


class RecordingCuda:
    """The parts of `torch.cuda` a capture calls, each recording what happens in order in `events`."""

    def __init__(self):
        self.events = []
        self.in_stream = None
        cuda = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                cuda.events.append(f"{self.name} waits for {other.name}")

        class CUDAGraph:
            def replay(self):
                cuda.events.append("replay")

        class Context:
            def __init__(self, enter, leave):
                self.enter, self.leave = enter, leave

            def __enter__(self):
                self.enter()

            def __exit__(self, *exc):
                self.leave()

        def stream(side):
            def enter():
                cuda.in_stream = side.name

            def leave():
                cuda.in_stream = None

            return Context(enter, leave)

        def graph(recorded, pool, capture_error_mode):
            def enter():
                cuda.events.append(f"capture into pool {pool} ({capture_error_mode})")
                cuda.in_stream = "capture"

            def leave():
                cuda.in_stream = None
                cuda.events.append("captured")

            return Context(enter, leave)

        self.Stream = lambda device: Stream("side")
        self.current_stream = lambda device: Stream("current")
        self.stream, self.graph, self.CUDAGraph = stream, graph, CUDAGraph
        self.graph_pool_handle = lambda: 7


def test_a_step_is_warmed_up_on_a_side_stream_then_recorded_once_in_the_shared_pool(monkeypatch):
    cuda = RecordingCuda()
    monkeypatch.setattr(graph_capture_module.torch, "cuda", cuda)
    capture = CudaGraphCapture(torch.device("cuda", 0))

    def forward():
        cuda.events.append(f"forward on {cuda.in_stream}")

    replays = [capture.capture(forward), capture.capture(forward)]
    one_capture = [
        "side waits for current",
        *["forward on side"] * WARMUP_RUNS,
        "current waits for side",
        "capture into pool 7 (thread_local)",
        "forward on capture",
        "captured",
    ]
    assert cuda.events == one_capture * 2
    replays[0]()
    assert cuda.events[-1] == "replay"


def test_graphs_are_captured_on_cuda_only():
    assert graph_capture(torch.device("cpu")) is None
