"""A prepared sample's engine requests, and the rows its outcomes become.

Each (sample, prompt) is one request, tagged with where its row belongs; each request's result (or the
error that kept it from the engine, or the `when` that skipped it) is one `ResultRow`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import xxhash

from batchvl.config import JobConfig, PromptConfig, SamplingConfig
from batchvl.engine.request import EngineRequest, EngineResult
from batchvl.engine.sampling.params import SamplingParams
from batchvl.errors import RowStatus, SampleError
from batchvl.inputs.types import ChatRequest
from batchvl.outputs.writers import ResultRow
from batchvl.pipeline.constraints import output_error, prompt_constraint, scored_choices
from batchvl.preprocess.sample import PreparedSample, Prompt


@dataclass(frozen=True)
class RowTag:
    """Where an engine result belongs: shard, sample and prompt."""

    shard: str
    sample_index: int
    prompt_index: int


def request_seed(base_seed: int, shard: str, key: str, prompt_name: str) -> int:
    """A per-request seed, so a sampled output does not depend on batch composition or run order."""
    return (
        xxhash.xxh64_intdigest(f"{base_seed}\0{shard}\0{key}\0{prompt_name}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
    )


def max_new_tokens_of(sampling: SamplingConfig, fields: dict) -> int:
    """A prompt's token limit on the sample: its `max_new_tokens`, or the sample's own from its
    `max_new_tokens_field`."""
    name = sampling.max_new_tokens_field
    if name is None:
        return sampling.max_new_tokens
    value = fields.get(name)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return sampling.max_new_tokens  # a null cell (NaN where pandas wrote it), a sample without the field
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # pandas writes an integer column with missing values as floats
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SampleError(
            "missing_field",
            f"sampling.max_new_tokens_field '{name}' must hold a positive integer, got {value!r}",
        )
    return value


def sampling_params(
    s: SamplingConfig,
    shard: str,
    key: str,
    prompt_name: str,
    max_new_tokens: int,
    chat: ChatRequest | None = None,
) -> SamplingParams:
    """A prompt's sampling (`JobConfig.prompt_samplings`), with what an openai_batch request sets for
    itself in its place."""
    own = chat or ChatRequest(())
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=_first(own.temperature, s.temperature),
        top_p=_first(own.top_p, s.top_p),
        top_k=s.top_k,
        seed=request_seed(_first(own.seed, s.seed), shard, key, prompt_name),
        stop=_first(own.stop, tuple(s.stop)),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
    )


def _first(value, default):
    return default if value is None else value


def prompt_of(cfg: JobConfig, sample: PreparedSample, prompt_index: int) -> PromptConfig:
    """The prompt a request of the sample answers: the job's, with an openai_batch request's own
    response format as its schema."""
    prompt = cfg.prompts[prompt_index]
    if sample.chat is None or sample.chat.json_schema is None:
        return prompt
    return dataclasses.replace(prompt, json_schema=sample.chat.json_schema)


def prompt_request(
    cfg: JobConfig,
    sample: PreparedSample,
    prompt_index: int,
    rendered: Prompt,
    max_new_tokens: int,
    priority: int,
) -> EngineRequest:
    """The engine request of one (sample, prompt), from the prompt as rendered for the backend: token ids
    or chat messages."""
    prompt = prompt_of(cfg, sample, prompt_index)
    is_messages = isinstance(rendered, tuple)
    return EngineRequest(
        prompt_token_ids=[] if is_messages else rendered,
        messages=rendered if is_messages else None,
        images=sample.images,
        sampling=sampling_params(
            cfg.prompt_samplings[prompt_index],
            sample.shard,
            sample.key,
            prompt.name,
            max_new_tokens,
            sample.chat,
        ),
        tag=RowTag(sample.shard, sample.index, prompt_index),
        priority=priority,
        constraint=prompt_constraint(prompt),
        scored_choices=scored_choices(prompt),
    )


def _row(sample: PreparedSample, prompt_index: int, prompt_name: str, **values) -> ResultRow:
    return ResultRow(
        key=sample.key,
        sample_index=sample.index,
        prompt=prompt_name,
        prompt_index=prompt_index,
        num_images=sample.num_images,
        fields=sample.fields,
        **values,
    )


def error_row(sample: PreparedSample, prompt_index: int, prompt_name: str, error: SampleError) -> ResultRow:
    return _row_without_output(sample, prompt_index, prompt_name, "error", error)


def skipped_row(sample: PreparedSample, prompt_index: int, prompt_name: str, reason: str) -> ResultRow:
    """The row of a prompt whose `when` did not match (or that uses a skipped prompt's output); its
    `error_message` says which."""
    return _row_without_output(sample, prompt_index, prompt_name, "skipped", None, reason)


def _row_without_output(
    sample: PreparedSample,
    prompt_index: int,
    prompt_name: str,
    status: RowStatus,
    error: SampleError | None,
    reason: str | None = None,
) -> ResultRow:
    return _row(
        sample,
        prompt_index,
        prompt_name,
        text=None,
        status=status,
        error_type=error.error_type if error else None,
        error_message=error.message if error else reason,
        num_prompt_tokens=0,
        num_output_tokens=0,
        finish_reason=None,
        latency_s=None,
    )


def result_row(sample: PreparedSample, prompt: PromptConfig, result: EngineResult) -> ResultRow:
    """The row of a finished request. An output that breaks its prompt's constraint (cut short, or not
    valid against its schema) is an error row that keeps the text it got."""
    tag: RowTag = result.tag
    error = result.error or _incomplete_error(result) or output_error(prompt, result.text)
    if error is not None and not result.num_output_tokens:  # it never ran
        row = error_row(sample, tag.prompt_index, prompt.name, error)
        row.num_prompt_tokens = result.num_prompt_tokens
        return row
    return _row(
        sample,
        tag.prompt_index,
        prompt.name,
        text=result.text,
        status="ok" if error is None else "error",
        error_type=error.error_type if error else None,
        error_message=error.message if error else None,
        num_prompt_tokens=result.num_prompt_tokens,
        num_output_tokens=result.num_output_tokens,
        finish_reason=result.finish_reason,
        latency_s=round(result.latency_s, 6),
        optional=_logprob_columns(result) | _choice_columns(prompt, result),
    )


def _incomplete_error(result: EngineResult) -> SampleError | None:
    """An output that ended before it was a whole match of its constraint keeps its text in an error row."""
    if result.is_complete:
        return None
    limit = "max_new_tokens" if result.finish_reason == "length" else "a stop string or stop token"
    return SampleError(
        "incomplete_output",
        f"the output ended ({limit}) before it matched its constraint; the partial text is kept; "
        "raise sampling.max_new_tokens (the job's or the prompt's, or the sample's token limit)",
    )


def _logprob_columns(result: EngineResult) -> dict:
    """The optional log-probability columns of a result that recorded them."""
    columns = {}
    if result.token_logprobs:
        columns["mean_logprob"] = sum(result.token_logprobs) / len(result.token_logprobs)
        columns["min_logprob"] = min(result.token_logprobs)
    if result.top_logprobs is not None:
        columns["top_logprobs"] = [
            [{"token": text, "token_id": token, "logprob": value} for text, token, value in position]
            for position in result.top_logprobs
        ]
    return columns


def _choice_columns(prompt: PromptConfig, result: EngineResult) -> dict:
    """`choice_probs` of a scored-choices result: each choice's probability among the choices (the
    softmax of their log-probabilities)."""
    if result.choice_logprobs is None:
        return {}
    top = max(result.choice_logprobs)
    weights = [math.exp(value - top) for value in result.choice_logprobs]
    total = sum(weights)
    return {"choice_probs": {c: w / total for c, w in zip(prompt.choices, weights, strict=True)}}
