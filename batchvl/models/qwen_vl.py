"""Adapters for the Qwen-VL families: Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

All three take patch rows and a (t, h, w) grid in the vision tower and place tokens with multimodal
rope (3 position axes). Qwen2.5-VL spaces video frames in time by seconds (`second_per_grid_ts`);
Qwen3-VL also adds deepstack features (intermediate vision layers) to the first decoder layers' hidden
states at image tokens, on every prefill chunk. A vision call's rows are padded up to their row bucket
with one blank image, so that the tower's packed linear layers take them as they are
(`padded_to_bucket`).
"""

from __future__ import annotations

import torch

from batchvl.layers.row_buckets import bucket_rows
from batchvl.models.adapter import VLMAdapter
from batchvl.models.qwen_vision_inputs import grid_inputs, on_device
from batchvl.preprocess.media import PreparedMedia

MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2  # mm_token_type_ids values


def padded_to_bucket(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge_size: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch rows (in `dtype`) and grids of a vision call with one blank image appended that fills the rows
    up to their bucket (`row_buckets`), when they fall short of it.

    Every linear layer of the tower would otherwise copy its input into a padded tensor of its own (about
    a tenth of encoding, measured on a CPU with AMX). The blank image is a strip one merge window high;
    it attends only to itself, costs at most an eighth more rows, and its output is dropped. An image's
    rows are a multiple of merge_size^2 and so are the buckets, so the strip's width is whole merge windows.
    """
    rows, width = pixel_values.shape
    padding = bucket_rows(rows) - rows
    if not padding:
        return pixel_values.to(device, dtype), grid_thw  # no copy where they already are what the tower takes
    pixels = torch.empty((rows + padding, width), dtype=dtype, device=device)
    pixels[:rows] = pixel_values
    pixels[rows:] = 0
    blank = torch.tensor([[1, merge_size, padding // merge_size]], dtype=grid_thw.dtype)
    return pixels, torch.cat([grid_thw, blank])


class Qwen2VLAdapter(VLMAdapter):
    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        config = model.config
        self.placeholder_token_ids = {"image": config.image_token_id, "video": config.video_token_id}

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        out = self._vision_features(pixel_values, grid_thw)
        return list(out.pooler_output[: len(grid_thw)])

    def _vision_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """The tower's outputs for the call's images or videos (`pooler_output` split by item), then for the
        blank image padding it, if any. The tower is called as transformers' `get_image_features` and
        `get_video_features` call it, with what it derives from the grid made on the host
        (`qwen_vision_inputs`), and its output split by sizes known there, not read from the device."""
        visual = self.model.model.visual
        merge_size = visual.spatial_merge_size
        pixels, grid = padded_to_bucket(pixel_values, grid_thw, merge_size, self.dtype, self.device)
        inputs = on_device({**grid_inputs(visual, grid), "grid_thw": grid}, self.device)
        out = visual(pixels, return_dict=True, **inputs)
        out.pooler_output = out.pooler_output.split((grid.prod(-1) // merge_size**2).tolist())
        return out

    @torch.inference_mode()
    def prompt_positions(
        self, prompt_token_ids: list[int], media: list[PreparedMedia]
    ) -> tuple[torch.Tensor, int]:
        ids = torch.tensor([prompt_token_ids], dtype=torch.long)
        if not media:
            return torch.arange(ids.shape[1]).expand(3, -1).contiguous(), 0
        token_types = torch.full_like(ids, MM_TEXT)
        token_types[ids == self.placeholder_token_ids["image"]] = MM_IMAGE
        token_types[ids == self.placeholder_token_ids["video"]] = MM_VIDEO
        # get_rope_index is a pure function of ids and grids; rope_deltas cached on the module is never used.
        positions, deltas = self.model.model.get_rope_index(ids, token_types, **self._rope_media(media))
        return positions[:, 0, :].contiguous(), int(deltas[0, 0])

    def _rope_media(self, media: list[PreparedMedia]) -> dict:
        grids = {}
        for kind in ("image", "video"):
            chosen = [m.grid_thw for m in media if m.kind == kind]
            grids[f"{kind}_grid_thw"] = torch.tensor(chosen, dtype=torch.long) if chosen else None
        return grids

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None, :]  # (3, T) -> (3, batch 1, T)


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    def _rope_media(self, media: list[PreparedMedia]) -> dict:
        videos = [m.seconds_per_grid_t for m in media if m.kind == "video"]
        return {**super()._rope_media(media), "second_per_grid_ts": torch.tensor(videos) if videos else None}


def add_deepstack_features(
    hidden_states: torch.Tensor, media_positions: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """transformers' `Qwen3VLTextModel._deepstack_process` with the media rows' packed positions where it
    takes a boolean mask of them: the same sum at the same rows (a mask's rows are its positions in
    order), without the mask's `nonzero`, which makes the host wait for the GPU in every deepstack layer of
    a step with media."""
    hidden_states = hidden_states.clone()
    features = features.to(hidden_states.device, hidden_states.dtype)
    hidden_states[0, media_positions] = hidden_states[0, media_positions] + features
    return hidden_states


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Embedding rows hold the merged features and each deepstack layer's features side by side. The text
    model adds the deepstack features by the media rows' positions (`add_deepstack_features`, its own
    `_deepstack_process` on this instance, to which `visual_pos_masks` carries the positions)."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.language_model._deepstack_process = add_deepstack_features

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        out = self._vision_features(pixel_values, grid_thw)
        sizes = [len(item) for item in out.pooler_output]
        # deepstack_features: per deepstack layer, one tensor over every item, split like pooler_output
        deepstack = [layer.split(sizes) for layer in out.deepstack_features]
        per_item = list(zip(out.pooler_output, *deepstack, strict=True))
        return [torch.cat(items, dim=-1) for items in per_item[: len(grid_thw)]]  # not the blank image

    def media_kwargs(self, media_positions: torch.Tensor | None, media_rows: torch.Tensor | None) -> dict:
        if media_rows is None:
            return {}
        deepstack = media_rows[:, self.hidden_size :].to(self.device, self.dtype)
        return {
            "visual_pos_masks": media_positions,  # positions, as `add_deepstack_features` takes them
            "deepstack_visual_embeds": list(deepstack.split(self.hidden_size, dim=-1)),
        }
