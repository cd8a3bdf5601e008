"""What the engine calls on a model: a small protocol, owned here so that the engine imports nothing from
the model families. `batchvl/models/adapter.py` implements it for Hugging Face VLMs (the part every family
shares), and each family overrides what differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchvl.preprocess.media import PreparedMedia


@dataclass(frozen=True)
class TextGeometry:
    """The decoder's shape, which sizes the KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int  # the logits' width


class ModelAdapter(Protocol):
    dtype: torch.dtype
    device: torch.device
    geometry: TextGeometry
    placeholder_token_ids: dict[str, int]  # media kind ("image", "video") -> its placeholder token id

    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Embedding rows per item (image or video), one (num_tokens, feature_dim) tensor each, in input
        order: what fills the item's placeholder tokens. `pixel_values` holds the items' pixels stacked,
        and zero rows after them up to `vision_call_rows`, or none."""
        ...

    def vision_call_rows(self, rows: int) -> int:
        """The rows (first axis) of a vision call's pixel tensor whose items have `rows` in all: more where
        the family pads its calls, the rows after the items' being zeros."""
        ...

    def use_vision_graphs(self, graph_capture, max_patches: int) -> bool:
        """From now on, replay vision calls of up to `max_patches` patches as graphs `graph_capture` records
        (`engine.vision_graphs`) where the family's tower can, or (`graph_capture` None) run them eagerly;
        whether they replay graphs."""
        ...

    def prompt_positions(
        self, prompt_token_ids: list[int], media: list[PreparedMedia]
    ) -> tuple[torch.Tensor, int]:
        """Positions of the prompt tokens, (num_pos_axes, L), and the offset for generated tokens
        (generated token i, counted over prompt + output, sits at position i + offset)."""
        ...

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        media_mask: torch.Tensor,
        media_rows: torch.Tensor | None,
        **attn_kwargs,
    ) -> torch.Tensor:
        """The decoder over packed tokens (T,) at positions (axes, T), the rows selected by `media_mask`
        filled by `media_rows`; returns hidden states (T, hidden)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states."""
        ...
