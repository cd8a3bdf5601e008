"""The Python API: run jobs from notebooks and scripts, and get the rows back as a `datasets.Dataset`.

    import batchvl

    model = batchvl.load_model("models/qwen2-vl")  # optional: load once, reuse across calls
    results = batchvl.caption(ds, model=model, prompts="Describe this image.", output_dir="captions")
    results.dataset          # datasets.Dataset: one row per (sample, prompt), in input order
    results.errors           # only the error rows
    results.to_pandas()
    results.to_labels()      # one row per sample, a typed column per prompt
    results.gallery(8)       # images beside their outputs, displayed by notebooks

This is the CLI's code path: the same job runner, engine, error rows and resume (calling again with the
same `output_dir` skips what is committed). `caption` stores an in-memory dataset in the output folder
as a saved `datasets` dataset and runs an `hf_dataset` job over it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from batchvl.config import (
    EngineConfig,
    JobConfig,
    ModelConfig,
    check_model_keys,
    is_remote,
    job_config_from_dict,
    load_job_config,
    resolve_paths,
)
from batchvl.errors import UserError
from batchvl.inputs.in_memory import as_dataset
from batchvl.models.checkpoint_folder import check_model_folder
from batchvl.models.loader import LoadedModel
from batchvl.models.loader import load_model as _load_model
from batchvl.storage import layout

if TYPE_CHECKING:
    import datasets
    import pandas
    from PIL import Image

CAPTION_KEY_COLUMN = "__batchvl_row__"  # caption(): the key is the row's index in the caller's dataset


@dataclass
class Results:
    """A job's committed rows and the stats of the run that produced them."""

    dataset: datasets.Dataset  # shard, key, sample_index, prompt, text, status, ... in input order
    stats: dict  # this run's stats (as in output.dir/_batchvl/stats/run-*.json)
    output_dir: str
    config: JobConfig

    @property
    def ok(self) -> datasets.Dataset:
        return self._rows_where(lambda status: status == "ok")

    @property
    def errors(self) -> datasets.Dataset:
        return self._rows_where(lambda status: status == "error")

    def _rows_where(self, keep) -> datasets.Dataset:
        # `select` on a status scan instead of `Dataset.filter`: no progress bar, nothing written to disk.
        return self.dataset.select([i for i, status in enumerate(self.dataset["status"]) if keep(status)])

    def to_pandas(self) -> pandas.DataFrame:
        return self.dataset.to_pandas()

    def to_labels(self) -> datasets.Dataset:
        """One row per sample, a typed column per prompt (see `read_labels`)."""
        return read_labels(self.config)

    def gallery(self, n: int = 8, seed: int = 0):
        """`n` sampled inputs beside their outputs, as HTML a notebook displays (`IPython.display.HTML`)."""
        from IPython.display import HTML

        from batchvl.commands.report.gallery import gallery_html, gallery_items

        table = self.dataset.data.table
        return HTML(gallery_html(gallery_items(self.config, table, n, seed)))

    def report(self, path: str | None = None, samples: int = 24, seed: int = 0) -> str:
        """Write the HTML report (as `batchvl report` does; default: output_dir/report.html); its path."""
        from batchvl.commands.report.page import write_report

        return write_report(self.config, path, samples, seed)[0]

    def __repr__(self) -> str:
        rows = self.dataset.num_rows
        statuses = self.dataset["status"]
        ok, errors = statuses.count("ok"), statuses.count("error")
        skipped = f", {rows - ok - errors} skipped" if rows - ok - errors else ""
        return f"Results({rows} rows: {ok} ok, {errors} error{skipped}; output_dir={self.output_dir!r})"


