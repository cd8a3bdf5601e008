"""An overlapped job reads nothing back from the device but its picks, in every family.

Overlapped steps (`engine.overlap`) pay only where nothing in a step makes the host wait for the device: one
read of a device value (`item`, `tolist`, a boolean mask's `nonzero`, a copy to the host) and the GPU idles
while the host builds the next step. Here each family's model runs a whole job on the meta device, a device
with shapes and no values, where every such read raises: scheduling, vision calls, prefill chunks cut
through images, decodes, the language model's loop and the logits, end to end. The one read a step must make
(its picks, read through `HostCopy` once the next step is launched) is given values by the test. On a GPU
the same code runs Triton's kernels and graphs where the meta device runs torch's ops; those have their own
guards (`test_decode_graphs.py`, the vision towers' tests)."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig
from batchvl.engine.device import host_copy
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.models.loader import load_model_parts, prepared_model
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import NEW_FAMILIES, random_image
from tests.engine.test_family_parity import prepare

META = torch.device("meta")
PICK = 7  # every pick read back: a token no family ends on
IMAGE_SIZES = [(100, 150), (60, 60), (200, 90), (28, 300)]
# prefill chunks of 16 tokens cut through every image; 3 sequences at most, so requests wait and join
LIMITS = EngineConfig(
    max_num_batched_tokens=16,
    max_num_seqs=3,
    block_size=4,
    kv_cache_mb=4,
    max_patches_per_encode=1024,
    overlap=True,
    cuda_graphs=False,
    fused_kernels=False,
)


@pytest.fixture
def picks_read(monkeypatch) -> list[int]:
    """Each meta tensor `HostCopy` reads, given the value PICK; the rows read, per read."""
    reads = []
    make = host_copy.HostCopy.__init__

    def on_meta(self, tensor):
        if tensor.device != META:
            return make(self, tensor)
        reads.append(tensor.numel())
        self._host, self._done = torch.full(tensor.shape, PICK, dtype=tensor.dtype), None

    monkeypatch.setattr(host_copy.HostCopy, "__init__", on_meta)
    return reads


def on_meta(path):
    """The family's tiny model prepared for the engine on the meta device (its weights have no values)."""
    parts = load_model_parts(str(path), "float32", "cpu")
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).to(META)
    return prepared_model(model, str(path), parts.family, torch.float32, META, processor=parts.processor)


def run_job(loaded) -> dict:
    renderer = PromptRenderer(loaded.processor)
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, LIMITS, loaded.eos_token_ids())
    for i, (height, width) in enumerate(IMAGE_SIZES):
        media = prepare(loaded, [random_image(height, width, i)])
        ids = renderer.token_ids(renderer.render(f"Describe picture {i}.", 1), media)
        engine.add_request(EngineRequest(ids, media, SamplingParams(3 + i, ignore_eos=True), tag=i))
    engine.add_request(EngineRequest(list(range(100, 130)), [], SamplingParams(5, ignore_eos=True), "text"))
    outputs = {}
    while engine.num_unfinished:
        for result in engine.step():
            assert result.error is None
            outputs[result.tag] = result.output_token_ids
    return outputs


@pytest.mark.parametrize("family", ["qwen2_vl", *NEW_FAMILIES])
def test_an_overlapped_job_reads_only_its_picks(family_models, family, picks_read):
    path, _ = family_models(family)
    loaded = on_meta(path)
    assert loaded.adapter.device == META
    outputs = run_job(loaded)
    assert outputs == {**{i: [PICK] * (3 + i) for i in range(len(IMAGE_SIZES))}, "text": [PICK] * 5}
    # each token came through a read of picks (a request's last pick may be one past its end, dropped)
    assert sum(picks_read) >= sum(len(tokens) for tokens in outputs.values())


def test_a_read_of_a_device_value_fails_the_job(family_models, picks_read, monkeypatch):
    """The guard's power: a forward that reads one value back, as a mask's row count would, stops the job."""
    path, _ = family_models("qwen2_vl")
    loaded = on_meta(path)
    compute_logits = loaded.adapter.compute_logits

    def reading(hidden):
        if hidden.abs().sum() > 0:  # a value read on the host
            pass
        return compute_logits(hidden)

    monkeypatch.setattr(loaded.adapter, "compute_logits", reading)
    with pytest.raises(RuntimeError, match="meta tensors"):
        run_job(loaded)
