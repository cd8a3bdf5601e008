"""Recording a step's kernels once and replaying them: CUDA graphs, captured as torch documents it.

A captured callable reads and writes only tensors that outlive it (static buffers): a replay launches the
recorded kernels over whatever those buffers hold then, without running any Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

# Runs before the capture: the first calls compile Triton's kernels and create cuBLAS's handles and
# workspaces, neither of which may happen while a stream is being captured (vLLM runs two as well).
WARMUP_RUNS = 2


class GraphCapture(Protocol):
    def capture(self, forward: Callable[[], None], warmups: int = ...) -> Callable[[], None]:
        """Record `forward`, which reads and writes only static buffers, after `warmups` runs (the
        backend's default where not given); returns its replay."""
        ...


def capture_or_none(
    graph_capture: GraphCapture, forward: Callable[[], None], what: str, **options
) -> tuple[Callable[[], None] | None, float]:
    """`forward` captured (`options` as `capture` takes them), and the host's seconds in the capture; the
    replay None where the capture failed, which is logged as `what` running eagerly from then on (the
    caller captures nothing more): a model whose steps cannot be captured still runs."""
    started = time.perf_counter()
    try:
        return graph_capture.capture(forward, **options), time.perf_counter() - started
    except Exception as exc:
        logger.warning("%s run eagerly: capturing one as a graph failed (%s)", what, exc)
        return None, time.perf_counter() - started


class CudaGraphCapture:
    """Graphs on one CUDA device, all in one memory pool: their intermediate tensors are dead once a replay
    ends (inputs and outputs live outside the pool), so the graphs, replayed one at a time, share it.

    All of them are captured on one stream: the caching allocator hands a freed block only to allocations
    on the stream it was allocated on, so a capture on a stream of its own could reuse none of the memory
    the captures before it freed. (With a new stream per capture, Qwen2-VL-2B's graphs up to 1,024 rows held
    10.9 GiB, the sum of every bucket's activations, on an H200, and the KV cache sized before them left a
    step too little.)"""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        # The capture's stream is the device's own: left to torch, it is made on the current device, which
        # is not the model's when that is cuda:N outside torchrun (nothing would be recorded).
        self.stream = torch.cuda.Stream(device)
        self.warmup_stream = torch.cuda.Stream(device)  # one as well: the warm-ups' memory is reused likewise

    def capture(self, forward: Callable[[], None], warmups: int = WARMUP_RUNS) -> Callable[[], None]:
        """`forward` run `warmups` times on a side stream, then recorded; returns its replay. (No warm-up
        where the same shapes have run eagerly before, as a vision call's have: `qwen_vision_graphs`.)"""
        if warmups:
            current = torch.cuda.current_stream(self.device)
            side = self.warmup_stream
            side.wait_stream(current)  # the warm-up reads inputs the current stream copied in
            with torch.cuda.stream(side):
                for _ in range(warmups):
                    forward()
            current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Begun and ended here, not by `torch.cuda.graph`, which first waits for the device and empties
        # torch's device and page-locked caches: a graph captured in the middle of a job would stall the
        # step in flight and make the steps after it allocate their activations and staging buffers anew.
        # A capture runs nothing, so the work queued on other streams needs no wait.
        with torch.cuda.stream(self.stream):  # (restores this thread's stream however the capture ends)
            # thread_local: only this thread's calls are checked while it captures; under the default
            # (global) a CUDA call not allowed during a capture would fail in whatever other thread makes it.
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                forward()
            finally:
                graph.capture_end()  # (a failed forward's capture ends too, and its error is raised)
        return graph.replay


def graph_capture(device: torch.device) -> CudaGraphCapture | None:
    """How steps are captured on `device`: CUDA graphs on a CUDA device, none elsewhere."""
    return CudaGraphCapture(device) if device.type == "cuda" else None