def load_model(path: str | Path, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load a checkpoint once, to pass as `model=` to several `run` / `caption` calls: as a job with the
    default engine settings loads it (on CUDA the fused kernels, `engine.fused_kernels: auto`)."""
    from transformers.utils import logging as hf_logging

    if not isinstance(path, str | os.PathLike):
        raise UserError(f"load_model() takes a checkpoint folder's path, got {type(path).__name__}")
    check_model_keys(ModelConfig(path=str(path), dtype=dtype, device=device))  # fp16 loaded fp32 unsaid
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the job's bar is the one worth a line in a notebook
    try:
        engine = EngineConfig()  # the settings a loaded model holds, at a job's defaults
        folder = str(Path(path).resolve())
        return _load_model(folder, dtype, device, False, engine.fused_kernels, engine.vision_attention)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()


def run(
    job: JobConfig | Mapping[str, Any] | str | Path,
    *,
    overrides: Sequence[str] | str | None = (),
    model: LoadedModel | None = None,
    progress: bool = True,
    processes: int | None = None,
    gpus: int | str | None = None,
) -> Results:
    """Run a job (a `JobConfig`, a dict shaped like the job file, or a job file's path) and read its rows.

    Relative paths in a dict resolve against the current folder. `overrides` are `--set` strings.
    `processes=N` or `gpus=N` ("all": every GPU) run N engine processes, as `batchvl run --processes N`
    and `--gpus N` do; each loads the model itself."""
    from batchvl.pipeline.node_places import node_places

    if model is not None and not isinstance(model, LoadedModel):
        raise UserError(
            f"run(model=) takes a load_model() result, got {type(model).__name__}; the job's model.path "
            "names the checkpoint to load (overrides=['model.path=...'] changes it)"
        )
    places = node_places(processes, None if gpus is None else str(gpus))
    cfg = _job_config(job, overrides)
    if model is not None and os.path.realpath(model.path) != os.path.realpath(cfg.model.path):
        raise UserError(
            f"model= was loaded from '{model.path}' but the job's model.path is '{cfg.model.path}'; "
            "pass the same checkpoint, or leave model= out"
        )
    if model is not None and places is not None:
        raise UserError(
            "model= is loaded in this process; with processes= or gpus= each loads its own: leave it out"
        )
    from batchvl.pipeline.node import run_node
    from batchvl.pipeline.runner import run_job

    if places is None:
        summary = run_job(cfg, loaded=model, show_progress=progress)
    else:
        summary = run_node(cfg, places, show_progress=progress)
    return Results(read_results(cfg), summary.stats, cfg.output.dir, cfg)


def caption(
    dataset: datasets.Dataset | pandas.DataFrame | Sequence[Image.Image | str | os.PathLike | bytes | None],
    *,
    model: LoadedModel | str | Path,
    prompts: str
    | Mapping[str, str | Mapping[str, Any]]
    | Sequence[str | Mapping[str, Any]] = "Describe this image.",
    output_dir: str | Path,
    image_column: str = "image",
    root: str | Path | None = None,
    rows_per_shard: int = 1000,
    sampling: Mapping[str, Any] | None = None,
    engine: Mapping[str, Any] | None = None,
    preprocess: Mapping[str, Any] | None = None,
    download: Mapping[str, Any] | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
) -> Results:
    """Caption (or ask `prompts` about) every row of an in-memory `datasets.Dataset`, a pandas DataFrame, or
    every image of a list (PIL images, paths, URLs or encoded bytes; `inputs.in_memory.as_dataset`).

    `image_column` holds images (an `Image` feature, bytes, paths or http(s) URLs, or a list of these;
    `download` holds `input.download` settings for the URLs). Paths resolve against `root` (default: the
    current folder) and must lie under it, as a job's under its `input.root` (`root="/"` takes absolute
    paths anywhere). `prompts` is one text, `{name: text}`,
    `{name: {text, choices | json_schema | regex, ...}}` with a job file's prompt keys, or a list of
    texts or such mappings with their `name`. Each row's key is its index in `dataset` (its position in a
    list or a frame). Calling again
    with the same `output_dir` resumes; a different dataset there is refused unless `overwrite=True`."""
    dataset = as_dataset(dataset, image_column)
    if not isinstance(model, LoadedModel | str | os.PathLike):
        raise UserError(
            f"caption(model=) takes a load_model() result or a checkpoint folder's path, got "
            f"{type(model).__name__}"
        )
    if image_column not in dataset.column_names:
        raise UserError(
            f"image_column '{image_column}' is not a column of the dataset (columns: "
            f"{', '.join(dataset.column_names)}); pass image_column="
        )
    if not isinstance(rows_per_shard, int) or isinstance(rows_per_shard, bool) or rows_per_shard <= 0:
        raise UserError(f"rows_per_shard must be a positive whole number, got {rows_per_shard!r}")
    if not isinstance(output_dir, str | os.PathLike):
        raise UserError(f"output_dir= takes a folder's path, got {type(output_dir).__name__}")
    if root is not None and not Path(root).is_dir():
        raise UserError(f"root= is the folder the image paths resolve against; '{root}' is not a folder")
    sections = {
        name: _section(name, value)
        for name, value in (
            ("sampling", sampling),
            ("engine", engine),
            ("preprocess", preprocess),
            ("download", download),
        )
    }
    if is_remote(str(output_dir)):
        raise UserError(
            f"caption() keeps a copy of the dataset in output_dir, a local folder; '{output_dir}' is a URL. "
            "To write to an object store, save the dataset as Parquet and run(job) with output.dir there"
        )
    out = Path(output_dir).resolve()
    # set only where paths are read: a dataset of image bytes keeps its results whatever the current folder
    paths_root = str(Path(root or ".").resolve()) if holds_paths(dataset.data.column(image_column)) else None
    staged = dataset.add_column(CAPTION_KEY_COLUMN, list(range(dataset.num_rows)))
    input_folder = staged_folder(staged, out)
    loaded = model if isinstance(model, LoadedModel) else None
    job = {
        "model": {
            "path": loaded.path if loaded else str(Path(model).resolve()),
            "dtype": str(loaded.adapter.dtype).removeprefix("torch.") if loaded else dtype,
            "device": loaded.adapter.device.type if loaded else "auto",
        },
        "input": {
            "format": "hf_dataset",
            "paths": [glob.escape(str(input_folder))],
            "image_column": image_column,
            "key_column": CAPTION_KEY_COLUMN,
            "root": paths_root,
            "download": sections["download"],
        },
        "prompts": _prompt_list(prompts),
        "sampling": sections["sampling"],
        "engine": sections["engine"],
        "preprocess": sections["preprocess"],
        "output": {"dir": str(out), "overwrite": overwrite},
    }
    cfg = job_config_from_dict(job)  # the job's mistakes (a sampling key, a prompt's), before any write
    if loaded is None:
        check_model_folder(cfg.model.path)
    stage_dataset(staged, out, rows_per_shard, overwrite)
    return run(cfg, model=loaded, progress=progress)


def holds_paths(column: pa.ChunkedArray) -> bool:
    """Whether an image column has cells read from a path: text (a path, or a URL, which ignores the root),
    or datasets' `Image` struct holding a path and no bytes; through lists of these."""
    for values in column.chunks:
        while pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            values = values.flatten()
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            if values.null_count < len(values):
                return True
        elif pa.types.is_struct(values.type) and {"bytes", "path"} <= {f.name for f in values.type}:
            without_bytes = pc.and_(pc.is_null(values.field("bytes")), pc.is_valid(values.field("path")))
            if pc.any(without_bytes).as_py():
                return True
    return False


