"""The GPU throughput benchmark's split of the host's time in engine steps (benchmarks/step_timing.py), on the
CPU over a tiny engine: every phase counted, and the phases adding up to the steps' own time."""

import importlib
import time
from pathlib import Path

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
