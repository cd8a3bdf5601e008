"""Idefics3's vision call (models/idefics3.py): each image's rows equal transformers' own
`get_image_features` over the same frames, and the tower and connector read nothing back from their tensors
(on a GPU, each such read makes the host wait for the device)."""

import copy

import torch

from tests.engine.fake_graphs import guard_host_reads
from tests.models.vision_call import vision_call

IMAGE_SIZES = [(60, 90), (400, 100)]  # 13 frames and 5


def test_each_images_rows_equal_transformers_features(family_models):
    _, loaded = family_models("idefics3")
    pixels, grid = vision_call(loaded, IMAGE_SIZES)
    ours = loaded.adapter.encode("image", pixels, grid)
    with torch.inference_mode():
        frames = pixels[None].to(loaded.adapter.device)
        stock = loaded.adapter.model.model.get_image_features(frames, return_dict=True).pooler_output
    stock = stock[0] if isinstance(stock, list) else stock.flatten(0, 1)  # 5.24's form, 5.17's
    frames = grid[:, 0].tolist()
    assert len(ours) == len(IMAGE_SIZES) and frames[0] != frames[1]
    assert torch.equal(torch.cat(ours), stock)
    assert [len(rows) for rows in ours] == [count * len(stock) // sum(frames) for count in frames]


def test_the_tower_and_connector_read_nothing_back(family_models, monkeypatch):
    _, loaded = family_models("idefics3")
    model = loaded.adapter.model.model
    # get_image_features among them: it finds padding frames by a boolean index (a wait on a GPU)
    for owner, name in (
        (model.vision_model, "forward"),
        (model.connector, "forward"),
        (model, "get_image_features"),
    ):
        guard_host_reads(monkeypatch, owner, name)
    pixels, grid = vision_call(loaded, IMAGE_SIZES)
    assert len(loaded.adapter.encode("image", pixels, grid)) == len(IMAGE_SIZES)


@torch.inference_mode()
def test_the_frames_position_ids_are_the_embeddings_own_in_each_dtype(family_models):
    """The position ids made once per frame size give the tower's embeddings of frames whose patches are all
    valid, bit for bit, in float32 and in bf16 (where transformers 5.17 rounds the patches' coordinates to
    the pixels' dtype first)."""
    from batchvl.models.idefics3 import frame_position_ids

    _, loaded = family_models("idefics3")
    tower = loaded.adapter.model.model.vision_model
    for dtype in (torch.float32, torch.bfloat16):
        embeddings = copy.deepcopy(tower.embeddings).to(dtype)
        side = embeddings.num_patches_per_side
        for patches_h, patches_w in ((side, side), (side // 2, side)):
            size = embeddings.patch_size
            frames = torch.randn(3, 3, patches_h * size, patches_w * size).to(dtype)
            every_patch = torch.ones((3, patches_h, patches_w), dtype=torch.bool)
            stock = embeddings(pixel_values=frames, patch_attention_mask=every_patch)
            ids = frame_position_ids(embeddings, patches_h, patches_w, dtype)
            assert ids.shape == (patches_h * patches_w,)
            patched = embeddings.patch_embedding(frames).flatten(2).transpose(1, 2)
            assert torch.equal(patched + embeddings.position_embedding(ids), stock)
