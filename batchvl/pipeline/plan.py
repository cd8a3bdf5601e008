"""Planning a job: everything a run would refuse is found here, before a model is loaded or a sample read.

`run`, `retry-failed`, `validate` and `slurm` all plan through `plan_job`, so the preflight and the run
cannot drift apart. A plan checks that:
- the model folder holds a supported family, weights that read and a tokenizer, and a fixed
  `engine.kv_cache_mb` fits the device (the built-in engine); or the server answers and serves the model
  (the openai backend);
- `output.dir` is a folder that can be written, holds no input and sits in no input folder or
  `input.root`, and no input pattern would read its results back as input;
- the storage options suit the protocols of the input paths and `output.dir`, and
  `input.download.cache_dir` and `engine.encoder_cache_dir` are folders that can be made and written,
  and the encoder cache's holds nothing but its own files and is outside `output.dir`;
- the inputs hold a sample at all (a folder of Parquet files read as a folder of images holds none);
- every input shard has an output name of its own;
- every prompt's `json_schema` or `regex` can be compiled to a grammar;
- every table shard has the columns the job reads (image, key, per-sample token limit) and every
  `{field}` the prompts use (Parquet footers and Arrow schemas are read, not the rows);
- the shards already committed were written by this config and checkpoint, or differ in prompts only,
  whose unchanged rows the run keeps (`resume.plan_shards`); a shard whose input file changed since its
  commit is run again whole.
"""

from __future__ import annotations

import difflib
import logging
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from batchvl.config import JobConfig, is_remote, output_definition
from batchvl.engine.device.placement import process_device
from batchvl.engine.parallel.replicas import check_replicas
from batchvl.engine.scheduling.kv_budget import check_kv_cache_fits
from batchvl.errors import UserError
from batchvl.inputs.paths import glob_matches
from batchvl.inputs.sources import Source, check_has_samples, job_source
from batchvl.inputs.stamps import stands_for, with_content
from batchvl.inputs.types import ShardInfo
from batchvl.models.checkpoint_folder import check_model_folder, vocab_size
from batchvl.outputs.commit import (
    finish_commit,
    is_committed_by,
    read_committed,
    record_input_stamp,
    record_marker,
)
from batchvl.outputs.writers import output_name, output_path
from batchvl.pipeline.cache_folders import check_cache_folder, check_encoder_cache_folder
from batchvl.pipeline.commit_strategies import companion_files
from batchvl.pipeline.constraints import check_constraints
from batchvl.pipeline.ledger import Selection, samples_read
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.prompt_reuse import RowsToRun
from batchvl.pipeline.resume import ShardPlan, plan_shards
from batchvl.pipeline.server_setup import check_server
from batchvl.pipeline.tasks import TaskSlice, shards_of_task
from batchvl.preprocess.prompts import template_fields
from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir
from batchvl.storage.reads_at_once import each_at_once
from batchvl.storage.remote import check_storage_options

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobPlan:
    out: OutputDir  # where the results go
    source: Source  # the reader that listed the shards; the run reads them through it
    listing: list[ShardInfo]  # every input shard of the job
    shards: list[ShardInfo]  # this task's shards, in shard id order
    resume: ShardPlan  # which of them are committed and which to run
    model_type: str
    graph: PromptGraph  # the prompts' follow-ups, checked
    output_defining: dict  # the config that a shard's rows depend on, as stored in its marker
    fingerprint: str  # of the output-defining config


