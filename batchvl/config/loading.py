"""A job file (YAML) or a dict, with `--set` overrides, into a `JobConfig`: relative paths resolved against
the job file's folder and a `json_schema` given as a path read."""

from __future__ import annotations

import dataclasses
import datetime
import json
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from batchvl.config.conversion import build
from batchvl.config.schema import CHAT_PROMPT, JobConfig, PromptConfig, is_remote
from batchvl.errors import ConfigError


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
                cache_dir=_absolute_or_none(inp.download.cache_dir, base),
            ),
        ),
        output=dataclasses.replace(cfg.output, dir=_absolute(cfg.output.dir, base)),
        engine=dataclasses.replace(
            cfg.engine, encoder_cache_dir=_absolute_or_none(cfg.engine.encoder_cache_dir, base)
        ),
    )


def _absolute_or_none(path: str | None, base: Path) -> str | None:
    return _absolute(path, base) if path else None


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
            value = yaml.load(raw, Loader=_UniqueKeyLoader)
        except yaml.YAMLError:
            value = raw
        except ConfigError as exc:
            raise ConfigError(f"--set {item}: {exc}") from None
        node = data
        parts = dotted.strip().split(".")
        for depth, part in enumerate(parts[:-1]):
            if _LIST_ITEM.fullmatch(part):
                items, index = _list_slot(node, part, dotted)
                child = items[index]
            else:
                child = node.setdefault(part, {})
            if isinstance(child, list):
                after = parts[depth + 1 :]
                rest = ".".join(after[1:] if after[0].isdigit() else after) or "KEY"
                raise ConfigError(
                    f"--set {dotted}: '{part}' is a list; name one of its items by index, as in "
                    f"--set {part}[0].{rest}=..."
                )
            if not isinstance(child, dict):
                raise ConfigError(f"--set {dotted}: '{part}' is not a section")
            node = child
        if _LIST_ITEM.fullmatch(parts[-1]):
            items, index = _list_slot(node, parts[-1], dotted)
            items[index] = value  # the item exists: replaced, never appended
        else:
            node[parts[-1]] = value
    return data


_LIST_ITEM = re.compile(r"(\w+)\[(\d+)\]")  # `prompts[0]` in `--set prompts[0].text=...`


def _list_slot(node: dict, part: str, dotted: str) -> tuple[list, int]:
    """The list and the index of the item `part` (`prompts[0]`) names, as the job file lists it."""
    name, index = _LIST_ITEM.fullmatch(part).groups()
    items = node.get(name)
    if not isinstance(items, list):
        raise ConfigError(
            f"--set {dotted}: the job file has no list '{name}'; set the whole list: {name}=[...]"
        )
    if int(index) >= len(items):
        raise ConfigError(f"--set {dotted}: '{name}' holds {len(items)} item(s), numbered from 0")
    return items, int(index)


def job_config_from_dict(
    data: Mapping, base_dir: str | Path | None = None, overrides: Sequence[str] = ()
) -> JobConfig:
    raw = _plain(apply_overrides(_plain(data, ""), overrides), "")
    cfg = build(JobConfig, raw, "")
    if cfg.input.format == "openai_batch":
        if "prompts" in raw:
            raise ConfigError(
                "input.format openai_batch: each request carries its own messages; remove 'prompts'"
            )
        cfg = dataclasses.replace(cfg, prompts=[CHAT_PROMPT])
    return resolve_paths(cfg, Path(base_dir) if base_dir is not None else Path.cwd())


def _plain(value: Any, key: str) -> Any:
    """A copy of a job's raw values as the typed conversion reads them: a YAML date (`2024-01-01`) and a
    path object as text, a numpy integer as an int; a value of any other type refused naming its key (a
    date reached the conversion as a `TypeError` traceback)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, f"{key}[{index}]") for index, item in enumerate(value)]
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise ConfigError(
        f"'{key}' holds a {type(value).__name__} ({str(value)[:60]!r}); a job takes text, numbers, "
        "true/false, lists and mappings"
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping: PyYAML keeps the last one silently,
    so a second `sampling:` section would quietly replace the first."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(  # named by the caller: the loader's own name is "<unicode string>"
                    f"key '{key}' is given twice (lines {first_line[key]} and {line}); "
                    "keep one and merge the values into it"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep)


# YAML 1.1, which PyYAML reads, takes `1e12` and `1.0e12` for text (its floats need a dot and a signed
# exponent: 1.0e+12); YAML 1.2 and every other reader a user knows take them for numbers.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _job_file_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: line {line} is not UTF-8 text (byte {raw[exc.start]:#04x}); save the job file as UTF-8"
        ) from None


def load_job_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give the job file (a .yaml file) itself")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a regular file; give the job file (a .yaml file) itself")
    if not path.is_file():
        raise ConfigError(f"job file not found: {path}")
    text = _job_file_text(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
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
