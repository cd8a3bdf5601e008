"""The GPU's own timeline of a job's engine steps, from CUDA events: where it ran out of work.

Two events a step, recorded on the device's stream as the step begins and as it returns. The GPU reaches
the first once it has finished all the work launched before the step, and the second once it has finished
the step's own. Per step:
- `gap`: the GPU's idle time between the end of the previous step's work and this step's beginning, while
  the host was outside the steps (taking input, writing rows) with nothing queued: idle for certain;
- `span`: the GPU's time from the step's beginning (or from when it reached it, if later) to the end of the
  step's work: its kernels, and the gaps where the host launched slower than the GPU ran;
- `lead`: how long after the host began the step the GPU reached it (on the host's clock, through a
  reference event recorded with the device idle): the work still queued ahead of the host. 0 means the GPU
  had run out of work, so that whatever the step did on the host before its first launch (scheduling,
  staging pixels) was time the GPU waited too.

Events count no kernels: a span is an upper bound of the kernel time in it (the profiler's window gives the
kernels' own), but the gaps and the zero leads are the GPU's idle time for certain, and two events a step
cost the timed job a few microseconds, where the profiler cost it several times its steps' wall.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

IDLE_LEAD_S = 0.0005  # a lead below this: the GPU had (all but) run out of work as the step began


@dataclass(frozen=True)
class StepMarks:
    """One step on the host's clock (seconds): when the host began it, when the GPU reached that beginning,
    when the GPU finished the step's work; and what the step ran ("prefill", "decode", or "none")."""

    kind: str
    host_begin: float
    gpu_begin: float
    gpu_end: float


def timeline_figures(marks: list[StepMarks]) -> dict:
    """The job's figures from its steps' marks: the GPU's idle time between steps, its time in steps by
    kind, the steps it reached idle, and per step (span, gap, lead) in ms."""
    if not marks:
        return {}
    spans = {"prefill": 0.0, "decode": 0.0, "none": 0.0}
    gaps, rows, idle_at_begin = 0.0, [], 0
    previous_end = marks[0].gpu_begin
    for step in marks:
        gap = max(0.0, step.gpu_begin - previous_end)
        span = step.gpu_end - step.gpu_begin
        lead = max(0.0, step.gpu_begin - step.host_begin)
        spans[step.kind] += span
        gaps += gap
        idle_at_begin += lead < IDLE_LEAD_S
        rows.append([round(span * 1e3, 3), round(gap * 1e3, 3), round(lead * 1e3, 3)])
        previous_end = step.gpu_end
    window = marks[-1].gpu_end - marks[0].gpu_begin
    return {
        "window_s": round(window, 4),
        "gpu_idle_between_steps_s": round(gaps, 4),
        "gpu_in_steps_s": {kind: round(seconds, 4) for kind, seconds in spans.items()},
        # the GPU's time in steps over the window: an upper bound of its kernel time's share
        "gpu_in_steps_share": round(sum(spans.values()) / window, 4) if window > 0 else None,
        "steps": len(marks),
        "steps_begun_with_the_gpu_idle": idle_at_begin,
        "columns": ["span_ms", "gap_ms", "lead_ms"],
        "rows": rows,
    }


class GpuTimeline:
    """Records a step's two events (`begin`, `end`) on `device`'s current stream; `figures()` reads them
    once the job is over (it waits for the device). `event` makes a timing event and `clock` is the host's
    clock: CUDA's and `time.perf_counter` unless a test gives others."""

    def __init__(
        self,
        device: torch.device,
        event: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Callable[[], None] | None = None,
    ):
        self.device = device
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._clock = clock
        self._synchronize = synchronize or (lambda: torch.cuda.synchronize(device))
        self._reference = None  # (event, host time): recorded with the device idle, before the first step
        self._open: tuple[float, object] | None = None
        self._steps: list[tuple[str, float, object, object]] = []

    def begin(self) -> None:
        if self._reference is None:
            self._synchronize()  # (before the job's first step: nothing of the job's is queued yet)
            self._reference = (self._recorded(), self._clock())
        host = self._clock()
        self._open = (host, self._recorded())

    def end(self, kind: str) -> None:
        host, begun = self._open
        self._steps.append((kind, host, begun, self._recorded()))
        self._open = None

    def figures(self) -> dict:
        if self._reference is None:
            return {}
        self._synchronize()
        reference, reference_host = self._reference

        def on_host_clock(event) -> float:
            return reference_host + reference.elapsed_time(event) / 1e3  # (ms)

        marks = [
            StepMarks(kind, host, on_host_clock(begun), on_host_clock(ended))
            for kind, host, begun, ended in self._steps
        ]
        return timeline_figures(marks)

    def _recorded(self):
        event = self._event()
        event.record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        return event
