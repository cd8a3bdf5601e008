"""`engine.fused_kernels` run by Triton's interpreter on CPU tensors: each swapped module equals the
transformers module it replaces on random inputs (the kernels' allowance: float32 within 1e-6 relative,
bf16 within one rounding step), and a tiny model of each family with the swaps equals `generate` in
float32 (tokens and logits, as the parity tests); in bf16 Qwen2-VL's, which has every kernel, is as close
to the float32 model as transformers' own bf16 model is (as tests/engine/test_bf16_accuracy.py).

The models are prepared as on CUDA: without the CPU's native kernels and oneDNN packing, whose swaps would
take the modules first. Run in a process of their own with TRITON_INTERPRET=1 by
tests/layers/test_fused_kernels.py."""

import collections
import os

import pytest
import torch
from transformers import AttentionInterface, AutoModelForImageTextToText
from transformers.activations import ACT2FN, QuickGELUActivation
from transformers.models.clip.modeling_clip import CLIPEncoderLayer, CLIPVisionConfig
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Config,
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLVisionBlock,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_vision,
)

from batchvl.config import EngineConfig
from batchvl.demo.tiny_model import build_tiny_model
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers import (
    fused_activation,
    fused_projections,
    packed_linear,
    triton_attention,
    triton_elementwise,
)
from batchvl.layers.attention import KVCache
from batchvl.layers.fused_kernels import rotate_text_rows, rotate_vision_rows, use_fused_kernels
from batchvl.layers.fused_projections import FusedQKVAttention, GatedMLP
from batchvl.layers.native_kernels import DISABLE_VARIABLE, native_ops
from batchvl.layers.residual_norm import (
    add_and_norm_forward,
    fuse_residual_norms,
    fused_residual_norm,
    fused_successor,
)
from batchvl.layers.rms_norm import STOCK_RMS_NORMS
from batchvl.layers.triton_modules import TritonLayerNorm, TritonNorm, TritonQuickGELU, TritonRMSNorm
from batchvl.models.loader import load_model
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import SHARPNESS, random_image
from tests.engine.reference import EngineProbe, assert_matches_reference, make_case, run_cases
from tests.engine.test_family_parity import prepare
from tests.layers.test_qwen3_text_attention import (
    CAUSAL_ATTENTION_NAME,
    causal_attention,
    step_inputs,
    stock_attention,
)
from tests.layers.triton_elementwise_checks import assert_close, random

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_fused_kernels.py, under Triton's interpreter", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
ROWS = 13
NEW_TOKENS = 4
PROMPT = "Describe this image."
# each kernel as it is counted: the rotary of the text model and of the vision tower apart, the norms that
# add the residual before them (one per layer) apart from the others, and the vision layers' closing adds
# handed to the next layer's first norm (by the residual norms' kernels)
KERNELS = (
    "rms_norm",
    "layer_norm",
    "quick_gelu",
    "silu_and_mul",
    "text_rotary",
    "vision_rotary",
    "residual_rms_norm",
    "residual_layer_norm",
    "closing_add_ahead",
)
# what each family has for each kernel to take: RMSNorms, LayerNorms, QuickGELUs, SiLU MLPs, text and
# vision attention modules rotating queries and keys, layers adding their residual in an RMSNorm and in a
# LayerNorm (decoder layers, vision blocks and encoder layers), vision layers followed by another
SWAPPED = {
    "qwen2_vl": (5, 5, 2, 2, 2, 2, 2, 2, 1),  # 2 text layers, 2 vision blocks, the merger's LayerNorm
    "qwen2_5_vl": (
        10,
        0,
        0,
        4,
        2,
        2,
        4,
        0,
        1,
    ),  # its vision blocks' norms are RMSNorms, its vision MLPs SiLU-gated
    "qwen3_vl": (9, 7, 0, 2, 2, 2, 2, 2, 1),  # and the per-head q/k norms of its 2 text layers
    "llava": (5, 8, 3, 2, 2, 0, 2, 3, 2),  # CLIP with one layer more than it uses
    "idefics3": (5, 5, 0, 2, 2, 0, 2, 2, 1),  # SigLIP's MLP is GELU-tanh
    "smolvlm": (5, 5, 0, 2, 2, 0, 2, 2, 1),  # Idefics3's model
    "internvl": (5, 5, 0, 2, 2, 0, 2, 0, 0),  # InternViT's layers scale their branches: not fused
}


