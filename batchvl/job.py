"""run_job: plan -> read and preprocess (worker pool) -> engine -> write, one direction, nothing lost.

Every (sample, prompt) ends as exactly one row: `ok` with its text, or `error` with a type and message.
Rows are buffered per input shard and the shard is committed (Parquet file, then completion marker) once
every row of that shard has an outcome; committed shards are skipped on rerun. A run can be one task of
a split job (`TaskSlice`), and stops cleanly between engine steps on SIGTERM / SIGUSR1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import xxhash
from tqdm.auto import tqdm

from batchvl import __version__
from batchvl.config import JobConfig, config_to_dict, fingerprint_of, output_defining_config
from batchvl.engine.engine import Engine, EngineRequest, EngineResult, EngineStats
from batchvl.engine.model_runner import encode_images
from batchvl.engine.request import SamplingParams
from batchvl.engine.vit_dp import (
    DataParallelEncoder,
    DistributedContext,
    init_distributed,
    launched_world_size,
    leave_process_group,
    release_serving_ranks,
    serve_encode_rounds,
)
from batchvl.errors import ErrorBudgetExceeded, SampleError, StoppedBySignal, UserError
from batchvl.io.claims import Holder, ShardClaims
from batchvl.io.commit import ShardMarker, commit_shard, is_committed_by
from batchvl.io.sources import job_source
from batchvl.io.types import ShardEnd, ShardInfo, ShardSkipped
from batchvl.io.writers import ResultRow, write_json_atomic
from batchvl.models.loader import LoadedModel, load_model
from batchvl.plan import JobPlan, plan_job
from batchvl.preprocess.pool import PreprocessPool, default_workers
from batchvl.preprocess.sample import PreparedSample, SampleProcessor
from batchvl.tasks import TaskSlice
from batchvl.utils.background import END, BackgroundIterator
from batchvl.utils.memory import HeapTrimmer, keep_freed_memory
from batchvl.utils.stats import RunStats
from batchvl.utils.stop import StopRequests

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long an idle run waits for input before looking at stop requests again


@dataclass(frozen=True)
class RowTag:
    """Where an engine result belongs: shard, sample and prompt."""

    shard: str
    sample_index: int
    prompt_index: int


@dataclass
class ShardProgress:
    info: ShardInfo
    position: int  # in this run's shard order: its requests' admission priority
    rows: list[ResultRow] = field(default_factory=list)
    expected_rows: int | None = None  # known once the whole shard has been read
    # samples with requests still in the engine -> how many of their prompts are unfinished
    in_flight: dict[int, tuple[PreparedSample, int]] = field(default_factory=dict)
    committed: bool = False
    skipped: bool = False  # another run has it (claimed, or committed it meanwhile)

    @property
    def is_complete(self) -> bool:
        return self.expected_rows is not None and len(self.rows) == self.expected_rows


@dataclass
class RunSummary:
    output_dir: str
    stats_path: str
    stats: dict
    is_driver: bool = True  # False on a rank that only served ViT encode rounds


def request_seed(base_seed: int, shard: str, key: str, prompt_name: str) -> int:
    """A per-request seed, so a sampled output does not depend on batch composition or run order."""
    return (
        xxhash.xxh64_intdigest(f"{base_seed}\0{shard}\0{key}\0{prompt_name}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
    )


def max_new_tokens_of(cfg: JobConfig, fields: dict) -> int:
    """The sample's token limit: `sampling.max_new_tokens`, or its own from `max_new_tokens_field`."""
    name = cfg.sampling.max_new_tokens_field
    if name is None:
        return cfg.sampling.max_new_tokens
    value = fields.get(name)
    if value is None:  # a null cell, or a sample without the field: the job's own limit
        return cfg.sampling.max_new_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SampleError(
            "missing_field",
            f"sampling.max_new_tokens_field '{name}' must hold a positive integer, got {value!r}",
        )
    return value


