"""The job file: YAML -> typed, validated, frozen dataclasses.

Every key is declared once here with its type, default and help text; the README's key table is
generated from these declarations (`keys_markdown_table`) and a test checks it is current. Mistakes
are one-line `ConfigError`s that name the dotted key.
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


def _key(default: Any = REQUIRED, help: str = "", factory: Any = None) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    path: str = _key(help="Folder of a Hugging Face checkpoint (safetensors weights)")
    dtype: Literal["float32", "bfloat16", "auto"] = _key(
        "auto", "auto: bfloat16 on CUDA and on CPUs with AVX-512, else float32 (never float16 on CPU)"
    )
    device: Literal["cpu", "cuda", "auto"] = _key("auto", "auto: cuda when available, else cpu")
    trust_remote_code: bool = _key(False, "Allow the checkpoint's own Python code to run")


@dataclass(frozen=True)
class InputConfig:
    paths: list[str] = _key(
        help="Glob patterns: Parquet files, tar files, `save_to_disk` folders or media folders (by format)"
    )
    format: Literal["parquet", "webdataset", "hf_dataset", "folder"] = _key(
        "parquet",
        "parquet: each file a shard; webdataset: tar shards; hf_dataset: each Arrow file a shard; "
        "folder: image/video files",
    )
    image_column: str = _key(
        "image", "Table column with image bytes, a {bytes, path} struct, a path, or a list of these"
    )
    key_column: str | None = _key(
        None, "Column used as the sample key (null: the row index; a row whose key is null gets its index)"
    )
    root: str | None = _key(
        None, "Folder that relative media paths in tables resolve against (null: the table file's folder)"
    )
    files_per_shard: int = _key(
        1000,
        "`folder` input: files per shard (the unit of output and resume); recorded shards keep their files",
    )


@dataclass(frozen=True)
class PromptConfig:
    name: str = _key(help="Prompt name, written to the `prompt` column")
    text: str = _key(
        help="Prompt text after the sample's images in one user turn; "
        "`{field}` inserts a field of the sample, `{key}` its key"
    )


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = _key(128, "Most tokens generated per request")
    max_new_tokens_field: str | None = _key(
        None,
        "Sample field (input column) holding a per-sample token limit, used instead of max_new_tokens "
        "(a null value falls back to max_new_tokens)",
    )
    temperature: float = _key(0.0, "0 = greedy")
    top_p: float = _key(1.0, "Nucleus sampling mass (1 = off)")
    top_k: int = _key(0, "Sample among the k most likely tokens (0 = off)")
    seed: int = _key(0, "Base seed; each request derives its own from it, its shard, key and prompt")
    stop: list[str] = _key(help="Stop strings (cut from the text)", factory=list)
    stop_token_ids: list[int] = _key(help="Token ids that end generation", factory=list)
    ignore_eos: bool = _key(False, "Keep generating past end-of-sequence tokens")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = _key(256, "Most requests running at once")
    max_num_batched_tokens: int = _key(
        2048, "Token budget of one engine step (decode tokens + prefill chunks)"
    )
    kv_cache_mb: float = _key(1024, "Memory for the paged KV cache, in MiB")
    block_size: int = _key(16, "Tokens per KV-cache block")
    encoder_cache_mb: float = _key(
        512, "Memory for cached image embeddings, in MiB (0: keep only while in use)"
    )
    max_patches_per_encode: int = _key(
        4096, "Most image patches in one vision-tower call (images are grouped by patch count)"
    )
    prefix_caching: bool = _key(
        True, "Reuse the KV cache of shared prompt prefixes (system prompt + image) across requests"
    )
    lookahead: int = _key(
        64, "Requests waiting in the engine, admitted cheapest image first (1: strict arrival order)"
    )
    disable_chunked_mm_input: bool = _key(
        False, "Never split an image's placeholder tokens across prefill chunks"
    )
    vit_parallel: str = _key(
        "none", "'data': split each encode step's images across torchrun ranks (ViT data parallelism)"
    )
    threads: int = _key(0, "torch intra-op threads (0: torch's default)")


@dataclass(frozen=True)
class PreprocessConfig:
    min_pixels: int | None = _key(None, "Smallest resized pixel count (null: the model processor's own)")
    max_pixels: int | None = _key(None, "Largest resized pixel count (null: the model processor's own)")
    max_image_pixels: int = _key(50_000_000, "Images over this many pixels are refused before full decode")
    video_fps: float = _key(2.0, "Video frames sampled per second of video")
    video_min_frames: int = _key(4, "Fewest frames sampled from a video")
    video_max_frames: int = _key(64, "Most frames sampled from a video")
    video_max_pixels: int = _key(
        20_000_000, "Pixel budget of one video over all its frames (each frame gets an even share)"
    )
    workers: int | None = _key(
        None, "Preprocessing worker processes (0: in the main process; null: half the CPU cores, 1 to 8)"
    )
    prefetch: int = _key(8, "Prepared samples each worker may hold ready ahead of the engine")
    timeout_s: float = _key(
        120.0,
        "A sample whose preprocessing takes longer becomes an error row and its worker is replaced "
        "(needs workers >= 1)",
    )


@dataclass(frozen=True)
class OutputConfig:
    dir: str = _key(help="Output folder: one Parquet file per input shard, stats in _batchvl/")
    overwrite: bool = _key(
        False, "Recompute shards that are already written, even when they were written with another config"
    )
    max_error_rate: float | None = _key(
        None,
        "Largest share of error rows a run may write (0.05 = 5%); over it the run exits with code 3 after "
        "committing its shards (null: no limit)",
    )


def _default_prompts() -> list[PromptConfig]:
    return [PromptConfig(name="caption", text="Describe this image.")]


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = _key(help="The model")
    input: InputConfig = _key(help="The input dataset")
    output: OutputConfig = _key(help="Where results go")
    prompts: list[PromptConfig] = _key(help="One request per (sample, prompt)", factory=_default_prompts)
    sampling: SamplingConfig = _key(help="Decoding", factory=SamplingConfig)
    engine: EngineConfig = _key(help="Engine limits", factory=EngineConfig)
    preprocess: PreprocessConfig = _key(help="Image and video preprocessing", factory=PreprocessConfig)


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
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, key)
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
    names = [f.name for f in dataclasses.fields(cls)]
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
        full = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in data:
            values[f.name] = _convert(data[f.name], hints[f.name], full)
        elif f.default is REQUIRED and f.default_factory is REQUIRED:
            raise ConfigError(f"missing required key '{full}'")
    return cls(**values)


def _check_values(cfg: JobConfig) -> None:
    def positive(key: str, value: int) -> None:
        if value <= 0:
            raise ConfigError(f"'{key}' must be positive, got {value}")

    e, s, p = cfg.engine, cfg.sampling, cfg.preprocess
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_mb",
        "block_size",
        "max_patches_per_encode",
        "lookahead",
    ):
        positive(f"engine.{name}", getattr(e, name))
    positive("sampling.max_new_tokens", s.max_new_tokens)
    positive("preprocess.max_image_pixels", p.max_image_pixels)
    positive("preprocess.prefetch", p.prefetch)
    positive("preprocess.video_min_frames", p.video_min_frames)
    positive("preprocess.video_max_frames", p.video_max_frames)
    positive("preprocess.video_max_pixels", p.video_max_pixels)
    if p.video_fps <= 0:
        raise ConfigError(f"'preprocess.video_fps' must be positive, got {p.video_fps}")
    positive("input.files_per_shard", cfg.input.files_per_shard)
    if p.timeout_s <= 0:
        raise ConfigError(f"'preprocess.timeout_s' must be positive, got {p.timeout_s}")
    if p.workers is not None and p.workers < 0:
        raise ConfigError(f"'preprocess.workers' must be >= 0, got {p.workers}")
    for key, value in (
        ("engine.encoder_cache_mb", e.encoder_cache_mb),
        ("engine.threads", e.threads),
        ("sampling.temperature", s.temperature),
        ("sampling.top_k", s.top_k),
    ):
        if value < 0:
            raise ConfigError(f"'{key}' must be >= 0, got {value}")
    if e.vit_parallel not in ("none", "data"):
        raise ConfigError(f"'engine.vit_parallel' must be 'none' or 'data', got '{e.vit_parallel}'")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"'sampling.top_p' must be in (0, 1], got {s.top_p}")
    rate = cfg.output.max_error_rate
    if rate is not None and not 0 <= rate <= 1:
        raise ConfigError(f"'output.max_error_rate' must be in [0, 1] (a share of rows), got {rate}")
    if p.min_pixels is not None and p.max_pixels is not None and p.min_pixels > p.max_pixels:
        raise ConfigError("'preprocess.min_pixels' must not exceed 'preprocess.max_pixels'")
    if not cfg.input.paths:
        raise ConfigError("'input.paths' must list at least one path or glob")
    if not cfg.prompts:
        raise ConfigError("'prompts' must hold at least one prompt")
    names = [prompt.name for prompt in cfg.prompts]
    if len(set(names)) != len(names):
        raise ConfigError(f"'prompts' names must be unique, got {names}")


def _resolve_paths(cfg: JobConfig, base: Path) -> JobConfig:
    def absolute(path: str) -> str:
        return os.path.normpath(path if Path(path).is_absolute() else base / path)

    model_path = cfg.model.path
    if not Path(model_path).is_absolute() and (base / model_path).is_dir():
        model_path = str((base / model_path).resolve())
    inp = cfg.input
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=model_path),
        input=dataclasses.replace(
            inp, paths=[absolute(p) for p in inp.paths], root=absolute(inp.root) if inp.root else None
        ),
        output=dataclasses.replace(cfg.output, dir=absolute(cfg.output.dir)),
    )


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
    _check_values(cfg)
    return _resolve_paths(cfg, Path(base_dir) if base_dir is not None else Path.cwd())


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


# What a shard's rows depend on: the model, the prompts, decoding, preprocessing and how samples are read.
# Engine limits, worker counts and the input file list are left out: they change speed or which shards
# exist, not the rows of a shard (the engine's outputs do not depend on its batch sizes).
OUTPUT_DEFINING_KEYS = {
    "model": ("path", "dtype", "trust_remote_code"),
    "input": ("format", "image_column", "key_column", "root", "files_per_shard"),
    "prompts": None,
    "sampling": None,
    "preprocess": (
        "min_pixels",
        "max_pixels",
        "max_image_pixels",
        "video_fps",
        "video_min_frames",
        "video_max_frames",
        "video_max_pixels",
    ),
}


def output_defining_config(cfg: JobConfig) -> dict:
    """The part of the job config that a shard's rows depend on, as plain JSON values."""
    d = config_to_dict(cfg)
    return {
        section: d[section] if keys is None else {k: d[section][k] for k in keys}
        for section, keys in OUTPUT_DEFINING_KEYS.items()
    }


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
            key = f"{prefix}{f.name}"
            args = typing.get_args(tp)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{key}.")
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
