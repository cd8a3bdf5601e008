"""A plan's reads of its shards, several at once where they wait on the network.

A plan reads a few small files for each shard (its marker, its output's size, its input's stamp) at every
`run`, `status`, `validate` and `retry-failed`. On an object store each read waits for an answer over the
network, tens of milliseconds from a cloud machine to its region's store, so that a folder of a thousand
committed shards planned one read after the other waits a minute or more before the job's first step.
Each shard's reads are independent of the others', and fsspec's filesystems take calls from several
threads (an async one runs them on its own event loop), so a plan reads READS_AT_ONCE shards at a time
in an object store's output folder (`OutputDir.reads_at_once`). A local folder's are read one by one: a
local read answers in microseconds, and threads handing the interpreter to each other cost more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

READS_AT_ONCE = 16  # an object store's
THREAD_NAME = "batchvl-plan-reads"


def each_at_once(function: Callable[[Item], Result], items: Iterable[Item], at_once: int) -> list[Result]:
    """`[function(item) for item in items]`, run in up to `at_once` threads: the results in the items'
    order, and where calls raise, the exception of the first such item in that order, once every call
    has returned."""
    items = list(items)
    if len(items) < 2 or at_once < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(at_once, len(items)), thread_name_prefix=THREAD_NAME) as pool:
        futures = [pool.submit(function, item) for item in items]
    return [future.result() for future in futures]
