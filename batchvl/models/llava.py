"""Adapter for LLaVA-1.5-style models: a CLIP vision tower, a projector and a Llama-style decoder.

Every image is one fixed-size crop; its features (the chosen vision layer, without the CLS token under
the "default" strategy, through the projector) fill its placeholder tokens. Positions are plain 1-D.
"""

from __future__ import annotations

import torch

from batchvl.models.adapter import VLMAdapter


class LlavaAdapter(VLMAdapter):
    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.placeholder_token_ids = {"image": model.config.image_token_id}

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return list(self.crop_features(pixel_values))

    def crop_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(crops, rows, hidden): each crop's features, the chosen layer's through the projector."""
        config = self.model.config
        out = self.model.model.get_image_features(
            pixel_values.to(self.device, self.dtype),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        )
        return out.pooler_output
