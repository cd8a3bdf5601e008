"""Qwen2-VL's vision calls replayed as CUDA graphs (`engine.vision_graphs`): one launch a call, not hundreds.

A vision call launches its tower's kernels one by one from Python: some 400 for Qwen2-VL's 32 blocks with
the fused kernels. On an H200's host that took some 35 ms a call whatever its size: a call of 4,096 patches
took 40 ms for 12.8 ms of kernels (`benchmarks/vision_call.py`, docs/benchmarks.md), so that a step's
vision call kept the host from preparing the next step for that long. A graph replays the same kernels in
one launch.

A graph records fixed shapes, so a call is given one of a few (`CallShape`):
- its rows, rounded up to a multiple of `ROWS_STEP`: the zero rows after the images are one blank image,
  as on the CPU (`qwen_vl.with_blank_image`), whose output is dropped;
- its sequences (the images and the blank one), rounded up to a power of two by sequences of no rows: the
  boundaries' last value repeated;
- the longest sequence's rows, rounded up to a power of two: the bound the varlen attention kernel is given
  (`vision_attention.varlen_vision_attention`'s `max_length_q`), which it reads for its grid alone.

Calls of one shape replay one graph over static buffers (the pixels, the patches' rotary positions, the
sequences' boundaries), each call's inputs copied in on the device. A shape is captured the second time a
call needs it; the first runs eagerly, at the same shape and bound, so that its outputs equal a replay's
and everything the capture needs (Triton's kernels for these shapes, the matmul library's choices) is made
outside it: the capture runs no warm-up of its own, and a replay is the call's only run on the device. A
graph's outputs live in the graphs' memory pool, which the next replay reuses: the call's embeddings are
copied out of it (the encoder cache keeps them past the step).

Only towers whose inputs are the rotary positions and the boundaries alone take graphs: Qwen2-VL's, with
the varlen attention kernel (bf16 or fp16 on an Ampere or newer GPU, `engine.vision_attention` not sdpa).
Qwen2.5-VL's windows and Qwen3-VL's interpolated position embeddings and deepstack outputs run eagerly, as
does a call of more rows than the largest shape (an image larger than `engine.max_patches_per_encode`
goes alone).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchvl.engine.device.graph_capture import GraphCapture, capture_or_none
from batchvl.layers import vision_attention
from batchvl.layers.attention import uploaded
from batchvl.layers.qwen_vision_attention import QwenVisionAttention

logger = logging.getLogger(__name__)

ROWS_STEP = 1024  # a graphed call's rows, a multiple of this: a 448x448 image's patches for Qwen2-VL
MIN_SEQUENCES = 8  # the fewest sequences a shape has, so that calls of a few images share one
CAPTURE_ON_NEED = 2  # a shape is captured the time a call needs it so often (the first runs eagerly)
MOST_GRAPHS = 64  # past this many shapes, calls of a new one run eagerly

# (pixels, rotary positions, boundaries, longest sequence's bound) -> the tower's merged output
Tower = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _covering(n: int) -> int:
    """The least power of two of at least n."""
    return 1 << (n - 1).bit_length()


def padded_rows(rows: int) -> int:
    """A graphed call's rows: `rows` rounded up to a multiple of ROWS_STEP."""
    return -(-rows // ROWS_STEP) * ROWS_STEP


@dataclass(frozen=True, order=True)
class CallShape:
    rows: int
    sequences: int  # boundaries: sequences + 1
    longest: int  # the bound of every sequence's rows

    @classmethod
    def of(cls, boundaries: torch.Tensor) -> CallShape:
        """The shape of a call whose sequences are cut at `boundaries` (on the host, from 0 to its rows)."""
        lengths = boundaries.diff()
        return cls(
            rows=int(boundaries[-1]),
            sequences=_covering(max(len(lengths), MIN_SEQUENCES)),
            longest=_covering(int(lengths.max())),
        )

    def padded_boundaries(self, boundaries: torch.Tensor) -> torch.Tensor:
        """`boundaries` with sequences of no rows after the call's, up to this shape's sequences."""
        missing = self.sequences + 1 - len(boundaries)
        return torch.cat([boundaries, boundaries[-1:].expand(missing)])


class VisionGraphs:
    def __init__(self, tower: Tower, graph_capture: GraphCapture, max_rows: int, device: torch.device):
        """Graphs of `tower`'s calls of at most `max_rows` rows (a multiple of ROWS_STEP) on `device`."""
        self.tower = tower
        self.graph_capture = graph_capture
        self.max_rows = max_rows
        self.device = device
        # The static inputs: a shape's graph reads the first rows of each (its own boundaries' buffer); the
        # pixels' made for the first call loaded, in its pixels' dtype and row shape
        self.pixels: torch.Tensor | None = None
        self.positions = torch.zeros((max_rows, 2), dtype=torch.long, device=device)
        self._boundaries: dict[int, torch.Tensor] = {}  # sequences -> int32 (sequences + 1)
        self._replays: dict[CallShape, tuple[Callable[[], None], list[torch.Tensor]]] = {}
        self._needs: Counter[CallShape] = Counter()
        self._failed = False
        self.capture_s = 0.0  # the host's time in captures
        self.replays = 0

    @property
    def captured(self) -> list[CallShape]:
        return sorted(self._replays)

    def takes(self, rows: int) -> bool:
        """Whether a call of `rows` (padded) rows runs at a graph's shape: no more than the largest, and no
        capture has failed."""
        return not self._failed and rows <= self.max_rows

    def __call__(
        self, pixels: torch.Tensor, positions: torch.Tensor, boundaries: torch.Tensor
    ) -> torch.Tensor:
        """The tower's merged output of a call `takes` took: `pixels` (rows, ...) on the device, its rotary
        `positions` (rows, 2) and its sequences' `boundaries` (int32, from 0 to rows) on the host. Replayed
        from its shape's graph, or run eagerly at that shape (see the module docstring)."""
        shape = CallShape.of(boundaries)
        positions, boundaries = uploaded([positions, shape.padded_boundaries(boundaries)], self.device)
        boundaries = boundaries.to(torch.int32)  # `uploaded` packs as int64
        if shape not in self._replays:
            self._needs[shape] += 1
            if self._needs[shape] < CAPTURE_ON_NEED or len(self._replays) >= MOST_GRAPHS:
                return self.tower(pixels, positions, boundaries, shape.longest)
        if self.pixels is None:
            self.pixels = pixels.new_zeros((self.max_rows, *pixels.shape[1:]))
        self.pixels[: shape.rows].copy_(pixels)
        self.positions[: shape.rows].copy_(positions)
        self._boundaries_of(shape).copy_(boundaries)
        graph = self._graph(shape)
        if graph is None:
            return self.tower(pixels, positions, boundaries, shape.longest)
        replay, output = graph
        replay()
        self.replays += 1
        return output[0].clone()  # out of the pool, which the next replay writes over

    def _boundaries_of(self, shape: CallShape) -> torch.Tensor:
        buffer = self._boundaries.get(shape.sequences)
        if buffer is None:
            buffer = torch.zeros(shape.sequences + 1, dtype=torch.int32, device=self.device)
            self._boundaries[shape.sequences] = buffer
        return buffer

    def _graph(self, shape: CallShape) -> tuple[Callable[[], None], list[torch.Tensor]] | None:
        """The shape's replay and the list its output is in, captured over the buffers' present contents if
        it is new; None where the capture failed (said once, and every later call runs eagerly)."""
        graph = self._replays.get(shape)
        if graph is not None:
            return graph
        assert self.pixels is not None  # loaded before
        pixels, positions = self.pixels[: shape.rows], self.positions[: shape.rows]
        boundaries = self._boundaries_of(shape)
        output: list[torch.Tensor] = []

        def forward() -> None:
            output[:] = [self.tower(pixels, positions, boundaries, shape.longest)]

        replay, seconds = capture_or_none(self.graph_capture, forward, "vision calls", warmups=0)
        self.capture_s += seconds
        if replay is None:
            self._failed = True
            return None
        self._replays[shape] = graph = (replay, output)
        logger.debug("vision graph captured: %s", shape)
        return graph


def graphable(visual: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a Qwen-VL tower's calls can be replayed as graphs (see the module docstring): positions and
    boundaries its only inputs, and every attention by the varlen kernel, which runs in `dtype` on
    `device`."""
    if hasattr(visual, "fullatt_block_indexes") or hasattr(visual, "num_grid_per_side"):
        return False  # Qwen2.5-VL's windows, Qwen3-VL's interpolated position embeddings
    attentions = [module for module in visual.modules() if isinstance(module, QwenVisionAttention)]
    return (
        bool(attentions)
        and all(getattr(module, vision_attention.VARLEN_ATTRIBUTE) for module in attentions)
        and vision_attention.flash_varlen_runs(dtype, device)
    )