def plan_job(
    cfg: JobConfig, task: TaskSlice | None = None, record: bool = False, model_loaded: bool = False
) -> JobPlan:
    """Check the job and list its shards. `record` (a run) creates `output.dir` and records new folder
    shards; without it (validate, status) nothing is written. `model_loaded`: the run is given the model,
    loaded, so its folder's weight and tokenizer files are not its to read."""
    if cfg.engine.backend == "openai":  # the server runs the model: any model it serves
        check_server(cfg)
        model_type = "server"
    else:
        model_config = check_model_folder(cfg.model.path, cfg.model.trust_remote_code, model_loaded)
        model_type = model_config.model_type
        check_stop_token_ids(cfg, vocab_size(model_config))
        device = process_device(cfg.model.device)  # refuses a GPU the machine does not have
        check_replicas(cfg.engine, device)
        check_kv_cache_fits(cfg.engine, device)
    check_constraints(cfg)
    graph = PromptGraph.of(cfg.prompts)  # refuses a follow-up that uses itself, a later or an unknown prompt
    check_storage_options("input.storage_options", cfg.input.storage_options, cfg.input.paths)
    check_storage_options("output.storage_options", cfg.output.storage_options, [cfg.output.dir])
    check_cache_folder("input.download.cache_dir", cfg.input.download.cache_dir)
    if cfg.input.root is not None and not os.path.isdir(cfg.input.root):  # every path cell a missing file
        raise UserError(f"input.root: {cfg.input.root} is not a folder; point it at the media's folder")
    check_encoder_cache_folder(cfg.engine.encoder_cache_dir, cfg.output.dir)
    out = OutputDir.of(cfg.output)
    out.check_writable(create=False)
    pass_urls = cfg.engine.server.pass_urls  # the server fetches them (set with the openai backend only)
    source = job_source(cfg, pass_http_urls=pass_urls)
    listing = source.list_shards()
    check_has_samples(source, listing)
    check_output_location(cfg, out, listing)
    check_output_names(listing)
    check_columns(cfg, listing)
    if record:  # every check passed: now the run may write
        out.check_writable(create=True)
        if cfg.input.format == "folder":  # the checked listing, now recorded
            source = job_source(cfg, record=True, pass_http_urls=pass_urls)
            listing = source.list_shards()
    shards = shards_of_task(listing, task)
    defining, fingerprint = output_definition(cfg)
    resume = plan_shards(out, shards, defining, fingerprint, cfg.output.overwrite, record, graph)
    if record:
        record_in_markers(out, resume, defining, fingerprint)
        finish_rewrites(cfg, out, resume)
    return JobPlan(out, source, listing, shards, resume, model_type, graph, defining, fingerprint)


@dataclass(frozen=True)
class Work:
    """What a run is to do: the shards to run, in order, and per shard the rows to produce. `plan` is the
    checked job they come from: its reader, prompt graph and fingerprint are the run's, computed once."""

    plan: JobPlan
    shards: list[ShardInfo]
    selection: Selection | None  # None: every (sample, prompt) of each shard; a shard not in it: too
    # Whether another run committed a shard while this one waited to read it (None: redo it anyway)
    committed_elsewhere: Callable[[str], bool] | None = None
    notes: dict = field(default_factory=dict)  # counts the run's stats report besides its own
    kept: dict[str, frozenset[str]] = field(default_factory=dict)  # shard -> prompts whose rows it keeps

    @property
    def num_task_shards(self) -> int:
        """The task's shards, done ones included."""
        return len(self.plan.shards)

    def most_requests(self, num_prompts: int) -> int | None:
        """At most how many requests the run makes: each sample it reads asked every prompt (a follow-up as
        if its `when` matched); None where a shard's samples are known only by reading it (tar files)."""
        samples = [samples_read(info, self.selection) for info in self.shards]
        return None if None in samples else sum(samples) * num_prompts


def job_work(cfg: JobConfig, task: TaskSlice | None, model_loaded: bool = False) -> Work:
    """A run's work: the task's shards that are not committed (all of them with --overwrite); of a shard
    committed with other prompts, only the rows of its changed and added prompts."""
    plan = plan_job(cfg, task, record=True, model_loaded=model_loaded)
    if plan.resume.num_done:
        logger.info("skipping %d committed shard(s) in %s", plan.resume.num_done, cfg.output.dir)
    if plan.resume.input_changed:
        logger.warning(
            "%d shard(s) were committed from input files that changed since; they are run again whole",
            len(plan.resume.input_changed),
        )
    committed = None if cfg.output.overwrite else committed_by_plan(plan)
    reuse = plan.resume.reuse
    selection: Selection = {shard: RowsToRun(plan.out, shard, reuse[shard], plan.graph) for shard in reuse}
    kept = {shard: frozenset(plan.graph.names[i] for i in reuse[shard].kept) for shard in reuse}
    if reuse:
        logger.info("%d shard(s) keep the committed rows of their unchanged prompts", len(reuse))
    dropped = sorted({name for shard in reuse.values() for name in shard.dropped})
    if dropped:
        logger.warning("the rows of prompts no longer in the job are dropped: %s", ", ".join(dropped))
    return Work(plan, plan.resume.pending, selection or None, committed, kept=kept)