def sampling_params(
    cfg: JobConfig, shard: str, key: str, prompt_name: str, max_new_tokens: int
) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=request_seed(s.seed, shard, key, prompt_name),
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def sample_processor(cfg: JobConfig, loaded: LoadedModel) -> SampleProcessor:
    media = loaded.family.media_preparer(loaded.processor, loaded.adapter.model.config, cfg.preprocess)
    return SampleProcessor(loaded.processor, media, cfg.prompts)


def _row(sample: PreparedSample, prompt_index: int, prompt_name: str, **values) -> ResultRow:
    return ResultRow(
        key=sample.key,
        sample_index=sample.index,
        prompt=prompt_name,
        prompt_index=prompt_index,
        num_images=sample.num_images,
        fields=sample.fields,
        **values,
    )


def error_row(sample: PreparedSample, prompt_index: int, prompt_name: str, error: SampleError) -> ResultRow:
    return _row(
        sample,
        prompt_index,
        prompt_name,
        text=None,
        status="error",
        error_type=error.error_type,
        error_message=error.message,
        num_prompt_tokens=0,
        num_output_tokens=0,
        finish_reason=None,
        latency_s=None,
    )


def result_row(sample: PreparedSample, prompt_name: str, result: EngineResult) -> ResultRow:
    tag: RowTag = result.tag
    if result.error is not None:
        row = error_row(sample, tag.prompt_index, prompt_name, result.error)
        row.num_prompt_tokens = result.num_prompt_tokens
        return row
    return _row(
        sample,
        tag.prompt_index,
        prompt_name,
        text=result.text,
        status="ok",
        error_type=None,
        error_message=None,
        num_prompt_tokens=result.num_prompt_tokens,
        num_output_tokens=result.num_output_tokens,
        finish_reason=result.finish_reason,
        latency_s=round(result.latency_s, 6),
    )


