"""The openai backend's set-up: the checks planning makes, and the backend a run drives (a server that
answers at `engine.server.url`, or one batchvl launches with `engine.server.launch`).

The model name sent in requests is `engine.server.model`, else `model.path`, which is how the fingerprint
names the served model: a url server must serve that name, so a job resumed against a server of another
model is refused like any changed config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from batchvl.config import JobConfig, is_remote
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.choice_scoring import ChoiceTokenizer
from batchvl.errors import UserError
from batchvl.inputs.download import DownloadCache
from batchvl.pipeline.constraints import prompt_constraint, scored_choices
from batchvl.pipeline.engine_setup import EngineSetup
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.rows import sampling_params
from batchvl.pipeline.tasks import TaskSlice
from batchvl.preprocess.chat_messages import ChatMessages
from batchvl.preprocess.media_urls import DataURLPreparer
from batchvl.preprocess.sample import SampleProcessor
from batchvl.server import payloads
from batchvl.server.client import check_accepted, served_models
from batchvl.server.process import ManagedServer
from batchvl.server.server_engine import ServerEngine
from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir
from batchvl.utils.secrets import url_without_userinfo

logger = logging.getLogger(__name__)

PROBE_TEXT = "Reply with one word."  # the text of the requests that check what a server takes


def served_model_name(cfg: JobConfig) -> str:
    return cfg.engine.server.model or cfg.model.path


def api_key(cfg: JobConfig) -> str | None:
    """The API key, read from the environment variable `engine.server.api_key_env` names (never stored)."""
    name = cfg.engine.server.api_key_env
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise UserError(f"engine.server.api_key_env names {name}, which is not set; export {name}=<key>")
    return key


def check_server(cfg: JobConfig) -> None:
    """Planning's checks: a url server answers and serves the model; a launch command can be run; scored
    choices have the tokenizer they need."""
    server = cfg.engine.server
    key = api_key(cfg)  # set for a launched server too, before it is started
    tokenizer = load_tokenizer(cfg)
    choice_tokens = choice_tokenizer(tokenizer)
    if any(scored_choices(p) is not None for p in cfg.prompts) and choice_tokens is None:
        raise UserError(
            f"scored choices on the openai backend need the model's tokenizer, with an end-of-sequence "
            f"token, and model.path {cfg.model.path} has none; point model.path at the served model's "
            "folder, or set choice_mode: generate"
        )
    if server.url is not None:
        check_served_model(server.url, served_model_name(cfg), key)
        check_prompts_accepted(cfg, server.url, key, tokenizer, choice_tokens)
    else:
        program = shlex.split(server.launch)[0] if server.launch.strip() else ""
        if shutil.which(program) is None:
            raise UserError(f"engine.server.launch: {program!r} is not a program here; give its full path")


def check_prompts_accepted(
    cfg: JobConfig, url: str, key: str | None, tokenizer, choice_tokens: ChoiceTokenizer | None
) -> None:
    """Each prompt's kind of request (its constraint, scored choices, log-probabilities), sent once as a
    one-token text request: a server that refuses one is a one-line error before any sample is read, not
    a run of error rows."""
    model = served_model_name(cfg)
    messages = ({"role": "user", "content": [{"type": "text", "text": PROBE_TEXT}]},)
    probes: dict[str, dict] = {}
    for prompt, own in zip(cfg.prompts, cfg.prompt_samplings, strict=True):
        sampling = dataclasses.replace(sampling_params(own, "", "", "", max_new_tokens=1), seed=0)
        request = EngineRequest([], [], sampling, constraint=prompt_constraint(prompt), messages=messages)
        choices = scored_choices(prompt)
        if choices is not None:
            answer = payloads.choice_answer(choices[0], choice_tokens)
            what = f"prompt '{prompt.name}''s scored choices (prompt_logprobs of a continued answer)"
            probes.setdefault("scored", (what, payloads.choice_body(model, request, answer)))
            continue
        body = payloads.chat_body(model, request, token_ids=tokenizer is not None)
        kind = json.dumps({k: v for k, v in body.items() if k not in ("messages", "seed")}, sort_keys=True)
        what = f"prompt '{prompt.name}''s request ({', '.join(sorted(set(body) - {'model', 'messages'}))})"
        probes.setdefault(kind, (what, body))
    for what, body in probes.values():
        check_accepted(url, key, body, what, cfg.engine.server.timeout_s)


def choice_tokenizer(tokenizer) -> ChoiceTokenizer | None:
    """What scores choices: the tokenizer, where it has an end-of-sequence token for a choice to end in."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return None
    return ChoiceTokenizer(tokenizer, [tokenizer.eos_token_id])


def check_served_model(url: str, model: str, key: str | None) -> None:
    served = served_models(url, key)
    if model not in served:
        raise UserError(
            f"the server at {url_without_userinfo(url)} serves {served}, not '{model}'; set "
            "engine.server.model to the name it serves (or model.path to the model it serves)"
        )


def load_tokenizer(cfg: JobConfig):
    """The model's tokenizer where model.path has one (choice scores and token texts need it), else None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        logger.info("no tokenizer at model.path %s: %s", cfg.model.path, exc)
        return None


def launch_command(cfg: JobConfig) -> list[str]:
    server = cfg.engine.server
    command = [*shlex.split(server.launch), *server.launch_args, "--model", cfg.model.path]
    command += ["--dtype", cfg.model.dtype]
    if server.model is not None:
        command += ["--served-model-name", server.model]
    return command


def server_log_path(out: OutputDir, task: TaskSlice | None) -> Path:
    """`_batchvl/logs/server-<task>.log` in a local output.dir, a local temporary folder for an object
    store's."""
    name = f"server-{task.index if task else 0}.log"
    if is_remote(out.url):
        return Path(tempfile.gettempdir()) / "batchvl-server-logs" / name
    return Path(out.url) / layout.LOGS / name


def server_engine_setup(
    cfg: JobConfig, out: OutputDir, task: TaskSlice | None, graph: PromptGraph
) -> EngineSetup:
    """What a run with the openai backend drives: prompts as chat messages, images as PNG data URLs."""
    media = DataURLPreparer(cfg.preprocess.max_image_pixels)
    cache = DownloadCache.of(cfg.input.download)
    messages = ChatMessages()
    samples = SampleProcessor(messages, media, cfg.prompts, graph.follow_ups, cache)
    start = functools.partial(server_engine, cfg, out, task)
    return EngineSetup(messages, samples, start, cfg.engine.server.max_concurrency)


def server_engine(cfg: JobConfig, out: OutputDir, task: TaskSlice | None) -> ServerEngine:
    """The engine of a run over a server: a launched server is started here (and stopped by `close`)."""
    server_cfg = cfg.engine.server
    model = served_model_name(cfg)
    key = api_key(cfg)
    managed = None
    if server_cfg.launch is not None:
        managed = ManagedServer(launch_command(cfg), server_log_path(out, task), server_cfg.startup_timeout_s)
        managed.start()
        url = managed.url
    else:
        url = server_cfg.url
    try:
        tokenizer = load_tokenizer(cfg)
        choice_tokens = choice_tokenizer(tokenizer)
        if managed is not None:  # planning could not ask a server that was not started yet
            check_prompts_accepted(cfg, url, key, tokenizer, choice_tokens)
        return ServerEngine(url, model, server_cfg, key, tokenizer, choice_tokens, managed)
    except BaseException:
        if managed is not None:
            managed.stop()
        raise