def committed_by_plan(plan: JobPlan) -> Callable[[str], bool]:
    """Whether a shard is committed by the planned config, from the input file as it was listed."""
    listed = {shard.shard: shard for shard in plan.shards}
    return lambda shard: is_committed_by(plan.out, plan.fingerprint, shard, listed[shard])


def record_in_markers(out: OutputDir, resume: ShardPlan, defining: dict, fingerprint: str) -> None:
    """Record what shards committed before they were recorded lack (the checkpoint's identity in the
    marker, the input's stamp beside it) in those a run accepted: from now on a change of either is
    noticed. A stamp that needed the input read to match is recorded anew (`stamps.stands_for`). The
    markers of rewrites left unfinished are written by `finish_rewrites`."""
    listed = {shard.shard: shard for shard in resume.shards}

    def record(name: str) -> None:
        shard, marker = listed[name], resume.done[name]
        if shard.stamp is not None:
            recorded = resume.recorded_stamps[name]
            if recorded is None or not stands_for(recorded, shard):
                record_input_stamp(out, name, with_content(shard))
        if marker.fingerprint != fingerprint:
            marker.config, marker.fingerprint = defining, fingerprint
            if marker.replaces is None:
                record_marker(out, marker)

    each_at_once(record, resume.done, out.reads_at_once)  # (each shard's files its own)


def finish_rewrites(cfg: JobConfig, out: OutputDir, resume: ShardPlan) -> None:
    """Finish the commits that stopped after a committed shard's new file was whole (its rows are the new
    ones; the batch API file and the marker are left): the shard is done, and now written as such."""
    for name, marker in resume.done.items():
        if marker.replaces is not None:
            finish_commit(out, marker, read_committed(out, name, marker), companion_files(cfg, out))
            logger.info("finished the commit of %s, stopped after its file was written", name)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _location(path: str) -> str:
    """Where a path points, comparable with another's: a URL as written, a local path with its links
    followed."""
    return path.rstrip("/") if is_remote(path) else os.path.realpath(path)


def check_stop_token_ids(cfg: JobConfig, vocab: int) -> None:
    """Stop token ids, the job's and each prompt's, are token ids of the model: one outside its
    vocabulary is never generated, so it is a typo (an id of another model's tokenizer)."""
    for prompt, sampling in zip(cfg.prompts, cfg.prompt_samplings, strict=True):
        outside = [token for token in sampling.stop_token_ids if not 0 <= token < vocab]
        if outside:
            raise UserError(
                f"prompt '{prompt.name}': sampling.stop_token_ids holds {outside[0]}, outside the model's "
                f"vocabulary (0 to {vocab - 1}); give ids of this model's tokenizer"
            )


def check_output_location(cfg: JobConfig, out: OutputDir, listing: list[ShardInfo]) -> None:
    """Results never land on, among or under the inputs, and are never read back as input."""
    where = _location(out.url)
    fix = "set output.dir to a folder outside the input"
    for shard in listing:
        location = _location(shard.path)
        if _inside(location, posixpath.join(where, layout.OWN_FILES)):
            continue
        if _inside(location, where) or (os.path.isdir(location) and _inside(where, location)):
            raise UserError(
                f"output.dir {out.url} overlaps the input {shard.path}: results would be written "
                f"over or among the inputs; {fix}"
            )
    if cfg.input.root is not None:
        # The media under the root must not lie among the results; results in a folder of their own under
        # the root (a project folder holding images/ and captions/, a notebook's folder) read nothing back:
        # the root confines path cells, it is not listed as input.
        root = os.path.realpath(cfg.input.root)
        if _inside(root, where):
            raise UserError(
                f"output.dir {out.url} holds input.root {cfg.input.root}: the media would lie among the "
                f"results; {fix}"
            )
    folders_are_inputs = cfg.input.format in ("folder", "hf_dataset")
    for pattern in cfg.input.paths:
        if folders_are_inputs and glob_matches(pattern, out.url):
            raise UserError(f"input.paths pattern '{pattern}' matches output.dir {out.url}; {fix}")
        for shard in listing:
            if not folders_are_inputs and glob_matches(pattern, output_path(out, shard.shard)):
                raise UserError(
                    f"input.paths pattern '{pattern}' would read the results in {out.url} back as "
                    f"input on the next run; {fix}, or narrow the pattern"
                )


