"""What the unfinished requests ask of a step beyond a greedy pick: sampled draws, kept log-probabilities,
grammar masks, scored choices. Counted as requests are added and finished, so that a step none of whose
requests asks for one makes none of the passes over its rows that look for it: at 1,024 decodes a step
each such pass cost some 0.1 ms of host work, and a captioning job's steps ask for none of them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchvl.engine.request import Request


@dataclass
class RequestMix:
    sampled: int = 0  # generating requests that draw their tokens (not greedy)
    logprobs: int = 0  # requests that keep their tokens' log-probabilities
    grammars: int = 0  # requests generating under a grammar
    scored: int = 0  # scoring requests (a scored choice each)

    def count(self, request: Request, sign: int = 1) -> None:
        """Count a request in (sign 1, as it is added) or out (-1, as it finishes)."""
        self.sampled += sign * (request.score_from is None and not request.sampling.is_greedy)
        self.logprobs += sign * (request.logprobs is not None)
        self.grammars += sign * (request.grammar is not None)
        self.scored += sign * (request.choice is not None)

    @classmethod
    def of(cls, requests: Iterable[Request]) -> RequestMix:
        """The mix of `requests`, counted afresh (what the running count must equal)."""
        mix = cls()
        for request in requests:
            mix.count(request)
        return mix
