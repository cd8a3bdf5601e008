"""The job file: YAML -> typed, validated, frozen dataclasses.

Every key is declared once here with its type, default and help text; the key table in
docs/configuration.md is generated from these declarations (`keys_markdown_table`) and a test checks it
is current. Mistakes are one-line `ConfigError`s that name the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import xxhash
import yaml

from batchvl.errors import ConfigError

REQUIRED = dataclasses.MISSING


def _key(
    default: Any = REQUIRED,
    help: str = "",
    factory: Any = None,
    *,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
    defines_output: bool = False,
    unset_leaves_fingerprint: bool = False,
    name: str | None = None,
) -> Any:
    """A job-file key: its default, help text, bounds (`above` is exclusive) and whether a shard's rows
    depend on it (`defines_output`: a changed value over committed shards is refused). A key added to a
    section that defines the output is `unset_leaves_fingerprint`: at its default it is left out of the
    fingerprint, so jobs that do not use it keep the fingerprint (and their committed shards) they had.
    `name` is the key's name in the job file where it cannot be the field's (a Python keyword)."""
    metadata = {
        "name": name,
        "help": help,
        "above": above,
        "at_least": at_least,
        "at_most": at_most,
        "defines_output": defines_output,
        "unset_leaves_fingerprint": unset_leaves_fingerprint,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _file_key(f: dataclasses.Field) -> str:
    """The key's name in the job file."""
    return f.metadata.get("name") or f.name


