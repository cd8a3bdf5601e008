"""Engine replicas on the CPU: several engines over one loaded model, each stepping in a thread of its own
with its share of torch's threads, behind the one engine interface the job loop drives.

Why: on a CPU every op of one engine is split evenly over all its threads, so each op waits for the
slowest core and for the threads to meet, and small ops (a decode step's, a small image's) split badly.
Engines of one thread each instead run whole steps side by side, a vision-tower call on one core while
another engine's decode runs on the next, each at its own core's pace (measured in docs/benchmarks.md).

The weights are shared (read only); each replica has its own scheduler, KV cache and encoder cache, with
its share of the job's memory for them. A request goes to the replica that holds its image, if one does
(its embedding and prompt prefix are cached there), unless that replica is far busier than the least
busy one; otherwise to the least busy one. Each replica's thread owns its engine: requests reach it
through its inbox, results come back through one outbox, and an exception in a replica (a bug, like one
in the single engine) stops the job from the next `step`.

Requests are shared out as they arrive, so one replica's share can outlast another's (a job's last
requests, an input running short): while a replica waits for requests, those with work take its threads,
each setting its thread count as a step begins (measured in docs/benchmarks.md, "Replicas on an AVX-512
CPU without AMX").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest, EngineResult
from batchvl.engine.scheduling.kv_budget import fixed_kv_cache_mb
from batchvl.engine.stats import EngineStats
from batchvl.errors import UserError
from batchvl.utils.queues import take_ready

logger = logging.getLogger(__name__)

STEP_WAIT_S = 0.05  # how long `step` waits for a finished request when none is ready
IDLE_WAIT_S = 0.05  # how long an idle replica waits for a request before looking at its stop flag
HOMES_KEPT = 16384  # images whose replica is remembered (a bounded map: the job's recent images)
MOST_AUTO_REPLICAS = 8  # `auto` on a larger machine: more would split the caches too thin
# `auto` runs one engine for a job of fewer requests: split over replicas, each one's share is a few
# requests, whose decodes run at a replica's pace where one engine would run them all on every core (on
# a 2-core AVX-512 machine, replicas took x0.72-0.80 of one engine's speed at 16 requests, x0.89-0.92 at
# 32; on the AMX machine, x0.93 at 8; docs/benchmarks.md)
FEWEST_REQUESTS_FOR_REPLICAS = 32
# `auto` runs one engine for a model of more weights: each replica's decode step reads every weight, so that
# replicas read them once each where one engine reads them once for all its rows, and a large model's ops
# split well over threads (at Qwen2-VL-2B's widths, 4.4 GB in bf16, replicas took x0.79-0.83 of one engine's
# speed at 32 samples on a 2-core AVX-512 machine; the `small` model's 0.2 GB gained x1.09-1.30 from them on
# the AMX machine; docs/benchmarks.md)
MOST_WEIGHT_BYTES_FOR_REPLICAS = 1 << 30


def check_replicas(config: EngineConfig, device: torch.device) -> None:
    """Refuse several replicas where one engine must run: on a GPU, whose kernels one engine's steps keep
    busy, and under ViT data parallelism, whose encode rounds one engine drives."""
    if config.replicas == "auto" or config.replicas == 1:
        return
    if device.type != "cpu":
        raise UserError(
            f"engine.replicas={config.replicas} runs engines side by side on the CPU, but model.device is "
            f"{device.type}; leave engine.replicas at auto (one engine on a GPU)"
        )
    if config.vit_parallel == "data":
        raise UserError(
            f"engine.replicas={config.replicas} cannot be combined with engine.vit_parallel: data; "
            "set one of them"
        )


def replica_count(
    config: EngineConfig,
    device: torch.device,
    under_torchrun: bool,
    model_config=None,
    most_requests: int | None = None,
    weight_bytes: int = 0,
) -> int:
    """How many engines the job runs: `engine.replicas`, with `auto` one per core the engine's threads use
    (at most MOST_AUTO_REPLICAS), or one for a job of fewer than FEWEST_REQUESTS_FOR_REPLICAS requests
    (`most_requests`, where known) or a model of more than MOST_WEIGHT_BYTES_FOR_REPLICAS of weights; one
    where `check_replicas` allows no more (a GPU, ViT data parallelism, torchrun's ranks), and for a model
    whose rotary embedding rewrites itself in its forward (`updates_itself_in_forward`)."""
    check_replicas(config, device)
    if device.type != "cpu" or under_torchrun:
        return 1
    if model_config is not None and updates_itself_in_forward(model_config):
        if config.replicas != "auto" and config.replicas > 1:
            logger.warning(
                "engine.replicas=%s: one engine instead, the model's rotary embedding rewrites itself "
                "in its forward",
                config.replicas,
            )
        return 1
    if config.replicas != "auto":
        return config.replicas
    if most_requests is not None and most_requests < FEWEST_REQUESTS_FOR_REPLICAS:
        return 1
    if weight_bytes > MOST_WEIGHT_BYTES_FOR_REPLICAS:
        return 1
    threads = config.threads or torch.get_num_threads()
    return max(1, min(threads, os.cpu_count() or 1, MOST_AUTO_REPLICAS))


def updates_itself_in_forward(model_config) -> bool:
    """Whether the model's rotary embedding is transformers' dynamic kind (`dynamic`, `longrope`), which
    rewrites its frequencies on the shared module as a forward's length changes: engines sharing it
    would read each other's. (The families batchvl runs today use static frequencies.)"""
    configs = [
        model_config,
        *(getattr(model_config, name, None) for name in ("text_config", "vision_config")),
    ]
    for config in filter(None, configs):
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(config, name, None)
            if isinstance(rope, dict):
                kind = str(rope.get("rope_type", rope.get("type", "")))
                if "dynamic" in kind or kind == "longrope":
                    return True
    return False


def replica_config(config: EngineConfig, count: int) -> EngineConfig:
    """One replica's settings: its share of the KV cache and encoder cache the job is given."""
    return dataclasses.replace(
        config,
        kv_cache_mb=fixed_kv_cache_mb(config) / count,
        encoder_cache_mb=config.encoder_cache_mb / count,
    )


@dataclass
class _Replica:
    engine: Engine
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    assigned: int = 0  # requests sent to it and not yet handed back (the main thread's count)
    thread: threading.Thread | None = None
    # Whether its engine has nothing to do and it waits for a request: set and cleared by its own thread,
    # read by the others' (a flag under the GIL, at worst a step stale)
    idle: bool = True

    @property
    def num_waiting(self) -> int:
        # Read from the main thread while the replica steps: lengths under the GIL, at worst a step
        # stale, which only shifts when the next request is sent.
        return self.inbox.qsize() + self.engine.num_waiting

    @property
    def wants_requests(self) -> bool:
        return self.num_waiting < self.engine.config.lookahead


class EngineReplicas:
    def __init__(self, make_engine: Callable[[], Engine], count: int, threads_each: int):
        self.threads_each = threads_each
        self._replicas = [_Replica(make_engine()) for _ in range(count)]
        # how much busier an image's replica may be and still get its requests: one look-ahead window
        self.lookahead = self._replicas[0].engine.config.lookahead
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._homes: OrderedDict[str, int] = OrderedDict()  # image content hash -> replica index
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        for index, replica in enumerate(self._replicas):
            replica.thread = threading.Thread(
                target=self._serve, args=(index, replica), name=f"batchvl-engine-{index}", daemon=True
            )
            replica.thread.start()

    @property
    def num_engines(self) -> int:
        return len(self._replicas)

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed: their seconds (encode_s, forward_s) are thread time, so with
        replicas running side by side they add up to more than the wall time."""
        total = EngineStats()
        for replica in self._replicas:
            total = total + replica.engine.stats
        return total

    @property
    def num_unfinished(self) -> int:
        return sum(replica.assigned for replica in self._replicas)

    @property
    def wants_requests(self) -> bool:
        return any(replica.wants_requests for replica in self._replicas)

    def add_request(self, item: EngineRequest) -> None:
        index = self._replica_for(item)
        replica = self._replicas[index]
        for image in item.images:
            self._homes[image.content_hash] = index
            self._homes.move_to_end(image.content_hash)
        while len(self._homes) > HOMES_KEPT:
            self._homes.popitem(last=False)
        replica.assigned += 1
        replica.inbox.put(item)

    def _replica_for(self, item: EngineRequest) -> int:
        """The replica that holds the request's first image, unless it is more than `lookahead` requests
        busier than the least busy one; else the least busy one wanting requests."""
        least = min(
            range(len(self._replicas)),
            key=lambda i: (not self._replicas[i].wants_requests, self._replicas[i].assigned),
        )
        home = self._homes.get(item.images[0].content_hash) if item.images else None
        if (
            home is not None
            and self._replicas[home].assigned - self._replicas[least].assigned <= self.lookahead
        ):
            return home
        return least

    def step(self) -> list[EngineResult]:
        """The requests finished since the last step (waiting up to STEP_WAIT_S for one when none is)."""
        batches = take_ready(self._outbox, STEP_WAIT_S if self.num_unfinished else 0)
        if self._failure is not None:
            raise self._failure
        results = []
        for index, finished in batches:
            self._replicas[index].assigned -= len(finished)
            results.extend(finished)
        return results

    def close(self) -> None:
        """Stop the replicas' threads (after their current step)."""
        self._stop.set()
        for replica in self._replicas:
            if replica.thread is not None:
                replica.thread.join()

    # On a replica's thread from here on.

    def _serve(self, index: int, replica: _Replica) -> None:
        threads = self.threads_each
        # This thread's own count (OpenMP's is per thread). torch gives a thread, on its first parallel op
        # or count asked, the count set last by any thread, over what it set itself before: asked first.
        torch.get_num_threads()
        torch.set_num_threads(threads)
        engine = replica.engine
        try:
            while not self._stop.is_set():
                if not self._take_requests(replica):
                    continue
                if threads != (wanted := self._threads_for(index)):
                    threads = wanted
                    torch.set_num_threads(threads)
                finished = engine.step()
                if finished:
                    self._outbox.put((index, finished))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread, which raises it
            self._failure = error
            self._outbox.put((index, []))  # wakes a waiting `step`

    def _take_requests(self, replica: _Replica) -> bool:
        """Add what the inbox holds to the engine; an idle engine waits a while for one. Whether the engine
        has work."""
        engine = replica.engine
        if not engine.num_unfinished:
            replica.idle = True
            try:
                engine.add_request(replica.inbox.get(timeout=IDLE_WAIT_S))
            except queue.Empty:
                return False
            replica.idle = False
        while True:
            try:
                engine.add_request(replica.inbox.get_nowait())
            except queue.Empty:
                return True

    def _threads_for(self, index: int) -> int:
        """The replica's threads for its next step: its own, and while other replicas wait for requests (a
        job's tail, its input running short) an even share of theirs among those with work, so that no core
        idles while a replica has steps to run."""
        working = [i for i, other in enumerate(self._replicas) if not other.idle or i == index]
        lent, extra = divmod(self.threads_each * (len(self._replicas) - len(working)), len(working))
        return self.threads_each + lent + (working.index(index) < extra)
