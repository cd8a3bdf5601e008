"""Adapter for InternVL (the transformers-format checkpoints): an InternViT tower over square tiles, a pixel
shuffle and MLP projector, a Qwen2-style decoder.

The model is LLaVA's with tiles: an image is several tiles (a grid and a thumbnail); each tile's features
(the chosen layer, without the CLS token, pixel-shuffled and projected) are `image_seq_length` rows,
filling that tile's run of context tokens; a video's frames are one tile each. The tiles of every image in
an encode call go through the tower as one batch. Positions are plain 1-D.
"""

from __future__ import annotations

import torch

from batchvl.models.llava import LlavaAdapter


class InternVLAdapter(LlavaAdapter):
    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.placeholder_token_ids["video"] = model.config.image_token_id  # a frame is one tile

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return self.per_item(self.crop_features(pixel_values), grid_thw)  # (tiles, image_seq_length, hidden)