# --- each module against the one it replaces -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rms_norm_equals_transformers(dtype):
    stock = Qwen2RMSNorm(48, eps=1e-6)
    stock.weight.data = random(48, dtype=dtype, seed=1)
    x = random(ROWS, 48, dtype=dtype, seed=2)
    assert_close(TritonRMSNorm(stock)(x), stock(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_norm_equals_torchs(dtype):
    stock = torch.nn.LayerNorm(48, eps=1e-6).to(dtype)
    stock.weight.data, stock.bias.data = random(48, dtype=dtype, seed=3), random(48, dtype=dtype, seed=4)
    x = random(2, ROWS, 48, dtype=dtype, seed=5) * 3 + 1
    expected = stock(x)
    assert_close(TritonLayerNorm(stock)(x), expected, scale=expected.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_gelu_equals_transformers(dtype):
    x = random(ROWS, 40, dtype=dtype, seed=6) * 4
    assert_close(TritonQuickGELU()(x), QuickGELUActivation()(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gated_mlp_with_the_silu_kernel_equals_transformers(dtype):
    torch.manual_seed(0)
    stock = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=40, hidden_act="silu")).to(dtype)
    fused = GatedMLP(stock)
    fused.silu_and_mul = triton_elementwise.silu_and_mul
    x = random(1, ROWS, 32, dtype=dtype, seed=7) * 2
    gate, up = fused.gate_up_proj(x).split(40, dim=-1)
    # the kernel's product against the MLP's, on the same projections (the fused linear's own rounding
    # is another matter, checked by the fused projections' tests)
    assert_close(fused.silu_and_mul(fused.gate_up_proj(x)), ACT2FN["silu"](gate) * up)
    # and the whole MLP against transformers' (bf16: a value across a rounding boundary moves one step)
    allowed = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(fused(x), stock(x), **allowed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_text_rotary_equals_transformers(dtype):
    heads, kv_heads, dim = 4, 2, 16
    qkv = random(ROWS, heads + 2 * kv_heads, dim, dtype=dtype, seed=8)
    angles = random(ROWS, dim // 2, dtype=torch.float32, seed=9) * 20
    cos, sin = (torch.cat([f, f], -1).to(dtype) for f in (angles.cos(), angles.sin()))
    query, key = (p.transpose(0, 1)[None] for p in qkv[:, : heads + kv_heads].split([heads, kv_heads], 1))
    expected_query, expected_key = apply_rotary_pos_emb(query, key, cos[None], sin[None])
    rotated = qkv.clone()
    rotate_text_rows(rotated[:, : heads + kv_heads], cos, sin)
    assert_close(rotated[:, :heads].transpose(0, 1)[None], expected_query)
    assert_close(rotated[:, heads : heads + kv_heads].transpose(0, 1)[None], expected_key)
    assert torch.equal(rotated[:, heads + kv_heads :], qkv[:, heads + kv_heads :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_vision_rotary_equals_transformers(dtype):
    heads, dim = 3, 16
    qkv = random(ROWS, 3, heads, dim, dtype=dtype, seed=10)
    angles = random(ROWS, dim // 2, dtype=torch.float32, seed=11) * 20
    cos, sin = (torch.cat([f, f], -1) for f in (angles.cos(), angles.sin()))
    expected_query, expected_key = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    rotated = qkv.clone()
    rotate_vision_rows(rotated[:, :2], cos, sin)
    assert_close(rotated[:, 0], expected_query)
    assert_close(rotated[:, 1], expected_key)
    assert torch.equal(rotated[:, 2], qkv[:, 2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoder_layer_adding_its_residual_in_the_norm_gives_the_layers_bits(dtype):
    # the same layer, its norms the kernel's, run by transformers' forward and by the fused one: the sum is
    # rounded where the layer rounds it and the norm reads it as it reads the layer's, so no bit may move
    config = Qwen2Config(
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(config, layer_idx=0).to(dtype).eval()
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = random(48, dtype=dtype, seed=12) + 1
    use_fused_kernels(layer)
    x = random(1, ROWS, 48, dtype=dtype, seed=13) * 3
    positions = torch.arange(ROWS)[None]
    arguments = {  # by keyword, as transformers' loop of layers passes them
        "attention_mask": None,
        "position_embeddings": Qwen2RotaryEmbedding(config)(x, positions),
        "position_ids": positions,
    }
    with torch.inference_mode():
        fused = layer(x, **arguments)
        stock = type(layer).forward(layer, x, **arguments)
    assert layer.forward.func is add_and_norm_forward
    assert torch.equal(fused, stock)
    assert not torch.equal(fused, x + layer.mlp(layer.post_attention_layernorm(x)))  # the layer did work


def vision_layer(kind: str, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple, dict]:
    """(a vision layer of `kind`, the arguments its tower's loop passes it by position and by keyword)."""
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, ROWS], dtype=torch.int32)  # two images
    angles = random(ROWS, 6, dtype=torch.float32, seed=14) * 20
    position_embeddings = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    by_keyword = {"cu_seqlens": cu_seqlens, "position_embeddings": position_embeddings}
    if kind == "qwen2_vl_block":  # LayerNorms, QuickGELU
        config = Qwen2VLVisionConfig(embed_dim=48, num_heads=4, mlp_ratio=2, depth=1)
        config._attn_implementation = "eager"
        return Qwen2VLVisionBlock(config), (), by_keyword
    if kind == "qwen2_5_vl_block":  # RMSNorms, a SiLU-gated MLP
        config = Qwen2_5_VLVisionConfig(hidden_size=48, num_heads=4, intermediate_size=64, depth=1)
        config._attn_implementation = "eager"
        return Qwen2_5_VLVisionBlock(config), (), by_keyword
    config = CLIPVisionConfig(hidden_size=48, intermediate_size=64, num_attention_heads=4)
    config._attn_implementation = "eager"
    # the attention mask by position, as CLIP's encoder passes it: the last keys masked, so that a mask
    # lost on the way changes the output
    mask = torch.zeros(1, 1, ROWS, ROWS)
    mask[..., -3:] = torch.finfo(dtype).min
    return CLIPEncoderLayer(config), (mask.to(dtype),), {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind,norm",
    [("qwen2_vl_block", TritonLayerNorm), ("qwen2_5_vl_block", TritonRMSNorm), ("clip", TritonLayerNorm)],
)
def test_a_vision_layer_adding_its_residual_in_the_norm_gives_the_layers_bits(dtype, kind, norm):
    layer, by_position, by_keyword = vision_layer(kind, dtype)
    layer = layer.to(dtype).eval()
    norms = [module for module in layer.modules() if "norm" in type(module).__name__.lower()]
    for i, module in enumerate(norms):
        module.weight.data = random(48, dtype=dtype, seed=15 + i) + 1
    counts = use_fused_kernels(layer)
    assert fused_residual_norm(layer) is not None and isinstance(fused_residual_norm(layer), norm)
    assert counts["residual_layer_norm" if norm is TritonLayerNorm else "residual_rms_norm"] == 1
    x = random(ROWS, 48, dtype=dtype, seed=13) * 3
    if kind == "clip":
        x = x[None]
    with torch.inference_mode():
        fused = layer(x, *by_position, **by_keyword)
        stock = type(layer).forward(layer, x, *by_position, **by_keyword)
    assert torch.equal(fused, stock)
    second = fused_residual_norm(layer)
    assert not torch.equal(fused, x + layer.mlp(second(x)))  # the attention did work


def weighted_norms(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> None:
    """Norm weights away from one, each its own, so that a norm's output read for another's shows."""
    norms = [child for child in module.modules() if "norm" in type(child).__name__.lower()]
    for i, norm in enumerate(norms):
        norm.weight.data = random(norm.weight.shape[0], dtype=dtype, seed=seed + i) + 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["qwen2_vl_block", "qwen2_5_vl_block", "clip"])
def test_a_vision_layer_handing_its_closing_add_to_the_next_layers_norm_gives_the_layers_bits(dtype, kind):
    first, by_position, by_keyword = vision_layer(kind, dtype)
    second = vision_layer(kind, dtype)[0]
    layers = torch.nn.ModuleList([first, second]).to(dtype).eval()  # as a tower lists its layers
    weighted_norms(layers, dtype, seed=15)
    counts = use_fused_kernels(layers)
    norm = second.layer_norm1 if kind == "clip" else second.norm1
    assert counts["closing_add_ahead"] == 1
    assert fused_successor(first) is norm and fused_successor(second) is None  # the last one's stays its own
    x = random(ROWS, 48, dtype=dtype, seed=13) * 3
    if kind == "clip":
        x = x[None]
    with torch.inference_mode():
        summed = first(x, *by_position, **by_keyword)
        assert norm._ahead is not None and norm._ahead[0] is summed
        chained = second(summed, *by_position, **by_keyword)
        assert norm._ahead is None  # taken by the call on the sum
        stock = type(second).forward(
            second, type(first).forward(first, x, *by_position, **by_keyword), *by_position, **by_keyword
        )
        # a loop that hands the next layer another tensor than the sum (as Qwen3-VL's text model adds
        # deepstack features after its first layers): the norm normalizes what it is given
        first(x, *by_position, **by_keyword)
        changed = summed + random(*summed.shape, dtype=dtype, seed=30)
        given_other = second(changed, *by_position, **by_keyword)
        stock_other = type(second).forward(second, changed, *by_position, **by_keyword)
    assert torch.equal(chained, stock)
    assert torch.equal(given_other, stock_other)
    assert not torch.equal(given_other, chained)


def qwen2_vl_tower(dtype: torch.dtype) -> Qwen2VisionTransformerPretrainedModel:
    """A Qwen2-VL vision tower of three blocks, its norms' weights each their own."""
    config = Qwen2VLVisionConfig(embed_dim=48, num_heads=4, mlp_ratio=2, depth=3, hidden_size=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel(config).to(dtype).eval()
    weighted_norms(tower, dtype, seed=40)
    return tower


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_towers_blocks_handing_their_closing_adds_on_give_the_towers_bits_with_fewer_passes(
    dtype, kernel_calls
):
    tower = qwen2_vl_tower(dtype)
    assert use_fused_kernels(tower)["closing_add_ahead"] == 2
    blocks = tower.blocks
    assert [fused_successor(block) for block in blocks] == [blocks[1].norm1, blocks[2].norm1, None]
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])  # two images, 24 patches
    pixels = random(24, 3 * 2 * 14 * 14, dtype=dtype, seed=41)
    with torch.inference_mode():
        chained = tower(pixels, grid)
        chained_calls = collections.Counter(kernel_calls)
        kernel_calls.clear()
        for block in blocks:
            del block.forward  # transformers' forwards, with the same Triton norms
        stock = tower(pixels, grid)
    assert torch.equal(chained.last_hidden_state, stock.last_hidden_state)
    assert torch.equal(chained.pooler_output, stock.pooler_output)
    # each block's two norms and the merger's: the first block's first norm and the merger's alone normalize
    # what they are given, every other norm adds a residual first
    assert dict(kernel_calls) == {"layer_norm": 7, "quick_gelu": 3}
    assert dict(chained_calls) == {
        "layer_norm": 2,
        "residual_layer_norm": 5,
        "closing_add_ahead": 2,
        "quick_gelu": 3,
    }


def test_a_layer_given_more_arguments_by_position_than_its_loop_passes_says_so():
    layer, _, _ = vision_layer("clip", torch.float32)
    use_fused_kernels(layer)
    with pytest.raises(TypeError, match="CLIPEncoderLayer takes 1 arguments by position"):
        layer(random(1, ROWS, 48, dtype=torch.float32, seed=13), None, None)


def test_only_layers_with_the_kernels_norm_add_their_residual_in_it():
    config = Qwen2Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    layer = Qwen2DecoderLayer(config, layer_idx=0)
    assert fuse_residual_norms(layer) == 0  # transformers' own norm has no fused add
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_vls_text_attention_with_the_kernels_equals_transformers(dtype, monkeypatch):
    """The q/k RMSNorms (strided views of the fused q/k/v output) and the one rotation, by the kernels:
    the queries, keys and values the attention gets are transformers'."""
    stock = stock_attention(dtype)
    seen = {}

    def recorded(module, query, key, value, *args, **kwargs):
        seen[type(module).__name__] = (query, key, value)
        return causal_attention(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(CAUSAL_ATTENTION_NAME, recorded)
    monkeypatch.setattr(fused_projections, "paged_attention", recorded)
    fused = torch.nn.Sequential(FusedQKVAttention(stock))  # a parent, for the swaps
    counts = use_fused_kernels(fused)
    assert (counts["rms_norm"], counts["text_rotary"]) == (2, 1)
    hidden, position_embeddings = step_inputs(dtype)
    with torch.inference_mode():
        stock(hidden, position_embeddings, attention_mask=None)
        fused[0](hidden, position_embeddings)
    expected, actual = seen["Qwen3VLTextAttention"], seen["FusedQKVAttention"]
    for got, want in zip(actual[:2], expected[:2], strict=True):
        # float32 against each head's largest value: a rotated value can cancel to near zero
        assert_close(got, want, scale=want.abs().amax(-1, keepdim=True))
    assert torch.equal(actual[2], expected[2])


# --- whole models ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def as_on_cuda():
    """Models load with the swaps a CUDA device gets: no native kernels, no oneDNN packing. Attention
    takes torch's path instead of its Triton kernels, checked elsewhere: the interpreter runs a kernel's
    programs one by one, tens of milliseconds each, and these checks are about the other kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DISABLE_VARIABLE, "0")
        patch.setattr(triton_attention, "takes", lambda layer: False)
        patch.setattr(fused_activation, "fuse_mlp_activations", lambda model: 0)
        patch.setattr(packed_linear, "pack_linear_weights", lambda model: 0)
        native_ops.cache_clear()
        yield
    native_ops.cache_clear()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp("models") / family
            built[family] = build_tiny_model(folder, family=family, seed=0, sharpness=SHARPNESS)
        return built[family]

    return get


def kernels_in(model: torch.nn.Module) -> tuple[int, ...]:
    """What the model runs the kernels in, counted as SWAPPED counts them, from its modules."""
    modules = list(model.modules())
    return (
        sum(isinstance(m, TritonRMSNorm) for m in modules),
        sum(isinstance(m, TritonLayerNorm) for m in modules),
        sum(isinstance(m, TritonQuickGELU) for m in modules),
        sum(getattr(m, "silu_and_mul", None) is triton_elementwise.silu_and_mul for m in modules),
        sum(getattr(m, "rotate", None) is rotate_text_rows for m in modules),
        sum(getattr(m, "rotate", None) is rotate_vision_rows for m in modules),
        sum(isinstance(fused_residual_norm(m), TritonRMSNorm) for m in modules),
        sum(isinstance(fused_residual_norm(m), TritonLayerNorm) for m in modules),
        sum(fused_successor(m) is not None for m in modules),
    )


def fused_model(family: str, path, dtype: str):
    """The family's tiny model as loaded on CUDA, with the kernels swapped in where it has what they
    replace, and none of the replaced modules left."""
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    model = loaded.adapter.model
    assert tuple(use_fused_kernels(model).values()) == kernels_in(model) == SWAPPED[family]
    left = {type(m).__name__ for m in model.modules()} & {
        *STOCK_RMS_NORMS,
        "LayerNorm",
        "QuickGELUActivation",
    }
    assert not left
    return loaded


def request_of(loaded) -> tuple[list[int], list, dict]:
    """(prompt ids, prepared media, processor inputs) of one prompt on one image: the interpreter's time
    grows with the rows, so one short request."""
    renderer = PromptRenderer(loaded.processor)
    image = random_image(60, 90, 0)
    prepared = prepare(loaded, [image])
    rendered = renderer.render(PROMPT, 1)
    inputs = loaded.processor(text=[rendered], images=[image], return_tensors="pt")
    return renderer.token_ids(rendered, prepared), prepared, inputs


# chunks of 16 tokens: prefill runs over cached context (positions and their rotation from an offset)
LIMITS = EngineConfig(max_num_batched_tokens=16, block_size=4)


@pytest.fixture
def kernel_calls(monkeypatch) -> collections.Counter:
    """Calls of each kernel from here on (the swaps take the counting functions)."""
    calls = collections.Counter()
    for name in ("rms_norm", "layer_norm", "quick_gelu", "silu_and_mul", "rotary_", "rotary_into_cache_"):
        kernel = getattr(triton_elementwise, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            if _name == "rotary_into_cache_":
                calls["text_rotary"] += 1
                calls["kv_written_by_rotary"] += 1
            elif _name == "rotary_":
                calls["vision_rotary" if kwargs.get("vision") else "text_rotary"] += 1
            elif _name == "rms_norm" and len(args) > 3:
                calls["residual_rms_norm"] += 1
            elif _name == "layer_norm" and len(args) > 4:
                calls["residual_layer_norm"] += 1
            else:
                calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_elementwise, name, counted)
    add_ahead = TritonNorm.add_ahead

    def counted_ahead(norm, *args):
        calls["closing_add_ahead"] += 1  # (its kernel counted too, as a residual norm's)
        return add_ahead(norm, *args)

    monkeypatch.setattr(TritonNorm, "add_ahead", counted_ahead)
    return calls


@pytest.mark.parametrize("family", SWAPPED)
def test_a_model_with_the_kernels_equals_generate_in_float32(
    family, as_on_cuda, model_dirs, kernel_calls, monkeypatch
):
    path = model_dirs(family)
    loaded = fused_model(family, path, "float32")
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    case = make_case(reference, "fp32", *request_of(loaded), NEW_TOKENS)
    copies = collections.Counter()
    write = KVCache.write
    monkeypatch.setattr(KVCache, "write", lambda *args: copies.update(["kv"]) or write(*args))
    _, observed = run_cases(loaded, [case], LIMITS, SamplingParams(NEW_TOKENS))
    assert_matches_reference(observed[case.tag], case)
    # every kernel the family has ran (its modules call them, not the eager ops)
    assert {name for name in KERNELS if kernel_calls[name]} == {
        name for name, count in zip(KERNELS, SWAPPED[family], strict=True) if count
    }
    # every text layer's keys and values went into the cache by its rotation's kernel, none by a copy
    assert kernel_calls["kv_written_by_rotary"] == kernel_calls["text_rotary"] > 0 and not copies


def teacher_forced_logits(model, inputs: dict, generated: list[int]) -> torch.Tensor:
    """The model's logits predicting each generated token, given the prompt and the tokens before it."""
    fed = torch.tensor([generated[:-1]])
    prompt_length = inputs["input_ids"].shape[1]
    forced = {**inputs, "input_ids": torch.cat([inputs["input_ids"], fed], dim=1)}
    forced["attention_mask"] = torch.ones_like(forced["input_ids"])
    if "mm_token_type_ids" in inputs:
        forced["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(fed)], dim=1)
    forced["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    with torch.inference_mode():
        return model(**forced).logits[0, prompt_length - 1 :].float()


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact.double()).norm() / exact.double().norm())


def test_a_bf16_model_with_the_kernels_is_as_close_to_float32_as_transformers_bf16(as_on_cuda, model_dirs):
    # Qwen2-VL has every kernel (the other families' modules are checked in bf16 one by one above: a
    # whole model under the interpreter takes half a minute)
    path = model_dirs("qwen2_vl")
    loaded = fused_model("qwen2_vl", path, "bfloat16")
    ids, media, inputs = request_of(loaded)
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, LIMITS, loaded.eos_token_ids())
    probe = EngineProbe(engine)
    engine.add_request(EngineRequest(ids, media, SamplingParams(NEW_TOKENS, ignore_eos=True), "bf16"))
    observed = probe.run()["bf16"]
    generated = observed.result.output_token_ids
    assert observed.logits.shape[0] == len(generated) == NEW_TOKENS
    exact = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    stock_bf16 = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    reference = teacher_forced_logits(exact, inputs, generated)
    engine_error = relative_error(observed.logits, reference)
    stock_error = relative_error(teacher_forced_logits(stock_bf16, inputs, generated), reference)
    assert engine_error < 1.25 * stock_error, (engine_error, stock_error)
