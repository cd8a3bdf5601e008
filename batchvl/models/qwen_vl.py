"""Adapter for the Qwen2-VL family (mrope positions, merged-patch image embeddings)."""

from __future__ import annotations

import torch

from batchvl.models.adapter import TextGeometry

MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2  # mm_token_type_ids values


class QwenVLAdapter:
    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.dtype = dtype
        self.device = device
        config = model.config
        text = config.text_config
        self.placeholder_token_ids = {"image": config.image_token_id, "video": config.video_token_id}
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.geometry = TextGeometry(
            num_layers=text.num_hidden_layers,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            max_model_len=text.max_position_embeddings,
        )
        self._embed = model.model.get_input_embeddings()

    @torch.inference_mode()
    def encode(self, kind: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        features = (
            self.model.model.get_video_features if kind == "video" else self.model.model.get_image_features
        )
        out = features(pixel_values.to(self.device, self.dtype), grid_thw.to(self.device), return_dict=True)
        return list(out.pooler_output)

    @torch.inference_mode()
    def prompt_positions(
        self, prompt_token_ids: list[int], media: list[tuple[str, tuple[int, int, int]]]
    ) -> tuple[torch.Tensor, int]:
        ids = torch.tensor([prompt_token_ids], dtype=torch.long)
        if not media:
            positions = torch.arange(ids.shape[1]).expand(3, -1)
            return positions.contiguous(), 0
        token_types = torch.full_like(ids, MM_TEXT)
        token_types[ids == self.placeholder_token_ids["image"]] = MM_IMAGE
        token_types[ids == self.placeholder_token_ids["video"]] = MM_VIDEO
        grids = {
            kind: torch.tensor([g for k, g in media if k == kind], dtype=torch.long)
            if any(k == kind for k, _ in media)
            else None
            for kind in ("image", "video")
        }
        # get_rope_index is a pure function of ids and grids; rope_deltas cached on the module is never used.
        positions, deltas = self.model.model.get_rope_index(
            ids, token_types, image_grid_thw=grids["image"], video_grid_thw=grids["video"]
        )
        return positions[:, 0, :].contiguous(), int(deltas[0, 0])

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(token_ids.to(self.device))

    def forward_text(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, **attn_kwargs
    ) -> torch.Tensor:
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds[None],
            position_ids=positions[:, None, :].to(self.device),
            past_key_values=None,
            use_cache=False,
            **attn_kwargs,
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()