class JobRunner:
    enforce_error_budget = True  # output.max_error_rate applies to this kind of run

    def __init__(
        self,
        cfg: JobConfig,
        loaded: LoadedModel | None = None,
        show_progress: bool = True,
        task: TaskSlice | None = None,
    ):
        self.cfg = cfg
        self.loaded = loaded
        self.show_progress = show_progress
        self.task = task
        self.stats = RunStats(task=str(task) if task else None)
        self.trimmer = HeapTrimmer()
        self.stop = StopRequests()
        # shard -> sample index -> prompt indices to run; None runs every (sample, prompt) of a shard
        self.selection: dict[str, dict[int, frozenset[int]]] | None = None
        self.planning_config = cfg  # the config whose shards these are (a retry's job, not its overrides)
        self.out_dir = cfg.output.dir
        self.output_defining = output_defining_config(cfg)
        self.fingerprint = fingerprint_of(self.output_defining)
        self.metadata = {
            "batchvl_version": __version__,
            "model_path": cfg.model.path,
            "config_fingerprint": self.fingerprint,
            "job_config": json.dumps(config_to_dict(cfg), sort_keys=True),
        }

    def run(self) -> RunSummary:
        keep_freed_memory()  # process-wide; the engine's steps reuse their activations' memory
        world_size = launched_world_size()
        if world_size == 1:
            return self._run()
        if self.cfg.engine.vit_parallel != "data":
            raise UserError(
                f"launched as {world_size} processes (WORLD_SIZE={world_size}) but engine.vit_parallel is "
                f"'{self.cfg.engine.vit_parallel}'; set engine.vit_parallel: data, or run without torchrun"
            )
        context = init_distributed(self.cfg.model.device)
        try:
            return self._run(context) if context.is_driver else self._serve(context)
        finally:
            if context.is_driver:
                release_serving_ranks(context.world_size)
            leave_process_group()

    def _load(self) -> LoadedModel:
        if self.cfg.engine.threads > 0:
            torch.set_num_threads(self.cfg.engine.threads)
        if self.loaded is None:
            m = self.cfg.model
            loading = time.perf_counter()
            self.loaded = load_model(m.path, m.dtype, m.device, m.trust_remote_code)
            self.stats.model_load_s = round(time.perf_counter() - loading, 3)
        return self.loaded

    def _local_encode(self, loaded: LoadedModel):
        return functools.partial(
            encode_images, loaded.adapter, max_patches=self.cfg.engine.max_patches_per_encode
        )

    def _serve(self, context: DistributedContext) -> RunSummary:
        """A rank other than 0: encode its share of every round rank 0 sends, until it says stop."""
        loaded = self._load()
        rounds = serve_encode_rounds(self._local_encode(loaded), loaded.adapter.device)
        logger.info("rank %d served %d encode rounds", context.rank, rounds)
        return RunSummary(self.out_dir, "", {"rank": context.rank, "encode_rounds": rounds}, is_driver=False)

    def _run(self, context: DistributedContext | None = None) -> RunSummary:
        with self.stop:
            summary = self._run_shards(context)
        self._check_ending(summary)
        return summary

    def _run_shards(self, context: DistributedContext | None) -> RunSummary:
        start = time.perf_counter()
        # Every check runs even when every shard is done: a wrong path is a mistake to report.
        plan = plan_job(self.planning_config, self.task, record=True)
        self.stats.shards_total = len(plan.shards)
        pending = self._pending_shards(plan)
        self.stats.shards_skipped = len(plan.shards) - len(pending)
        engine = None
        if pending and not self.stop.requested:
            loaded = self._load()
            parallel_encoder = None
            if context is not None:
                parallel_encoder = DataParallelEncoder(
                    context, self._local_encode(loaded), loaded.adapter.device
                )
            engine = Engine(
                loaded.adapter,
                loaded.processor.tokenizer,
                self.cfg.engine,
                loaded.eos_token_ids(),
                parallel_encoder,
            )
            self._process(pending, engine)
        self.stats.wall_s = round(time.perf_counter() - start, 3)
        stats = self.stats.to_dict(asdict(engine.stats if engine else EngineStats()))
        stats["vit_parallel_ranks"] = context.world_size if context else 1
        stats["stopped_by"] = self.stop.signal_name or None
        stats_path = self._write_stats(stats)
        return RunSummary(self.out_dir, stats_path, stats)

    def _pending_shards(self, plan: JobPlan) -> list[ShardInfo]:
        """The task's shards to run now: those not committed (all with overwrite)."""
        if plan.resume.num_done:
            logger.info("skipping %d committed shard(s) in %s", plan.resume.num_done, self.out_dir)
        return plan.resume.pending

    def _check_ending(self, summary: RunSummary) -> None:
        """Raise when the run ended early on purpose; its shards are committed by now."""
        stats = summary.stats
        left = stats["shards_total"] - stats["shards_skipped"] - stats["shards_committed"]
        if self.stop.requested:
            lost = stats["rows_not_committed"]
            raise StoppedBySignal(
                f"stopped by {self.stop.signal_name} after committing {stats['shards_committed']} shard(s); "
                f"{left} shard(s) left for the next run of the same command"
                + (f" ({lost} row(s) were done in them and will be redone)" if lost else ""),
                128 + int(self.stop.signum),
                summary,
            )
        limit = self.cfg.output.max_error_rate if self.enforce_error_budget else None
        rows = stats["ok"] + stats["errors"]
        if limit is not None and rows and stats["errors"] / rows > limit:
            raise ErrorBudgetExceeded(
                f"{stats['errors']} of {rows} rows are errors ({stats['errors'] / rows:.1%}), over "
                f"output.max_error_rate={limit:g}; the shards are committed, error rows show why "
                "(batchvl status, then batchvl retry-failed)",
                ErrorBudgetExceeded.EXIT_CODE,
                summary,
            )

    def _process(self, shards: list[ShardInfo], engine: Engine) -> None:
        pre = self.cfg.preprocess
        workers = default_workers() if pre.workers is None else pre.workers
        self.claims = ShardClaims(self.out_dir, Holder.of_process(os.getpid()))
        pool = PreprocessPool(
            job_source(self.cfg),
            shards,
            sample_processor(self.cfg, self.loaded),
            workers,
            pre.prefetch,
            pre.timeout_s,
            {name: frozenset(samples) for name, samples in self.selection.items()}
            if self.selection
            else None,
            self.claims,
            self._committed_meanwhile(),
        )
        self.stats.preprocess_workers = workers
        progress = {s.shard: ShardProgress(s, position) for position, s in enumerate(shards)}
        lookahead = self.cfg.engine.lookahead
        known = (
            [s.num_rows for s in shards]
            if self.selection is None
            else [len(self.selection[s.shard]) for s in shards]
        )
        bar = tqdm(
            total=sum(known) if None not in known else None,
            unit="sample",
            disable=not self.show_progress,
            dynamic_ncols=True,
            smoothing=0,  # the average since the start, as `samples_per_s` in the summary and stats
        )
        feed = BackgroundIterator(pool, maxsize=max(4, workers * 2))
        started = time.perf_counter()
        try:
            with bar:
                while not self.stop.requested:
                    if engine.num_waiting >= lookahead:
                        self._step(engine, progress, bar)
                        continue
                    idle = engine.num_unfinished == 0
                    waited_from = time.perf_counter()
                    try:
                        # Poll while the engine has work: it keeps stepping until input is ready.
                        item = feed.get(timeout=IDLE_POLL_S) if idle else feed.get(block=False)
                    except queue.Empty:
                        if idle:
                            self.stats.input_wait_s += time.perf_counter() - waited_from
                        else:
                            self._step(engine, progress, bar)
                        continue
                    if idle:
                        self.stats.input_wait_s += time.perf_counter() - waited_from
                    if item is END:
                        break
                    if isinstance(item, ShardEnd):
                        progress[item.shard].expected_rows = self._expected_rows(item.shard, item.num_samples)
                        self._commit_if_complete(progress[item.shard])
                    elif isinstance(item, ShardSkipped):
                        self._skip(progress[item.shard], item.reason, bar)
                    else:
                        self._submit(item, engine, progress[item.shard], bar)
                while engine.num_unfinished and not self.stop.requested:
                    self._step(engine, progress, bar)
        finally:
            feed.close()
            for shard_progress in progress.values():
                self.claims.release(shard_progress.info.shard)  # ours only; the next run may take them
            self.stats.processing_s = time.perf_counter() - started
            self.stats.rows_not_committed = sum(len(s.rows) for s in progress.values() if not s.committed)
            self.stats.worker_restarts = pool.stats.worker_restarts
            self.stats.samples_crashed = pool.stats.samples_crashed
            self.stats.samples_timed_out = pool.stats.samples_timed_out
        if self.stop.requested:
            return  # unfinished shards stay uncommitted; the next run redoes them
        for shard_progress in progress.values():
            if not (shard_progress.committed or shard_progress.skipped):
                raise RuntimeError(f"shard {shard_progress.info.shard} ended incomplete; this is a bug")

    def _submit(self, sample: PreparedSample, engine: Engine, shard: ShardProgress, bar) -> None:
        self.stats.preprocess_s += sample.preprocess_s
        if sample.error is not None:
            self._add_error_rows(sample, shard, sample.error)
            self._sample_done(bar)
            return
        try:
            max_new_tokens = max_new_tokens_of(self.cfg, sample.fields)
        except SampleError as error:
            self._add_error_rows(sample, shard, error)
            self._sample_done(bar)
            return
        requests = []
        for prompt_index in self._prompt_indices(sample):
            prompt, prepared = self.cfg.prompts[prompt_index], sample.prompts[prompt_index]
            if prepared.error is not None:
                self._add_row(shard, error_row(sample, prompt_index, prompt.name, prepared.error))
                continue
            requests.append(
                EngineRequest(
                    prompt_token_ids=prepared.token_ids,
                    images=sample.images,
                    sampling=sampling_params(self.cfg, sample.shard, sample.key, prompt.name, max_new_tokens),
                    tag=RowTag(sample.shard, sample.index, prompt_index),
                    priority=shard.position,
                )
            )
        if not requests:
            self._sample_done(bar)
            return
        shard.in_flight[sample.index] = (sample, len(requests))
        for request in requests:
            engine.add_request(request)

    def _committed_meanwhile(self):
        """What tells a shard another run committed while this one waited to read it (None: redo it
        anyway, as --overwrite asks)."""
        if self.cfg.output.overwrite:
            return None
        return functools.partial(is_committed_by, self.out_dir, self.fingerprint)

    def _skip(self, shard: ShardProgress, reason: str, bar) -> None:
        shard.skipped = True
        self.stats.shards_claimed_elsewhere += 1
        logger.warning("skipping %s: %s", shard.info.shard, reason)
        rows = shard.info.num_rows if self.selection is None else len(self.selection[shard.info.shard])
        if bar.total is not None and rows is not None:
            bar.total -= rows

    def _sample_done(self, bar) -> None:
        """Every row of a sample has its outcome: the one point where a sample counts, for the progress
        bar and the stats alike."""
        self.stats.samples += 1
        bar.update(1)

    def _add_error_rows(self, sample: PreparedSample, shard: ShardProgress, error: SampleError) -> None:
        for prompt_index in self._prompt_indices(sample):
            self._add_row(shard, error_row(sample, prompt_index, self.cfg.prompts[prompt_index].name, error))

    def _prompt_indices(self, sample: PreparedSample) -> list[int]:
        """The prompts to run for a sample: all of them, or those selected for it."""
        if self.selection is None:
            return list(range(len(self.cfg.prompts)))
        return sorted(self.selection[sample.shard][sample.index])

    def _expected_rows(self, shard: str, num_samples: int) -> int:
        if self.selection is None:
            return num_samples * len(self.cfg.prompts)
        return sum(len(prompts) for index, prompts in self.selection[shard].items() if index < num_samples)

    def _step(self, engine: Engine, progress: dict[str, ShardProgress], bar) -> None:
        started = time.perf_counter()
        results = engine.step()
        self.stats.engine_s += time.perf_counter() - started
        self.trimmer.maybe_trim()
        self.claims.refresh(s.info.shard for s in progress.values() if not (s.committed or s.skipped))
        for result in results:
            tag: RowTag = result.tag
            shard = progress[tag.shard]
            sample, remaining = shard.in_flight[tag.sample_index]
            if remaining > 1:
                shard.in_flight[tag.sample_index] = (sample, remaining - 1)
            else:
                del shard.in_flight[tag.sample_index]
                self._sample_done(bar)
            self._add_row(shard, result_row(sample, self.cfg.prompts[tag.prompt_index].name, result))
        elapsed = max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(out_tok_s=f"{engine.stats.output_tokens / elapsed:.1f}", refresh=False)

    def _add_row(self, shard: ShardProgress, row: ResultRow) -> None:
        shard.rows.append(row)
        self.stats.record_row(row.status, row.error_type)
        self._commit_if_complete(shard)

    def _commit_if_complete(self, shard: ShardProgress) -> None:
        if shard.is_complete and not shard.committed:
            path = self._commit(shard)
            self.stats.shards_committed += 1
            logger.info("committed %s (%d rows)", path, len(shard.rows))
            shard.committed = True
            shard.rows = []  # written; free the memory
            self.claims.release(shard.info.shard)

    def _commit(self, shard: ShardProgress) -> str:
        marker = ShardMarker.for_rows(
            shard.info.shard,
            shard.rows,
            self.output_defining,
            self.fingerprint,
            task=str(self.task) if self.task else None,
            batchvl_version=__version__,
        )
        return commit_shard(self.out_dir, shard.info.shard, shard.rows, self.metadata, marker)

    def _write_stats(self, stats: dict) -> str:
        folder = Path(self.out_dir, "_batchvl", "stats")
        path = folder / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        write_json_atomic(str(path), stats)
        return str(path)


def run_job(
    cfg: JobConfig,
    loaded: LoadedModel | None = None,
    show_progress: bool = True,
    task: TaskSlice | None = None,
) -> RunSummary:
    return JobRunner(cfg, loaded, show_progress, task).run()
