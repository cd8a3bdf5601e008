"""What a model folder must hold, checked before any work (by `validate` and by a run's plan, before its
output folder is made): a `config.json` that transformers reads, safetensors weights whose headers read,
and a tokenizer that turns text into tokens. Each gap is one line naming the folder and the file; without
these checks a broken `config.json` was a traceback, truncated weights failed minutes into a run, and a
folder without its tokenizer files loaded an empty tokenizer that made every row an error."""

from __future__ import annotations

import json
from pathlib import Path

from batchvl.errors import UserError, first_line
from batchvl.models.registry import model_family

TOKENIZER_PROBE = "A photo of a cat."


def read_model_config(path: str, trust_remote_code: bool = False):
    """The configuration of the checkpoint in `path`, as transformers reads its `config.json`."""
    from transformers import AutoConfig

    config_file = Path(path, "config.json")
    if not config_file.is_file():
        raise UserError(
            f"model.path '{path}' is not a model folder (no config.json); "
            "build one with `batchvl make-tiny-model DIR` or point model.path at a checkpoint folder"
        )
    try:
        data = json.loads(config_file.read_bytes())
    except OSError as exc:
        raise UserError(f"model.path '{path}': config.json cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # invalid JSON, or not UTF-8
        raise UserError(
            f"model.path '{path}': config.json is not valid JSON ({exc}); restore the checkpoint's file"
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            f"model.path '{path}': config.json holds a JSON {type(data).__name__}, not the model's "
            "configuration (an object with its model_type); restore the checkpoint's file"
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError, OSError, ImportError) as exc:
        raise UserError(
            f"model.path '{path}': transformers cannot read config.json: {first_line(exc)}"
        ) from None
    return config


def check_weights(path: str) -> None:
    """Every weight file the folder holds or its index names is there, and each is a safetensors file
    whose header reads and whose data its header covers (a truncated copy fails here, in milliseconds)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(
            f"model.path '{path}' has no .safetensors weights; convert the checkpoint to safetensors"
        )
    index = Path(path, "model.safetensors.index.json")
    if index.is_file():
        try:
            named = set(json.loads(index.read_bytes()).get("weight_map", {}).values())
        except (ValueError, AttributeError):
            named = set()  # transformers reports an unreadable index itself when it loads
        missing = sorted(name for name in named if not Path(path, name).is_file())
        if missing:
            raise UserError(
                f"model.path '{path}': {index.name} names weight files the folder lacks: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; copy the checkpoint again"
            )
    for file in files:
        try:
            with safe_open(str(file), "pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"model.path '{path}': {file.name} is not a whole safetensors file ({exc}); copy the "
                "checkpoint again"
            ) from None


def check_tokenizer(path: str, trust_remote_code: bool = False) -> None:
    """The folder's tokenizer loads and turns text into tokens. Without its files, transformers loads a
    tokenizer of the special tokens alone, which makes no token of text."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        ids = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    except (ValueError, KeyError, TypeError, OSError, ImportError) as exc:
        raise UserError(f"model.path '{path}': its tokenizer cannot be loaded: {first_line(exc)}") from None
    if not ids:
        raise UserError(
            f"model.path '{path}' has no usable tokenizer (the one loaded from it knows {len(tokenizer)} "
            "token(s) and makes none of text); copy the checkpoint's tokenizer files (tokenizer.json, "
            "tokenizer_config.json) into it"
        )


def check_model_folder(path: str, trust_remote_code: bool = False, loaded: bool = False):
    """Everything a run needs of the folder, checked; the checkpoint's configuration, of a supported
    family. The weights and the tokenizer are left unread where the run is given the model `loaded`
    (a benchmark's model built on its device has no weight files)."""
    config = read_model_config(path, trust_remote_code)
    model_family(config.model_type)  # an unsupported model is named before its files are looked at
    if not loaded:
        check_weights(path)
        check_tokenizer(path, trust_remote_code)
    return config


def vocab_size(config) -> int:
    """The number of token ids the model's head scores (its language model's, for a vision-language one)."""
    return getattr(config, "text_config", config).vocab_size
