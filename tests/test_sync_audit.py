"""The GPU benchmarks' audit of the host's waits for the GPU (benchmarks/sync_audit.py), on the CPU with a
stand-in for torch.cuda: each wait counted at the batchvl or transformers line that caused it, other warnings
shown as before, torch restored after; and the step timer's windows (the audit after the kernel window)."""

import importlib
import json
import traceback
import warnings
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


class FakeCuda:
    """torch.cuda's calls the audit makes: a sync debug mode, and the explicit waits."""

    def __init__(self):
        self.mode = 0
        self.waits = 0

        class Event:
            def synchronize(event):
                self.waits += 1

        self.Event = Event

    def get_sync_debug_mode(self):
        return self.mode

    def set_sync_debug_mode(self, mode):
        self.mode = {"warn": 1}.get(mode, mode)

    def synchronize(self, device=None):
        self.waits += 1


def code_at(path: str, source: str) -> dict:
    """The functions of `source`, as if defined in the file `path` (their frames name it)."""
    names = {}
    exec(compile(source, path, "exec"), names)
    return names


WAITS = code_at(
    "/site-packages/batchvl/engine/waits.py",
    "import warnings\n"
    "def read(message):\n"
    "    warnings.warn(message)\n"
    "def wait(cuda, event):\n"
    "    cuda.synchronize()\n"
    "    event.synchronize()\n",
)


def test_a_wait_in_transformers_is_named_with_the_batchvl_line_that_called_it(benchmark):
    site_of = benchmark("sync_audit").site_of
    frames = [
        traceback.FrameSummary("/repo/batchvl/engine/engine.py", 10, "step"),
        traceback.FrameSummary("/repo/batchvl/models/qwen_vl.py", 70, "_vision_features"),
        traceback.FrameSummary("/venv/transformers/models/qwen2_vl/modeling_qwen2_vl.py", 300, "rot_pos_emb"),
        traceback.FrameSummary("/venv/torch/_tensor.py", 5, "tolist"),
    ]
    assert site_of(frames) == (
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py:300 rot_pos_emb"
        " <- batchvl/models/qwen_vl.py:70 _vision_features"
    )
    assert site_of(frames[:2] + frames[3:]) == "batchvl/models/qwen_vl.py:70 _vision_features"
    assert site_of(frames[3:]) == "elsewhere"


def test_the_audit_counts_each_wait_at_its_site_and_restores_torch(benchmark):
    sync_audit = benchmark("sync_audit")
    cuda = FakeCuda()
    synchronize, event_synchronize = cuda.synchronize, cuda.Event.synchronize
    audit = sync_audit.SyncAudit(cuda)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        audit.start()
        assert cuda.mode == 1
        for _ in range(3):
            WAITS["read"](sync_audit.SYNC_WARNING)
        WAITS["read"]("something else")
        WAITS["wait"](cuda, cuda.Event())
        audit.stop()
    assert [str(warning.message) for warning in shown] == ["something else"]  # shown, not counted
    assert cuda.waits == 2  # the wrapped waits still wait
    assert (cuda.mode, cuda.synchronize, cuda.Event.synchronize) == (0, synchronize, event_synchronize)
    report = audit.report(steps=2)
    assert report["host_waits_per_step"] == {"implicit": 1.5, "explicit": 1.0}
    assert report["host_wait_sites"] == [
        {"kind": "implicit", "site": "batchvl/engine/waits.py:3 read", "waits": 3},
        {"kind": "explicit", "site": "batchvl/engine/waits.py:5 wait", "waits": 1},
        {"kind": "explicit", "site": "batchvl/engine/waits.py:6 wait", "waits": 1},
    ]


def test_the_audit_window_follows_the_kernel_window(benchmark, monkeypatch, tmp_path):
    step_timing = benchmark("step_timing")
    events = []

    class Profile:
        def __init__(self, activities):
            pass

        def start(self):
            events.append(("profile", timer.engine_steps))

        def stop(self):
            events.append(("profile end", timer.engine_steps))

        def export_chrome_trace(self, path):
            Path(path).write_text(json.dumps({"traceEvents": []}))

    class Audit:
        def __init__(self, cuda):
            pass

        def start(self):
            events.append(("audit", timer.engine_steps))

        def stop(self):
            events.append(("audit end", timer.engine_steps))

        def report(self, steps):
            return {"steps": steps}

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(step_timing, "SyncAudit", Audit)
    timer = step_timing.StepTimer(profile_after=2, profile_steps=3, audit_steps=4, profiling=True)
    with pytest.raises(step_timing.WindowsDone):  # the profiled job ends with its windows
        for _ in range(12):
            timer._before_step()
            timer._after_step()
    assert events == [("profile", 2), ("profile end", 5), ("audit", 5), ("audit end", 9)]
    assert timer.window["steps"] == 3 and timer.audit == {"steps": 4}