def _check_bounds(key: str, value: Any, metadata: Mapping) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return  # null, or not a number
    above, at_least, at_most = metadata.get("above"), metadata.get("at_least"), metadata.get("at_most")
    low_ok = (above is None or value > above) and (at_least is None or value >= at_least)
    if low_ok and (at_most is None or value <= at_most):
        return
    if at_most is not None:
        low = f"({above:g}" if above is not None else f"[{at_least:g}"
        raise ConfigError(f"'{key}' must be in {low}, {at_most:g}], got {value}")
    if above == 0:
        raise ConfigError(f"'{key}' must be positive, got {value}")
    raise ConfigError(f"'{key}' must be >= {at_least if at_least is not None else above:g}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    path: str = _key(help="Folder of a Hugging Face checkpoint (safetensors weights)", defines_output=True)
    dtype: Literal["float32", "bfloat16", "auto"] = _key(
        "auto",
        "auto: bfloat16 on CUDA and on CPUs with AVX-512, else float32 (never float16 on CPU)",
        defines_output=True,
    )
    device: Literal["cpu", "cuda", "auto"] = _key("auto", "auto: cuda when available, else cpu")
    trust_remote_code: bool = _key(
        False, "Allow the checkpoint's own Python code to run", defines_output=True
    )


@dataclass(frozen=True)
class DownloadConfig:
    concurrency: int = _key(8, "Downloads in flight at once, per preprocessing worker", above=0)
    timeout_s: float = _key(
        10.0, "Connect timeout, and the longest wait for the next bytes of a response", above=0
    )
    total_timeout_s: float = _key(
        60.0, "Longest one attempt at a download may take, however slowly the bytes come", above=0
    )
    max_bytes: int = _key(
        50 * 2**20, "Largest body read; a larger one is an `image_too_large` error row", above=0
    )
    retries: int = _key(
        3, "Further attempts after a timeout, a refused connection, HTTP 429 or 5xx", at_least=0
    )
    backoff_s: float = _key(
        0.5, "Wait before the first retry, doubled for each later one (a Retry-After header wins)", at_least=0
    )
    max_redirects: int = _key(5, "Most redirects followed for one URL", at_least=0)
    allow_private: bool = _key(
        False,
        "Allow URLs that resolve to loopback, private or link-local addresses (refused by default: job "
        "files and datasets come from other people)",
    )
    cache_dir: str | None = _key(
        None, "Keep downloaded bytes here (content-addressed), so retries and reruns do not download again"
    )


@dataclass(frozen=True)
class InputConfig:
    paths: list[str] = _key(
        help="Glob patterns: Parquet files, tar files, `save_to_disk` folders or media folders (by format)"
    )
    format: Literal["parquet", "webdataset", "hf_dataset", "folder", "openai_batch"] = _key(
        "parquet",
        "parquet: each file a shard; webdataset: tar shards; hf_dataset: each Arrow file a shard; "
        "folder: image/video files; openai_batch: JSONL files of chat-completion requests, each line "
        "with its own messages and sampling",
        defines_output=True,
    )
    image_column: str = _key(
        "image",
        "Table column with image bytes, a {bytes, path} struct, a path, an http(s) URL, or a list of these",
        defines_output=True,
    )
    key_column: str | None = _key(
        None,
        "Column used as the sample key (null: the row index; a row whose key is null gets its index)",
        defines_output=True,
    )
    root: str | None = _key(
        None,
        "Folder that relative media paths in tables resolve against (null: the table file's folder)",
        defines_output=True,
    )
    files_per_shard: int = _key(
        1000,
        "`folder` input: files per shard (the unit of output and resume); recorded shards keep their files",
        above=0,
        defines_output=True,
    )
    storage_options: dict = _key(
        help="fsspec options for `s3://`, `gs://` ... input paths (credentials, endpoint_url); "
        "empty: the environment's, as fsspec finds them",
        factory=dict,
    )
    download: DownloadConfig = _key(
        help="Image cells that are http(s) URLs: how they are fetched", factory=DownloadConfig
    )


@dataclass(frozen=True)
class WhenConfig:
    prompt: str = _key(help="An earlier prompt whose output decides whether this prompt runs")
    equals: str | None = _key(None, "Run when that output is exactly this")
    in_: list[str] | None = _key(None, "Run when that output is one of these", name="in")


@dataclass(frozen=True)
class PromptConfig:
    name: str = _key(
        help="Prompt name, written to the `prompt` column; not empty, and not a column of the labels "
        "(`shard`, `key`, `sample_index`, another prompt's name + `_status` / `_probs`)"
    )
    text: str = _key(
        help="Prompt text after the sample's images in one user turn; "
        "`{field}` inserts a field of the sample, `{key}` its key, `{prompt}` an earlier prompt's output"
    )
    continue_: str | None = _key(
        None,
        "An earlier prompt: this prompt is the next user turn of its conversation (its images and text, "
        "its output as the answer, then this text)",
        unset_leaves_fingerprint=True,
        name="continue",
    )
    when: WhenConfig | None = _key(
        None,
        "Run only where an earlier prompt's output matches ({prompt, equals} or {prompt, in}); other "
        "samples get a `skipped` row",
        unset_leaves_fingerprint=True,
    )
    json_schema: dict | str | None = _key(
        None,
        "JSON schema the output must follow, inline or a path to a .json file relative to the job file "
        "(the output is generated under it, and a row is ok only if it parses and validates)",
        unset_leaves_fingerprint=True,
    )
    json_whitespace: Literal["compact", "any"] = _key(
        "compact",
        "json_schema output: compact (no whitespace between JSON tokens) or any whitespace",
        unset_leaves_fingerprint=True,
    )
    regex: str | None = _key(
        None, "Regular expression the whole output must match", unset_leaves_fingerprint=True
    )
    choices: list[str] | None = _key(
        None,
        "The output is exactly one of these strings, the most probable given the prompt "
        "(see choice_mode); its probability among the choices is in `choice_probs`",
        unset_leaves_fingerprint=True,
    )
    choice_mode: Literal["score", "generate"] = _key(
        "score",
        "choices prompt: score every choice (teacher-forced, one short prefill each) or generate under "
        "the choices as a constraint (cheaper for hundreds of choices; no choice_probs)",
        unset_leaves_fingerprint=True,
    )


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = _key(128, "Most tokens generated per request", above=0)
    max_new_tokens_field: str | None = _key(
        None,
        "Sample field (input column) holding a per-sample token limit, used instead of max_new_tokens "
        "(a null value falls back to max_new_tokens)",
    )
    temperature: float = _key(0.0, "0 (or below 1e-5) = greedy", at_least=0)
    top_p: float = _key(1.0, "Nucleus sampling mass (1 = off)", above=0, at_most=1)
    top_k: int = _key(0, "Sample among the k most likely tokens (0 = off)", at_least=0)
    seed: int = _key(0, "Base seed; each request derives its own from it, its shard, key and prompt")
    stop: list[str] = _key(help="Stop strings (cut from the text)", factory=list)
    stop_token_ids: list[int] = _key(help="Token ids that end generation", factory=list)
    ignore_eos: bool = _key(False, "Keep generating past end-of-sequence tokens")
    logprobs: bool = _key(
        False,
        "Add mean_logprob and min_logprob columns: over each row's output tokens, the log-probability of "
        "each token in the distribution it was chosen from",
        unset_leaves_fingerprint=True,
    )
    top_logprobs: int = _key(
        0,
        "Add a top_logprobs column: per output token, this many most likely tokens with their "
        "log-probabilities (0: off)",
        at_least=0,
        at_most=20,
        unset_leaves_fingerprint=True,
    )


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = _key(256, "Most requests running at once", above=0)
    max_num_batched_tokens: int = _key(
        2048, "Token budget of one engine step (decode tokens + prefill chunks)", above=0
    )
    kv_cache_mb: float = _key(1024, "Memory for the paged KV cache, in MiB", above=0)
    block_size: int = _key(16, "Tokens per KV-cache block", above=0)
    encoder_cache_mb: float = _key(
        512, "Memory for cached image embeddings, in MiB (0: keep only while in use)", at_least=0
    )
    max_patches_per_encode: int = _key(
        4096, "Most image patches in one vision-tower call (images are grouped by patch count)", above=0
    )
    prefix_caching: bool = _key(
        True, "Reuse the KV cache of shared prompt prefixes (system prompt + image) across requests"
    )
    lookahead: int = _key(
        64,
        "Requests waiting in the engine, admitted cheapest image first (1: strict arrival order)",
        above=0,
    )
    disable_chunked_mm_input: bool = _key(
        False, "Never split an image's placeholder tokens across prefill chunks"
    )
    vit_parallel: Literal["none", "data"] = _key(
        "none", "'data': split each encode step's images across torchrun ranks (ViT data parallelism)"
    )
    threads: int = _key(0, "torch intra-op threads (0: torch's default)", at_least=0)


@dataclass(frozen=True)
class PreprocessConfig:
    min_pixels: int | None = _key(
        None, "Smallest resized pixel count (null: the model processor's own)", above=0, defines_output=True
    )
    max_pixels: int | None = _key(
        None, "Largest resized pixel count (null: the model processor's own)", above=0, defines_output=True
    )
    max_image_pixels: int = _key(
        50_000_000,
        "Images over this many pixels are refused before full decode",
        above=0,
        defines_output=True,
    )
    video_fps: float = _key(2.0, "Video frames sampled per second of video", above=0, defines_output=True)
    video_min_frames: int = _key(4, "Fewest frames sampled from a video", above=0, defines_output=True)
    video_max_frames: int = _key(64, "Most frames sampled from a video", above=0, defines_output=True)
    video_max_pixels: int = _key(
        20_000_000,
        "Pixel budget of one video over all its frames (each frame gets an even share)",
        above=0,
        defines_output=True,
    )
    workers: int | None = _key(
        None,
        "Preprocessing worker processes (0: in the main process; null: half the CPU cores, 1 to 8)",
        at_least=0,
    )
    prefetch: int = _key(8, "Prepared samples each worker may hold ready ahead of the engine", above=0)
    timeout_s: float = _key(
        120.0,
        "A sample whose preprocessing (its downloads included) takes longer becomes an error row and its "
        "worker is replaced (needs workers >= 1)",
        above=0,
    )


@dataclass(frozen=True)
class OutputConfig:
    dir: str = _key(
        help="Output folder: one Parquet file per input shard, stats in _batchvl/; a local path or an "
        "object-store URL (s3://bucket/prefix, gs://...)"
    )
    format: Literal["parquet", "openai_batch"] = _key(
        "parquet",
        "openai_batch: also a JSONL file per shard in the batch API's output shape, beside its Parquet file",
        defines_output=True,
        unset_leaves_fingerprint=True,
    )
    storage_options: dict = _key(
        help="fsspec options for an `s3://`, `gs://` ... output.dir (credentials, endpoint_url); empty: the "
        "environment's, as fsspec finds them",
        factory=dict,
    )
    overwrite: bool = _key(
        False, "Recompute shards that are already written, even when they were written with another config"
    )
    max_error_rate: float | None = _key(
        None,
        "Largest share of error rows a run may write (0.05 = 5%); over it the run exits with code 3 after "
        "committing its shards (null: no limit)",
        at_least=0,
        at_most=1,
    )


def _default_prompts() -> list[PromptConfig]:
    return [PromptConfig(name="caption", text="Describe this image.")]


# openai_batch requests carry their own messages: the job has this one prompt, whose text is unused.
CHAT_PROMPT = PromptConfig(name="response", text="")


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = _key(help="The model")
    input: InputConfig = _key(help="The input dataset")
    output: OutputConfig = _key(help="Where results go")
    prompts: list[PromptConfig] = _key(
        help="One request per (sample, prompt)", factory=_default_prompts, defines_output=True
    )
    sampling: SamplingConfig = _key(help="Decoding", factory=SamplingConfig, defines_output=True)
    engine: EngineConfig = _key(help="Engine limits", factory=EngineConfig)
    preprocess: PreprocessConfig = _key(help="Image and video preprocessing", factory=PreprocessConfig)

    def __post_init__(self) -> None:
        # A config built in Python (the API, a notebook) is held to the rules a job file is: every key's
        # type and bounds, then what relates keys to each other.
        _check_keys(self, "")
        _check_values(self)


# ---- conversion -------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"'{key}' must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1:  # e.g. dict | str: the type the value has, if it is one of them
            fitting = [a for a in inner if isinstance(value, typing.get_origin(a) or a)]
            if not fitting:
                raise ConfigError(
                    f"'{key}' must be {' or '.join(_type_name(a) for a in inner)}, got {value!r} "
                    f"({type(value).__name__})"
                )
            inner = fitting[:1]
        return _convert(value, inner[0], key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r} ({type(value).__name__})")
        (inner,) = typing.get_args(tp)
        return [_convert(item, inner, f"{key}[{i}]") for i, item in enumerate(value)]
    # bool is an int subclass in Python; a YAML `true` for a count is a mistake, not 1.
    if tp is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"'{key}' must be an integer, got {value!r} ({type(value).__name__})")
    if tp is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"'{key}' must be a number, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"'{key}' must be true or false, got {value!r} ({type(value).__name__})")
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"'{key}' must be a string, got {value!r} ({type(value).__name__})")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = f"'{prefix}'" if prefix else "the job file"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [_file_key(f) for f in dataclasses.fields(cls)]
    for name in data:
        if name not in names:
            full = f"{prefix}.{name}" if prefix else str(name)
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = (
                f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
                if close
                else f"valid: {', '.join(names)}"
            )
            raise ConfigError(f"unknown key '{full}' ({hint})")
    values = {}
    for f in dataclasses.fields(cls):
        key = _file_key(f)
        full = f"{prefix}.{key}" if prefix else key
        if key in data:
            values[f.name] = _convert(data[key], hints[f.name], full)
        elif f.default is REQUIRED and f.default_factory is REQUIRED:
            raise ConfigError(f"missing required key '{full}'")
    return cls(**values)


