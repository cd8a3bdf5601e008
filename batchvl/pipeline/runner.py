"""run_job: plan -> read and preprocess (worker pool) -> engine -> write, one direction, nothing lost.

Every (sample, prompt) ends as exactly one row: `ok` with its text, or `error` with a type and message.
The ledger (`ledger.py`) keeps each shard's rows and says when every row of a shard has an outcome; the
runner then commits it through the run's commit strategy (`commit_strategies.py`), after the step's
results or the input item are handled; committed shards are skipped on rerun. A run can be one task of a
split job (`TaskSlice`), and stops cleanly between engine steps on a stop signal.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import time
from collections.abc import Callable

from tqdm.auto import tqdm

from batchvl.config import JobConfig
from batchvl.engine.interface import EngineInterface
from batchvl.engine.parallel.ranks import in_launched_processes, serve_rank
from batchvl.engine.parallel.vit_dp import DistributedContext
from batchvl.engine.stats import EngineStats
from batchvl.errors import ServerGone
from batchvl.inputs.download import DownloadStats
from batchvl.inputs.stamps import ContentStamps
from batchvl.inputs.types import ShardEnd, ShardInfo, ShardSkipped
from batchvl.models.loader import LoadedModel, ModelParts
from batchvl.outputs.claims import Holder, ShardClaims
from batchvl.outputs.dataset_card import DatasetCard
from batchvl.outputs.run_stats import write_run_stats
from batchvl.outputs.writers import ResultRow
from batchvl.pipeline.commit_strategies import WriteShard
from batchvl.pipeline.ending import RunSummary, raise_if_ended_early, rows_committed_before
from batchvl.pipeline.engine_setup import EngineSetup
from batchvl.pipeline.launch import builtin_engine_setup, job_model_parts, load_job_model
from batchvl.pipeline.ledger import CommitStrategy, ShardLedger
from batchvl.pipeline.plan import Work, job_work
from batchvl.pipeline.rows import prompt_of, result_row
from batchvl.pipeline.sample_flow import Progress, SampleFlow
from batchvl.pipeline.server_setup import server_engine_setup
from batchvl.pipeline.tasks import TaskSlice
from batchvl.preprocess.pool import PoolStats, PreprocessPool, default_workers, warn_if_oversubscribed
from batchvl.preprocess.sample import PreparedSample
from batchvl.storage import layout
from batchvl.storage.output_dir import LocalDir, OutputDir
from batchvl.utils.background import END, BackgroundIterator, prompt_handoffs
from batchvl.utils.memory import HeapTrimmer, keep_freed_memory
from batchvl.utils.stats import RunStats
from batchvl.utils.stop import StopRequests

logger = logging.getLogger(__name__)

# What a killed run leaves in these folders is not in the way of any later run, so only a run's end
# removes it (a run's start removes the temp files of the results and the card, which it rewrites)
LEFT_BEHIND = (layout.MARKERS, layout.CARD, layout.CLAIMS, layout.STATS)

IDLE_POLL_S = 0.5  # how long an idle run waits for input before looking at stop requests again
NOTHING = object()  # no prepared input was ready


def feed_size(workers: int, input_window: int) -> int:
    """Prepared samples the run's input thread holds for the engine: at least the engine's input window, so
    that one pass between two steps can fill it. The run takes every ready sample, then steps while the
    input thread refills the feed: a feed of fewer hands the engine at most about that many new samples a
    step (a GPU job with 8 workers and a feed of 16 admitted about 16 new requests a step, where its steps
    had room for some 40). And two a worker, at least 4."""
    return max(4, 2 * workers, input_window)


class JobRunner:
    """Runs a job's work: `work` plans it (by default, the task's uncommitted shards) and `commit` writes
    each complete shard (by default, as a new file); `mode` names the run in its stats, and only a
    plain run ("run") is held to `output.max_error_rate`. One process of a node's launch
    (`pipeline/node.py`) counts its samples through `count_sample` and leaves the stats file to the
    launcher (`write_stats=False`), which writes one for the node."""

    def __init__(
        self,
        cfg: JobConfig,
        loaded: LoadedModel | None = None,
        show_progress: bool = True,
        task: TaskSlice | None = None,
        *,
        work: Callable[[], Work] | None = None,
        commit: CommitStrategy | None = None,
        mode: str = "run",
        count_sample: Callable[[], None] | None = None,
        write_stats: bool = True,
    ):
        self.cfg = cfg
        self.loaded = loaded
        self.show_progress = show_progress
        self.task = task
        self.plan_work = work or functools.partial(job_work, cfg, task, loaded is not None)
        self.out = OutputDir.of(cfg.output)
        self.commit = commit  # None: write each shard as a new file, with the plan's fingerprint
        self.stats = RunStats(mode=mode, task=str(task) if task else None)
        self.count_sample = count_sample
        self.write_stats = write_stats
        self.downloads = DownloadStats()
        self.trimmer = HeapTrimmer()
        self.stop = StopRequests()
        self.claims = ShardClaims(self.out, Holder.of_process(os.getpid()))
        self.card = DatasetCard(self.out)
        self.server_gone: ServerGone | None = None  # the openai backend's server went away mid-run
        self.engine: EngineInterface | None = None  # once started, after the preprocessing workers
        # the stamps its commits record, read beside the job's thread (None: its commits record none)
        self.input_stamps: ContentStamps | None = None

    def run(self) -> RunSummary:
        keep_freed_memory()  # process-wide; the engine's steps reuse their activations' memory
        return in_launched_processes(self.cfg.engine, self.cfg.model.device, self._drive, self._serve)

    def _load(self, parts: ModelParts | None = None) -> LoadedModel:
        if self.loaded is None:
            self.loaded, seconds = load_job_model(self.cfg, parts)
            self.stats.model_load_s = round(seconds, 3)
        return self.loaded

    def _model_parts(self) -> ModelParts:
        """What the preprocessing needs of the model: read from its folder, or from the model given."""
        return job_model_parts(self.cfg) if self.loaded is None else ModelParts.of(self.loaded)

    def _serve(self, context: DistributedContext) -> RunSummary:
        rounds = serve_rank(self._load().adapter, self.cfg.engine, context)
        return RunSummary(self.out.url, "", {"rank": context.rank, "encode_rounds": rounds}, is_driver=False)

    def _drive(self, context: DistributedContext | None) -> RunSummary:
        with self.stop:
            summary = self._run_shards(context)
        limit = self.cfg.output.max_error_rate if self.stats.mode == "run" else None
        raise_if_ended_early(summary, self.stop, limit, self.server_gone)
        return summary

    def _run_shards(self, context: DistributedContext | None) -> RunSummary:
        start = time.perf_counter()
        work = self.plan_work()  # every check runs even when every shard is done
        self.stats.shards_total = work.num_task_shards
        self.stats.shards_skipped = work.num_task_shards - len(work.shards)
        pool_stats = PoolStats()
        if work.shards and not self.stop.requested:
            if self.cfg.engine.backend == "openai":
                setup = server_engine_setup(self.cfg, self.out, self.task, work.plan.graph)
            else:
                parts = self._model_parts()  # the weights load as the engine starts, after the workers'
                load = functools.partial(self._load, parts)
                requests = work.most_requests(len(self.cfg.prompts))
                setup = builtin_engine_setup(self.cfg, parts, load, context, work.plan.graph, requests)
            try:
                pool_stats = self._process(work, setup)
            finally:
                if self.engine is not None:
                    self.engine.close()  # a launched server is stopped on every way out
        self._remove_left_behind()
        self.stats.wall_s = round(time.perf_counter() - start, 3)
        engine = self.engine
        stats = self.stats.to_dict(engine.stats if engine else EngineStats(), pool_stats, self.downloads)
        stats["vit_parallel_ranks"] = context.world_size if context else 1
        stats["engine_replicas"] = engine.num_engines if engine else 1  # encode_s, forward_s summed over them
        stats["stopped_by"] = self.stop.signal_name or ("server_gone" if self.server_gone else None)
        stats.update(work.notes)
        stats["rows_committed_before"] = rows_committed_before(work.plan.resume)
        path = write_run_stats(self.out, stats) if self.write_stats else ""
        return RunSummary(self.out.url, path, stats)

    def _remove_left_behind(self) -> None:
        """Remove what killed runs left under `_batchvl/`: stale claims, and temp files of writers that
        are gone. The shards are committed by now: a failure here is a warning, never a failed run."""
        try:
            self.claims.remove_stale()
            if isinstance(self.out, LocalDir):  # an object store has no temp files
                for folder in LEFT_BEHIND:
                    self.out.remove_dead_temps(self.out.join(folder))
        except Exception as error:  # an object store's own errors too
            logger.warning("what killed runs left in %s was not removed: %s", self.out.url, error)

    def _process(self, work: Work, setup: EngineSetup) -> PoolStats:
        pre = self.cfg.preprocess
        workers = default_workers() if pre.workers is None else pre.workers
        if pre.workers is not None:  # (the default is half the usable cores)
            warn_if_oversubscribed(workers)
        self.stats.preprocess_workers = workers
        ledger = ShardLedger(work.shards, work.selection, len(self.cfg.prompts))
        self.flow = SampleFlow(self.cfg, work.plan.graph, setup.prompts)
        if self.commit is None:
            plan = work.plan
            self.commit = WriteShard(
                self.cfg, self.out, self.task, plan.output_defining, plan.fingerprint, work.kept, self.stats
            )
        if self.commit.records_input_stamp:
            self.input_stamps = ContentStamps()
        pool = PreprocessPool(
            work.plan.source,
            work.shards,
            setup.samples,
            workers,
            pre.prefetch,
            pre.timeout_s,
            ledger.wanted(),
            self.claims,
            work.committed_elsewhere,
        )
        # the workers start (`engine_setup.py`)
        feed = BackgroundIterator(pool, maxsize=feed_size(workers, setup.input_window))
        started = time.perf_counter()
        try:
            pool.forked.wait()  # before the engine's start launches any subprocess (`PreprocessPool.forked`)
            forked = time.perf_counter()
            self.stats.workers_start_s = round(forked - started, 3)
            self.engine = engine = setup.start_engine()  # (it loads the model, where the run loads it)
            started = time.perf_counter()  # processing: from the engine's start on
            self.stats.engine_start_s = round(started - forked - self.stats.model_load_s, 3)
            # (the input thread's handoffs of the GIL: `background.py`)
            with samples_bar(ledger, work.shards, self.show_progress) as bar, prompt_handoffs():
                self._feed_and_step(feed, engine, ledger, bar)
        except ServerGone as gone:
            self.server_gone = gone  # the rows of the shards in flight are left for the next run
        finally:
            feed.close()
            if self.input_stamps is not None:
                self.input_stamps.close()
            for shard in ledger.shards:
                self.claims.release(shard)  # ours only; the next run may take them
            self.stats.processing_s = time.perf_counter() - started
            self.stats.shards_committed = ledger.num_committed
            self.stats.shards_claimed_elsewhere = ledger.num_skipped
            self.stats.rows_not_committed = ledger.rows_not_committed
        unfinished = list(ledger.open_shards())
        if (
            unfinished and not self.stop.requested and self.server_gone is None
        ):  # both leave them for the next run
            raise RuntimeError(f"shards {unfinished} ended incomplete; this is a bug")
        return pool.stats

    def _feed_and_step(
        self, feed: BackgroundIterator, engine: EngineInterface, ledger: ShardLedger, bar
    ) -> None:
        """Feed prepared samples to the engine and step it until the input ends and every request is
        done, or a stop is requested. The engine never waits while input is ready, nor the reverse."""
        while not self.stop.requested:
            if not engine.wants_requests:
                self._step(engine, ledger, bar)
                continue
            item = self._next_input(feed, idle=engine.num_unfinished == 0)
            if item is NOTHING:
                if engine.num_unfinished:
                    self._step(engine, ledger, bar)
            elif item is END:
                break
            elif isinstance(item, ShardEnd):
                ledger.end_of_shard(item.shard, item.num_samples)
                if self.input_stamps is not None:  # its file read: its digest taken
                    self.input_stamps.start(ledger.shards[item.shard].info)
                self._commit_complete(ledger)
            elif isinstance(item, ShardSkipped):
                self._skip(ledger, item, bar)
            else:
                self._submit(item, engine, ledger, bar)
        while engine.num_unfinished and not self.stop.requested:
            self._step(engine, ledger, bar)

    def _next_input(self, feed: BackgroundIterator, idle: bool):
        """The next prepared item, NOTHING if none is ready. An idle engine waits for one (a while, then
        looks at stop requests again); a busy one only looks, and keeps stepping."""
        waited_from = time.perf_counter()
        try:
            return feed.get(timeout=IDLE_POLL_S) if idle else feed.get(block=False)
        except queue.Empty:
            return NOTHING
        finally:
            if idle:
                self.stats.input_wait_s += time.perf_counter() - waited_from

    def _submit(self, sample: PreparedSample, engine: EngineInterface, ledger: ShardLedger, bar) -> None:
        self.stats.preprocess_s += sample.preprocess_s
        if sample.downloads is not None:
            self.downloads += sample.downloads
        prompts = ledger.prompts_of(sample.shard, sample.index)
        used = ledger.used_rows_of(sample.shard, sample.index)
        progress = self.flow.start(sample, prompts, ledger.position(sample.shard), used)
        self._carry_out(progress, engine, ledger, bar)
        self._commit_complete(ledger)  # a sample that fails before the engine can complete its shard

    def _carry_out(self, progress: Progress, engine: EngineInterface, ledger: ShardLedger, bar) -> None:
        """Rows to the ledger, requests to the engine, and a sample that is done to the count."""
        for row in progress.rows:
            self._add_row(ledger, progress.shard, row)
        for request in progress.requests:
            engine.add_request(request)
        if progress.sample_done:
            self._sample_done(bar)

    def _step(self, engine: EngineInterface, ledger: ShardLedger, bar) -> None:
        started = time.perf_counter()
        results = engine.step()
        self.stats.engine_s += time.perf_counter() - started
        self.trimmer.maybe_trim()
        self.claims.refresh(ledger.open_shards())
        for result in results:
            sample = self.flow.sample_of(result.tag)
            row = result_row(sample, prompt_of(self.cfg, sample, result.tag.prompt_index), result)
            self._carry_out(self.flow.finish(result.tag, row), engine, ledger, bar)
        self._commit_complete(ledger)  # after the loop: an upload never runs between two results
        elapsed = max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(out_tok_s=f"{engine.stats.output_tokens / elapsed:.1f}", refresh=False)

    def _sample_done(self, bar) -> None:
        """Every row of a sample has its outcome: the one point where a sample counts, for the progress
        bar and the stats alike."""
        self.stats.samples += 1
        bar.update(1)
        if self.count_sample is not None:
            self.count_sample()

    def _add_row(self, ledger: ShardLedger, shard: str, row: ResultRow) -> None:
        self.stats.record_row(row.status, row.error_type)
        ledger.add_row(shard, row)

    def _skip(self, ledger: ShardLedger, skipped: ShardSkipped, bar) -> None:
        ledger.skip(skipped.shard)
        logger.warning("skipping %s: %s", skipped.shard, skipped.reason)
        samples = ledger.samples_of(ledger.shards[skipped.shard].info)
        if bar.total is not None and samples is not None:
            bar.total -= samples

    def _commit_complete(self, ledger: ShardLedger) -> None:
        for state in ledger.complete_shards():
            info = state.info
            if self.input_stamps is not None:  # the input's stamp, with the digest of the file read
                info = dataclasses.replace(info, stamp=self.input_stamps.of(info))
            path = self.commit(info, state.rows)
            logger.info("committed %s (%d rows)", path, len(state.rows))
            self.card.shard_committed(state.info.shard, path)
            ledger.mark_committed(state.info.shard)
            self.claims.release(state.info.shard)


def samples_bar(ledger: ShardLedger, shards: list[ShardInfo], show: bool) -> tqdm:
    """The run's progress bar over the samples of `shards` (no total where a shard's count is unknown)."""
    known = [ledger.samples_of(info) for info in shards]
    return tqdm(
        total=sum(known) if None not in known else None,
        unit="sample",
        disable=not show,
        dynamic_ncols=True,
        smoothing=0,  # the average since the start, as `samples_per_s` in the summary and stats
    )


def run_job(
    cfg: JobConfig,
    loaded: LoadedModel | None = None,
    show_progress: bool = True,
    task: TaskSlice | None = None,
) -> RunSummary:
    return JobRunner(cfg, loaded, show_progress, task).run()
