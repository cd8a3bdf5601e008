"""Vision encoding: grouped, one attention call per layer, and equal to encoding each image alone."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.engine.model_runner import encode_batches, encode_images
from batchvl.layers import vision_attention
from batchvl.layers.qwen_vision_attention import QwenVisionAttention, rotate_queries_and_keys
from batchvl.layers.row_buckets import bucket_rows
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image, prepare_video
from batchvl.preprocess.video import FrameSampling, decode_video
from tests.conftest import random_image, tower_pixels, video_bytes

SIZES = [(60, 60), (60, 60), (120, 80), (30, 300), (200, 150), (60, 60), (90, 90)]


@pytest.fixture(scope="module")
def media(loaded_fp32):
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    images = [prepare_image(random_image(h, w, seed), spec) for seed, (h, w) in enumerate(SIZES)]
    clip = decode_video(video_bytes(12, 10, 56, 84), None, FrameSampling(2.0, 4, 8), 2, 10**8)
    return images, prepare_video(clip, spec, 10**6)


@pytest.fixture(scope="module")
def stock(tiny_model_dir):
    """The model as transformers runs it: SDPA, one attention call per image."""
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def stock_features(stock, item: PreparedMedia) -> torch.Tensor:
    features = stock.model.get_video_features if item.kind == "video" else stock.model.get_image_features
    with torch.inference_mode():
        out = features(torch.from_numpy(tower_pixels(item)), torch.tensor([item.grid_thw]), return_dict=True)
    return out.pooler_output[0]


def test_one_call_per_layer_equals_each_image_alone(loaded_fp32, stock, media, monkeypatch):
    images, clip = media
    calls = []
    varlen = vision_attention.varlen_vision_attention

    def counting(*args, **kwargs):
        calls.append(kwargs["cu_seq_lens_q"].numel() - 1)
        return varlen(*args, **kwargs)

    monkeypatch.setattr(vision_attention, "varlen_vision_attention", counting)
    # as the engine calls the tower: each call's pixels staged, and padded on the CPU to their row bucket
    together = encode_images(loaded_fp32.adapter, images, max_patches=4096)
    video = encode_images(loaded_fp32.adapter, [clip], max_patches=4096)
    depth = loaded_fp32.adapter.model.config.vision_config.depth
    # one call per layer for all 7 images and the blank one padding their rows to a bucket; then one per
    # layer for the video's 2 frame groups, whose rows are a bucket already
    rows = sum(len(img.pixel_values) for img in images)
    assert bucket_rows(rows) > rows
    assert bucket_rows(len(clip.pixel_values)) == len(clip.pixel_values)
    assert calls == [len(images) + 1] * depth + [clip.grid_thw[0]] * depth
    for img, emb in zip(images, together, strict=True):
        torch.testing.assert_close(emb, stock_features(stock, img), rtol=0, atol=1e-5)
    torch.testing.assert_close(video[0], stock_features(stock, clip), rtol=0, atol=1e-5)


def test_a_vision_calls_sequence_lengths_are_read_once_not_in_every_layer(loaded_fp32, monkeypatch):
    # Reading them from a GPU is a sync. Each call's cu_seqlens is one tensor that every layer gets.
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    reads = []
    tolist = torch.Tensor.tolist

    def recording_tolist(tensor):
        values = tolist(tensor)
        reads.append(values)
        return values

    monkeypatch.setattr(torch.Tensor, "tolist", recording_tolist)
    lengths_of_calls = []
    for sizes in ([(60, 60), (120, 80), (30, 300)], [(200, 150), (90, 90), (60, 60)]):
        chosen = [prepare_image(random_image(h, w, seed), spec) for seed, (h, w) in enumerate(sizes)]
        encode_images(loaded_fp32.adapter, chosen, max_patches=4096)  # one call, as the engine makes it
        lengths = sorted(img.num_patches for img in chosen)  # a call's images in ascending patch counts
        padding = bucket_rows(sum(lengths)) - sum(lengths)  # a blank image pads the call's rows to a bucket
        lengths_of_calls.append(lengths + [padding] if padding else lengths)
    assert loaded_fp32.adapter.model.config.vision_config.depth > 1
    assert [
        read for read in reads if read in lengths_of_calls
    ] == lengths_of_calls  # once a call, each its own


def test_encode_batches_group_by_kind_and_patch_count(media):
    images, clip = media
    batches = encode_batches([*images, clip], max_patches=2 * images[0].num_patches)
    assert sorted(id(img) for batch in batches for img in batch) == sorted(id(i) for i in [*images, clip])
    for batch in batches:
        assert len({img.kind for img in batch}) == 1
        assert len(batch) == 1 or sum(img.num_patches for img in batch) <= 2 * images[0].num_patches
    sizes = [[img.num_patches for img in batch] for batch in batches if batch[0].kind == "image"]
    flat = [n for batch in sizes for n in batch]
    assert flat == sorted(flat)  # ascending patch counts: neighbours in a call are alike
    assert [img.num_patches for img in batches[0]] == [images[0].num_patches] * 2  # the equal 60x60 pair


def test_equal_runs_split_wherever_the_length_changes():
    assert vision_attention.equal_runs([16, 16, 17, 40, 40, 40, 100, 16]) == [
        (0, 2),
        (2, 1),
        (3, 3),
        (6, 1),
        (7, 1),
    ]
    assert vision_attention.equal_runs([64] * 5) == [(0, 5)]


def test_mixed_lengths_attend_within_each_sequence_in_one_call_per_run(monkeypatch):
    torch.manual_seed(0)
    lengths = [16, 16, 17, 40, 40, 40, 100, 16]  # unsorted on purpose: runs are consecutive sequences
    heads, dim, total = 4, 8, sum(lengths)
    query, key, value = (torch.randn(1, heads, total, dim) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])  # sequences in the call
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(vision_attention.F, "scaled_dot_product_attention", counting)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out, _ = vision_attention.varlen_vision_attention(
        None, query, key, value, None, scaling=None, cu_seq_lens_q=cu, max_length_q=max(lengths)
    )
    assert calls == [2, 1, 3, 1, 1]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = sdpa(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end])
        torch.testing.assert_close(out[:, start:end], alone.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_queries_and_keys_rotated_together_give_the_bits_of_transformers_rotation_in_float32():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    torch.manual_seed(0)
    qkv = torch.randn(50, 3, 4, 16)  # (rows, q/k/v, heads, head dim), as the qkv layer's view
    cos, sin = torch.randn(50, 16), torch.randn(50, 16)
    rotated = rotate_queries_and_keys(qkv[:, :2], cos, sin)
    query, key = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    assert rotated.dtype == torch.float32
    assert torch.equal(rotated[:, 0], query) and torch.equal(rotated[:, 1], key)


def test_bf16_queries_and_keys_rotate_within_bf16_rounding_of_transformers():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    torch.manual_seed(0)
    qkv = torch.randn(500, 3, 4, 16).to(torch.bfloat16)
    angles = torch.rand(500, 16) * 6.3
    cos, sin = angles.cos(), angles.sin()
    rotated = rotate_queries_and_keys(qkv[:, :2], cos, sin)
    query, key = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)  # float32 inside
    assert rotated.dtype == torch.bfloat16
    for mine, stock in ((rotated[:, 0], query), (rotated[:, 1], key)):
        error = float((mine.double() - stock.double()).norm() / stock.double().norm())
        assert 0 < error < 2**-7  # a few bf16 roundings (2^-9 each) apart, not a wrong rotation


def test_the_loaded_qwen_tower_runs_its_own_attention_module(loaded_fp32):
    blocks = loaded_fp32.adapter.model.model.visual.blocks
    assert all(type(block.attn) is QwenVisionAttention for block in blocks)


@pytest.mark.parametrize("setting,flash_varlen", [("auto", True), ("flash_varlen", True), ("sdpa", False)])
def test_the_towers_attention_is_loaded_as_engine_vision_attention_sets_it(
    tiny_model_dir, setting, flash_varlen
):
    from batchvl.models.loader import load_model

    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu", vision_attention=setting)
    modules = [m for m in loaded.adapter.model.modules() if isinstance(m, QwenVisionAttention)]
    assert len(modules) == loaded.adapter.model.config.vision_config.depth
    assert all(getattr(m, vision_attention.VARLEN_ATTRIBUTE) is flash_varlen for m in modules)
