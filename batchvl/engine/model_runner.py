"""The tensor side of the engine: KV cache, image embeddings, packed forward passes.

The scheduler decides what runs; the runner turns a step's chunks into one packed forward: token
embeddings with image rows scattered in, per-request positions, cache slots, and the logits of the
chunks that end at a request's last known token.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.device.device_block_table import DeviceBlockTable
from batchvl.engine.device.graph_capture import graph_capture
from batchvl.engine.device.pixel_staging import stage_pixels
from batchvl.engine.device.sync import synchronize
from batchvl.engine.overlap import with_picks
from batchvl.engine.packed_step import PackedStep
from batchvl.engine.parallel.vit_dp import DataParallelEncoder
from batchvl.engine.request import RequestPositions, ScheduledChunk
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.layers import triton_attention
from batchvl.layers.attention import (
    InPlaceDecodes,
    KVCache,
    PagedAttentionMetadata,
    decode_splits,
    uploaded,
)
from batchvl.layers.row_buckets import pads_rows
from batchvl.preprocess.media import PreparedMedia


@dataclass
class StepLogits:
    """A forward's float32 logits: one row per chunk with `samples_next_token` (in chunk order), and one
    per scored position of the chunks of scoring requests (in chunk order, then position order)."""

    sampled: torch.Tensor
    scored: torch.Tensor


def kv_bytes_per_block(adapter: ModelAdapter, block_size: int) -> int:
    geo = adapter.geometry
    element = torch.tensor([], dtype=adapter.dtype).element_size()
    return 2 * geo.num_layers * block_size * geo.num_kv_heads * geo.head_dim * element


def encode_batches(images: list[PreparedMedia], max_patches: int) -> list[list[PreparedMedia]]:
    """Vision calls for a set of images: one media kind per call, images sorted by patch count, a call
    holding at most `max_patches` patches (an image larger than that goes alone). Sorted, images of
    equal size are neighbours, which the vision attention batches together (see `vision_attention`);
    the linear layers take the whole call at once."""
    batches: list[list[PreparedMedia]] = []
    current: list[PreparedMedia] = []
    patches = 0
    for img in sorted(images, key=lambda img: (img.kind, img.num_patches)):
        if current and (img.kind != current[0].kind or patches + img.num_patches > max_patches):
            batches.append(current)
            current, patches = [], 0
        current.append(img)
        patches += img.num_patches
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def encode_images(adapter: ModelAdapter, images: list[PreparedMedia], max_patches: int) -> list[torch.Tensor]:
    """Embeddings of `images`, in their order, computed in vision calls grouped by `encode_batches`."""
    position = {id(img): i for i, img in enumerate(images)}
    out: list[torch.Tensor | None] = [None] * len(images)
    for batch in encode_batches(images, max_patches):
        rows = sum(len(img.pixel_values) for img in batch)
        pixel_values = stage_pixels(batch, adapter.vision_call_rows(rows), adapter.dtype, adapter.device)
        grid = torch.tensor([img.grid_thw for img in batch], dtype=torch.long)
        for img, embedding in zip(batch, adapter.encode(batch[0].kind, pixel_values, grid), strict=True):
            out[position[id(img)]] = embedding
    return out


class ModelRunner:
    def __init__(
        self,
        adapter: ModelAdapter,
        block_manager: BlockManager,
        parallel_encoder: DataParallelEncoder | None = None,
        decode_graph_rows: int = 0,
        vision_graph_patches: int = 0,
    ):
        """A runner over the cache `block_manager` hands out. On a device that captures graphs (CUDA):
        `decode_graph_rows`, the most rows of a decode step replayed as a graph, and `vision_graph_patches`,
        the most patches of a vision call replayed as one, where the family's tower can; 0: none. The two
        kinds share one capture, whose memory pool holds whichever graph replays (one at a time)."""
        self.adapter = adapter
        self.block_manager = block_manager
        self.parallel_encoder = parallel_encoder
        geo = adapter.geometry
        num_blocks, block_size = block_manager.num_blocks, block_manager.block_size
        any_graphs = graph_capture(adapter.device) if decode_graph_rows or vision_graph_patches else None
        capture = any_graphs if decode_graph_rows else None
        # whether this runner's vision calls replay graphs (a runner without them turns the adapter's off)
        self.vision_graphs_on = adapter.use_vision_graphs(
            any_graphs if vision_graph_patches else None, vision_graph_patches
        )
        self.kv_cache = KVCache.allocate(
            geo.num_layers,
            # with decode graphs, one block more: the padding rows' scratch block, which no request is given
            (num_blocks + (capture is not None)) * block_size,
            geo.num_kv_heads,
            geo.head_dim,
            adapter.dtype,
            adapter.device,
        )
        # (its padding row, for the graphs' padding rows, points at the scratch block past the manager's)
        self.block_table = DeviceBlockTable(block_manager.table, adapter.device, padding_block=num_blocks)
        self.decode_graphs = None
        if capture is not None and self.kv_cache.decodes_in_place:
            from batchvl.engine.device.decode_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                adapter, self.kv_cache, self.block_table, decode_graph_rows, capture
            )
            axes = adapter.prompt_positions([0], [])[0].shape[0]  # the family's position axes
            self.decode_graphs.capture_ahead(axes)
        self.forward_s = 0.0  # summed time of the language model's forwards

    def prompt_positions(self, prompt_token_ids: list[int], images: list[PreparedMedia]) -> RequestPositions:
        """A request's positions, computed once when it is added (the request holds them)."""
        return RequestPositions(*self.adapter.prompt_positions(prompt_token_ids, images))

    def encode(self, images: list[PreparedMedia], max_patches_per_call: int) -> list[torch.Tensor]:
        """The embeddings of `images`, in their order, encoded here or split across ranks under ViT data
        parallelism. See `encode_batches` for the grouping."""
        if self.parallel_encoder is not None:
            return self.parallel_encoder.encode(images)
        return encode_images(self.adapter, images, max_patches_per_call)

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        embeddings: Mapping[str, torch.Tensor],
        picks_in_flight: torch.Tensor | None = None,
        wait: bool = True,
    ) -> StepLogits:
        """Run one packed forward, with the images' rows taken from `embeddings` (by content hash); returns
        the logits the chunks need (see `StepLogits`). An overlapped step passes the previous step's picks,
        still on the device, for the placeholders among the tokens (see `overlap.py`), and does not wait
        for the forward's kernels (its `forward_s` is then their launch)."""
        self.block_table.sync()  # the blocks the schedule gave requests, before any kernel reads the table
        if self.decode_graphs is not None and self.decode_graphs.takes(chunks):
            started = time.perf_counter()
            sampled = self.decode_graphs.run(chunks, picks_in_flight)
            if sampled is not None:
                if wait:
                    synchronize(self.adapter.device)
                self.forward_s += time.perf_counter() - started
                return StepLogits(sampled, sampled[:0])
        in_place = self.kv_cache.decodes_in_place
        packed = PackedStep.of(chunks, in_place, self.block_manager, pads_rows(self.adapter.device))
        token_ids, positions, sequences = packed.token_ids, packed.positions, packed.sequences
        chunk_rows, chunk_starts, chunk_counts = packed.table_rows, packed.starts, packed.counts
        chunk_first_rows, last_rows, scored_rows = packed.first_rows, packed.last_rows, packed.scored_rows
        first_rows = chunk_first_rows.tolist()
        media_mask, media_rows = self._media_rows(len(token_ids), chunks, first_rows, embeddings)
        slot_mapping = self._slot_mapping(chunk_rows, chunk_starts, chunk_counts, chunk_first_rows)
        # the single-query chunks the kernels attend where the cache holds them (see `_in_place_decodes`)
        single = chunk_counts == 1 if in_place else np.zeros(len(chunks), dtype=bool)
        decode_lengths = chunk_starts[single] + 1
        device = self.adapter.device
        # the step's tokens, positions, cache slots, logits rows and decodes go to the device in one copy
        token_ids_on, positions_on, slots_on, logits_rows, *decodes = uploaded(
            [
                torch.from_numpy(token_ids),
                positions,
                torch.from_numpy(slot_mapping),
                torch.from_numpy(np.concatenate([last_rows, scored_rows])),
                torch.from_numpy(chunk_first_rows[single]),
                torch.from_numpy(self.block_table.starts(chunk_rows[single])),
                torch.from_numpy(decode_lengths),
            ],
            device,
        )
        if picks_in_flight is not None:
            token_ids_on = with_picks(token_ids_on, picks_in_flight)
        in_place_decodes = self._in_place_decodes(*decodes, decode_lengths) if single.any() else None
        meta = PagedAttentionMetadata.build(self.kv_cache, slots_on, sequences, device, in_place_decodes)
        started = time.perf_counter()
        hidden = self.adapter.forward(
            token_ids_on,
            positions_on,
            media_mask,
            media_rows,
            batchvl_attention=meta,
        )
        logits = self.adapter.compute_logits(hidden[logits_rows])
        if wait:
            synchronize(device)  # the forward's kernels done, not just launched
        self.forward_s += time.perf_counter() - started
        return StepLogits(logits[: len(last_rows)], logits[len(last_rows) :])

    def _slot_mapping(
        self, table_rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, first_rows: np.ndarray
    ) -> np.ndarray:
        """The cache slot of each packed token, in one lookup, of the chunks given by their requests' table
        rows, their first positions, their token counts and their first packed rows."""
        rows = np.repeat(table_rows, counts)
        # each token's position: its chunk's first, plus how far past its chunk's first row it lies
        positions = np.arange(counts.sum()) + np.repeat(starts - first_rows, counts)
        return self.block_manager.table.slots(rows, positions)

    def _in_place_decodes(
        self, rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, host_lengths: np.ndarray
    ) -> InPlaceDecodes:
        """The step's single-query chunks as the decode kernels read them: their packed rows, their rows'
        starts in the block table on the device, their keys. Triton's grouped kernel gets the splits of
        the decodes' own pages (it would choose them from the table's size), as the graphs do."""
        block_size = self.block_manager.block_size
        layer = self.kv_cache.layers[0]
        splits = None  # (the CPU's kernels have none)
        if triton_attention.takes(layer):
            splits = decode_splits(layer.shape[1], host_lengths, block_size)
        return InPlaceDecodes(rows, self.block_table.blocks, starts, lengths, block_size, splits)

    @staticmethod
    def _media_rows(
        num_tokens: int,
        chunks: list[ScheduledChunk],
        first_rows: list[int],
        embeddings: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Which packed rows are media placeholders, and the embedding rows that fill them, in order: for a
        chunk that cuts through an image, just the slice of its embedding that falls inside the chunk
        (`first_rows`: each chunk's first packed row)."""
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        pieces = []
        for chunk, first_row in zip(chunks, first_rows, strict=True):
            if chunk.is_generated:
                continue  # no media
            for span in chunk.request.images_overlapping(chunk.start, chunk.end):
                lo, hi = max(chunk.start, span.offset), min(chunk.end, span.end)
                first = first_row + lo - chunk.start
                mask[first : first + hi - lo] = True
                rows = span.row_offset + lo - span.offset
                pieces.append((first, embeddings[span.content_hash][rows : rows + hi - lo]))
        if not pieces:
            return mask, None
        # Chunks are packed in order and a request's runs are sorted by offset: pieces follow the mask.
        return mask, torch.cat([rows for _, rows in pieces])
