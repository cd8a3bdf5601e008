"""Overlapped steps (`engine.overlap`): step n+1 is scheduled, built and launched before the host reads
step n's picks, so that on a GPU the host's work for a step runs while the device computes the one before.

An overlapped step keeps its picks on the device, greedy or sampled (a sampled row's draw needs one number
from its request's generator, not its logits: `sampling/sampler.py`). Each request that sampled in it gets a
placeholder as its newest output token, `placeholder(row)`, naming the row of its pick. The scheduler counts
the placeholder as a token, so the request's next decode is scheduled at once; the runner packs the
placeholder and the device swaps the pick in (`with_picks`); only once that next forward is launched does
the host read the picks (`InFlightPicks.read`), write them over the placeholders and apply the stop rules. A
request those picks end has been run one step too far: that step's pick is dropped (it gets no placeholder),
and its KV blocks and images are freed once that step is launched, which is safe because whatever reuses
them is a later forward, queued behind it on the same stream. Nothing else in the step waits for the device
either: the images it encodes are not waited for (the forward reads their embeddings behind the vision call
on the same stream), and a Qwen-VL vision call reads nothing back (`models/qwen_vision_inputs.py`).

A constrained request is overlapped too: its grammar takes the picks when they are read, and the
mask for its row of the step just launched is filled on the host then, while the device runs that step's
forward, and applied on the device before that step's picks are made: a labeling job's grammar work,
every row's mask every step, runs beside the device instead of between its steps. The log-probabilities
of a request that keeps them, and a scored choice's, are computed on the device from the step's
logits and copied without waiting (`RowLogprobs`); the host reads them with the picks, and a scoring
request's group is answered then, a step after its request ended (`Engine.num_unfinished` counts it
until then). A serial step computes them the same way and reads them at once, so the two give the same
values for the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchvl.engine.device.host_copy import HostCopy
from batchvl.engine.request import EngineResult, Request
from batchvl.engine.sampling.choice_scoring import StepScores
from batchvl.engine.sampling.logprobs import RowLogprobs


def placeholder(row: int) -> int:
    """The output token standing for the pick of `row` of the step in flight (token ids are >= 0)."""
    return -1 - row


def with_picks(token_ids: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """The packed token ids with each placeholder replaced by its pick, on the device."""
    return torch.where(token_ids < 0, picks[(-1 - token_ids).clamp(min=0)], token_ids)


@dataclass
class InFlightPicks:
    """A launched step's results, not yet read: its picks (`requests[i]`'s newest output token is the
    placeholder of row `rows[i]`), the log-probabilities of those picks whose requests keep them (in
    `logprob_requests`' order), and its scored choices' log-probabilities."""

    requests: list[Request]
    rows: Sequence[int]
    picks: torch.Tensor  # on the device, read by the next step's forward
    host: HostCopy
    logprob_requests: list[Request]
    logprobs: RowLogprobs | None
    scores: StepScores | None

    def read(self) -> list[Request]:
        """Write the picks over their placeholders (waiting for them alone) and add the log-probabilities
        of those that keep them; the requests, in row order."""
        tokens = self.host.tolist()
        for request, row in zip(self.requests, self.rows, strict=True):
            request.output_token_ids[-1] = tokens[row]
        if self.logprobs is not None:
            for request, (chosen, top) in zip(self.logprob_requests, self.logprobs.read(), strict=True):
                request.logprobs.append(chosen, top, request.sampling)
        return self.requests

    def scored(self) -> list[EngineResult]:
        """The results of the scored-choice groups whose last request the step ended."""
        return self.scores.collect() if self.scores is not None else []