def read_results(job: JobConfig | Mapping[str, Any] | str | Path) -> datasets.Dataset:
    """The committed rows of a job (run by the CLI, `run` or `caption`) as one `datasets.Dataset`;
    refused, as `run` refuses, where shards were written by another config."""
    import datasets
    from datasets.table import InMemoryTable

    from batchvl.commands.labels import job_rows

    return datasets.Dataset(InMemoryTable(_without_maps(job_rows(_job_config(job, ())))))


def _without_maps(table: pa.Table) -> pa.Table:
    """`datasets` has no map type: a map column (`choice_probs`) becomes a list of {key, value} structs,
    its storage layout."""
    for index, column in enumerate(table.schema):
        if pa.types.is_map(column.type):
            entry = pa.struct([("key", column.type.key_type), ("value", column.type.item_type)])
            table = table.set_column(index, column.name, table.column(index).cast(pa.list_(entry)))
    return table


def read_labels(job: JobConfig | Mapping[str, Any] | str | Path) -> datasets.Dataset:
    """The job's labels: one row per sample with, per prompt, its value (typed from a JSON schema: structs,
    lists, ints, floats, bools; text otherwise), `<prompt>_status`, and `<prompt>_probs` for scored
    choices. See `commands/labels.py`; a value its column's type cannot hold (an integer beyond int64)
    makes the column JSON text, with a warning. Refused, as `run` refuses, where shards were written by
    another config."""
    import datasets
    from datasets.table import InMemoryTable

    from batchvl.commands.labels import job_labels, table_notes

    table = job_labels(_job_config(job, ()))
    for note in table_notes(table):
        warnings.warn(note, stacklevel=2)
    return datasets.Dataset(InMemoryTable(table))


