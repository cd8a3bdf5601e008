"""Steps of decodes only, replayed as graphs: one per row bucket that steps keep coming back to.

On CUDA a decoder layer launches some 34 kernels: at Qwen2-VL-2B's 28 layers a decode step is ~960
launches, tens of ms of host work against ~2 ms of GPU work. A step whose chunks are all single-token
decodes (no media, no scoring) has the shapes of its row bucket once padded, so its launches can be
recorded once per bucket and replayed over static buffers that each step fills in:

- token ids (B,), positions (axes, B) and cache slots (B,) of the step's rows;
- the decode attention's metadata in `InPlaceDecodes`' layout (what Triton's kernel reads on CUDA and the
  native one on the CPU): rows 0..B-1, and per row where its request's row of the block table starts and
  how many keys it has. The pages are the runner's `DeviceBlockTable`, which the runner brings up to date
  before every step, graphed or not: a step copies in 2B ints, not its block tables.
- the logits (B, vocab) float32 of every row, the real rows first.

Padding rows (the bucket's rows past the step's) are token 0 at position 0, writing their K/V to a scratch
slot, the first of one cache block beyond the block manager's (no request ever owns it), and attending to
that one key through the block table's padding row: finite values where nothing reads them. Not slot 0:
the torch decode path reads it, masked, as its own padding, and it must stay finite; not zero keys: the
kernels would divide 0 by 0.

The buckets are the eager path's row buckets (`row_buckets.bucket_rows`: 16, 32, ... 128, then eight per
doubling), and at 16 rows or fewer a decode step reads the weights once whatever its rows, so the padding
costs next to nothing.

The largest bucket's graph is captured when the engine starts (`capture_ahead`), over rows that are all
padding: the graphs share one memory pool, which that capture sizes once for all of them, and a full
batch's steps, the most of a large job's, replay it from the first. A step of a bucket with no graph of
its own replays the smallest captured graph of more rows (with its position axes and decode splits), its
rows past the step's padding: a replay launches nothing per layer, where an eager step of a 2B model
launches some 960 kernels (some 15 ms of an H200 host's time, against 5-8 ms of GPU work for 1,024 rows),
so that even a few rows padded to the largest bucket take less time than run eagerly. A bucket is captured
once steps have needed it `CAPTURE_OVER_PADDING` times (the step that needs it then, with its inputs: the
warm-up runs compute the step itself, and writing the same K/V to the same slots again changes nothing),
or, with no larger graph to pad into, `CAPTURE_ON_NEED` times (the first runs eagerly). On an H200 a
capture at Qwen2-VL-2B's depth took 67 ms: capturing all 32 buckets up to 1,024 rows ahead, as vLLM captures
its own, took 2.1 s, 14% of a 1,000-sample job's wall time, and a job's last requests end in waves, its
steps passing each smaller bucket a few times on their way down, where a capture would not repay itself:
those steps replay the largest graph padded. A padded step's matmuls run at the larger graph's rows, where
the eager step runs them at its own bucket's: each row's values may differ from the eager step's in the
last bits where the GPU's matmul library picks another kernel for the other shape (the CPU's give the
same values). A capture in the middle of a job neither waits for the device nor empties torch's caches
(`graph_capture.py`: `torch.cuda.graph` would do both, and the steps after it would allocate their memory
anew).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.device.device_block_table import DeviceBlockTable
from batchvl.engine.device.graph_capture import GraphCapture, capture_or_none
from batchvl.engine.overlap import with_picks
from batchvl.engine.request import ScheduledChunk
from batchvl.layers import triton_attention
from batchvl.layers.attention import InPlaceDecodes, KVCache, PagedAttentionMetadata, decode_splits, uploaded
from batchvl.layers.row_buckets import bucket_rows

logger = logging.getLogger(__name__)

MAX_POSITION_AXES = 4  # 1-D rope, M-RoPE's 3 axes, and a text axis before them where a family adds one
# A graph not captured ahead is captured on the step that needs it this many times, where no larger graph
# replays the step padded (the steps before run eagerly), and where one does: a bucket needed that often
# is one that steps keep coming back to, not one that a job's last requests pass on their way out
CAPTURE_ON_NEED = 2
CAPTURE_OVER_PADDING = 16


def is_graphable(chunks: list[ScheduledChunk]) -> bool:
    """Whether a step is decodes only: one generated token each (so no media) that samples the next."""
    return all(chunk.num_tokens == 1 and chunk.is_generated and chunk.samples_next_token for chunk in chunks)


class DecodeGraphs:
    def __init__(
        self,
        adapter: ModelAdapter,
        kv_cache: KVCache,
        block_table: DeviceBlockTable,
        max_rows: int,
        graph_capture: GraphCapture,
    ):
        """`block_table`'s padding row points at the scratch block, which no request is given."""
        self.adapter = adapter
        self.kv_cache = kv_cache
        self.block_table = block_table
        self.block_size = block_size = block_table.host.block_size
        self.largest = bucket_rows(max_rows)
        self.scratch_slot = block_table.padding_block * block_size
        self.graph_capture = graph_capture
        device = adapter.device

        def ints(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=device)

        # The static buffers by name (a bucket's graph reads their first rows), each filled by one copy a step
        self.buffers = {
            "token_ids": ints(self.largest),
            "positions": ints(MAX_POSITION_AXES * self.largest),  # (axes, B) in the first axes * B
            "slots": ints(self.largest),
            "starts": ints(self.largest),
            "lengths": ints(self.largest),
        }
        self.rows = torch.arange(self.largest, device=device)
        self.logits = torch.zeros(self.largest, adapter.geometry.vocab_size, device=device)
        # (rows, position axes, the grouped decode kernel's splits) -> replay
        self._replays: dict[tuple[int, int, int | None], Callable[[], None]] = {}
        self._needs: Counter[tuple[int, int, int | None]] = Counter()  # steps that needed each graph
        # Triton's decode kernels read the cache on CUDA (the native ones on the CPU, which have no splits)
        self.splits_matter = triton_attention.takes(kv_cache.layers[0])
        self._failed = False
        self.capture_s = 0.0  # the host's time in captures, ahead and when steps came to need them
        self.replayed_rows = 0  # the rows of the graph the last step replayed: its buffers' layout

    @property
    def captured(self) -> list[tuple[int, int, int | None]]:
        """The (rows, position axes, decode splits) of the graphs captured so far."""
        return list(self._replays)

    @torch.inference_mode()  # as the steps run: their graphs are captured inside `ModelRunner.execute`
    def capture_ahead(self, axes: int) -> None:
        """Capture the largest bucket's graph for steps of `axes` position axes and one decode split (or
        none), over padding rows (see the module docstring)."""
        if axes > MAX_POSITION_AXES:  # its steps run eagerly (`takes`)
            return
        self._load([], np.empty(0, dtype=np.int64), self.largest, axes)
        if self._replay(self.largest, axes, 1 if self.splits_matter else None) is not None:
            logger.info("decode graphs: %d rows captured in %.2f s", self.largest, self.capture_s)

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step runs as a graph: decodes only, no more rows than the largest bucket, and no
        capture has failed."""
        axes = chunks[0].request.positions.prompt.shape[0]
        return (
            not self._failed
            and len(chunks) <= self.largest
            and axes <= MAX_POSITION_AXES
            and is_graphable(chunks)
        )

    def run(
        self, chunks: list[ScheduledChunk], picks_in_flight: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The float32 logits (one row per chunk, in order) of a step `takes` took, from a graph, valid
        until the next step: its bucket's, else (until that is captured) the smallest captured one of more
        rows with its position axes and decode splits, over padding rows; None where the caller runs the
        step eagerly: no such graph yet, or a capture failed (said once, and every later step too). An
        overlapped step's placeholders are swapped for the previous step's picks in the token buffer, on
        the device, before the replay (outside the graph: the picks are a new tensor each step)."""
        axes = chunks[0].request.positions.prompt.shape[0]
        lengths = np.fromiter((chunk.start + 1 for chunk in chunks), dtype=np.int64, count=len(chunks))
        splits = self._splits(lengths)
        key = (bucket_rows(len(chunks)), axes, splits)
        if key not in self._replays:
            self._needs[key] += 1
            padded = self._padded(*key)
            if padded is not None and self._needs[key] < CAPTURE_OVER_PADDING:
                key = padded
            elif padded is None and self._needs[key] < CAPTURE_ON_NEED:
                return None  # run eagerly: a graph replayed once would not repay its capture
        rows = key[0]
        self._load(chunks, lengths, rows, axes)
        if picks_in_flight is not None:
            token_ids = self.buffers["token_ids"][:rows]
            token_ids.copy_(with_picks(token_ids, picks_in_flight))
        replay = self._replay(*key)
        if replay is None:
            return None
        replay()
        self.replayed_rows = rows
        return self.logits[: len(chunks)]  # read before the next step's replay rewrites them

    def _padded(self, rows: int, axes: int, splits: int | None) -> tuple[int, int, int | None] | None:
        """The key of the smallest captured graph of more than `rows` rows with these axes and splits."""
        larger = [key for key in self._replays if key[0] > rows and key[1:] == (axes, splits)]
        return min(larger) if larger else None

    def _replay(self, rows: int, axes: int, splits: int | None) -> Callable[[], None] | None:
        """The graph of (rows, axes, splits), captured over the buffers' present contents if it is new;
        None where the capture failed (said once, and no graph runs from then on)."""
        replay = self._replays.get((rows, axes, splits))
        if replay is None:
            forward = self._forward(rows, axes, splits)
            replay, seconds = capture_or_none(self.graph_capture, forward, "decode steps")
            self.capture_s += seconds
            if replay is None:
                self._failed = True
                return None
            self._replays[rows, axes, splits] = replay
        return replay

    def _splits(self, lengths: np.ndarray) -> int | None:
        """The grouped decode kernel's splits for a step of decodes of `lengths` keys: those the eager step
        gets (from the decodes' own pages, not the block table's size), so that each row's sums run in the
        eager path's order. None where the kernels have no splits."""
        if not self.splits_matter:
            return None
        return decode_splits(self.kv_cache.layers[0].shape[1], lengths, self.block_size)

    def _load(self, chunks: list[ScheduledChunk], lengths: np.ndarray, rows: int, axes: int) -> None:
        """Fill the static buffers with the step's inputs (`lengths`: each chunk's keys, its start + 1), the
        padding rows' after them up to `rows` (all of the rows without chunks)."""
        padding, count = rows - len(chunks), len(chunks)
        # a pass per quantity (a loop appending to three lists cost some 0.2 ms a step at 1,024 decodes on a
        # 2-core CPU); each decode's token is its request's newest, which its chunk reaches (`is_graphable`)
        requests = [chunk.request for chunk in chunks]
        token_ids = [request.output_token_ids[-1] for request in requests]
        deltas = np.fromiter((request.positions.delta for request in requests), np.int64, count)
        table_rows = np.fromiter((request.table_row for request in requests), np.int64, count)
        starts = lengths - 1
        table = self.block_table

        def padded(values, pad: int) -> torch.Tensor:
            return torch.from_numpy(
                np.concatenate([np.asarray(values, dtype=np.int64), np.full(padding, pad, dtype=np.int64)])
            )

        step = [
            padded(token_ids, 0),
            padded(starts + deltas, 0).expand(axes, -1),  # on every axis
            padded(table.host.slots(table_rows, starts), self.scratch_slot),
            padded(table.starts(table_rows), table.padding_start),
            padded(lengths, 1),
        ]
        for buffer, values in zip(self.buffers.values(), uploaded(step, self.adapter.device), strict=True):
            buffer[: values.numel()].copy_(values.reshape(-1))

    def _forward(self, rows: int, axes: int, splits: int | None) -> Callable[[], None]:
        """The bucket's step over the static buffers: what its graph records."""
        buffers = self.buffers
        decodes = InPlaceDecodes(
            self.rows[:rows],
            self.block_table.blocks,
            buffers["starts"][:rows],
            buffers["lengths"][:rows],
            self.block_size,
            splits,
        )
        meta = PagedAttentionMetadata(self.kv_cache, buffers["slots"][:rows], [], in_place_decodes=decodes)
        token_ids = buffers["token_ids"][:rows]
        positions = buffers["positions"][: axes * rows].view(axes, rows)
        no_media = torch.zeros(rows, dtype=torch.bool)
        logits = self.logits[:rows]

        def forward() -> None:
            hidden = self.adapter.forward(token_ids, positions, no_media, None, batchvl_attention=meta)
            logits.copy_(self.adapter.compute_logits(hidden))

        return forward
