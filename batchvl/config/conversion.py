"""Plain values (parsed YAML, a dict) into the config's typed sections: each value checked against its
key's declared type, unknown keys refused with the key meant."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from batchvl.config.keys import REQUIRED, file_key
from batchvl.errors import ConfigError

# ---- conversion -------------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
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
            fitting = [a for a in inner if _fits(value, a)]
            if not fitting:
                raise ConfigError(
                    f"'{key}' must be {' or '.join(type_name(a) for a in inner)}, got {value!r} "
                    f"({type(value).__name__})"
                )
            inner = fitting[:1]
        return convert(value, inner[0], key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r} ({type(value).__name__})")
        (inner,) = typing.get_args(tp)
        return [convert(item, inner, f"{key}[{i}]") for i, item in enumerate(value)]
    # bool is an int subclass in Python; a YAML `true` for a count is a mistake, not 1.
    if tp is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"'{key}' must be an integer, got {value!r} ({type(value).__name__})")
    if tp is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"'{key}' must be a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):  # .inf slips past every bound, and an infinite wait overflows
            raise ConfigError(f"'{key}' must be a finite number, got {value}")
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"'{key}' must be true or false, got {value!r} ({type(value).__name__})")
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"'{key}' must be a string, got {value!r} ({type(value).__name__})")
    return value


def _fits(value: Any, tp: Any) -> bool:
    """Whether `value` is of `tp`, one type of a union: a Literal's own values (`float | Literal["auto"]`),
    a whole number for a float."""
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(tp) or tp)


def build(cls: type, data: Any, prefix: str) -> Any:
    where = f"'{prefix}'" if prefix else "the job file"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [file_key(f) for f in dataclasses.fields(cls)]
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
        key = file_key(f)
        full = f"{prefix}.{key}" if prefix else key
        if key in data:
            values[f.name] = convert(data[key], hints[f.name], full)
        elif f.default is REQUIRED and f.default_factory is REQUIRED:
            raise ConfigError(f"missing required key '{full}'")
    return cls(**values)