def staged_folder(staged: datasets.Dataset, out: Path) -> Path:
    """Where `stage_dataset` saves `staged` under `out`: a folder named by the dataset's fingerprint, which
    `datasets` derives from its content and the transforms that made it, so rerunning a notebook finds
    the same folder and resumes."""
    return out / layout.STAGED_INPUT / staged._fingerprint  # no public accessor; stable across releases


def stage_dataset(staged: datasets.Dataset, out: Path, rows_per_shard: int, overwrite: bool) -> Path:
    """Save `staged` (the caller's dataset with its row index as the key) under `out`, once; refuse a
    different one there."""
    folder = staged_folder(staged, out)
    fingerprint, root = folder.name, folder.parent
    record_path = root / "dataset.json"
    if record_path.is_file():
        previous = json.loads(record_path.read_text())["fingerprint"]
        if previous != fingerprint:
            if not overwrite:
                raise UserError(
                    f"{out} holds results of another dataset (fingerprint {previous}, this one is "
                    f"{fingerprint}); pass another output_dir, or overwrite=True to replace them"
                )
            shutil.rmtree(root / previous, ignore_errors=True)
    if not (folder / "state.json").is_file():
        _save_atomically(staged, folder, max(1, math.ceil(staged.num_rows / rows_per_shard)))
    root.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps({"fingerprint": fingerprint, "num_rows": staged.num_rows}))
    return folder


def _save_atomically(dataset: datasets.Dataset, folder: Path, num_shards: int) -> None:
    from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

    temporary = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    was_enabled = is_progress_bar_enabled()
    disable_progress_bars()  # saving is quick; one bar (the job's) is what a notebook should show
    try:
        dataset.save_to_disk(str(temporary), num_shards=num_shards)
    finally:
        if was_enabled:
            enable_progress_bars()
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(temporary, folder)


def _section(name: str, value: Mapping[str, Any] | None) -> dict:
    """A job file section passed as a keyword argument (`sampling={...}`), as a dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UserError(
            f"{name}= takes a mapping of the job file's {name} keys (e.g. {name}={{...}}), got "
            f"{type(value).__name__}"
        )
    return dict(value)


def _prompt_list(prompts) -> list[dict]:
    if isinstance(prompts, str):
        return [{"name": "caption", "text": prompts}]
    if isinstance(prompts, Mapping):
        return [_named_prompt(str(name), prompt) for name, prompt in prompts.items()]
    if not isinstance(prompts, Sequence):
        raise UserError(
            f"prompts= takes a text, a {{name: text}} mapping or a list of texts or mappings; got "
            f"{type(prompts).__name__}"
        )
    listed = []
    for number, prompt in enumerate(prompts):
        listed.append(
            dict(prompt) if isinstance(prompt, Mapping) else {"name": f"prompt_{number}", "text": prompt}
        )
    return listed


def _named_prompt(name: str, prompt) -> dict:
    """`{name: text}` or `{name: {text, choices, json_schema, ...}}`: a prompt of the job file, named."""
    if isinstance(prompt, str):
        return {"name": name, "text": prompt}
    if not isinstance(prompt, Mapping):
        raise UserError(
            f"prompts['{name}'] must be the prompt's text or a mapping of its keys (text, choices, "
            f"json_schema, regex, ...), got {type(prompt).__name__}"
        )
    if prompt.get("name", name) != name:
        raise UserError(f"prompts['{name}'] is named '{prompt['name']}' inside; keep one name")
    return {**prompt, "name": name}


def _job_config(job, overrides: Sequence[str] | str | None) -> JobConfig:
    if overrides is None:
        overrides = ()
    if isinstance(overrides, str):  # one override, not its characters
        overrides = [overrides]
    if not isinstance(overrides, Sequence) or not all(isinstance(o, str) for o in overrides):
        raise UserError(
            f"overrides= takes 'key=value' texts, as --set does (e.g. ['sampling.max_new_tokens=32']); "
            f"got {overrides!r}"
        )
    if not isinstance(job, JobConfig | Mapping | str | os.PathLike):
        raise UserError(
            f"a job is a JobConfig, a dict shaped like the job file or a job file's path; got "
            f"{type(job).__name__}"
        )
    if isinstance(job, JobConfig):
        if overrides:
            raise UserError("overrides apply to a dict or a job file; change the JobConfig itself instead")
        return resolve_paths(job, Path.cwd())  # as a job file's are against its folder
    if isinstance(job, Mapping):
        return job_config_from_dict(job, Path.cwd(), overrides)
    return load_job_config(job, overrides)
