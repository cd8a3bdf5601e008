"""What a prompt's output must be: its `json_schema`, `regex` or `choices`, as the engine's constraint
(or, for choices, the strings it scores), checked when the job is planned and verified again on every
finished output.

The engine generates under the constraint (`engine/sampling/structured_output.py`), so an output that ends
normally matches it. The check here is the promise on the row: an `ok` row of a JSON-schema prompt parses
and validates against the schema (with jsonschema, which also checks what a grammar cannot express, such as
`minimum` or `format`; its patterns matched by RE2, see `json_schemas.py`), an `ok` row of a regex prompt
matches the whole regex and one of a choices prompt is one of the choices, all as the text is written (after
a stop string cut it); otherwise the row is an `invalid_output` error with the text kept.
"""

from __future__ import annotations

import functools
import json
import logging

from batchvl.config import JobConfig, PromptConfig
from batchvl.engine.sampling.structured_output import OutputConstraint
from batchvl.errors import SampleError, UserError
from batchvl.pipeline.json_schemas import bounded_regex, bounded_validator, check_schema

logger = logging.getLogger(__name__)


def prompt_constraint(prompt: PromptConfig) -> OutputConstraint | None:
    """The grammar the prompt's output is generated under (None: free text, or scored choices)."""
    if prompt.json_schema is not None:
        return OutputConstraint.json_schema(
            prompt.json_schema, any_whitespace=prompt.json_whitespace == "any"
        )
    if prompt.regex is not None:
        return OutputConstraint("regex", prompt.regex)
    if prompt.choices is not None and prompt.choice_mode == "generate":
        return OutputConstraint.choices(prompt.choices)
    return None


def scored_choices(prompt: PromptConfig) -> tuple[str, ...] | None:
    """The choices the engine scores for the prompt (None: it generates)."""
    if prompt.choices is not None and prompt.choice_mode == "score":
        return tuple(prompt.choices)
    return None


def check_constraints(cfg: JobConfig) -> None:
    """Every prompt's schema or regex converts to a grammar and can be checked in bounded time (a user
    error otherwise, before any work); what is checked after generation but not enforced is logged."""
    for prompt in cfg.prompts:
        constraint = prompt_constraint(prompt)
        if constraint is None:
            continue
        try:
            if prompt.json_schema is not None:
                for warning in check_schema(prompt.json_schema):
                    logger.warning("prompt '%s': json_schema %s", prompt.name, warning)
                bounded_validator(_canonical(prompt.json_schema))
            if prompt.regex is not None:
                bounded_regex(prompt.regex)
            constraint.grammar()
        except ValueError as exc:
            raise UserError(f"prompt '{prompt.name}': its {constraint.kind} cannot be used: {exc}") from None


def check_request_schema(schema: dict | None) -> None:
    """A request's own schema (an openai_batch response_format) is one a job's prompt could have; else the
    request is a `bad_request` error row (the job's prompts are checked before any work)."""
    if schema is not None:
        problem = _schema_problem(_canonical(schema))
        if problem is not None:
            raise SampleError("bad_request", f"response_format's schema cannot be used: {problem}")


@functools.lru_cache(maxsize=256)
def _schema_problem(canonical_schema: str) -> str | None:
    schema = json.loads(canonical_schema)
    try:
        check_schema(schema)
        bounded_validator(canonical_schema)
        OutputConstraint.json_schema(schema).grammar()
    except ValueError as exc:
        return str(exc)
    return None


def _canonical(schema: dict) -> str:
    """The schema's text for caches of what does not depend on its key order (checks, validators)."""
    return json.dumps(schema, sort_keys=True)


def output_error(prompt: PromptConfig, text: str) -> SampleError | None:
    """Why a finished output, as written to its row (a stop string cut), does not satisfy its prompt's
    constraint; None when it does (or has none)."""
    if prompt.choices is not None and text not in prompt.choices:
        return SampleError(
            "invalid_output", f"the output {text!r} is not one of the choices {prompt.choices}"
        )
    if prompt.regex is not None and not bounded_regex(prompt.regex).fullmatch(text):
        return SampleError("invalid_output", f"the output {text!r} does not match the regex {prompt.regex!r}")
    if prompt.json_schema is None:
        return None
    try:
        value = json.loads(text)
        problem = next(iter(bounded_validator(_canonical(prompt.json_schema)).iter_errors(value)), None)
    except RecursionError:
        return SampleError("invalid_output", "the output nests JSON too deeply to be checked")
    except ValueError as exc:
        return SampleError("invalid_output", f"the output is not valid JSON ({exc})")
    if problem is not None:
        where = "/".join(str(part) for part in problem.absolute_path) or "the top level"
        return SampleError(
            "invalid_output", f"the output does not follow the schema at {where}: {problem.message}"
        )
    return None