def _check_keys(section: Any, prefix: str) -> None:
    """Every key's type and bounds, section by section: what the loader's conversion checks in a job file,
    for a config built from dataclasses, which skips it."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key, value, tp = f"{prefix}{_file_key(f)}", getattr(section, f.name), hints[f.name]
        inner = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if inner and typing.get_origin(tp) is list:  # prompts
            if not isinstance(value, list):
                raise ConfigError(f"'{key}' must be a list, got {value!r} ({type(value).__name__})")
            for i, item in enumerate(value):
                _check_section(item, inner[0], f"{key}[{i}]")
        elif inner:
            if value is not None or type(None) not in typing.get_args(tp):
                _check_section(value, inner[0], key)
        else:
            _convert(value, tp, key)
            _check_bounds(key, value, f.metadata)


def _check_section(value: Any, cls: type, key: str) -> None:
    if not isinstance(value, cls):
        raise ConfigError(f"'{key}' must be a {cls.__name__}, got {type(value).__name__}")
    _check_keys(value, f"{key}.")


def _check_values(cfg: JobConfig) -> None:
    """What one key's bounds cannot say (each key's own bounds are checked as it is read)."""
    p = cfg.preprocess
    if p.min_pixels is not None and p.max_pixels is not None and p.min_pixels > p.max_pixels:
        raise ConfigError("'preprocess.min_pixels' must not exceed 'preprocess.max_pixels'")
    if not cfg.input.paths:
        raise ConfigError("'input.paths' must list at least one path or glob")
    remote = [p for p in cfg.input.paths if is_remote(p)]
    if remote and cfg.input.format in ("folder", "hf_dataset"):
        raise ConfigError(
            f"input.format {cfg.input.format} reads local folders; '{remote[0]}' is a URL (parquet, "
            "webdataset and openai_batch files can be read from object stores)"
        )
    if not cfg.prompts:
        raise ConfigError("'prompts' must hold at least one prompt")
    names = [prompt.name for prompt in cfg.prompts]
    if len(set(names)) != len(names):
        raise ConfigError(f"'prompts' names must be unique, got {names}")
    _check_column_names(names)
    for prompt in cfg.prompts:
        _check_constraint_keys(prompt)


LABEL_COLUMNS = ("shard", "key", "sample_index")  # the label table's own columns, before the prompts'
PROMPT_COLUMN_SUFFIXES = ("_status", "_probs")  # a prompt's columns in the label table besides its value


def _check_column_names(names: list[str]) -> None:
    """A prompt's name names its label-table columns (`<name>`, `<name>_status`, `<name>_probs`): none may
    be empty, or be a column of the table's own or of another prompt."""
    if any(not name.strip() for name in names):
        raise ConfigError(f"'prompts' names must not be empty, got {names}; name each prompt")
    reserved = f"{', '.join(LABEL_COLUMNS)} and each prompt's <name>{'/<name>'.join(PROMPT_COLUMN_SUFFIXES)}"
    for name in names:
        owner = next((n for n in names for s in PROMPT_COLUMN_SUFFIXES if n + s == name), None)
        if name in LABEL_COLUMNS or owner is not None:
            column = f"prompt '{owner}''s {name} column" if owner else f"the {name} column"
            raise ConfigError(
                f"prompt name '{name}' would replace {column} in the labels (reserved: {reserved}); "
                "rename the prompt"
            )


