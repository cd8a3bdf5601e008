"""The job file: YAML -> typed, validated, frozen dataclasses.

Every key is declared once (`schema.py`) with its type, default, help text and bounds; the key table in
docs/configuration.md is generated from these declarations (`reference.py`) and a test checks it is
current. A `JobConfig` checks itself when it is built, so a config made in Python is held to the rules a job
file is; mistakes are one-line `ConfigError`s that name the dotted key. `loading.py` reads job files and
`--set` overrides; `fingerprint.py` says which keys define the output.
"""

from batchvl.config.fingerprint import (
    as_recorded_by,
    changed_keys,
    config_fingerprint,
    config_to_dict,
    definition_fingerprint,
    describe_change,
    output_defining_config,
    output_definition,
    split_definition,
)
from batchvl.config.loading import apply_overrides, job_config_from_dict, load_job_config, resolve_paths
from batchvl.config.reference import describe_keys, keys_markdown_table
from batchvl.config.schema import (
    CHAT_PROMPT,
    DownloadConfig,
    EngineConfig,
    InputConfig,
    JobConfig,
    ModelConfig,
    OutputConfig,
    PreprocessConfig,
    PromptConfig,
    SamplingConfig,
    ServerConfig,
    WhenConfig,
    check_model_keys,
    is_remote,
)

__all__ = [
    "CHAT_PROMPT",
    "DownloadConfig",
    "EngineConfig",
    "InputConfig",
    "JobConfig",
    "ModelConfig",
    "OutputConfig",
    "PreprocessConfig",
    "PromptConfig",
    "SamplingConfig",
    "ServerConfig",
    "WhenConfig",
    "apply_overrides",
    "as_recorded_by",
    "changed_keys",
    "check_model_keys",
    "config_fingerprint",
    "config_to_dict",
    "definition_fingerprint",
    "describe_change",
    "describe_keys",
    "is_remote",
    "job_config_from_dict",
    "keys_markdown_table",
    "load_job_config",
    "output_defining_config",
    "output_definition",
    "resolve_paths",
    "split_definition",
]
