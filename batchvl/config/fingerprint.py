"""What defines a job's output: the keys declared `defines_output` and the identity of the checkpoint at
`model.path` (`checkpoint.py`), their fingerprint (stored in each shard's marker, so a changed config or
checkpoint over committed shards is noticed), its split into what defines every row and what defines one
prompt's rows, and the keys that changed."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import xxhash

from batchvl.config.checkpoint import PART_NAMES, checkpoint_identity
from batchvl.config.schema import JobConfig, SamplingConfig

CHECKPOINT = "checkpoint"  # the key of the checkpoint's identity in the definition's `model` section


def config_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def output_defining_config(cfg: JobConfig) -> dict:
    """The part of the job config that a shard's rows depend on, as plain JSON values: the keys declared
    with `defines_output` (a whole section where the section itself is). Engine limits, worker counts and
    the input file list are left out: they change speed or which shards exist, not a shard's rows. The
    checkpoint's identity is in (`model.checkpoint`): the same `model.path` may hold other files."""
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
    if cfg.engine.backend == "openai":  # the served model's name (model.path when unset) defines it too
        out["engine"]["served_model"] = cfg.engine.server.model or cfg.model.path
    elif (identity := checkpoint_identity(cfg.model.path)) is not None:
        out["model"][CHECKPOINT] = identity
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


def output_definition(cfg: JobConfig) -> tuple[dict, str]:
    """The output-defining config (as stored in each shard's marker) and its fingerprint, the one place
    the fingerprint is computed: the plan of a run, `status` and the label export all take it from here."""
    defining = output_defining_config(cfg)
    return defining, definition_fingerprint(defining)


def definition_fingerprint(defining: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(defining, sort_keys=True).encode())


def as_recorded_by(defining: dict, recorded: dict) -> dict:
    """A run's output-defining config as a marker holding `recorded` would store it. Markers written
    before the checkpoint's identity was recorded hold none: against those the identity is left out, so
    their shards stay committed (their rows taken as the checkpoint's at `model.path` now, the only one
    known), and a run records it in them."""
    if CHECKPOINT in recorded.get("model", {}) or CHECKPOINT not in defining.get("model", {}):
        return defining
    return {**defining, "model": {k: v for k, v in defining["model"].items() if k != CHECKPOINT}}


def describe_change(key: str) -> str:
    """A changed key as a refusal names it: a part of the checkpoint, which no job-file key sets, in words."""
    part = key.removeprefix(f"model.{CHECKPOINT}.")
    return f"the {PART_NAMES[part]} at model.path ({key})" if part in PART_NAMES else key


def split_definition(defining: dict) -> tuple[dict, dict[str, dict]]:
    """An output-defining config (a run's, or the one a marker stored) as what defines every row (model,
    backend, input, preprocessing) and each prompt's own definition, by name, with the sampling its
    requests take (`prompt_definition`). A committed row stays valid while both of its parts are
    unchanged, and those of the prompts it uses (the prompt graph knows which). Markers written before rows
    were reused, or before prompts had their own sampling, hold the same config, so they split the same
    way."""
    every_row = {key: value for key, value in defining.items() if key not in ("prompts", "sampling")}
    sampling = defining["sampling"]
    return every_row, {prompt["name"]: prompt_definition(prompt, sampling) for prompt in defining["prompts"]}


def prompt_definition(prompt: dict, sampling: dict) -> dict:
    """A prompt's definition: its own keys, and as its `sampling` the job-wide section with the prompt's
    own keys in their place. So a job-wide change is a change of the prompts that do not set that key
    themselves, and moving a value from the section into a prompt (or back) changes nothing. A key added
    to the section since (`unset_leaves_fingerprint`) at its default is left out, as the fingerprint leaves
    it out, so a prompt that sets it to its default keeps its definition."""
    merged = {**sampling, **(prompt.get("sampling") or {})}
    if prompt.get("choices") is not None and prompt.get("choice_mode", "score") == "score":
        # Scored, not sampled: only what adds columns, or makes a sample's limit an error, reaches its rows
        merged = {key: value for key, value in merged.items() if key in SCORED_SAMPLING_KEYS}
    return {**prompt, "sampling": {key: value for key, value in merged.items() if not _unset_new(key, value)}}


SCORED_SAMPLING_KEYS = ("logprobs", "top_logprobs", "max_new_tokens_field")


def _unset_new(key: str, value: Any) -> bool:
    declared = {f.name: f for f in dataclasses.fields(SamplingConfig)}.get(key)
    return (
        declared is not None
        and bool(declared.metadata["unset_leaves_fingerprint"])
        and value == declared.default
    )


def config_fingerprint(cfg: JobConfig) -> str:
    """Hash of what changes outputs (model, prompts, sampling, preprocessing), not of engine limits."""
    return output_definition(cfg)[1]


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (a changed list is one key)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [k for key in keys for k in changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]
