"""The Qwen-VL towers' vision calls replayed as CUDA graphs (`engine.vision_graphs`): one launch a call.

A vision call launches its tower's kernels one by one from Python: some 400 for Qwen2-VL's 32 blocks with
the fused kernels. On an H200's host that took some 35 ms a call whatever its size: a call of 4,096 patches
took 40 ms for 12.8 ms of kernels (`benchmarks/vision_call.py`, docs/benchmarks.md), so that a step's
vision call kept the host from preparing the next step for that long. A graph replays the same kernels in
one launch.

A graph records fixed shapes, so a call is given one of a few (`CallShape`):
- its rows, rounded up to a multiple of `ROWS_STEP`: the zero rows after the images are one blank image,
  as on the CPU (`qwen_vl.with_blank_image`), whose output is dropped;
- for each cut of its rows into sequences the tower attends within (`BOUNDARIES`: the images and the blank
  one, and Qwen2.5-VL's windows), their count rounded up to a power of two, at least `MIN_SEQUENCES`, by
  sequences of no rows (the boundaries' last value repeated), and the longest one's rows rounded up to a
  power of two: the bound the varlen attention kernel is given (the tower's `max_seqlen` and
  `max_window_seqlen`, which `vision_attention.varlen_vision_attention` takes as its `max_length_q`) and
  reads for its grid alone.
Whatever else the tower derives from the grid (the patches' rotary positions; Qwen2.5-VL's window order;
Qwen3-VL's position-embedding interpolation) has the rows' shape.

Calls of one shape replay one graph over static buffers (the pixels, and each shape's own copies of the
other inputs), each call's inputs copied in on the device. A shape is captured the second time a call needs
it; the first runs eagerly, at the same shape and bounds, so that its outputs equal a replay's and
everything the capture needs (Triton's kernels for these shapes, the matmul library's choices) is made
outside it: the capture runs no warm-up of its own, and a replay is the call's only run on the device. A
graph's outputs (the merged embeddings, and Qwen3-VL's deepstack features) live in the graphs' memory pool,
which the next replay reuses: they are copied out of it (the encoder cache keeps them past the step).

Only towers that attend by the varlen kernel take graphs (bf16 or fp16 on an Ampere or newer GPU,
`engine.vision_attention` not sdpa): their attention is told the bounds and reads nothing back. A call of
more rows than the largest shape (an image larger than `engine.max_patches_per_encode` goes alone) runs
eagerly.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchvl.engine.device.graph_capture import GraphCapture, capture_or_none
from batchvl.layers import vision_attention
from batchvl.layers.qwen_vision_attention import QwenVisionAttention
from batchvl.layers.row_buckets import power_of_two_at_least
from batchvl.models.qwen_vision_inputs import BOUNDARIES, on_device

logger = logging.getLogger(__name__)

ROWS_STEP = 1024  # a graphed call's rows, a multiple of this: a 448x448 image's patches for Qwen2-VL
MIN_SEQUENCES = 8  # the fewest sequences a cut has, so that calls of a few images share one shape
CAPTURE_ON_NEED = 2  # a shape is captured the time a call needs it so often (the first runs eagerly)
MOST_GRAPHS = 64  # past this many shapes, calls of a new one run eagerly

# (pixels, the other inputs by the tower's keyword) -> its outputs: the merged embeddings first
Tower = Callable[[torch.Tensor, dict], list[torch.Tensor]]


def padded_rows(rows: int) -> int:
    """A graphed call's rows: `rows` rounded up to a multiple of ROWS_STEP."""
    return -(-rows // ROWS_STEP) * ROWS_STEP


@dataclass(frozen=True, order=True)
class Cut:
    """One boundaries input of a shape: its name, its sequences and the bound of their rows."""

    name: str
    sequences: int  # boundaries: sequences + 1
    longest: int

    @classmethod
    def of(cls, name: str, boundaries: torch.Tensor) -> Cut:
        """The cut of sequences at `boundaries` (on the host, from 0 to the call's rows)."""
        lengths = boundaries.diff()
        sequences = power_of_two_at_least(max(len(lengths), MIN_SEQUENCES))
        return cls(name, sequences, power_of_two_at_least(int(lengths.max())))

    def padded(self, boundaries: torch.Tensor) -> torch.Tensor:
        """`boundaries` with sequences of no rows after the call's, up to this cut's sequences."""
        missing = self.sequences + 1 - len(boundaries)
        return torch.cat([boundaries, boundaries[-1:].expand(missing)])


@dataclass(frozen=True, order=True)
class CallShape:
    rows: int
    cuts: tuple[Cut, ...]
    # the other inputs' (name, shape and dtype) or (name, value): what a graph records of them, read from
    # the inputs rather than assumed to follow from the rows
    others: tuple[tuple, ...] = ()

    @classmethod
    def of(cls, rows: int, inputs: dict) -> CallShape:
        """The shape of a call of `rows` whose tower inputs, made on the host, are `inputs`."""
        bounds = {BOUNDARIES[name] for name in BOUNDARIES if name in inputs}
        others = tuple(
            (name, tuple(value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else (name, value)
            for name, value in sorted(inputs.items())
            if name not in BOUNDARIES and name not in bounds
        )
        return cls(rows, tuple(Cut.of(name, inputs[name]) for name in BOUNDARIES if name in inputs), others)

    def inputs(self, inputs: dict) -> dict:
        """`inputs` at this shape: each cut's boundaries padded and its bound, the rest as they are."""
        shaped = dict(inputs)
        for cut in self.cuts:
            shaped[cut.name] = cut.padded(inputs[cut.name])
            shaped[BOUNDARIES[cut.name]] = cut.longest
        return shaped


class VisionGraphs:
    def __init__(self, tower: Tower, graph_capture: GraphCapture, max_rows: int, device: torch.device):
        """Graphs of `tower`'s calls of at most `max_rows` rows (a multiple of ROWS_STEP) on `device`."""
        self.tower = tower
        self.graph_capture = graph_capture
        self.max_rows = max_rows
        self.device = device
        # The static inputs: the pixels' buffer, made for the first call loaded in its pixels' dtype and row
        # shape, whose first rows a shape's graph reads; each shape's own buffers of the other inputs
        self.pixels: torch.Tensor | None = None
        self._inputs: dict[CallShape, dict] = {}
        self._replays: dict[CallShape, tuple[Callable[[], None], list[torch.Tensor]]] = {}
        self._needs: Counter[CallShape] = Counter()
        self._failed = False
        self.capture_s = 0.0  # the host's time in captures
        self.replays = 0  # the calls replayed
        self.eager_calls = 0  # the calls it took that ran eagerly at their shape: first needs, failures

    @property
    def captured(self) -> list[CallShape]:
        return sorted(self._replays)

    def takes(self, rows: int) -> bool:
        """Whether a call of `rows` (padded) rows runs at a graph's shape: no more than the largest, and no
        capture has failed."""
        return not self._failed and rows <= self.max_rows

    def __call__(self, pixels: torch.Tensor, inputs: dict) -> list[torch.Tensor]:
        """The tower's outputs for a call `takes` took: `pixels` (rows, ...) on the device, the tower's other
        `inputs` made on the host (`qwen_vision_inputs.grid_inputs`). Replayed from its shape's graph, or run
        eagerly at that shape (see the module docstring)."""
        shape = CallShape.of(len(pixels), inputs)
        shaped = on_device(shape.inputs(inputs), self.device)
        if shape not in self._replays:
            self._needs[shape] += 1
            if self._needs[shape] < CAPTURE_ON_NEED or len(self._replays) >= MOST_GRAPHS:
                return self._eager(pixels, shaped)
        if self.pixels is None:
            self.pixels = pixels.new_zeros((self.max_rows, *pixels.shape[1:]))
        self.pixels[: shape.rows].copy_(pixels)
        buffers = self._inputs_of(shape, shaped)
        for name, buffer in buffers.items():
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(shaped[name])
        graph = self._graph(shape)
        if graph is None:
            return self._eager(pixels, shaped)
        replay, outputs = graph
        replay()
        self.replays += 1
        return [output.clone() for output in outputs]  # out of the pool, which the next replay writes over

    def _eager(self, pixels: torch.Tensor, shaped: dict) -> list[torch.Tensor]:
        self.eager_calls += 1
        return self.tower(pixels, shaped)

    def _inputs_of(self, shape: CallShape, shaped: dict) -> dict:
        """The shape's static inputs, made like a call's inputs at the shape (ints, its bounds, as they
        are)."""
        buffers = self._inputs.get(shape)
        if buffers is None:
            buffers = {
                name: torch.empty_like(value) if isinstance(value, torch.Tensor) else value
                for name, value in shaped.items()
            }
            self._inputs[shape] = buffers
        return buffers

    def _graph(self, shape: CallShape) -> tuple[Callable[[], None], list[torch.Tensor]] | None:
        """The shape's replay and the list its outputs are in, captured over the buffers' present contents if
        it is new; None where the capture failed (said once, and every later call runs eagerly)."""
        graph = self._replays.get(shape)
        if graph is not None:
            return graph
        assert self.pixels is not None  # loaded before
        pixels, inputs = self.pixels[: shape.rows], self._inputs[shape]
        outputs: list[torch.Tensor] = []

        def forward() -> None:
            outputs[:] = self.tower(pixels, inputs)

        replay, seconds = capture_or_none(self.graph_capture, forward, "vision calls", warmups=0)
        self.capture_s += seconds
        if replay is None:
            self._failed = True
            return None
        self._replays[shape] = graph = (replay, outputs)
        logger.debug("vision graph captured: %s", shape)
        return graph


def graphable(visual: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a Qwen-VL tower's calls can be replayed as graphs (see the module docstring): every attention
    by the varlen kernel, which runs in `dtype` on `device`."""
    attentions = [module for module in visual.modules() if isinstance(module, QwenVisionAttention)]
    return (
        bool(attentions)
        and all(getattr(module, vision_attention.VARLEN_ATTRIBUTE) for module in attentions)
        and vision_attention.flash_varlen_runs(dtype, device)
    )
