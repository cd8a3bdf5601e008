"""A step's chunks as the packed forward's host-side inputs: token ids, positions, and per chunk its request's
block table row, first position, token count and first packed row.

Most of a large step's chunks are decodes (one generated token each): at 1,024 of them a loop over the
chunks appending to half a dozen lists cost about a millisecond and a half of host work a step on a 2-core
CPU. Here each per-chunk quantity is read in one pass of its own (a comprehension or `np.fromiter`, a
fraction of a loop iteration's cost), the decodes' tokens and positions are written with one array
operation each, and only the chunks of more than one token (prompt chunks, at most a few dozen a step) are
visited one by one.

On the CPU, rows past the chunks pad the step to its row bucket (`row_buckets`): the packed linear layers
then take the step as it is (no copy per layer) and oneDNN reuses the kernels it built for that bucket.
Padding tokens are token 0 at position 0; they attend to nothing, write no KV, and their rows are dropped
with the rest of the hidden states. A GPU's step is not padded (`row_buckets.pads_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchvl.engine.request import Request, ScheduledChunk
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.layers.attention import SequenceSlice
from batchvl.layers.row_buckets import bucket_rows


@dataclass
class PackedStep:
    token_ids: np.ndarray  # (rows,) int64, the step's tokens then the padding's
    positions: torch.Tensor  # (axes, rows) int64
    # per chunk, int64: its request's block table row, its first position, its tokens, its first packed row
    table_rows: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    first_rows: np.ndarray
    # the chunks attended one by one: every chunk of more than one query, and where the kernels do not read
    # the cache in place, the single-query ones too (see PagedAttentionMetadata)
    sequences: list[SequenceSlice]
    last_rows: np.ndarray  # the last row of each chunk that samples its request's next token, in chunk order
    scored_rows: np.ndarray  # each scoring chunk's scored positions' rows, in chunk order then position order

    @classmethod
    def of(
        cls, chunks: list[ScheduledChunk], in_place: bool, block_manager: BlockManager, pad: bool
    ) -> PackedStep:
        """`in_place`: whether the kernels attend single-query chunks where the cache holds them; `pad`:
        whether the rows are padded to their bucket."""
        count = len(chunks)
        requests = [chunk.request for chunk in chunks]
        starts = np.fromiter((chunk.start for chunk in chunks), np.int64, count)
        counts = np.fromiter((chunk.num_tokens for chunk in chunks), np.int64, count)
        table_rows = np.fromiter((request.table_row for request in requests), np.int64, count)
        first_rows = np.cumsum(counts) - counts
        total = int(counts.sum())
        rows = bucket_rows(total) if pad else total
        axes = requests[0].positions.prompt.shape[0]
        token_ids = np.zeros(rows, dtype=np.int64)
        positions = torch.zeros((axes, rows), dtype=torch.long)
        # a decode: one generated token, whose position on every axis is its index plus the request's delta
        decode = np.fromiter((c.num_tokens == 1 and c.is_generated for c in chunks), bool, count)
        decodes = np.flatnonzero(decode)
        if len(decodes):
            decode_requests = [requests[i] for i in decodes.tolist()]
            decode_starts = starts[decodes]
            token_ids[first_rows[decodes]] = [
                request.output_token_ids[start - len(request.prompt_token_ids)]
                for request, start in zip(decode_requests, decode_starts.tolist(), strict=True)
            ]
            deltas = np.fromiter((r.positions.delta for r in decode_requests), np.int64, len(decodes))
            positions[:, torch.from_numpy(first_rows[decodes])] = torch.from_numpy(decode_starts + deltas)
        sequences = []
        scored_rows: list[int] = []
        for i in np.flatnonzero(~decode | (not in_place)).tolist():
            chunk, request, first = chunks[i], requests[i], int(first_rows[i])
            if not decode[i]:
                end = first + chunk.num_tokens
                token_ids[first:end] = request.token_ids(chunk.start, chunk.end)
                positions[:, first:end] = chunk_positions(request, chunk.start, chunk.end)
            if chunk.num_tokens > 1 or not in_place:
                key_slots, _ = block_manager.key_layout(request, chunk.end)
                sequences.append(SequenceSlice(first, chunk.num_tokens, key_slots, num_keys=chunk.end))
        samples = np.fromiter((chunk.samples_next_token for chunk in chunks), bool, count)
        for i in np.flatnonzero(~samples).tolist():
            chunk, first = chunks[i], int(first_rows[i])
            if chunk.request.score_from is not None:
                scored_rows.extend(first + position - chunk.start for position in chunk.scored_positions)
        last_rows = (first_rows + counts - 1)[samples]
        return cls(
            token_ids,
            positions,
            table_rows,
            starts,
            counts,
            first_rows,
            sequences,
            last_rows,
            np.array(scored_rows, dtype=np.int64),
        )


def chunk_positions(request: Request, start: int, end: int) -> torch.Tensor:
    """The positions (axes, end - start) of the request's tokens [start, end): the prompt's as computed when
    it was added, then the generated tokens', each its index plus the request's delta on every axis."""
    pos = request.positions
    num_prompt = pos.prompt.shape[1]
    if end <= num_prompt:
        return pos.prompt[:, start:end]
    generated = torch.arange(max(start, num_prompt), end) + pos.delta
    generated = generated.expand(pos.prompt.shape[0], -1)
    if start >= num_prompt:
        return generated
    return torch.cat([pos.prompt[:, start:], generated], dim=1)
