"""Linear layers with weights packed once for oneDNN: in bf16 the same bits as `F.linear`, in fp32 within
its rounding; only where the weight is the layer's own; and the engine's outputs unchanged by them (bf16
here; fp32 greedy outputs are checked against `generate` by the parity tests, which run packed)."""

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers import packed_linear
from batchvl.layers.packed_linear import PackedLinear, pack_linear_weights, release_checkpoint_mapping
from batchvl.models import loader
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import bf16_packs, random_image
from tests.engine.reference import EngineProbe


@pytest.mark.parametrize("bias", [True, False])
@torch.inference_mode()  # as the engine runs (with autograd on, F.linear takes another path for 3-D input)
def test_packed_linear_gives_the_bits_of_f_linear_for_any_number_of_rows(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    if not bf16_packs():  # no bf16 kernels in oneDNN here: the layer is left as it is
        assert pack_linear_weights(torch.nn.Sequential(linear)) == 0
        return
    packed = PackedLinear(linear)
    for shape in [(1, 96), (7, 96), (300, 96), (2, 5, 96)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        got = packed(x)
        assert got.shape == (*shape[:-1], 160)
        assert torch.equal(got, F.linear(x, linear.weight, linear.bias))


@pytest.mark.parametrize("bias", [True, False])
@torch.inference_mode()
def test_packed_fp32_linear_gives_f_linear_within_rounding_for_any_number_of_rows(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    assert packed.dtype == torch.float32
    for shape in [(1, 96), (7, 96), (300, 96), (2, 5, 96)]:
        x = torch.randn(shape)
        got = packed(x)
        assert got.shape == (*shape[:-1], 160)
        torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-6)


def test_only_bf16_and_fp32_linears_with_their_own_weight_are_packed():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 32)
    head = torch.nn.Linear(32, 50, bias=False)
    head.weight = embed.weight  # tied: the embedding still reads its rows
    model = torch.nn.ModuleDict(
        {
            "embed": embed,
            "mlp": torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)),
            "head": head,
        }
    ).to(torch.bfloat16)
    model["fp32"] = torch.nn.Linear(32, 32)
    model["fp16"] = torch.nn.Linear(32, 32).to(torch.float16)  # only bf16 and fp32 are packed
    assert pack_linear_weights(model) == (3 if bf16_packs() else 1)
    bf16_kind = PackedLinear if bf16_packs() else torch.nn.Linear
    assert [type(m) for m in model["mlp"]] == [bf16_kind, bf16_kind]
    assert type(model["fp32"]) is PackedLinear
    assert type(model["head"]) is torch.nn.Linear
    assert type(model["fp16"]) is torch.nn.Linear
    assert model["head"].weight is model["embed"].weight


def test_the_loader_packs_every_linear_in_bf16_and_fp32(tiny_model_dir, loaded_fp32):
    bf16 = loader.load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu").adapter.model
    for model in (bf16, loaded_fp32.adapter.model):
        plain = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
        packed = [name for name, m in model.named_modules() if isinstance(m, PackedLinear)]
        if model is bf16 and not bf16_packs():
            assert packed == [] and "lm_head" in plain
            continue
        assert plain == []
        assert "lm_head" in packed
        assert any(".visual." in name for name in packed)
        assert any(".language_model." in name for name in packed)


# Loads the model in both dtypes with oneDNN held to AVX2 code, as on a CPU without AVX-512, where torch
# refuses to pack bf16 weights; prints what each dtype got and a bf16 forward of the output head.
AVX2_LOAD = """
import sys, torch
from batchvl.models.loader import load_model
from batchvl.layers.packed_linear import PackedLinear
assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
for dtype in ("bfloat16", "float32"):
    model = load_model(sys.argv[1], dtype=dtype, device="cpu").adapter.model
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    print(dtype, kinds.count("PackedLinear"), kinds.count("Linear"))
head = load_model(sys.argv[1], dtype="bfloat16", device="cpu").adapter.model.lm_head
print("head", tuple(head(torch.ones(2, head.in_features, dtype=torch.bfloat16)).shape))
"""


def test_bf16_on_a_cpu_without_onednn_bf16_kernels_loads_with_plain_linears(tiny_model_dir):
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "BATCHVL_NATIVE_KERNELS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", AVX2_LOAD, str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    packed, plain = map(int, lines["bfloat16"].split())
    assert packed == 0 and plain > 0  # bf16: every linear left to F.linear
    packed, plain = map(int, lines["float32"].split())
    assert packed > 0 and plain == 0  # fp32 still packed
    assert lines["head"].startswith("(2, ")  # a bf16 forward through an unpacked layer


def mapped(path) -> bool:
    return any(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_lets_go_of_the_mapped_checkpoint_and_keeps_every_value(tmp_path, tiny_model_dir, dtype):
    from transformers import AutoModelForImageTextToText

    folder = shutil.copytree(tiny_model_dir, tmp_path / "model")  # a file no other test maps
    if dtype == torch.bfloat16:  # a checkpoint stored in bf16, as real ones are: loaded without a copy
        AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).save_pretrained(folder)
    checkpoint = folder / "model.safetensors"
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).eval()
    assert mapped(checkpoint)  # weights in the checkpoint's own dtype are views of the file
    embed = model.get_input_embeddings().weight.detach().clone()
    norm = model.model.language_model.norm.weight.detach().clone()
    if dtype == torch.bfloat16 and not bf16_packs():
        assert pack_linear_weights(model) == 0  # nothing packed, the checkpoint stays what holds the weights
        return
    assert pack_linear_weights(model) > 0
    gc.collect()
    assert not mapped(checkpoint)
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert torch.equal(model.model.language_model.norm.weight, norm)


def test_releasing_the_mapping_keeps_tied_weights_tied():
    embed = torch.nn.Embedding(50, 32)
    head = torch.nn.Linear(32, 50, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "mlp": torch.nn.Linear(32, 32)})
    release_checkpoint_mapping(model)
    assert model["head"].weight is model["embed"].weight


def engine_run(model_dir) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Greedy tokens and every sampled position's logits, per image, with several decodes per step."""
    loaded = loader.load_model(str(model_dir), dtype="bfloat16", device="cpu")
    renderer = PromptRenderer(loaded.processor)
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    limits = EngineConfig(max_num_batched_tokens=37, max_num_seqs=8)
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, limits, loaded.eos_token_ids())
    probe = EngineProbe(engine)
    for tag, (h, w) in enumerate([(100, 150), (200, 90), (300, 280)]):
        prepared = prepare_image(random_image(h, w, tag), spec)
        rendered = renderer.render("Describe this image.", 1)
        sampling = SamplingParams(8, ignore_eos=True)
        engine.add_request(EngineRequest(renderer.token_ids(rendered, [prepared]), [prepared], sampling, tag))
    return {tag: (seen.result.output_token_ids, seen.logits) for tag, seen in probe.run().items()}


def test_the_engine_gives_the_same_bf16_outputs_with_packed_and_plain_weights(tiny_model_dir, monkeypatch):
    packed = engine_run(tiny_model_dir)
    monkeypatch.setattr(packed_linear, "pack_linear_weights", lambda model: 0)
    plain = engine_run(tiny_model_dir)
    assert packed.keys() == plain.keys() == {0, 1, 2}
    for tag, (tokens, logits) in packed.items():
        assert tokens == plain[tag][0]
        assert logits.shape[0] == 8
        assert torch.equal(logits, plain[tag][1])
