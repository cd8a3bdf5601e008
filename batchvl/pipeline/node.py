"""One node, several engine processes (`batchvl run --gpus N|all`, `--processes N`): the launcher.

The launcher plans the job once, as a single run does, so that every mistake is refused before any
process starts; then it starts one process per place (`node_places.py`) with multiprocessing's spawn
(a fresh interpreter: nothing of this process's CUDA or threads carried over), each running the job as a
single run would (`node_child.py`): the processes are concurrent runs of one job, which split its shards
through the claims. The launcher shows one progress bar, adds the processes' stats into one stats file
(`node_stats.py`) and ends as one run: the summary, then one exit code.

A process that dies (killed, out of memory) loses only the rows of the shard it held: its claim is stale
at once (same host, its process is gone), so a sibling that comes to the shard afterwards runs it, and the
rerun of the same command runs what is left. The others finish; the launcher then exits 1 naming the
process and its device. A stop signal reaches every process, and each commits its finished shards.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection, wait

from batchvl.config import JobConfig
from batchvl.engine.device.placement import launched_world_size
from batchvl.engine.stats import EngineStats
from batchvl.errors import ProcessDied, UserError
from batchvl.inputs.download import DownloadStats
from batchvl.outputs.run_stats import write_run_stats
from batchvl.pipeline.ending import RunSummary, raise_if_ended_early, rows_committed_before
from batchvl.pipeline.ledger import ShardLedger
from batchvl.pipeline.node_child import run_child
from batchvl.pipeline.node_places import Place, process_config
from batchvl.pipeline.node_stats import node_stats
from batchvl.pipeline.plan import Work, job_work
from batchvl.pipeline.runner import samples_bar
from batchvl.pipeline.tasks import TaskSlice
from batchvl.preprocess.pool import PoolStats
from batchvl.storage.output_dir import OutputDir
from batchvl.utils.stats import RunStats
from batchvl.utils.stop import StopRequests

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the launcher looks at its processes when none has anything to say
MISTAKE = 2  # a process's exit code for a mistake of the job's (a UserError), as the command's


class NodeStop(StopRequests):
    """The launcher's stop requests: the first stop signal goes on to every process as SIGTERM, and each
    stops as a single run does (a terminal's Ctrl-C reaches them itself: a second SIGINT from here would
    interrupt them at once); a second Ctrl-C goes on as SIGINT, to interrupt them at once. The launcher
    has no deadline of its own: it waits for the processes, whose own deadlines bound the wait."""

    def __init__(self, processes: list[multiprocessing.Process]):
        super().__init__()
        self.processes = processes

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning("%s received: every process stops after its current step", self.signal_name)
            self._send(signal.SIGTERM)
        elif signum == signal.SIGINT:
            self._send(signal.SIGINT)

    def _send(self, signum: int) -> None:
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                    os.kill(process.pid, signum)


def check_node(cfg: JobConfig) -> None:
    """What a node's launch cannot run, refused before any work."""
    if cfg.engine.backend == "openai":
        raise UserError(
            "--gpus / --processes start one built-in engine per process; with engine.backend: openai the "
            "server spreads the work: run one batchvl against it"
        )
    if cfg.output.overwrite:
        # a process that comes to a shard its sibling has just written again cannot tell that rewrite from
        # the old commit it is told to overwrite, and would write the shard again
        raise UserError(
            "--overwrite with --gpus / --processes would write again what the processes write: run "
            "--overwrite once alone, or set output.dir to a new folder"
        )
    if cfg.engine.vit_parallel != "none" or launched_world_size() > 1:
        raise UserError(
            "--gpus / --processes start their own processes: run them outside torchrun, without "
            "engine.vit_parallel"
        )


def run_node(
    cfg: JobConfig, places: list[Place], show_progress: bool = True, task: TaskSlice | None = None
) -> RunSummary:
    """Run the job in one process per place; the node's summary, or JobEnded as a single run raises it."""
    check_node(cfg)
    work = job_work(cfg, task)
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    processes, readers = [], []
    for place in places:
        reader, writer = context.Pipe(duplex=False)
        child = process_config(cfg, place, len(places))
        processes.append(context.Process(target=run_child, args=(place.index, child, task, level, writer)))
        readers.append((reader, writer))
    node = _Node(len(places))
    ledger = ShardLedger(work.shards, work.selection, len(cfg.prompts))
    with NodeStop(processes) as stop, samples_bar(ledger, work.shards, show_progress) as bar:
        for place, process, (_, writer) in zip(places, processes, readers, strict=True):
            if stop.requested:
                break  # the rest are not started
            with _sees_only(place.gpu):
                process.start()
            writer.close()  # the child's copy is the one left: its end is the pipe's end
        node.listen([reader for reader, _ in readers], [p for p in processes if p.pid is not None], bar)
    for process in processes:
        if process.pid is not None:
            process.join()
    devices = [place.device(cfg) for place in places]
    codes = [process.exitcode for process in processes]
    summary = _summary(cfg, task, work, node, devices, codes, stop, time.perf_counter() - started)
    _raise_unless_finished(cfg, summary, node, devices, codes, stop)
    return summary


