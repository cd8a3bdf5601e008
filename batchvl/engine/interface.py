"""The interface the job loop drives, whatever runs the requests: batchvl's engine (`engine.py`) or a
server (`batchvl/server/backend.py`). The loop adds requests while `wants_requests`, steps, and turns each
result into its row."""

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

    def step(self) -> list[EngineResult]:
        """Some work, and the requests that finished since the last step."""
        ...
