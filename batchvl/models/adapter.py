"""The engine's `ModelAdapter` protocol (engine/adapter.py) for Hugging Face VLMs: what all families share.

The engine owns scheduling, the KV cache, attention, positions, embedding fusion and sampling; an adapter
exposes the pieces of a Hugging Face model it needs (vision tower, token embeddings, decoder stack,
lm_head, the family's position rule), so the engine has no family-specific branches. `VLMAdapter`
implements what the families have in common (a decoder stack on `model.model`, media rows written over
placeholder embeddings, 1-D positions); a family overrides what differs.
"""

from __future__ import annotations

import torch

from batchvl.engine.adapter import TextGeometry
from batchvl.layers.attention import uploaded
from batchvl.layers.decoder_stack import DecoderStack
from batchvl.preprocess.media import PreparedMedia


class VLMAdapter:
    """Subclasses set `placeholder_token_ids` (media kind -> its placeholder token id) and implement
    `encode`; they override positions and extra decoder inputs where their family differs."""

    placeholder_token_ids: dict[str, int]
    decoder_name = "language_model"  # the decoder stack's attribute on `model.model`

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.dtype = dtype
        self.device = device
        text = model.config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.geometry = TextGeometry(
            num_layers=text.num_hidden_layers,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            max_model_len=text.max_position_embeddings,
            vocab_size=text.vocab_size,
        )
        self.hidden_size = text.hidden_size
        self.language_model = getattr(model.model, self.decoder_name)
        # the engine's own loop of its layers, where the text model is one it computes (else its forward)
        self.decoder_stack = DecoderStack.of(self.language_model)
        self._embed = model.model.get_input_embeddings()

    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """See `ModelAdapter.encode`. A family may carry more than the input embedding in a row, e.g.
        Qwen3-VL's deepstack features side by side."""
        raise NotImplementedError

    def vision_call_rows(self, rows: int) -> int:
        """See `ModelAdapter.vision_call_rows`. Default: no padding."""
        return rows

    @staticmethod
    def per_item(features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """(tiles, rows, hidden) features of a call's items, each `grid_thw[i, 0]` tiles in order -> each
        item's rows, (its tiles x rows, hidden), as views."""
        rows_per_tile = features.shape[1]
        return list(features.flatten(0, 1).split((grid_thw[:, 0] * rows_per_tile).tolist()))

    def use_vision_graphs(self, graph_capture, max_patches: int) -> bool:
        """See `ModelAdapter.use_vision_graphs`. Default: the tower runs eagerly."""
        return False

    def prompt_positions(
        self, prompt_token_ids: list[int], media: list[PreparedMedia]
    ) -> tuple[torch.Tensor, int]:
        """See `ModelAdapter.prompt_positions`. Default: 1-D, no offset."""
        return torch.arange(len(prompt_token_ids))[None], 0

    def embed(
        self, token_ids: torch.Tensor, media_positions: torch.Tensor | None, media_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """The step's input embeddings, the media rows written at their positions."""
        embeds = self._embed(token_ids.to(self.device))
        if media_rows is not None:
            embeds.index_copy_(0, media_positions, media_rows[:, : self.hidden_size].to(embeds.dtype))
        return embeds

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        media_mask: torch.Tensor,
        media_rows: torch.Tensor | None,
        **attn_kwargs,
    ) -> torch.Tensor:
        """See `ModelAdapter.forward`: the decoder stack on `model.model`, media rows written over the
        placeholder embeddings, and what `media_kwargs` adds."""
        media_positions = None
        if media_rows is not None:
            # the packed rows the media rows fill, found on the host and uploaded without a wait: a boolean
            # mask on the device would make the host wait for the GPU (the count of its rows sizes the
            # result), which an overlapped step must not
            (media_positions,) = uploaded([media_mask.nonzero().flatten()], self.device)
        inputs_embeds = self.embed(token_ids, media_positions, media_rows)[None]
        position_ids = self.position_ids(positions.to(self.device))
        media_kwargs = self.media_kwargs(media_positions, media_rows)
        if self.decoder_stack is not None:
            return self.decoder_stack(inputs_embeds, position_ids, **media_kwargs, **attn_kwargs)[0]
        out = self.language_model(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            # no cache argument at all: its name differs between releases (transformers 5.24 deprecates
            # past_key_values for cache) and its default, none, is what the engine's own KV cache needs
            use_cache=False,
            **media_kwargs,
            **attn_kwargs,
        )
        return out.last_hidden_state[0]

    def media_kwargs(self, media_positions: torch.Tensor | None, media_rows: torch.Tensor | None) -> dict:
        """Extra decoder arguments carrying media beyond the input embeddings (none by default), given the
        packed positions of the media rows on the device."""
        return {}

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """(axes, T) -> what the decoder takes: (1, T) for 1-D rope."""
        return positions

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()
