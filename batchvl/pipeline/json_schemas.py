"""JSON schemas as prompt constraints: what is refused before any work, what is only warned about, and the
validation of finished outputs in bounded time.

xgrammar enforces a schema while the output is generated; jsonschema validates the finished output (it also
checks what a grammar cannot express, such as `minimum` or `format`). Both meet the user's regular
expressions (`pattern`, `patternProperties`). jsonschema matches them with Python's backtracking `re`, where
a pattern such as `^(a{1,2}){1,40}b` takes exponential time on a long enough output and hangs the job; here
they are matched with RE2, in time linear in the text. RE2 has no lookaround and no backreferences, and
xgrammar cannot enforce those either (it ignores a lookahead in a schema with a warning), so a schema that
uses them is refused before any work instead of being half enforced.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

MAX_SCHEMA_DEPTH = 32  # subschemas nested in subschemas; real schemas stay far below, validators recurse
# Keywords whose value is one subschema, a list of subschemas, or a mapping of names to subschemas.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if")
_ONE += ("then", "else", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaRefused(ValueError):
    """The schema cannot be used as a constraint; the message says where and why."""


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, dict, int]]:
    """Every subschema object of `schema` as (JSON pointer, subschema, nesting depth), the root first."""
    stack = [(path, schema, 0)]
    while stack:
        where, node, depth = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema
        yield where, node, depth
        for keyword in _ONE:
            if isinstance(node.get(keyword), dict | bool):
                stack.append((f"{where}/{keyword}", node[keyword], depth + 1))
        for keyword in _LIST:
            if isinstance(node.get(keyword), list):
                stack.extend(
                    (f"{where}/{keyword}/{i}", item, depth + 1) for i, item in enumerate(node[keyword])
                )
        for keyword in _MAP:
            if isinstance(node.get(keyword), dict):
                stack.extend(
                    (f"{where}/{keyword}/{name}", item, depth + 1) for name, item in node[keyword].items()
                )


def check_schema(schema: dict) -> list[str]:
    """Raise `SchemaRefused` for a schema batchvl cannot enforce or check in bounded time, or one no output
    can satisfy; return warnings for keywords that are checked after generation but not enforced."""
    warnings = []
    for where, node, depth in subschemas(schema):
        at = where or "the top level"
        if depth > MAX_SCHEMA_DEPTH:  # the first such subschema: its path alone would be 33 levels long
            raise SchemaRefused(f"it nests subschemas over {MAX_SCHEMA_DEPTH} deep; flatten it")
        for pattern in _patterns_of(node):
            bounded_regex(pattern, f"at {at}")
        if "patternProperties" in node and "unevaluatedProperties" in node:
            raise SchemaRefused(
                f"unevaluatedProperties beside patternProperties (at {at}) cannot be checked in bounded "
                "time; use additionalProperties"
            )
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            warnings.append(
                f"at {at}, minLength/maxLength beside a pattern are not enforced while generating (outputs "
                "that break them become invalid_output rows); put the length in the pattern, as in "
                "^[a-z]{1,8}$"
            )
    reason = never_valid(schema)
    if reason is not None:
        raise SchemaRefused(f"no output can satisfy it: {reason}")
    return warnings


def _patterns_of(node: dict) -> list[str]:
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns.extend(node["patternProperties"])
    return patterns


@functools.lru_cache(maxsize=1024)
def bounded_regex(pattern: str, where: str = ""):
    """The pattern compiled by RE2 (matching takes time linear in the text); `SchemaRefused` for syntax RE2
    lacks (lookaround, backreferences), which xgrammar cannot enforce either."""
    import re2

    options = re2.Options()
    options.log_errors = False  # the reason goes into our one-line message, not to stderr
    try:
        return re2.compile(pattern, options=options)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        named = f"the pattern {pattern!r}{' ' + where if where else ''}"
        if not _python_compiles(pattern):  # a plain mistake, not syntax RE2 lacks: say so
            raise SchemaRefused(f"{named} is not a valid regular expression ({reason}); correct it") from None
        raise SchemaRefused(
            f"{named} cannot be used ({reason}): lookaround "
            "and backreferences can neither be enforced while generating nor checked in bounded time"
        ) from None


def _python_compiles(pattern: str) -> bool:
    """Whether Python's `re` takes the pattern: RE2 refuses its lookaround and backreferences, which `re`
    takes, and a mistake (an unclosed group), which neither takes."""
    import re

    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def never_valid(schema: Any, where: str = "") -> str | None:
    """Why no value can satisfy `schema` (for the plain cases: a false schema, `not: {}`, an empty enum,
    `allOf` of types that share no value, a required property that can never be valid), else None."""
    at = where or "the top level"
    if schema is False:
        return f"{at} is false"
    if not isinstance(schema, dict):
        return None
    if schema.get("not") in ({}, True):
        return f"{at} is 'not' of a schema every value satisfies"
    if schema.get("enum") == []:
        return f"{at} has an empty enum"
    members = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
    for i, member in enumerate(members):
        if (reason := never_valid(member, f"{where}/allOf/{i}")) is not None:
            return reason
    types = [_types(s) for s in [schema, *members] if isinstance(s, dict) and _types(s) is not None]
    if types and not functools.reduce(_common_types, types):
        return f"{at} asks for types that share no value ({' and '.join('/'.join(sorted(t)) for t in types)})"
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for name in schema.get("required", []) if isinstance(schema.get("required"), list) else []:
        if name in properties and (reason := never_valid(properties[name], f"{where}/properties/{name}")):
            return reason
    return None


def _types(schema: dict) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    return set(declared) if isinstance(declared, list) else None


def _common_types(a: set[str], b: set[str]) -> set[str]:
    common = a & b
    if ("integer" in a and "number" in b) or ("number" in a and "integer" in b):
        common.add("integer")  # every integer is a number
    return common


@functools.lru_cache(maxsize=64)
def bounded_validator(canonical_schema: str):
    """A jsonschema validator of the schema (given as JSON text, built once per schema) that matches
    `pattern` and `patternProperties` with RE2. Raises SchemaRefused for an invalid JSON schema."""
    import jsonschema

    schema = json.loads(canonical_schema)
    base = jsonschema.validators.validator_for(schema)
    try:
        base.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaRefused(f"not a valid JSON schema: {exc.message}") from None
    additional = base.VALIDATORS.get("additionalProperties")

    def pattern(validator, regex, instance, schema):
        if validator.is_type(instance, "string") and not bounded_regex(regex).search(instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {regex!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if validator.is_type(instance, "object"):
            for regex, subschema in patterns.items():
                for key, value in instance.items():
                    if bounded_regex(regex).search(key):
                        yield from validator.descend(value, subschema, path=key, schema_path=regex)

    def additional_properties(validator, value, instance, schema):
        # jsonschema's own keyword matches patternProperties with `re`: give it only the keys RE2 leaves
        patterns = schema.get("patternProperties") or {}
        if patterns and validator.is_type(instance, "object"):
            instance = {
                key: item
                for key, item in instance.items()
                if not any(bounded_regex(regex).search(key) for regex in patterns)
            }
            schema = {key: item for key, item in schema.items() if key != "patternProperties"}
        yield from additional(validator, value, instance, schema)

    keywords = {"pattern": pattern, "patternProperties": pattern_properties}
    if additional is not None:
        keywords["additionalProperties"] = additional_properties
    return jsonschema.validators.extend(base, keywords)(schema)
