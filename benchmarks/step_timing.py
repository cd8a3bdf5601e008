"""Where a job's engine time goes, for the GPU throughput benchmark: each language-model step's time by what
it ran (a step with prompt chunks, or decodes only), and the GPU's kernel time over a window of steps.

Kernel time is the sum of the CUDA kernels' own durations from torch's profiler (its CUDA activity, read by
CUPTI on the GPU's clock), merged where kernels overlap, over a window of consecutive engine steps; its share
is that over the window's wall time, the gaps between steps included (the GPU is idle there too). Neither
the forwards' Python time nor CUDA events are used: a forward's wall time includes its launches, and events
bracketing a step count the GPU's idle gaps inside it as busy.

After that window, a second one (`audit_steps`) counts where the host waited for the GPU (`sync_audit`).

Both cost the host dearly: on an H200, eager steps of some 1,000 decodes (969 launches a step) took 146 ms
each under the profiler, where one took 23 ms without it, and starting it, reading its trace and the
audit's stacks take seconds more. A job they run in is not the job to time: the benchmark times a job
with the timer's cheap counters alone (`profiling=False`: the window's wall without the profiler, for
comparison), then runs the same job again with the profiler and the audit, which ends it once they are
done (`WindowsDone`).

Over the whole job, the host's time in each engine step is split by what it was doing (`host_split`):
scheduling, the vision calls (launched, or run to their end where a step is serial), the forwards (the
same), waiting for a step's picks to reach the host, and the rest of the step (committing, finishing
requests, the grammar's masks). With overlapped steps, a host that seldom waits for picks is what bounds
the job: the GPU idles while the host works; one that waits most of the time is bound by the GPU.

On a GPU the timed job also records two CUDA events a step (`gpu_timeline.py`): the GPU's idle time
between steps, its time in each step, and how far behind the host it was as each began.

The engine's start is split too (`start_split`, outside the job's processing time): resolving its step
sizes (on a GPU with a probe step), the rest of building the engine, of which sizing its KV cache by the
largest step's activations (a second probe) and capturing the largest decode graph ahead.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from gpu_timeline import GpuTimeline
from sync_audit import SyncAudit

# what the host did in an engine step (see the module docstring), in the order a step does it
HOST_PHASES = ("schedule", "vision", "forward", "picks_read", "rest_of_step")
# what the engine's start did (see the module docstring): the first two add up to it, the last two are parts
# of the second
START_PHASES = ("step_sizes", "engine_build", "kv_cache_sizing", "decode_graphs_ahead")
# A step's row in `trace`. `waiting`: the requests added and not yet admitted as it began, which the job
# tops up to `engine.lookahead` before each step from the input ready: below it while prompts are still to
# come, the input did not keep up with the engine.
TRACE_COLUMNS = ("start_s", "wall_ms", "prompt_tokens", "decodes", "patches", "waiting")
TOP_KERNELS = 12  # the kernels named in a summary, by their summed time
KERNEL = "kernel"  # a CUDA kernel's category in the profiler's trace (copies: gpu_memcpy, gpu_memset)


class WindowsDone(Exception):
    """Raised out of the step that ends a profiling timer's windows: the rest of that job is not needed."""


