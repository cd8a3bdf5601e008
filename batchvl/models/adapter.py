"""The interface between the engine and a model family.

The engine owns scheduling, the KV cache, attention, positions, embedding fusion and sampling; an adapter
exposes the pieces of a Hugging Face model it needs (vision tower, token embeddings, decoder stack,
lm_head, the family's position rule), so the engine has no family-specific branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TextGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int


class VLMAdapter(Protocol):
    placeholder_token_ids: dict[str, int]  # media kind ("image", "video") -> its placeholder token id
    geometry: TextGeometry
    dtype: torch.dtype
    device: torch.device

    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Merged embeddings per image (or video), one (num_tokens, hidden) tensor each, in input order."""
        ...

    def prompt_positions(
        self, prompt_token_ids: list[int], media: list[tuple[str, tuple[int, int, int]]]
    ) -> tuple[torch.Tensor, int]:
        """Positions of the prompt tokens, shape (num_pos_axes, L), and the offset for generated tokens;
        `media` lists (kind, grid_thw) of the prompt's images and videos in order."""
        ...

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def forward_text(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, **attn_kwargs
    ) -> torch.Tensor:
        """Run the decoder over packed tokens (T, hidden) at positions (axes, T); returns (T, hidden)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