def _check_constraint_keys(prompt: PromptConfig) -> None:
    where = f"prompt '{prompt.name}'"
    given = [k for k in ("json_schema", "regex", "choices") if getattr(prompt, k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{where} has {' and '.join(given)}; keep one constraint per prompt")
    if prompt.choices is not None:
        if not prompt.choices or any(choice == "" for choice in prompt.choices):
            raise ConfigError(f"{where}: 'choices' must list at least one non-empty string")
        if len(set(prompt.choices)) != len(prompt.choices):
            raise ConfigError(f"{where}: 'choices' holds a choice twice: {prompt.choices}")
    if prompt.choice_mode != "score" and prompt.choices is None:
        raise ConfigError(f"{where}: 'choice_mode' applies to a choices prompt; remove it")
    if prompt.json_whitespace != "compact" and prompt.json_schema is None:
        raise ConfigError(f"{where}: 'json_whitespace' applies to a json_schema prompt; remove it")
    if prompt.when is not None and (prompt.when.equals is None) == (prompt.when.in_ is None):
        raise ConfigError(f"{where}: 'when' takes one of 'equals' or 'in'")
    if prompt.when is not None and prompt.when.in_ == []:
        raise ConfigError(f"{where}: 'when.in' must list at least one output (with none, it never runs)")


def is_remote(path: str) -> bool:
    """A URL with a protocol other than file:// (s3://bucket/...): read through fsspec."""
    return "://" in path and not path.startswith("file://")


def _absolute(path: str, base: Path) -> str:
    if is_remote(path):  # fsspec resolves it, never relative to the job file
        return path
    path = path.removeprefix("file://")
    return os.path.normpath(path if Path(path).is_absolute() else base / path)


def resolve_paths(cfg: JobConfig, base: Path) -> JobConfig:
    """Relative paths made absolute against `base` (a job file's folder, or the working folder of a config
    built in Python), and a `json_schema` given as a path replaced by the schema the file holds."""
    model_path = cfg.model.path
    if not Path(model_path).is_absolute() and (base / model_path).is_dir():
        model_path = str((base / model_path).resolve())
    inp = cfg.input
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=model_path),
        prompts=[_with_schema_read(prompt, base) for prompt in cfg.prompts],
        input=dataclasses.replace(
            inp,
            paths=[_absolute(p, base) for p in inp.paths],
            root=_absolute(inp.root, base) if inp.root else None,
            download=dataclasses.replace(
                inp.download,
                cache_dir=_absolute(inp.download.cache_dir, base) if inp.download.cache_dir else None,
            ),
        ),
        output=dataclasses.replace(cfg.output, dir=_absolute(cfg.output.dir, base)),
    )


