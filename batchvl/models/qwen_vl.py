"""Adapters for the Qwen-VL families: Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

All three take patch rows and a (t, h, w) grid in the vision tower and place tokens with multimodal
rope (3 position axes). Qwen2.5-VL spaces video frames in time by seconds (`second_per_grid_ts`);
Qwen3-VL also adds deepstack features (intermediate vision layers) to the first decoder layers' hidden
states at image tokens, on every prefill chunk. On the CPU a vision call's rows are padded up to their row
bucket with one blank image, so that the tower's packed linear layers take them as they are
(`vision_call_rows`, `with_blank_image`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch

from batchvl.engine.device.graph_capture import GraphCapture
from batchvl.layers.row_buckets import bucket_rows, pads_rows
from batchvl.models.adapter import VLMAdapter
from batchvl.models.qwen_vision_graphs import VisionGraphs, graphable, padded_rows
from batchvl.models.qwen_vision_inputs import grid_inputs, on_device
from batchvl.preprocess.media import PreparedMedia

MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2  # mm_token_type_ids values


def with_blank_image(grid_thw: torch.Tensor, rows: int, merge_size: int) -> torch.Tensor:
    """The grids of a vision call whose `rows` pixel rows run past its items' rows, with one blank image
    over the zero rows after them: a strip one merge window high, which attends only to itself and whose
    output is dropped. Item rows are a multiple of merge_size^2 and so are the row buckets the rows are
    padded to (`vision_call_rows`), so the strip's width is whole merge windows."""
    padding = rows - int(grid_thw.prod(-1).sum())
    if not padding:
        return grid_thw
    blank = torch.tensor([[1, merge_size, padding // merge_size]], dtype=grid_thw.dtype)
    return torch.cat([grid_thw, blank])


class Qwen2VLAdapter(VLMAdapter):
    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype, device)
        config = model.config
        self.placeholder_token_ids = {"image": config.image_token_id, "video": config.video_token_id}
        # bounded: a job whose prompts all differ in layout (free-form questions) keeps the last ones
        self._positions_of_layout = functools.lru_cache(maxsize=4096)(self._layout_positions)
        self.vision_graphs: VisionGraphs | None = None  # `use_vision_graphs`

    def use_vision_graphs(self, graph_capture: GraphCapture | None, max_patches: int) -> bool:
        """See `ModelAdapter.use_vision_graphs`: where the tower can (`qwen_vision_graphs.graphable`), its
        calls of up to `max_patches` patches, padded, replay graphs from now on."""
        visual = self.model.model.visual
        self.vision_graphs = None
        if graph_capture is None or not graphable(visual, self.dtype, self.device):
            return False

        @torch.inference_mode()
        def tower(pixels: torch.Tensor, inputs: dict) -> list[torch.Tensor]:
            # what the tower derives from the grid, given; the grid itself is read by nothing then
            out = visual(pixels, None, return_dict=True, **inputs)
            return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]

        self.vision_graphs = VisionGraphs(tower, graph_capture, padded_rows(max_patches), self.device)
        return True

    def vision_call_rows(self, rows: int) -> int:
        """With vision graphs, a graph's rows (`qwen_vision_graphs.padded_rows`) where one takes the call.
        Otherwise on the CPU, the row bucket (`row_buckets`): every linear layer of the tower would otherwise
        copy its input into a padded tensor of its own (about a tenth of encoding, measured on a CPU with
        AMX), where the call's rows cost at most an eighth more; a GPU's matmuls take any row count: no
        padding, whose rows would only add work there."""
        graphs = self.vision_graphs
        if graphs is not None and graphs.takes(padded_rows(rows)):
            return padded_rows(rows)
        return bucket_rows(rows) if pads_rows(self.device) else rows

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
        pixels = pixel_values.to(self.device, self.dtype)  # as staged for the call: no copy
        grid = with_blank_image(grid_thw, len(pixels), merge_size)
        sizes = (grid.prod(-1) // merge_size**2).tolist()
        graphs = self.vision_graphs
        if graphs is not None and graphs.takes(len(pixels)):
            merged, *deepstack = graphs(pixels, grid_inputs(visual, grid))
            return SimpleNamespace(pooler_output=merged.split(sizes), deepstack_features=deepstack)
        inputs = on_device({**grid_inputs(visual, grid), "grid_thw": grid}, self.device)
        out = visual(pixels, return_dict=True, **inputs)
        out.pooler_output = out.pooler_output.split(sizes)
        return out

    def prompt_positions(
        self, prompt_token_ids: list[int], media: list[PreparedMedia]
    ) -> tuple[torch.Tensor, int]:
        """transformers' `get_rope_index` for one prompt, computed once per prompt layout.

        `get_rope_index` reads the prompt only through its token types (text, image or video, in order)
        and the media's grids (and Qwen2.5-VL's seconds per grid), so prompts that share those share
        their positions: a captioning job's prompts mostly do, and the host skips its dozens of small
        tensor ops a request (about a millisecond on a CPU core). The cached tensor is shared by those
        requests, which only read it."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        if not media:
            return torch.arange(len(ids)).expand(3, -1).contiguous(), 0
        token_types = np.zeros(len(ids), dtype=np.int64)
        token_types[ids == self.placeholder_token_ids["image"]] = MM_IMAGE
        token_types[ids == self.placeholder_token_ids["video"]] = MM_VIDEO
        layout = tuple((m.kind, tuple(m.grid_thw), m.seconds_per_grid_t) for m in media)
        return self._positions_of_layout(token_types.tobytes(), layout)

    @torch.inference_mode()
    def _layout_positions(self, token_types: bytes, layout: tuple) -> tuple[torch.Tensor, int]:
        """`get_rope_index` of a prompt with these token types (int64 bytes) and media (kind, grid and
        seconds per grid, in prompt order). rope_deltas cached on the module is never used."""
        types = torch.frombuffer(bytearray(token_types), dtype=torch.long)[None]
        # ids of zeros: a transformers that read the ids' values would give positions the tests tell apart
        ids = torch.zeros_like(types)
        positions, deltas = self.model.model.get_rope_index(ids, types, **self._rope_media(layout))
        return positions[:, 0, :].contiguous(), int(deltas[0, 0])

    def _rope_media(self, layout: tuple) -> dict:
        """`get_rope_index`'s media arguments from a prompt's (kind, grid, seconds per grid) in order."""
        grids = {}
        for kind in ("image", "video"):
            chosen = [grid for item_kind, grid, _ in layout if item_kind == kind]
            grids[f"{kind}_grid_thw"] = torch.tensor(chosen, dtype=torch.long) if chosen else None
        return grids

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None, :]  # (3, T) -> (3, batch 1, T)


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    def _rope_media(self, layout: tuple) -> dict:
        videos = [seconds for kind, _, seconds in layout if kind == "video"]
        return {**super()._rope_media(layout), "second_per_grid_ts": torch.tensor(videos) if videos else None}


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
