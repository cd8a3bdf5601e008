"""The engine's own loop of decoder layers (`decoder_stack`): every family runs it, its residual adds go to
the norms after them, and it equals transformers `generate` in fp32 with the stock norms too, where each
add is done eagerly (the parity suites run it with the native norms)."""

import collections
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForImageTextToText

import batchvl.layers.rms_norm as rms_norm
from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers.decoder_stack import DecoderStack
from batchvl.layers.native_kernels import native_ops
from batchvl.layers.rms_norm import NativeRMSNorm
from batchvl.models.loader import load_model
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import NEW_FAMILIES, random_image
from tests.engine.reference import assert_matches_reference, make_case, run_cases
from tests.engine.test_family_parity import prepare

NEW_TOKENS = 5


class OpCounts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def image_request(loaded, seed: int = 0) -> tuple[list[int], list, dict]:
    renderer = PromptRenderer(loaded.processor)
    image = random_image(60, 90, seed)
    rendered = renderer.render("Describe this image.", 1)
    prepared = prepare(loaded, [image])
    inputs = loaded.processor(text=[rendered], images=[image], return_tensors="pt")
    return renderer.token_ids(rendered, prepared), prepared, inputs


@pytest.mark.parametrize("family", ["qwen2_vl", *NEW_FAMILIES])
def test_every_family_runs_its_layers_in_the_engines_own_loop(family_models, family, monkeypatch):
    _, loaded = family_models(family)
    adapter = loaded.adapter
    assert adapter.decoder_stack is not None
    assert len(adapter.decoder_stack.layers) == adapter.geometry.num_layers

    def refused(*args, **kwargs):
        raise AssertionError("the text model's own forward ran")

    monkeypatch.setattr(type(adapter.language_model), "forward", refused)
    for layer in adapter.language_model.layers:
        monkeypatch.setattr(type(layer), "forward", refused)
    ids, media, _ = image_request(loaded)
    engine = Engine(adapter, loaded.processor.tokenizer, EngineConfig(), loaded.eos_token_ids())
    engine.add_request(EngineRequest(ids, media, SamplingParams(NEW_TOKENS, ignore_eos=True), "one"))
    results = []
    while engine.num_unfinished:
        results += engine.step()
    assert len(results[0].output_token_ids) == NEW_TOKENS


@pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")
def test_a_steps_residual_adds_are_the_norms_own(loaded_fp32, monkeypatch):
    """On the CPU every norm after the first layer's first adds its residual in its kernel: a decode step
    runs no eager add, and each layer's two norms and the final one past the first take a residual."""
    calls = collections.Counter()
    add_and_norm = NativeRMSNorm.add_and_norm

    def counted(self, hidden_states, residual):
        calls[id(self)] += 1
        return add_and_norm(self, hidden_states, residual)

    monkeypatch.setattr(NativeRMSNorm, "add_and_norm", counted)
    adapter = loaded_fp32.adapter
    engine = Engine(adapter, loaded_fp32.processor.tokenizer, EngineConfig(), loaded_fp32.eos_token_ids())
    engine.add_request(EngineRequest(list(range(100, 120)), [], SamplingParams(8, ignore_eos=True), "text"))
    for _ in range(3):  # the prefill, then decodes
        engine.step()
    calls.clear()
    ops = OpCounts()
    with ops:
        engine.step()
    assert ops.counts[torch.ops.aten.add.Tensor] == 0
    text = adapter.language_model
    norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in text.layers]
    fused = [norm for pair in norms for norm in pair]
    assert calls == {id(norm): 1 for norm in [*fused[1:], text.norm]}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_stock_norms_add_eagerly_and_equal_generate(family_models, family, monkeypatch):
    """Without the native norms (no `add_and_norm`: the norms of a GPU without the fused kernels) the loop
    adds each residual itself, and still gives `generate`'s tokens and logits; Qwen3-VL with its deepstack
    features, which restart the residual after its first layers."""
    path, _ = family_models(family)
    monkeypatch.setattr(rms_norm, "use_native_rms_norms", lambda model: 0)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert not any(isinstance(module, NativeRMSNorm) for module in loaded.adapter.model.modules())
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids, media, inputs = image_request(loaded, seed=3)
    case = make_case(reference, "stock", ids, media, inputs, NEW_TOKENS)
    limits = EngineConfig(max_num_batched_tokens=16, block_size=4)
    _, observed = run_cases(loaded, [case], limits, SamplingParams(NEW_TOKENS))
    assert_matches_reference(observed["stock"], case)


def test_other_text_models_keep_their_own_forward():
    layer = torch.nn.Module()
    text = SimpleNamespace(layers=[layer], config=SimpleNamespace(num_hidden_layers=1))

    class GemmaModel(torch.nn.Module):  # a text model the loop does not know
        pass

    gemma = GemmaModel()
    gemma.layers, gemma.config = text.layers, text.config
    assert DecoderStack.of(gemma) is None

    class LlamaModel(torch.nn.Module):  # a known text model with a layer of another kind
        pass

    llama = LlamaModel()
    llama.layers, llama.config = text.layers, text.config
    assert DecoderStack.of(llama) is None
