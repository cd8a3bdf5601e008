"""The GPU throughput benchmark's split of the host's time in engine steps (benchmarks/step_timing.py), on the
CPU over a tiny engine: every phase counted, and the phases adding up to the steps' own time."""

import importlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def step_timing(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("step_timing")


def requests(loaded) -> list[EngineRequest]:
    """Two captions of an image each and a text prompt, greedy: every step overlaps."""
    renderer = PromptRenderer(loaded.processor)
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    out = [EngineRequest(list(range(100, 110)), [], SamplingParams(6, ignore_eos=True), "text")]
    for i in range(2):
        image = prepare_image(random_image(48, 64, seed=i), spec)
        ids = renderer.token_ids(renderer.render("Describe it.", 1), [image])
        out.append(EngineRequest(ids, [image], SamplingParams(6, ignore_eos=True), i))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_the_host_split_names_each_phase_and_adds_up_to_the_steps(step_timing, loaded_fp32, overlap):
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(max_num_batched_tokens=48, overlap=overlap),
        loaded_fp32.eos_token_ids(),
    )
    for request in requests(loaded_fp32):
        engine.add_request(request)
    timer = step_timing.StepTimer()
    stepped = 0.0
    with timer.installed():
        while engine.num_unfinished:
            started = time.perf_counter()
            engine.step()
            stepped += time.perf_counter() - started
    split = timer.host_split
    assert list(split) == ["schedule", "vision", "forward", "picks_read", "rest_of_step"]
    assert all(split[phase] > 0 for phase in ("schedule", "vision", "forward", "rest_of_step"))
    # an overlapped step reads the step before's picks; a serial one reads its own inside the step's rest
    assert (split["picks_read"] > 0) is overlap
    assert split["forward"] == pytest.approx(sum(timer.seconds.values()))
    assert sum(split.values()) == pytest.approx(stepped, rel=0.05)
    assert sum(split.values()) <= stepped
    # the trace: a row a step, in order, whose prompt tokens, decodes and patches are the job's
    trace = [dict(zip(step_timing.TRACE_COLUMNS, row, strict=True)) for row in timer.trace]
    assert len(trace) == timer.engine_steps and trace[0]["start_s"] == 0
    ends = [row["start_s"] + row["wall_ms"] / 1e3 for row in trace]
    assert all(end <= row["start_s"] + 1e-4 for end, row in zip(ends, trace[1:], strict=False))
    assert sum(row["wall_ms"] for row in trace) / 1e3 == pytest.approx(stepped, rel=0.05)
    prompts = requests(loaded_fp32)
    computed = sum(len(r.prompt_token_ids) for r in prompts) - engine.scheduler.num_prefix_cached_tokens
    assert sum(row["prompt_tokens"] for row in trace) == computed
    # each request's first token comes from its prompt's last chunk, the other 5 from decodes; overlapped,
    # one more decode a request, whose token is dropped once the step after reads that it had ended
    assert sum(row["decodes"] for row in trace) == (5 + overlap) * len(prompts)
    assert sum(row["patches"] for row in trace) == engine.encoder_cache.patches_encoded > 0
    # every request was added before the first step: waiting, then admitted, none of them again
    waiting = [row["waiting"] for row in trace]
    assert waiting[0] == len(prompts) and waiting[-1] == 0 and waiting == sorted(waiting, reverse=True)


def test_the_start_split_times_the_engines_build_by_part_and_puts_the_parts_back(step_timing, loaded_fp32):
    from batchvl.engine import builder
    from batchvl.engine import engine as engine_module
    from batchvl.engine.device.decode_graphs import DecodeGraphs

    def parts():
        return (
            builder.step_sizes_for,
            Engine.__init__,
            engine_module.kv_cache_bytes,
            DecodeGraphs.capture_ahead,
        )

    originals = parts()
    timer = step_timing.StepTimer()
    with timer.installed():
        started = time.perf_counter()
        builder.build_engine(
            loaded_fp32.adapter,
            loaded_fp32.processor.tokenizer,
            loaded_fp32.eos_token_ids(),
            EngineConfig(replicas=1),
        )
        built = time.perf_counter() - started
    split = timer.start_split
    assert list(split) == ["step_sizes", "engine_build", "kv_cache_sizing", "decode_graphs_ahead"]
    assert split["step_sizes"] > 0 and split["kv_cache_sizing"] > 0
    assert split["kv_cache_sizing"] < split["engine_build"]
    assert split["step_sizes"] + split["engine_build"] <= built
    assert split["decode_graphs_ahead"] == 0  # no decode graphs on the CPU
    assert parts() == originals