class _Node:
    """What the processes said: their finished samples (to the bar), stats, and failures."""

    def __init__(self, size: int):
        self.runs: list[dict | None] = [None] * size
        self.ended_at: list[float | None] = [None] * size
        self.ended: list[bool] = [False] * size
        self.failures: dict[int, tuple[str, int]] = {}

    def listen(self, readers: list[Connection], started: list[multiprocessing.Process], bar) -> None:
        """Until every started process has ended, then what is left in their pipes."""
        sentinels = {process.sentinel: process for process in started}
        open_readers = list(readers[: len(started)])
        while sentinels:
            for ready in wait([*open_readers, *sentinels], timeout=POLL_S):
                if ready in sentinels:
                    # reaped at once: until then its pid exists, and its claims look alive to the others
                    sentinels.pop(ready).join()
                elif not self._take(ready, bar):
                    open_readers.remove(ready)
        for reader in open_readers:
            while reader.poll() and self._take(reader, bar):
                pass

    def _take(self, reader: Connection, bar) -> bool:
        """One message; False where the pipe has ended (its process is gone, or died mid-message)."""
        try:
            message = reader.recv()
        except (EOFError, OSError):
            reader.close()
            return False
        kind, index = message[0], message[1]
        if kind == "samples":
            bar.update(message[2])
        elif kind == "ended":
            self.runs[index], self.ended[index] = message[2], True
            self.ended_at[index] = time.monotonic()
        else:
            self.failures[index] = (message[2], message[3])
        return True


@contextlib.contextmanager
def _sees_only(gpu: str | None):
    """CUDA_VISIBLE_DEVICES for a process started here (spawn: it takes this process's environment)."""
    if gpu is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _summary(cfg, task, work: Work, node: _Node, devices, codes, stop: NodeStop, wall_s: float) -> RunSummary:
    zero = RunStats(task=str(task) if task else None).to_dict(EngineStats(), PoolStats(), DownloadStats())
    stats = node_stats(zero, node.runs, devices, codes, node.ended_at)
    stats["wall_s"] = round(wall_s, 3)
    stats["shards_total"] = work.num_task_shards
    stats["shards_skipped"] = work.num_task_shards - len(work.shards)
    # the processes count their siblings' shards as another run's; the node counts those of runs outside it
    all_finished = all(node.ended) and not stop.requested
    stats["shards_claimed_elsewhere"] = len(work.shards) - stats["shards_committed"] if all_finished else 0
    stats["stopped_by"] = stop.signal_name or None
    stats["rows_committed_before"] = rows_committed_before(work.plan.resume)
    out = OutputDir.of(cfg.output)
    return RunSummary(out.url, write_run_stats(out, stats), stats)


def _raise_unless_finished(cfg, summary: RunSummary, node: _Node, devices, codes, stop: NodeStop) -> None:
    """A stop (which the processes obeyed, however each ended) first, then a mistake of the job's found
    while reading, a process that died or failed, and the error budget over the node's rows."""
    if not stop.requested:
        for message, code in node.failures.values():
            if code == MISTAKE:
                raise UserError(message)
        dead = [_death(i, devices[i], codes[i], node) for i in range(len(devices)) if not node.ended[i]]
        if dead:
            committed = summary.stats["shards_committed"]
            others = "no process finished" if len(dead) == len(devices) else "the other processes finished"
            raise ProcessDied(
                f"{'; '.join(dead)}; {others} ({committed} shard(s) committed); "
                "rerun the same command to finish the job",
                ProcessDied.EXIT_CODE,
                summary,
            )
    raise_if_ended_early(summary, stop, cfg.output.max_error_rate)


def _death(index: int, device: str, code: int | None, node: _Node) -> str:
    if index in node.failures:
        return f"process {index} ({device}) failed: {node.failures[index][0]}"
    if code is not None and code < 0:
        return f"process {index} ({device}) was killed by {signal.Signals(-code).name}"
    return f"process {index} ({device}) died with exit code {code}"
