"""JSON schemas and regexes as constraints: refused before any work when they cannot be enforced, checked in
bounded time or satisfied at all; warned about when only checked after generation; and finished outputs
validated in time linear in the text, with the keywords that take patterns giving jsonschema's answers."""

import json
import logging
import re
import time

import pytest

from batchvl.config import PromptConfig, job_config_from_dict
from batchvl.errors import ConfigError, SampleError, UserError
from batchvl.pipeline.constraints import check_constraints, check_request_schema, output_error

BASE = {"model": {"path": "/m"}, "input": {"paths": ["/d"]}, "output": {"dir": "/o"}}


def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def check(**prompt) -> None:
    check_constraints(job_config_from_dict({**BASE, "prompts": [{"name": "p", "text": "t", **prompt}]}))


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        # xgrammar ignores a lookahead in a schema (with a warning) and Python's re backtracks on it
        (
            {"type": "string", "pattern": "^(a{1,2}){1,40}(?=b)"},
            "the pattern '^(a{1,2}){1,40}(?=b)' at the top ",
        ),
        (
            {"type": "object", "patternProperties": {"^(x)\\1$": {}}},
            "lookaround and backreferences can neither",
        ),
        (nested(200), "nests subschemas over 32 deep"),
        (nested(33), "nests subschemas over 32 deep"),
        (
            {"type": "string", "$defs": {"code": {"type": "string", "pattern": "a(?=b)"}}},
            "the pattern 'a(?=b)' at /$defs/code cannot be used",
        ),
        ({"not": {}}, "no output can satisfy it: the top level is 'not' of a schema every value satisfies"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "asks for types that share no value"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "/properties/a is false"),
        ({"enum": []}, "has an empty enum"),
        (
            {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False},
            "unevaluatedProperties beside patternProperties (at the top level) cannot be checked",
        ),
    ],
)
def test_schemas_that_cannot_be_enforced_checked_or_satisfied_are_refused_before_work(schema, fragment):
    with pytest.raises(UserError, match=re.escape("prompt 'p': its json_schema cannot be used: ")) as refused:
        check(json_schema=schema)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    # the same schema in an openai_batch request is that request's error row
    with pytest.raises(SampleError) as row:
        check_request_schema(schema)
    assert row.value.error_type == "bad_request" and fragment in row.value.message


@pytest.mark.parametrize(
    "schema",
    [
        nested(32),
        {"allOf": [{"type": "number"}, {"type": "integer", "minimum": 1}]},
        {"type": ["string", "null"], "allOf": [{"type": "null"}]},
        {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"},
    ],
)
def test_schemas_that_can_be_satisfied_are_accepted(schema):
    check(json_schema=schema)
    check_request_schema(schema)


def test_a_regex_with_lookaround_is_refused():
    with pytest.raises(UserError, match=re.escape("prompt 'p': its regex cannot be used")) as refused:
        check(regex="ab(?!c)")
    assert "lookaround and backreferences can neither" in str(refused.value)


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        (
            {"regex": "(ab"},
            "the pattern '(ab' is not a valid regular expression (missing ): (ab); correct it",
        ),
        (
            {"json_schema": {"type": "string", "pattern": "(["}},
            "the pattern '([' at the top level is not a valid regular expression (",
        ),
    ],
)
def test_a_pattern_with_a_mistake_is_named_a_mistake_not_lookaround(prompt, fragment):
    with pytest.raises(UserError) as refused:
        check(**prompt)
    assert fragment in str(refused.value) and "lookaround" not in str(refused.value)


def test_a_length_beside_a_pattern_is_warned_about_in_one_line(caplog):
    with caplog.at_level(logging.WARNING):
        check(
            json_schema={
                "type": "object",
                "properties": {"id": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}},
            }
        )
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(
        "prompt 'p': json_schema at /properties/id, minLength/maxLength beside a pattern"
    )
    assert "\n" not in warning


def test_when_in_must_list_an_output():
    prompts = [{"name": "a", "text": "t"}, {"name": "b", "text": "t", "when": {"prompt": "a", "in": []}}]
    with pytest.raises(ConfigError, match=re.escape("prompt 'b': 'when.in' must list at least one output")):
        job_config_from_dict({**BASE, "prompts": prompts})


def schema_prompt(schema: dict) -> PromptConfig:
    return PromptConfig(name="p", text="t", json_schema=schema)


def test_a_pattern_that_backtracks_exponentially_is_checked_in_linear_time():
    # Python's re takes seconds on 38 a's and doubles with each two more; RE2 answers at once
    prompt = schema_prompt({"type": "string", "pattern": "^(a{1,2}){1,40}b"})
    started = time.perf_counter()
    error = output_error(prompt, json.dumps("a" * 38))
    assert time.perf_counter() - started < 1.0
    assert error.error_type == "invalid_output"
    expected = f"'{'a' * 38}' does not match '^(a{{1,2}}){{1,40}}b'"
    assert error.message == f"the output does not follow the schema at the top level: {expected}"


def test_the_keywords_that_take_patterns_give_jsonschemas_answers():
    schema = {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"}},
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    }
    prompt = schema_prompt(schema)
    assert output_error(prompt, '{"id":"ab1","x_a":3,"x_b":4}') is None
    # a pattern is found anywhere in the string, as JSON Schema says, unless it anchors itself
    unanchored = schema_prompt(
        {"type": "object", "properties": {"c": {"type": "string", "pattern": "[0-9]{2}"}}}
    )
    assert output_error(unanchored, '{"c":"ab12cd"}') is None
    keys = schema_prompt({"type": "object", "patternProperties": {"_n": {"type": "integer"}}})
    assert "'3' is not of type 'integer'" in output_error(keys, '{"x_n_y":"3"}').message
    cases = {
        '{"id":"ab12"}': "at id: 'ab12' does not match '^[a-z]{2}[0-9]$'",
        '{"id":"ab1","x_a":"3"}': "at x_a: '3' is not of type 'integer'",
        '{"id":"ab1","y":1}': "at the top level: Additional properties are not allowed ('y' was unexpected)",
    }
    for text, fragment in cases.items():
        error = output_error(prompt, text)
        assert error is not None and error.error_type == "invalid_output", text
        assert fragment in error.message, error.message


def test_an_output_nested_too_deep_to_check_is_an_invalid_output_row():
    error = output_error(schema_prompt({"type": "array"}), "[" * 100_000 + "]" * 100_000)
    assert (error.error_type, error.message) == (
        "invalid_output",
        "the output nests JSON too deeply to be checked",
    )


def test_a_regex_prompt_is_checked_on_the_text_as_written():
    prompt = PromptConfig(name="p", text="t", regex="xyz")
    assert output_error(prompt, "xyz") is None
    error = output_error(prompt, "xy")  # a stop string "z" cut it
    assert (error.error_type, error.message) == (
        "invalid_output",
        "the output 'xy' does not match the regex 'xyz'",
    )
    for text in ("wxyz", "xyzz"):  # the whole output must match, not a part of it
        assert output_error(prompt, text).message == f"the output '{text}' does not match the regex 'xyz'"
