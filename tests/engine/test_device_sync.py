"""Engine timings on a GPU: the forward's and the vision tower's times are read after their device's
queued work is done. CUDA is faked: `torch.cuda.synchronize` is replaced, and in the engine test the
wait stands for kernels still running when the forward returns."""

import time

import torch

from batchvl.config import EngineConfig
from batchvl.engine import model_runner
from batchvl.engine.device import sync as device_sync
from batchvl.engine.encoder_cache import cache as encoder_cache
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image

KERNELS_S = 0.05  # how long the faked device takes to finish what was queued


def test_only_a_cuda_device_is_waited_for(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: waited.append(device))
    device_sync.synchronize(torch.device("cpu"))
    assert waited == []
    device_sync.synchronize(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def test_forward_and_encode_times_include_the_work_the_device_still_had_queued(loaded_fp32, monkeypatch):
    waited = []

    def finish_queued_kernels(device):
        waited.append(device)
        time.sleep(KERNELS_S)

    # The engine's CPU model, whose device work is faked to finish only when it is waited for.
    monkeypatch.setattr(model_runner, "synchronize", finish_queued_kernels)
    monkeypatch.setattr(encoder_cache, "synchronize", finish_queued_kernels)
    renderer = PromptRenderer(loaded_fp32.processor)
    prepared = prepare_image(
        random_image(28, 28, 0), QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    )
    rendered = renderer.render("Describe this image.", 1)
    tokenizer, eos = loaded_fp32.processor.tokenizer, loaded_fp32.eos_token_ids()
    runner = Engine(loaded_fp32.adapter, tokenizer, EngineConfig(), eos)
    sampling = SamplingParams(2, ignore_eos=True)
    runner.add_request(EngineRequest(renderer.token_ids(rendered, [prepared]), [prepared], sampling, "t"))
    while runner.num_unfinished:
        runner.step()
    stats = runner.stats
    assert stats.steps == 2 and stats.images_encoded == 1
    assert waited == [loaded_fp32.adapter.device] * 3  # one encode, two forwards
    assert stats.forward_s >= 2 * KERNELS_S
    assert stats.encode_s >= KERNELS_S