def check_output_names(listing: list[ShardInfo]) -> None:
    """No two input shards write the same output file (`s.tar` and `s.tar.gz` both make `s.parquet`)."""
    writers: dict[str, ShardInfo] = {}
    for shard in listing:
        name = os.path.normpath(output_name(shard.shard))
        first = writers.setdefault(name, shard)
        if first is not shard:
            raise UserError(
                f"inputs {first.path} and {shard.path} would both write {name}; rename one of them, or run "
                "them as two jobs with different output.dir"
            )


def check_columns(cfg: JobConfig, listing: list[ShardInfo]) -> None:
    """Each table shard has the columns the job reads; the prompts use only fields samples have."""
    inp = cfg.input
    prompt_names = {prompt.name for prompt in cfg.prompts}  # `{name}` of a prompt is its output
    used = {
        name: prompt.name
        for prompt in cfg.prompts
        for name in template_fields(prompt.text)
        if name != "key" and name not in prompt_names
    }
    # A per-sample token limit's column, of the job or of a prompt's own sampling
    token_fields = dict.fromkeys(
        s.max_new_tokens_field for s in cfg.prompt_samplings if s.max_new_tokens_field
    )
    for shard in listing:
        if shard.columns is None:
            if inp.format == "folder" and (used or token_fields):
                name = [*used, *token_fields][0]
                raise UserError(
                    f"'{name}' is used by the job, but folder input has no fields (only {{key}}, the file's "
                    "path); use a table input (parquet) to give samples fields"
                )
            continue  # tar members' fields are known only by reading them
        wanted = [
            ("input.image_column", inp.image_column),
            ("input.key_column", inp.key_column),
            *(("sampling.max_new_tokens_field", field) for field in token_fields),
        ]
        for option, column in wanted:
            if column is not None and column not in shard.columns:
                raise UserError(
                    f"{option}: column '{column}' is not in {shard.path}{_close(column, shard.columns)}; "
                    f"its columns: {', '.join(shard.columns)}"
                )
        for column in token_fields:
            _check_token_limit_type(shard, column)
        if inp.key_column is not None:
            _check_key_type(shard, inp.key_column)
        fields = [c for c in shard.columns if c not in (inp.image_column, inp.key_column)]
        for name, prompt in used.items():
            if name not in fields:
                raise UserError(
                    f"prompt '{prompt}' uses {{{name}}}, which is not a column of {shard.path}"
                    f"{_close(name, fields)}; fields: {', '.join(['key', *fields])}"
                )


def _check_key_type(shard: ShardInfo, column: str) -> None:
    """A key column holds single values (text, numbers, dates): a key is written in every row and names the
    sample in the report; one of bytes (the image column named as the key) made megabyte keys of each
    image's bytes, and a list or struct is no id."""
    if shard.column_types is None or shard.columns is None:
        return
    kind = shard.column_types[shard.columns.index(column)]
    if pa.types.is_nested(kind) or any(
        check(kind) for check in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary)
    ):
        raise UserError(
            f"input.key_column: column '{column}' of {shard.path} holds {kind}, not single values such as "
            "text or numbers; name a column of sample ids, or leave key_column out (each row's index is "
            "its key)"
        )


def _check_token_limit_type(shard: ShardInfo, column: str) -> None:
    """A column of per-sample token limits holds numbers (floats too: pandas writes an integer column with
    missing values as floats); one of text would make each of its samples an error row."""
    if shard.column_types is None or shard.columns is None:
        return
    kind = shard.column_types[shard.columns.index(column)]
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_null(kind)):
        raise UserError(
            f"sampling.max_new_tokens_field: column '{column}' of {shard.path} holds {kind}, not numbers; "
            "name a column of per-sample token limits"
        )


def _close(name: str, names: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