class StepTimer:
    """Installed around one job: times `ModelRunner.execute` per step by its chunks and the window of steps
    `profile_after` to `profile_after + profile_steps` of `Engine.step` (none where `profile_steps` is 0).
    With `profiling` (on a GPU only), the window is profiled, the host's waits are audited over the
    `audit_steps` steps after it, and the job ends there (`WindowsDone`); without, the window's wall alone
    is taken."""

    def __init__(
        self,
        profile_after: int = 0,
        profile_steps: int = 0,
        audit_steps: int = 0,
        profiling: bool = False,
        timeline: GpuTimeline | None = None,
    ):
        self.profile_after, self.profile_steps = profile_after, profile_steps
        self.timeline = timeline  # every step's events on the GPU, where given (`gpu_timeline.py`)
        self.profiling = profiling and profile_steps > 0
        self.audit_steps = audit_steps if self.profiling else 0
        self.audit: dict | None = None  # the audited window's waits, once it is over
        self._audit: SyncAudit | None = None
        self.seconds = {"prefill": 0.0, "decode": 0.0}  # steps with prompt chunks, steps of decodes only
        self.steps = {"prefill": 0, "decode": 0}
        self.host_split = dict.fromkeys(HOST_PHASES, 0.0)  # seconds of every engine step, by what it did
        self.start_split = dict.fromkeys(START_PHASES, 0.0)  # seconds of the engine's start, by what it did
        self._in_step = threading.local()  # the split's seconds so far in the step this thread runs
        # every step of the job in order, a row of TRACE_COLUMNS: when it began (seconds from the first
        # step's start), its wall, its prompt tokens, its decodes, the patches its vision calls encoded and
        # the requests waiting as it began
        self.trace: list[list[float]] = []
        self._first_step_at: float | None = None
        self.engine_steps = 0
        self.engine = None  # the engine of the steps (its config with `auto` sizes resolved), once one ran
        self.window: dict | None = None  # the profiled window's figures, once it is over
        self._profiler = None
        self._window_started = 0.0

    @contextlib.contextmanager
    def installed(self):
        from batchvl.engine import builder, engine
        from batchvl.engine.device.decode_graphs import DecodeGraphs
        from batchvl.engine.device.host_copy import HostCopy
        from batchvl.engine.engine import Engine
        from batchvl.engine.model_runner import ModelRunner
        from batchvl.engine.scheduling.scheduler import Scheduler

        step, execute = Engine.step, ModelRunner.execute
        timer = self

        def timed_step(engine):
            timer.engine = engine
            timer._before_step()
            started = time.perf_counter()
            timer._in_step.seconds = 0.0  # per thread: the CPU's engine replicas step in threads of their own
            timer._in_step.tokens = (0, 0)
            timer._in_step.kind = "none"  # a step that ran no forward
            timer._in_step.stepping = True
            patches, waiting = engine.encoder_cache.patches_encoded, engine.num_waiting
            if timer.timeline is not None:
                timer.timeline.begin()
            try:
                return step(engine)
            finally:
                timer._in_step.stepping = False
                if timer.timeline is not None:
                    timer.timeline.end(timer._in_step.kind)  # split's kind: `timed_execute`
                elapsed = time.perf_counter() - started
                timer.host_split["rest_of_step"] += elapsed - timer._in_step.seconds
                timer._trace(started, elapsed, engine.encoder_cache.patches_encoded - patches, waiting)
                timer._after_step()

        def timed_execute(runner, chunks, *args, **kwargs):
            if not getattr(timer._in_step, "stepping", False):  # a probe of the engine's start, not a step
                return execute(runner, chunks, *args, **kwargs)
            started = time.perf_counter()
            decodes = sum(chunk.is_generated for chunk in chunks)
            timer._in_step.tokens = (sum(c.num_tokens for c in chunks if not c.is_generated), decodes)
            try:
                return execute(runner, chunks, *args, **kwargs)
            finally:
                # the runner's own test for a decode: one generated token
                decodes_only = all(chunk.num_tokens == 1 and chunk.is_generated for chunk in chunks)
                kind = timer._in_step.kind = "decode" if decodes_only else "prefill"
                # the forward synchronizes, but for an overlapped step's: then its launch alone
                elapsed = time.perf_counter() - started
                timer.seconds[kind] += elapsed
                timer._add("forward", elapsed)
                timer.steps[kind] += 1

        # (owner, function, phase, the split it counts in: None for the host split of the steps)
        timed = [
            (Scheduler, "schedule", "schedule", None),
            (Engine, "_encode", "vision", None),
            (HostCopy, "tolist", "picks_read", None),
            (builder, "step_sizes_for", "step_sizes", self.start_split),
            (Engine, "__init__", "engine_build", self.start_split),
            (engine, "kv_cache_bytes", "kv_cache_sizing", self.start_split),
            (DecodeGraphs, "capture_ahead", "decode_graphs_ahead", self.start_split),
        ]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _, _ in timed]
        for owner, name, phase, split in timed:
            setattr(owner, name, self._timed(getattr(owner, name), phase, split))
        Engine.step, ModelRunner.execute = timed_step, timed_execute
        try:
            yield self
        finally:
            Engine.step, ModelRunner.execute = step, execute
            for owner, name, original in originals:
                setattr(owner, name, original)
            self._stop_profile()  # a run shorter than the window: what it covered
            self._stop_audit()

    def _timed(self, function, phase: str, split: dict | None = None):
        """`function`, its seconds added to the host split's `phase` (or to that of `split`)."""

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - started
                if split is None:
                    self._add(phase, seconds)
                else:
                    split[phase] += seconds

        return timed

    def _trace(self, started: float, elapsed: float, patches: int, waiting: int) -> None:
        if self._first_step_at is None:
            self._first_step_at = started
        prompt_tokens, decodes = self._in_step.tokens
        since_first = round(started - self._first_step_at, 4)
        self.trace.append([since_first, round(elapsed * 1e3, 2), prompt_tokens, decodes, patches, waiting])

    def _add(self, phase: str, seconds: float) -> None:
        self.host_split[phase] += seconds
        self._in_step.seconds = getattr(self._in_step, "seconds", 0.0) + seconds

    def _before_step(self) -> None:
        if self.profile_steps and self.engine_steps == self.profile_after and self.window is None:
            if self.profiling:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CUDA])
                self._profiler.start()
            self._window_started = time.perf_counter()

    def _after_step(self) -> None:
        self.engine_steps += 1
        audit_from = self.profile_after + self.profile_steps
        if self.engine_steps == audit_from and self.window is None and self.profile_steps:
            if self.profiling:
                self._stop_profile()
            else:
                self.window = {"steps": self.profile_steps, "wall_s": self._window_wall()}
        if self.audit_steps and self.engine_steps == audit_from and self.audit is None:
            import torch

            self._audit = SyncAudit(torch.cuda)
            self._audit.start()
        elif self._audit is not None and self.engine_steps == audit_from + self.audit_steps:
            self._stop_audit()
        if self.profiling and self.engine_steps == audit_from + self.audit_steps:
            raise WindowsDone

    def _window_wall(self) -> float:
        return round(time.perf_counter() - self._window_started, 4)

    def _stop_audit(self) -> None:
        if self._audit is None:
            return
        self._audit.stop()
        self.audit = self._audit.report(self.engine_steps - self.profile_after - self.profile_steps)
        self._audit = None

    def _stop_profile(self) -> None:
        if self._profiler is None:
            return
        import torch

        torch.cuda.synchronize()  # the window's last kernels are in it
        wall = self._window_wall()
        self._profiler.stop()
        steps = self.engine_steps - self.profile_after
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            self._profiler.export_chrome_trace(str(trace))
            summary = kernel_summary(json.loads(trace.read_text()).get("traceEvents", []))
        self._profiler = None
        self.window = {
            "steps": steps,
            "wall_s": wall,
            "kernel_s": round(summary["kernel_ms"] / 1e3, 4),
            "kernels": summary["kernels"],
            "kernels_per_step": round(summary["kernels"] / max(steps, 1), 1),
            "top_kernels": summary["top_kernels"],  # where the window's GPU time went
        }


def kernel_intervals(trace: dict) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every CUDA kernel in a profiler's Chrome trace."""
    return [
        (event["ts"], event["ts"] + event["dur"])
        for event in trace.get("traceEvents", [])
        if event.get("cat") == KERNEL and event.get("ph") == "X"
    ]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval (microseconds): kernels on two streams at once count once."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6


def kernel_summary(events: list[dict]) -> dict:
    """Of a profiler's Chrome trace events: the kernels' busy time (overlaps once), their count, and the
    TOP_KERNELS names by summed time."""
    kernels = [event for event in events if event.get("cat") == KERNEL and event.get("ph") == "X"]
    by_name: dict[str, list[float]] = defaultdict(list)
    for kernel in kernels:
        by_name[kernel["name"]].append(kernel["dur"])
    top = sorted(by_name.items(), key=lambda item: sum(item[1]), reverse=True)[:TOP_KERNELS]
    return {
        "kernel_ms": round(busy_seconds(kernel_intervals({"traceEvents": kernels})) * 1e3, 3),
        "kernels": len(kernels),
        "top_kernels": [
            {"name": name[:120], "calls": len(durations), "ms": round(sum(durations) / 1e3, 3)}
            for name, durations in top
        ],
    }
