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
        """transformers' `get_image_features` without its search for all-zero padding frames, a boolean
        index and a read of their count (each a wait for the device on a GPU): batchvl's frames are each
        an image's own, never padding. The frames of the call go through the tower as one batch, as its
        forward runs them but for the attention mask it makes of their patch mask (all patches valid, which
        it checks by reading the mask back on a GPU): the tower attends without one."""
        model = self.model.model
        tower = model.vision_model
        frames = pixel_values.to(self.device, self.dtype)  # (all frames, 3, T, T)
        patches = (frames.shape[0], frames.shape[2] // tower.patch_size, frames.shape[3] // tower.patch_size)
        every_patch = torch.ones(patches, dtype=torch.bool, device=self.device)
        hidden = tower.embeddings(pixel_values=frames, patch_attention_mask=every_patch)
        hidden = tower.post_layernorm(tower.encoder(inputs_embeds=hidden).last_hidden_state)
        return self.per_item(model.connector(hidden), grid_thw)  # (frames, image_seq_len, hidden)


class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM2: Idefics3's model, whose video frames fill image tokens (each frame a global view)."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.placeholder_token_ids["video"] = model.config.image_token_id