def _with_schema_read(prompt: PromptConfig, base: Path) -> PromptConfig:
    """A `json_schema` given as a path is replaced by the schema it holds, so the schema (not its file
    name) is what the job's fingerprint covers."""
    if not isinstance(prompt.json_schema, str):
        return prompt
    path = Path(_absolute(prompt.json_schema, base))
    where = f"prompt '{prompt.name}': json_schema {prompt.json_schema}"
    try:
        schema = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be read ({exc.strerror or exc}); give a path relative to the job file"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"{where} holds {type(schema).__name__}, not a JSON schema object")
    return dataclasses.replace(prompt, json_schema=schema)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply `section.key=value` strings (value parsed as YAML) to a raw job dict."""
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"--set expects section.key=value, got '{item}'")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = data
        parts = dotted.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {dotted}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return data


def job_config_from_dict(
    data: Mapping, base_dir: str | Path | None = None, overrides: Sequence[str] = ()
) -> JobConfig:
    raw = apply_overrides(json.loads(json.dumps(dict(data))), overrides)
    cfg = _build(JobConfig, raw, "")
    if cfg.input.format == "openai_batch":
        if "prompts" in raw:
            raise ConfigError(
                "input.format openai_batch: each request carries its own messages; remove 'prompts'"
            )
        cfg = dataclasses.replace(cfg, prompts=[CHAT_PROMPT])
    return resolve_paths(cfg, Path(base_dir) if base_dir is not None else Path.cwd())


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping: PyYAML keeps the last one silently,
    so a second `sampling:` section would quietly replace the first."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(
                    f"{self.name}: key '{key}' is given twice (lines {first_line[key]} and {line}); "
                    "keep one and merge the values into it"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep)


def load_job_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file not found: {path}")
    try:
        with path.open() as handle:
            data = yaml.load(handle, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the job file must be a mapping of sections, got {type(data).__name__}")
    return job_config_from_dict(data, path.resolve().parent, overrides)


def config_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def output_defining_config(cfg: JobConfig) -> dict:
    """The part of the job config that a shard's rows depend on, as plain JSON values: the keys declared
    with `defines_output` (a whole section where the section itself is). Engine limits, worker counts and
    the input file list are left out: they change speed or which shards exist, not a shard's rows."""
    d = _without_unset_new_keys(cfg)
    out: dict = {}
    hints = typing.get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        if section.metadata["defines_output"]:
            out[section.name] = d[section.name]
            continue
        keys = [f.name for f in dataclasses.fields(hints[section.name]) if f.metadata["defines_output"]]
        present = {k: d[section.name][k] for k in keys if k in d[section.name]}  # unset new keys are not
        if present:
            out[section.name] = present
    for prompt in out["prompts"]:
        orders = _unsorted_property_orders(prompt.get("json_schema"))
        if orders:
            prompt["json_schema_property_order"] = orders
    return out


