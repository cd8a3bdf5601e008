"""Every key with its type, default and help text, for the generated table in docs/configuration.md."""

from __future__ import annotations

import dataclasses
import json
import typing

from batchvl.config.conversion import type_name
from batchvl.config.keys import REQUIRED, file_key
from batchvl.config.schema import JobConfig


def describe_keys() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) for every leaf key, in declaration order."""
    rows = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{file_key(f)}"
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
                rows.append((key, type_name(tp), default, f.metadata.get("help", "")))

    walk(JobConfig, "")
    return rows


def keys_markdown_table() -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, tp, default, help_text in describe_keys():
        escaped = tp.replace("|", "\\|")  # a pipe inside a Markdown table cell
        lines.append(f"| `{key}` | {escaped} | `{default}` | {help_text} |")
    return "\n".join(lines)
