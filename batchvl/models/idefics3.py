"""Adapter for Idefics3-style models: a SigLIP-like vision tower over square tiles, a pixel-shuffle
connector and a Llama-style decoder.

An image is several frames (tiles plus a global view); each frame's features are `image_seq_len` rows,
filling that frame's run of image tokens. The frames of every image in an encode call go through the
tower as one batch (each frame attends only to itself). Positions are plain 1-D.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchvl.models.adapter import VLMAdapter


def frame_position_ids(embeddings: torch.nn.Module, patches_h: int, patches_w: int, dtype) -> torch.Tensor:
    """The position ids (patches_h x patches_w,) the tower's embeddings give a frame whose every patch is
    valid, computed on the host by the installed module's own forward: its arithmetic changed between
    transformers releases (5.17 rounds the patches' fractional coordinates to the pixels' dtype and picks
    the valid patches by a boolean index, a wait for the device on a GPU; later releases do neither), so it
    runs as it is, over a stand-in that has no weights: its patch embedding gives zeros, and its position
    embedding hands back the ids it is given."""
    taken = []
    size = embeddings.patch_size
    stand_in = SimpleNamespace(
        patch_size=size,
        num_patches_per_side=embeddings.num_patches_per_side,
        patch_embedding=lambda pixels: torch.zeros((1, 1, patches_h, patches_w), dtype=pixels.dtype),
        position_embedding=lambda ids: taken.append(ids) or torch.zeros(ids.shape + (1,), dtype=dtype),
    )
    pixels = torch.zeros((1, 3, patches_h * size, patches_w * size), dtype=dtype)
    every_patch = torch.ones((1, patches_h, patches_w), dtype=torch.bool)
    type(embeddings).forward(stand_in, pixel_values=pixels, patch_attention_mask=every_patch)
    return taken[0][0]


class Idefics3Adapter(VLMAdapter):
    decoder_name = "text_model"

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.placeholder_token_ids = {"image": model.config.image_token_id}
        self._position_ids: dict[tuple[int, int], torch.Tensor] = {}  # per frame's patch grid, on the device

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """transformers' `get_image_features` without its search for all-zero padding frames, a boolean
        index and a read of their count (each a wait for the device on a GPU): batchvl's frames are each
        an image's own, never padding. The frames of the call go through the tower as one batch, as its
        forward runs them but for the attention mask it makes of their patch mask (all patches valid, which
        it checks by reading the mask back on a GPU): the tower attends without one. The embeddings are the
        tower's (patches, then their position embedding) with the position ids of a frame whose patches are
        all valid, made once per frame size (`frame_position_ids`)."""
        model = self.model.model
        tower = model.vision_model
        frames = pixel_values.to(self.device, self.dtype)  # (all frames, 3, T, T)
        embeddings = tower.embeddings
        patches = embeddings.patch_embedding(frames)  # (frames, hidden, patches_h, patches_w)
        grid = (patches.shape[2], patches.shape[3])
        if grid not in self._position_ids:
            ids = frame_position_ids(embeddings, *grid, self.dtype)
            self._position_ids[grid] = ids.to(self.device)
        hidden = patches.flatten(2).transpose(1, 2) + embeddings.position_embedding(self._position_ids[grid])
        hidden = tower.post_layernorm(tower.encoder(inputs_embeds=hidden).last_hidden_state)
        return self.per_item(model.connector(hidden), grid_thw)  # (frames, image_seq_len, hidden)


class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM2: Idefics3's model, whose video frames fill image tokens (each frame a global view)."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        self.placeholder_token_ids["video"] = model.config.image_token_id