def _unsorted_property_orders(schema: Any) -> list[list[str]]:
    """The names of every `properties` mapping in a JSON schema that does not list them alphabetically, in
    the order written. The model writes properties in that order, so it defines the output; the fingerprint's
    JSON sorts keys and would not see it. A schema with alphabetical properties adds nothing, so it keeps the
    fingerprint it had when the grammar sorted them."""
    orders = []
    if isinstance(schema, dict):
        properties = schema.get("properties")
        if isinstance(properties, dict) and list(properties) != sorted(properties):
            orders.append(list(properties))
        for value in schema.values():
            orders.extend(_unsorted_property_orders(value))
    elif isinstance(schema, list):
        for value in schema:
            orders.extend(_unsorted_property_orders(value))
    return orders


def _without_unset_new_keys(value: Any) -> Any:
    """`config_to_dict`, leaving out the `unset_leaves_fingerprint` keys that hold their defaults."""
    if isinstance(value, list):
        return [_without_unset_new_keys(item) for item in value]
    if not dataclasses.is_dataclass(value):
        return value
    out = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if f.metadata.get("unset_leaves_fingerprint") and item == f.default:
            continue
        out[f.name] = _without_unset_new_keys(item)
    return out


def config_fingerprint(cfg: JobConfig) -> str:
    """Hash of what changes outputs (model, prompts, sampling, preprocessing), not of engine limits."""
    return fingerprint_of(output_defining_config(cfg))


def fingerprint_of(output_defining: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(output_defining, sort_keys=True).encode())


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (a changed list is one key)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [k for key in keys for k in changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]


def describe_keys() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) for every leaf key, in declaration order."""
    rows = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{_file_key(f)}"
            args = typing.get_args(tp)
            section = [a for a in (tp, *args) if dataclasses.is_dataclass(a)]  # also `Section | None`
            if section and typing.get_origin(tp) is not list:
                walk(section[0], f"{key}.")
            elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
                walk(args[0], f"{key}[].")
            else:
                if f.default is not REQUIRED:
                    default = json.dumps(f.default)
                elif f.default_factory is not REQUIRED:
                    default = json.dumps(f.default_factory())
                else:
                    default = "required"
                rows.append((key, _type_name(tp), default, f.metadata.get("help", "")))

    walk(JobConfig, "")
    return rows


def keys_markdown_table() -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, tp, default, help_text in describe_keys():
        escaped = tp.replace("|", "\\|")  # a pipe inside a Markdown table cell
        lines.append(f"| `{key}` | {escaped} | `{default}` | {help_text} |")
    return "\n".join(lines)