def test_a_forward_outside_the_steps_is_not_counted_as_one(step_timing, loaded_fp32):
    """The probes that size a GPU engine's steps and KV cache run forwards as it is built: those are its
    start's (`start_split`), not steps of the job."""
    from batchvl.engine.scheduling.activation_peak import largest_step

    timer = step_timing.StepTimer()
    with timer.installed():
        largest_step(loaded_fp32.adapter, EngineConfig(max_num_batched_tokens=16, max_num_seqs=2))()
    assert timer.steps == {"prefill": 0, "decode": 0} and timer.seconds == {"prefill": 0.0, "decode": 0.0}
    assert timer.host_split["forward"] == 0.0


class FakeProfiler:
    """torch's profiler as the timer uses it: one kernel of 2 ms a step that ran under it."""

    def __init__(self, steps_seen: list[int]):
        self.steps_seen = steps_seen
        self.started_at = None

    def start(self):
        self.started_at = len(self.steps_seen)

    def stop(self):
        self.kernels = len(self.steps_seen) - self.started_at

    def export_chrome_trace(self, path):
        events = [
            {"cat": "kernel", "ph": "X", "name": "gemm", "ts": 10_000 * i, "dur": 2_000}
            for i in range(self.kernels)
        ]
        Path(path).write_text(json.dumps({"traceEvents": events}))


class FakeAudit:
    started = stopped = 0

    def __init__(self, cuda):
        pass

    def start(self):
        FakeAudit.started += 1

    def stop(self):
        FakeAudit.stopped += 1

    def report(self, steps):
        return {"steps": steps}


def run_steps(monkeypatch, timer, steps: int) -> int:
    """`steps` engine steps of a stand-in engine under `timer`; how many began."""
    from batchvl.engine import engine as engine_module

    begun = []
    monkeypatch.setattr(engine_module.Engine, "step", lambda self: begun.append(self) or [])
    engine = SimpleNamespace(encoder_cache=SimpleNamespace(patches_encoded=0), num_waiting=0)
    with timer.installed():
        for _ in range(steps):
            engine_module.Engine.step(engine)
    return len(begun)


def test_the_timed_job_takes_its_windows_wall_without_the_profiler(step_timing, monkeypatch):
    """The job whose wall gives samples/s runs no profiler and no audit (each would cost its host time
    inside that wall), keeps every step, and times the window's steps for the profiled window's share."""
    monkeypatch.setattr("torch.profiler.profile", lambda **kwargs: pytest.fail("profiled the timed job"))
    monkeypatch.setattr(step_timing, "SyncAudit", lambda cuda: pytest.fail("audited the timed job"))
    timer = step_timing.StepTimer(profile_after=2, profile_steps=3, audit_steps=2)
    assert run_steps(monkeypatch, timer, 9) == 9
    assert timer.window["steps"] == 3 and timer.window["wall_s"] >= 0
    assert "kernel_s" not in timer.window and timer.audit is None


def test_the_profiled_job_profiles_its_window_audits_the_steps_after_and_ends_there(step_timing, monkeypatch):
    steps_seen: list[int] = []
    profilers = []

    def profile(**kwargs):
        profilers.append(FakeProfiler(steps_seen))
        return profilers[-1]

    monkeypatch.setattr("torch.profiler.profile", profile)
    monkeypatch.setattr("torch.cuda.synchronize", lambda *args: None)
    monkeypatch.setattr(step_timing, "SyncAudit", FakeAudit)
    timer = step_timing.StepTimer(profile_after=2, profile_steps=3, audit_steps=2, profiling=True)
    original = step_timing.StepTimer._after_step

    def after_step(self):
        steps_seen.append(self.engine_steps)
        original(self)

    monkeypatch.setattr(step_timing.StepTimer, "_after_step", after_step)
    with pytest.raises(step_timing.WindowsDone):
        run_steps(monkeypatch, timer, 20)
    # the window: steps 2, 3 and 4, one kernel each; the audit: steps 5 and 6, and no step after them
    assert len(steps_seen) == 7 and len(profilers) == 1
    assert timer.window["steps"] == 3 and timer.window["kernels"] == 3
    assert timer.window["kernel_s"] == pytest.approx(0.006)
    assert timer.window["top_kernels"] == [{"name": "gemm", "calls": 3, "ms": 6.0}]
    assert timer.audit == {"steps": 2} and (FakeAudit.started, FakeAudit.stopped) == (1, 1)
