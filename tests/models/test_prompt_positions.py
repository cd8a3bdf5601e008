"""A Qwen-VL prompt's positions are computed once per layout (models/qwen_vl.py `prompt_positions`): each
prompt's positions and offset equal transformers' `get_rope_index` called with the prompt's own token ids,
whether computed or taken from the cache, and prompts that differ in layout never share them."""

import numpy as np
import pytest
import torch

from batchvl.preprocess.media import PreparedMedia

QWEN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(params=QWEN_FAMILIES)
def adapter(request, family_models, loaded_fp32):
    loaded = loaded_fp32 if request.param == "qwen2_vl" else family_models(request.param)[1]
    return loaded.adapter


def media(kind: str, grid: tuple[int, int, int], seconds: float = 0.0) -> PreparedMedia:
    tokens = int(np.prod(grid)) // 4  # a 2x2 merge
    return PreparedMedia(np.zeros((1, 1), np.float32), grid, "hash", tokens, "", kind, seconds)


def prompt(adapter, parts: list, seed: int) -> list[int]:
    """Token ids: an int part is that many random text tokens, a PreparedMedia its placeholder run."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids += rng.integers(100, 1000, size=part).tolist()
        elif part.kind == "video" and type(adapter).__name__ == "Qwen3VLAdapter":
            # Qwen3-VL: a run per temporal step, each after its timestamp's text
            for _ in range(part.grid_thw[0]):
                ids += rng.integers(100, 1000, size=3).tolist()
                ids += [adapter.placeholder_token_ids["video"]] * (part.num_tokens // part.grid_thw[0])
        else:
            ids += [adapter.placeholder_token_ids[part.kind]] * part.num_tokens
    return ids


def transformers_positions(adapter, ids: list[int], items: list[PreparedMedia]) -> tuple[torch.Tensor, int]:
    """`get_rope_index` called as a caller of transformers would: the prompt's ids and their token types."""
    token_ids = torch.tensor([ids])
    types = torch.zeros_like(token_ids)
    types[token_ids == adapter.placeholder_token_ids["image"]] = 1
    types[token_ids == adapter.placeholder_token_ids["video"]] = 2
    kwargs = {}
    for kind in ("image", "video"):
        grids = [item.grid_thw for item in items if item.kind == kind]
        kwargs[f"{kind}_grid_thw"] = torch.tensor(grids) if grids else None
    seconds = [item.seconds_per_grid_t for item in items if item.kind == "video"]
    if type(adapter).__name__ == "Qwen2_5_VLAdapter":
        kwargs["second_per_grid_ts"] = torch.tensor(seconds) if seconds else None
    with torch.inference_mode():
        positions, deltas = adapter.model.model.get_rope_index(token_ids, types, **kwargs)
    return positions[:, 0, :], int(deltas[0, 0])


def layouts() -> list[list]:
    image, wide = media("image", (1, 8, 12)), media("image", (1, 12, 4))
    video, slow = media("video", (4, 8, 8), 0.5), media("video", (4, 8, 8), 2.0)
    return [
        [5, image, 9],
        [5, wide, 9],  # the same token count as above, another grid
        [3, image, 4, wide, 2],
        [3, wide, 4, image, 2],  # the same grids in the other order
        [6, video, 3],
        [6, slow, 3],  # the same grid, more seconds a frame (Qwen2.5-VL spaces frames by them)
        [2, image, 1, video, 4],
        [7],
    ]


def test_each_prompt_gets_transformers_positions_computed_or_cached(adapter):
    for seed in range(3):  # the same layouts with other text: from the second round on, cache hits
        for parts in layouts():
            items = [part for part in parts if isinstance(part, PreparedMedia)]
            ids = prompt(adapter, parts, seed)
            positions, delta = adapter.prompt_positions(ids, items)
            expected, expected_delta = transformers_positions(adapter, ids, items)
            assert torch.equal(positions, expected), parts
            assert delta == expected_delta, parts
    hits = adapter._positions_of_layout.cache_info().hits
    assert hits >= 2 * (len(layouts()) - 1)  # every layout with media, on the second and third rounds


def test_prompts_of_one_layout_compute_their_positions_once(adapter, monkeypatch):
    calls = []
    compute = adapter.model.model.get_rope_index
    counted = lambda *args, **kwargs: calls.append(1) or compute(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(adapter.model.model, "get_rope_index", counted)
    adapter._positions_of_layout.cache_clear()
    parts = [4, media("image", (1, 6, 10)), 11]
    for seed in range(5):
        adapter.prompt_positions(prompt(adapter, parts, seed), [parts[1]])
    assert len(calls) == 1
