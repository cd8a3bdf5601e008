"""The real-size random models the GPU benchmarks make on their device: Qwen2-VL-2B's and -7B's
configurations (their parameter counts, counted on the meta device without allocating), and the builder end
to end at the `tiny` size on the CPU."""

import pytest
import torch

from batchvl.demo.device_model import build_on_device, parameter_count
from batchvl.demo.tiny_model import SIZES


@pytest.mark.parametrize(("size", "parameters"), [("2b", 2_208_985_600), ("7b", 8_291_375_616)])
def test_the_real_sizes_have_the_real_models_parameter_counts(size, parameters):
    assert parameter_count(size) == parameters  # 2.21B and 8.29B, as the published checkpoints


def test_the_real_sizes_configurations():
    two, seven = SIZES["2b"], SIZES["7b"]
    assert (two.hidden_size, two.num_layers, two.num_heads, two.num_kv_heads, two.head_dim) == (
        1536,
        28,
        12,
        2,
        128,
    )
    assert (seven.hidden_size, seven.num_heads, seven.num_kv_heads, seven.intermediate_size) == (
        3584,
        28,
        4,
        18944,
    )
    assert (two.vocab_size, seven.vocab_size, two.tied_embeddings, seven.tied_embeddings) == (
        151936,
        152064,
        True,
        False,
    )
    assert all((s.vit_depth, s.vit_dim, s.vit_heads) == (32, 1280, 16) for s in (two, seven))


def test_a_model_made_on_its_device_is_seeded_in_its_dtype_with_no_weight_files(tmp_path):
    loaded = build_on_device(tmp_path / "m", "tiny", "cpu", dtype=torch.bfloat16)
    parameters = list(loaded.adapter.model.parameters())
    assert {p.dtype for p in parameters} == {torch.bfloat16}
    assert {p.device.type for p in parameters} == {"cpu"}
    assert (tmp_path / "m" / "config.json").is_file() and not list((tmp_path / "m").glob("*.safetensors"))
    phases: dict[str, float] = {}
    again = build_on_device(tmp_path / "again", "tiny", "cpu", dtype=torch.bfloat16, phases_s=phases)
    assert set(phases) == {"processor", "weights", "prepare"} and min(phases.values()) >= 0
    first = next(loaded.adapter.model.parameters())
    assert torch.equal(first, next(again.adapter.model.parameters()))  # seeded
    assert loaded.eos_token_ids()
