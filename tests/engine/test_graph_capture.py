"""CUDA graph capture as torch documents it, checked against a recording stand-in for `torch.cuda`: the step
warmed up on a side stream that waits for the current one, then recorded once, every graph in one pool,
without a wait for the device or an emptied cache (a capture can come in the middle of a job)."""

import pytest
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
            def capture_begin(self, pool, capture_error_mode):
                cuda.events.append(f"capture into pool {pool} on {cuda.in_stream} ({capture_error_mode})")
                cuda.capturing = True

            def capture_end(self):
                cuda.events.append(f"captured on {cuda.in_stream}")
                cuda.capturing = False

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

        def stall(name):
            def call(*args):
                cuda.events.append(name)

            return call

        made = []

        def new_stream(device):
            made.append(device)
            return Stream(f"stream {len(made)}")  # named by the capture, which makes its own

        self.Stream = new_stream
        self.current_stream = lambda device: Stream("current")
        self.stream, self.CUDAGraph = stream, CUDAGraph
        self.capturing = False
        # what `torch.cuda.graph` does before a capture: here recorded, and no event may name them
        self.synchronize, self.empty_cache = stall("synchronize"), stall("empty_cache")
        self.graph_pool_handle = lambda: 7
        self.streams_made_on = made


def named_streams(capture: CudaGraphCapture) -> CudaGraphCapture:
    capture.stream.name, capture.warmup_stream.name = "capture", "side"
    return capture


def test_a_step_is_warmed_up_on_a_side_stream_then_recorded_once_in_the_shared_pool(monkeypatch):
    cuda = RecordingCuda()
    monkeypatch.setattr(graph_capture_module.torch, "cuda", cuda)
    capture = named_streams(CudaGraphCapture(torch.device("cuda", 0)))

    def forward():
        cuda.events.append(f"forward on {cuda.in_stream}")

    replays = [capture.capture(forward), capture.capture(forward)]
    one_capture = [
        "side waits for current",
        *["forward on side"] * WARMUP_RUNS,
        "current waits for side",
        "capture into pool 7 on capture (thread_local)",
        "forward on capture",
        "captured on capture",
    ]
    assert cuda.events == one_capture * 2
    replays[0]()
    assert cuda.events[-1] == "replay"
    # two streams for every capture, the model's device's (cuda:N's own when the process's current device
    # is another): the caching allocator reuses a freed block only on the stream that allocated it, so the
    # graphs share their pool's memory only when all are captured on one stream
    assert cuda.streams_made_on == [torch.device("cuda", 0)] * 2


def test_a_failed_capture_is_ended_and_gives_the_thread_its_stream_back(monkeypatch):
    """A forward that fails while captured: the capture ends (the stream would stay in capture mode) on
    the capture's stream, and the thread is back on its own stream (or every later kernel of the thread
    would go to the capture's stream), with the forward's error raised."""
    cuda = RecordingCuda()
    monkeypatch.setattr(graph_capture_module.torch, "cuda", cuda)
    capture = named_streams(CudaGraphCapture(torch.device("cuda", 0)))

    def forward():
        if cuda.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        capture.capture(forward)
    assert cuda.events[-1] == "captured on capture" and not cuda.capturing
    assert cuda.in_stream is None


def test_graphs_are_captured_on_cuda_only():
    assert graph_capture(torch.device("cpu")) is None
