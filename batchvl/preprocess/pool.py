"""The preprocessing pool: a torch DataLoader over the input stream, robust to crashing and hanging workers.

Each worker reads the shards and keeps every n-th sample (a disjoint part of the stream), preprocesses
it (waits for its downloads, decode, resize, patchify, hash, tokenize) and hands plain arrays back;
`in_order=False` lets a slow sample hold back only itself. Workers record what they are doing in
shared memory. A watchdog thread kills a worker stuck on one sample longer than `timeout_s`; when a
worker dies (killed, segfault, out of memory) the loader is rebuilt, the sample it was working on is
reported as an error, and every sample not yet delivered is processed again, so one bad sample costs
that sample only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import torch.utils.data

from batchvl.errors import SampleError, UserError, first_line
from batchvl.inputs.fetch_ahead import media_ready
from batchvl.inputs.sources import Source
from batchvl.inputs.types import ShardEnd, ShardInfo, ShardSkipped
from batchvl.outputs.claims import ShardClaims
from batchvl.preprocess import shared_pixels
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.sample import PreparedSample, SampleProcessor
from batchvl.utils.memory import load_libc, release_free_heap
from batchvl.utils.stats import Counters

logger = logging.getLogger(__name__)

# STOPPED: killed because another worker failed (its sample is redone); DONE: finished its part and exits
IDLE, BUSY, TIMED_OUT, STOPPED, DONE = range(5)
SLOT_FIELDS = 5  # pid, state, shard number, sample index, start time


PR_SET_PDEATHSIG = 1  # prctl option, from linux/prctl.h


def _init_worker(parent_pid: int, pixels_prefix: str | None, _worker_id: int) -> None:
    """Ignore Ctrl-C, which a terminal sends to the whole process group: the job process decides how to
    stop, and a worker that died of it would look like a crash. Have the kernel kill this worker when the
    job process dies (Linux): without it a worker of a SIGKILLed job (the OOM killer, `kill -9`) lives on,
    blocked forever on a queue nobody reads. Send pixels as shared-memory files named after
    `pixels_prefix` (`shared_pixels.py`; None: torch's way)."""
    shared_pixels.write_as(pixels_prefix)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux") and (libc := load_libc()) is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the job died before the request took effect
        os._exit(1)


MOST_WORKERS = 8


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity's (a Slurm task's, a container's cpuset), which
    may be far fewer than the machine's."""
    if hasattr(os, "sched_getaffinity"):  # (Linux)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_workers(cores: int | None = None) -> int:
    """Preprocessing workers for `cores` CPU cores (those this process may use by default): half of them,
    at most 8."""
    return max(1, min(MOST_WORKERS, (cores or usable_cores()) // 2))


def warn_if_oversubscribed(workers: int, cores: int | None = None) -> bool:
    """Say so where `preprocess.workers` asks for more workers than the cores this process may run on
    (`usable_cores`, by default): they would share them with each other and with the engine's threads,
    each switch between them costing time and none preparing samples faster. Returns whether it said so."""
    usable = cores if cores is not None else usable_cores()
    if workers <= usable:
        return False
    logger.warning(
        "preprocess.workers is %d, more than the %d CPU core(s) this run may use: the workers share them "
        "with each other and the engine; set preprocess.workers to %d or fewer (or leave it unset: half "
        "the cores)",
        workers,
        usable,
        usable,
    )
    return True


@dataclass
class PoolStats(Counters):
    worker_restarts: int = 0
    samples_crashed: int = 0
    samples_timed_out: int = 0


@dataclass(frozen=True)
class SlotState:
    pid: int
    state: int
    shard_no: int
    index: int
    started: float


class WorkerSlots:
    """Shared memory where each worker says which sample it is on and since when.

    Lock-free on purpose: workers get SIGKILLed, and one killed while holding a lock would leave it held
    forever. Each worker writes only its own slot, one aligned double at a time, and `begin` writes the
    sample's fields before the BUSY state, so a reader that sees BUSY also sees the sample it belongs to.
    """

    PID, STATE, SHARD, INDEX, STARTED = range(SLOT_FIELDS)

    def __init__(self, context, num_workers: int):
        self.array = context.Array(ctypes.c_double, num_workers * SLOT_FIELDS, lock=False)
        self.num_workers = num_workers

    def register(self, worker: int) -> None:
        base = worker * SLOT_FIELDS
        self.array[base + self.STATE] = IDLE
        self.array[base + self.PID] = os.getpid()

    def begin(self, worker: int, shard_no: int, index: int) -> None:
        base = worker * SLOT_FIELDS
        self.array[base + self.SHARD] = shard_no
        self.array[base + self.INDEX] = index
        self.array[base + self.STARTED] = time.monotonic()
        self.array[base + self.STATE] = BUSY

    def end(self, worker: int) -> None:
        self.array[worker * SLOT_FIELDS + self.STATE] = IDLE

    def mark(self, worker: int, state: int) -> None:
        self.array[worker * SLOT_FIELDS + self.STATE] = state

    def snapshot(self) -> list[SlotState]:
        values = self.array[:]  # state comes before the fields it vouches for
        return [
            SlotState(int(v[0]), int(v[1]), int(v[2]), int(v[3]), v[4])
            for v in (values[i * SLOT_FIELDS : (i + 1) * SLOT_FIELDS] for i in range(self.num_workers))
        ]


UNDECIDED, OURS, SKIP = range(3)  # a shard's claim decision, in shared memory


class ClaimDecisions:
    """Whether this run reads each shard, decided once per shard for all workers.

    Every worker reads every shard (keeping its share of the samples), so they must agree. The worker
    `position % num_workers` decides shard `position` (claims it, or finds another run's claim) and
    writes the decision; the others wait for it. One writer per cell, so no lock a killed worker could
    leave held; the wait ends because a decider is never waiting on a later shard. Decisions outlive
    worker restarts.
    """

    def __init__(
        self,
        context,
        shards: list[ShardInfo],
        claims: ShardClaims,
        is_committed: Callable[[str], bool] | None,
    ):
        self.cells = context.Array(ctypes.c_byte, max(1, len(shards)), lock=False)
        self.position = {shard.shard: i for i, shard in enumerate(shards)}
        self.claims = claims
        self.is_committed = is_committed  # a shard committed by another run while this one waited

    def decide(self, shard: str, worker: int, num_workers: int) -> tuple[int, str | None]:
        """(OURS or SKIP, the reason to report when this worker is the one that decided to skip)."""
        position = self.position[shard]
        if self.cells[position] == UNDECIDED and position % num_workers == worker:
            holder = self.claims.acquire(shard)
            reason = None
            if holder is not None:
                reason = f"another run has it (pid {holder.pid} on {holder.host})"
            elif self.is_committed is not None and self.is_committed(shard):
                self.claims.release(shard)
                reason = "another run committed it"
            self.cells[position] = OURS if reason is None else SKIP
            return self.cells[position], reason
        while self.cells[position] == UNDECIDED:
            time.sleep(0.01)
        return self.cells[position], None


@dataclass(frozen=True)
class ReaderFailure:
    """A mistake found while reading (e.g. a missing column), raised as a UserError in the main process."""

    message: str


class PreprocessDataset(torch.utils.data.IterableDataset):
    def __init__(
        self,
        source: Source,
        shards: list[ShardInfo],
        processor: SampleProcessor,
        delivered: frozenset[tuple[str, int]],
        failed: dict[tuple[str, int], SampleError],
        slots: WorkerSlots | None,
        wanted: dict[str, frozenset[int]] | None = None,
        decisions: ClaimDecisions | None = None,
    ):
        self.decisions = decisions
        self.source = source
        self.shards = shards
        self.processor = processor
        self.wanted = wanted
        self.delivered = delivered
        self.failed = failed
        self.slots = slots

    def __iter__(self) -> Iterator[PreparedSample | ShardEnd | ShardSkipped | ReaderFailure]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.slots is not None:
            self.slots.register(worker)
        try:
            for shard_no, shard in enumerate(self.shards):
                name = shard.shard
                if self.decisions is not None:
                    decision, reason = self.decisions.decide(name, worker, num_workers)
                    if reason is not None:
                        yield ShardSkipped(name, reason)
                    if decision == SKIP:
                        continue

                if self.wanted is not None and name in self.wanted and not self.wanted[name]:
                    if worker == 0:  # no sample of it is wanted (a committed shard that only drops rows)
                        yield ShardEnd(name, 0)
                    continue

                def keep(index: int, name: str = name) -> bool:
                    return (
                        index % num_workers == worker
                        and (name, index) not in self.delivered
                        and (self.wanted is None or name not in self.wanted or index in self.wanted[name])
                    )

                for item in self.source.iter_shard(shard, keep):
                    if isinstance(item, ShardEnd):
                        if worker == 0:  # every worker counts the shard; one reports it
                            yield item
                        continue
                    failure = self.failed.get((name, item.index))
                    if failure is not None:
                        yield PreparedSample.failed(item, failure)
                        continue
                    if self.slots is not None:
                        self.slots.begin(worker, shard_no, item.index)
                    # After `begin`: a download that hangs is this sample's, and the watchdog ends it.
                    prepared = self.processor(media_ready(item))
                    if info is not None:  # sent to the job process
                        prepared = in_shared_memory(prepared)
                    if self.slots is not None:
                        self.slots.end(worker)
                    yield prepared
        except UserError as exc:
            yield ReaderFailure(str(exc))
        if self.slots is not None:
            self.slots.mark(worker, DONE)  # the loader lets a worker exit once its part is done


def in_shared_memory(prepared: PreparedSample) -> PreparedSample:
    """The sample with its pixels in shared memory, ready to be sent; where they cannot be put there, the
    sample's error row, which says why (sent as it was, it would be dropped on the way: see
    `PreparedMedia.in_shared_memory`)."""
    try:
        images = [m.in_shared_memory() if isinstance(m, PreparedMedia) else m for m in prepared.images]
    except (RuntimeError, OSError) as exc:
        message = (
            "the prepared sample could not be put in shared memory to reach the job process (a full "
            f"/dev/shm, or a file size limit such as ulimit -f?): {first_line(exc)}"
        )
        return dataclasses.replace(prepared, images=[], error=SampleError("preprocess_error", message))
    return dataclasses.replace(prepared, images=images)


def _identity(item):
    return item


class Watchdog:
    """Watches the workers; when one dies or spends more than `timeout_s` on a sample, stops them all.

    A worker that hangs is killed and its sample reported as timed out. Once any worker has died, the
    others are killed too (their samples are simply redone), because a worker can die while its queue
    thread is halfway through sending an earlier result: the main process would then wait forever for
    the rest of that message. With every writer gone, the read ends instead, the loader reports the
    death, and the pool restarts.
    """

    def __init__(self, slots: WorkerSlots, timeout_s: float):
        self.slots = slots
        self.timeout_s = timeout_s
        self.tripped = False  # it found a failure and stopped the workers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchvl-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        interval = min(0.5, self.timeout_s / 4)
        while not self._stop.wait(interval):
            if self._check():
                self.tripped = True
                self._stop_all()
                return

    def confirm_failure(self, grace_s: float = 2.0) -> bool:
        """After the loader failed to read: whether a worker failure caused it. The read can end before the
        next periodic check sees the death (a lone worker's exit closes the queue at once), so look now,
        for up to `grace_s` while the dying process becomes a zombie."""
        deadline = time.monotonic() + grace_s
        while not self.tripped:
            if self._check():
                self.tripped = True
                self._stop_all()
            elif time.monotonic() > deadline:
                break
            else:
                time.sleep(0.05)
        return self.tripped

    def _check(self) -> bool:
        """True once a worker died before finishing its part, or was killed for hanging."""
        now = time.monotonic()
        for worker, slot in enumerate(self.slots.snapshot()):
            if slot.pid <= 0 or slot.state == DONE:
                continue  # not started yet, or exited normally
            if _is_dead(slot.pid):
                return True  # a crash if it was on a sample; the pool reports it
            if slot.state == BUSY and now - slot.started > self.timeout_s:
                self.slots.mark(worker, TIMED_OUT)
                logger.warning(
                    "preprocessing worker %d exceeded %.0f s on one sample", slot.pid, self.timeout_s
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGKILL)
                return True
        return False

    def _stop_all(self) -> None:
        for worker, slot in enumerate(self.slots.snapshot()):
            if slot.pid <= 0 or _is_dead(slot.pid):
                continue
            if slot.state == BUSY:
                self.slots.mark(worker, STOPPED)
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.pid, signal.SIGKILL)


def _close_parent_write_end(iterator) -> None:
    """Close the main process's copy of the result queue's write end (it never writes to it), so that
    a read cut short by dying workers ends instead of waiting for bytes only a worker could send."""
    result_queue = getattr(iterator, "_worker_result_queue", None)
    writer = getattr(result_queue, "_writer", None)
    if writer is not None and not writer.closed:
        writer.close()


def _unregister_from_sigchld(iterator) -> None:
    """Keep torch's SIGCHLD handler from raising in the main thread when one of our workers dies.

    Once any DataLoader has been iterated in the main thread, torch raises from a SIGCHLD handler
    wherever the main thread happens to be (mid engine step) for every registered worker that exits.
    A dying worker is an event this pool handles (the loader's own liveness check reports it here), so
    its workers are taken off that list. Uses the iterator's private bookkeeping, checked defensively.
    """
    from torch.utils.data._utils import signal_handling

    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


def _wait_until_exited(slots: WorkerSlots, timeout_s: float = 5.0) -> None:
    """Give killed workers a moment to finish exiting, so their slots tell dead from alive."""
    deadline = time.monotonic() + timeout_s
    pids = [slot.pid for slot in slots.snapshot() if slot.pid > 0 and slot.state != DONE]
    while any(not _is_dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _is_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class PreprocessPool:
    """Iterate prepared samples (and shard ends) over `shards`; every sample comes out exactly once.

    With `wanted`, only those samples of the shards it names are read and prepared (a retry of failed
    rows, the changed prompts of a committed shard); shard ends still report the shard's full sample
    count, but a shard of which no sample is wanted is not read at all: its end reports 0. With
    `claims`, each shard is claimed before it is read; one another run has (or committed meanwhile, by
    `is_committed`) comes out as a `ShardSkipped` instead of its samples.
    """

    def __init__(
        self,
        source: Source,
        shards: list[ShardInfo],
        processor: SampleProcessor,
        workers: int,
        prefetch: int,
        timeout_s: float,
        wanted: dict[str, frozenset[int]] | None = None,
        claims: ShardClaims | None = None,
        is_committed: Callable[[str], bool] | None = None,
    ):
        self.source = source
        self.wanted = wanted  # per shard, the only sample indices to read (None, or a shard not in it: all)
        self.shards = shards
        self.processor = processor
        self.workers = workers
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self.stats = PoolStats()
        start_methods = multiprocessing.get_all_start_methods()
        # fork: workers start at once and share the tokenizer without pickling; they never run torch ops.
        self.context = multiprocessing.get_context("fork" if "fork" in start_methods else "spawn")
        self.decisions = ClaimDecisions(self.context, shards, claims, is_committed) if claims else None
        # Set once the first workers are forked (or will not be: none asked for, or the iteration failed).
        # A fork copies every open descriptor: one made while another thread starts a subprocess keeps the
        # pipe through which that subprocess reports its exec open, and the thread waits on it forever (a
        # launched server's start did). Whoever starts subprocesses beside the pool waits for this first.
        self.forked = threading.Event()
        self.pixels_prefix = shared_pixels.pool_prefix()  # the workers' pixel files' (`shared_pixels.py`)

    def __iter__(self) -> Iterator[PreparedSample | ShardEnd | ShardSkipped]:
        with shared_pixels.owning(self.pixels_prefix):  # its files' lock: this job is alive
            if self.pixels_prefix is not None:
                shared_pixels.remove_left_behind()  # by job processes killed before they could
            try:
                yield from self._iterate()
            finally:
                self.forked.set()  # (an iteration that failed before its forks)

    def _iterate(self) -> Iterator[PreparedSample | ShardEnd | ShardSkipped]:
        delivered: set[tuple[str, int]] = set()
        sizes: dict[str, int] = {}  # shard -> number of samples, known from its ShardEnd
        failed: dict[tuple[str, int], SampleError] = {}
        while True:
            # A shard is finished once its end was seen and all of its samples came out.
            finished = {
                name
                for name, size in sizes.items()
                if self._count(delivered, name) == self._expected(name, size)
            }
            shards = [s for s in self.shards if s.shard not in finished]
            slots = WorkerSlots(self.context, self.workers) if self.workers else None
            dataset = PreprocessDataset(
                self.source,
                shards,
                self.processor,
                frozenset(delivered),
                failed,
                slots,
                self.wanted,
                self.decisions,
            )
            if slots is None:
                self.forked.set()  # no worker to fork
                yield from self._checked(iter(dataset), delivered, sizes)
                return
            # Forked workers tokenize; the Rust tokenizer's thread pool must not be inherited mid-use.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            with warnings.catch_warnings():
                # torch warns when workers outnumber its CPU estimate; the count is the user's choice.
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                loader = torch.utils.data.DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.workers,
                    prefetch_factor=self.prefetch,
                    collate_fn=_identity,
                    multiprocessing_context=self.context,
                    in_order=False,
                    worker_init_fn=functools.partial(_init_worker, os.getpid(), self.pixels_prefix),
                )
                # Forked workers share the job process's pages copy-on-write: heap pages kept free for reuse
                # would be copied on the engine's first write to each after the fork (about 1 s of system
                # time on the throughput workload); handed back first, they come back as fresh pages.
                release_free_heap()
                items = iter(loader)  # the workers are forked here
                self.forked.set()
                _unregister_from_sigchld(items)
                _close_parent_write_end(items)
            watchdog = Watchdog(slots, self.timeout_s)
            try:
                with watchdog:
                    yield from self._checked(items, delivered, sizes)
                return
            except (RuntimeError, EOFError, OSError) as exc:
                # After a failure the watchdog stops every worker; the loader then either sees a worker
                # gone ("exited unexpectedly") or first reads the end of the queue, possibly in the middle
                # of a result a dying worker was sending (EOFError / OSError).
                if not ("exited unexpectedly" in str(exc) or watchdog.confirm_failure()):
                    raise
                _wait_until_exited(slots)
                lost = self._lost_samples(slots, shards)
                if not lost:
                    raise RuntimeError(f"a preprocessing worker died outside any sample: {exc}") from exc
                failed.update(lost)
                self.stats.worker_restarts += 1
                logger.warning("restarting preprocessing workers after: %s", exc)
            finally:
                del items  # shuts the workers down
                if self.pixels_prefix is not None:  # what they sent that was never received
                    shared_pixels.remove_unreceived(self.pixels_prefix)

    @staticmethod
    def _count(delivered: set[tuple[str, int]], shard: str) -> int:
        return sum(1 for name, _ in delivered if name == shard)

    def _expected(self, shard: str, size: int) -> int:
        """How many samples of a shard of `size` samples come out."""
        if self.wanted is None or shard not in self.wanted:
            return size
        return sum(1 for index in self.wanted[shard] if index < size)

    def _checked(
        self, items, delivered: set, sizes: dict
    ) -> Iterator[PreparedSample | ShardEnd | ShardSkipped]:
        for item in items:
            if isinstance(item, ReaderFailure):
                raise UserError(item.message)
            if isinstance(item, ShardSkipped):
                sizes[item.shard] = 0  # nothing of it comes out: finished for the restart logic
                yield item
                continue
            if isinstance(item, ShardEnd):
                if item.shard in sizes:
                    continue  # already reported before a restart
                sizes[item.shard] = item.num_samples
            else:
                delivered.add((item.shard, item.index))
            yield item

    def _lost_samples(
        self, slots: WorkerSlots, shards: list[ShardInfo]
    ) -> dict[tuple[str, int], SampleError]:
        lost = {}
        for slot in slots.snapshot():
            if slot.state == TIMED_OUT:
                self.stats.samples_timed_out += 1
                error = SampleError(
                    "preprocess_timeout",
                    f"preprocessing took longer than preprocess.timeout_s={self.timeout_s:g} s; "
                    "the worker was stopped",
                )
            elif slot.state == BUSY and _is_dead(slot.pid):
                self.stats.samples_crashed += 1
                error = SampleError(
                    "preprocess_crash", "the preprocessing worker crashed on this sample (killed or segfault)"
                )
            else:
                continue
            lost[(shards[slot.shard_no].shard, slot.index)] = error
        return lost
