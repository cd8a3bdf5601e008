"""The GPU throughput benchmark's timeline of the GPU's work by step (benchmarks/gpu_timeline.py): its
figures from two events a step, against a simulated device whose work and idle times are set by hand, and
its events taken once per engine step by the step timer."""

import importlib
import time
from pathlib import Path

import pytest
import torch

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from tests.test_step_timing import requests

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SIMULATED = torch.device("cpu")  # the simulated device's events take no stream


@pytest.fixture
def gpu_timeline(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu_timeline")


class SimulatedDevice:
    """A host clock set by hand and a device that runs what is launched in order: an event is reached
    once the device has finished the work launched before it was recorded."""

    def __init__(self):
        self.host = 0.0
        self.free_at = 0.0  # when the device finishes the work launched so far
        self.synchronized = 0

    def launch(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host) + seconds

    def synchronize(self) -> None:
        self.synchronized += 1
        self.host = max(self.host, self.free_at)

    def event(self):
        return SimulatedEvent(self)


class SimulatedEvent:
    def __init__(self, device: SimulatedDevice):
        self.device, self.reached = device, None

    def record(self, stream=None) -> None:
        self.reached = max(self.device.host, self.device.free_at)

    def elapsed_time(self, later: "SimulatedEvent") -> float:
        return (later.reached - self.reached) * 1e3  # ms, as CUDA's


def test_the_gpus_gaps_spans_and_leads_by_step(gpu_timeline):
    device = SimulatedDevice()
    timeline = gpu_timeline.GpuTimeline(
        SIMULATED, event=device.event, clock=lambda: device.host, synchronize=device.synchronize
    )
    ms = 1e-3
    # step 1 begins with the device idle: 1 ms of host work, then 10 ms of kernels
    timeline.begin()
    device.host = 1 * ms
    device.launch(10 * ms)
    device.host = 2 * ms
    timeline.end("prefill")
    # the host is away until 20 ms (input, rows): the device idles from 11 to 20 ms
    device.host = 20 * ms
    timeline.begin()
    device.host = 21 * ms
    device.launch(30 * ms)  # to 51 ms
    device.host = 22 * ms
    timeline.end("decode")
    # step 3 begins at 30 ms, the device 21 ms behind: 5 ms more, to 56 ms
    device.host = 30 * ms
    timeline.begin()
    device.host = 31 * ms
    device.launch(5 * ms)
    device.host = 32 * ms
    timeline.end("decode")

    figures = timeline.figures()
    assert figures["rows"] == [[11.0, 0.0, 0.0], [31.0, 9.0, 0.0], [5.0, 0.0, 21.0]]
    assert figures["gpu_idle_between_steps_s"] == pytest.approx(0.009)
    assert figures["gpu_in_steps_s"] == pytest.approx({"prefill": 0.011, "decode": 0.036, "none": 0.0})
    assert figures["window_s"] == pytest.approx(0.056)
    assert figures["gpu_in_steps_share"] == pytest.approx(round(47 / 56, 4))
    assert figures["steps"] == 3 and figures["steps_begun_with_the_gpu_idle"] == 2
    assert device.synchronized == 2  # before the first step (the reference), and to read the events


def test_a_job_without_steps_has_no_figures(gpu_timeline):
    device = SimulatedDevice()
    timeline = gpu_timeline.GpuTimeline(SIMULATED, event=device.event, synchronize=device.synchronize)
    assert timeline.figures() == {} and device.synchronized == 0


def test_the_step_timer_marks_every_engine_step_by_what_it_ran(gpu_timeline, loaded_fp32):
    step_timing = importlib.import_module("step_timing")
    device = SimulatedDevice()
    timeline = gpu_timeline.GpuTimeline(
        SIMULATED, event=device.event, clock=time.perf_counter, synchronize=device.synchronize
    )
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(max_num_batched_tokens=8),
        loaded_fp32.eos_token_ids(),
    )
    for request in requests(loaded_fp32):
        engine.add_request(request)
    timer = step_timing.StepTimer(timeline=timeline)
    with timer.installed():
        while engine.num_unfinished:
            engine.step()
    kinds = [step[0] for step in timeline._steps]
    prompt_tokens = [row[step_timing.TRACE_COLUMNS.index("prompt_tokens")] for row in timer.trace]
    decodes = [row[step_timing.TRACE_COLUMNS.index("decodes")] for row in timer.trace]
    assert len(kinds) == len(timer.trace) == timer.engine_steps
    assert kinds == [
        "prefill" if p else "decode" if d else "none" for p, d in zip(prompt_tokens, decodes, strict=True)
    ]
    assert kinds.count("prefill") >= 3 and kinds.count("decode") >= 3  # budgets of 8 tokens: chunked
    # the split's own kinds: a step is counted alike in both
    assert {kind: kinds.count(kind) for kind in ("prefill", "decode")} == timer.steps
