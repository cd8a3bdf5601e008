"""The interface the job loop drives, whatever runs the requests: batchvl's engine (`engine.py`, or its
replicas, `parallel/replicas.py`) or a server (`batchvl/server/server_engine.py`). The loop adds requests
while `wants_requests`, steps, turns each result into its row, and closes it on every way out."""

from __future__ import annotations

from typing import Protocol

from batchvl.engine.request import EngineRequest, EngineResult
from batchvl.engine.stats import EngineStats


class EngineInterface(Protocol):
    @property
    def stats(self) -> EngineStats: ...

    @property
    def num_unfinished(self) -> int:
        """Requests added whose results have not been handed back yet."""
        ...

    @property
    def wants_requests(self) -> bool:
        """Whether to add more before stepping (false: step until it is true again)."""
        ...

    def add_request(self, item: EngineRequest) -> None: ...

    @property
    def num_engines(self) -> int:
        """Engines stepping side by side (`engine.replicas`): their stats' seconds are summed over them."""
        ...

    def step(self) -> list[EngineResult]:
        """Some work, and the requests that finished since the last step."""
        ...

    def close(self) -> None:
        """Stop what runs beside the caller (threads, a launched server)."""
        ...
