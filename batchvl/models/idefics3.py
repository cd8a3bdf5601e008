"""Adapter for Idefics3-style models: a SigLIP-like vision tower over square tiles, a pixel-shuffle
connector and a Llama-style decoder.

An image is several frames (tiles plus a global view); each frame's features are `image_seq_len` rows,
filling that frame's run of image tokens. The frames of every image in an encode call go through the
tower as one batch (each frame attends only to itself). Positions are plain 1-D.
"""

from __future__ import annotations

import torch

from batchvl.models.adapter import VLMAdapter


class Idefics3Adapter(VLMAdapter):
    decoder_name = "text_model"

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.placeholder_token_ids = {"image": model.config.image_token_id}

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        frames = pixel_values.to(self.device, self.dtype)[None]  # (batch 1, all frames, 3, T, T)
        out = self.model.model.get_image_features(frames, return_dict=True)
        pooled = out.pooler_output
        # One (frames * image_seq_len, hidden) tensor per batch entry; some transformers releases (5.17 among
        # them) give one (frames, image_seq_len, hidden) tensor instead.
        features = pooled.flatten(0, 1) if isinstance(pooled, torch.Tensor) else pooled[0]
        rows_per_frame = features.shape[0] // pixel_values.shape[0]
        return list(features.split((grid_thw[:, 0] * rows_per_frame).tolist()))
