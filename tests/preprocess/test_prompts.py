"""Prompt templates: fields of the sample fill `{name}`; other braces are text."""

import pytest

from batchvl.errors import SampleError
from batchvl.preprocess.prompts import fill_template


def test_fields_fill_named_slots():
    assert fill_template("Q: {question} ({key})", {"question": "why?", "key": 7}) == "Q: why? (7)"


def test_other_braces_are_left_alone_and_doubled_braces_are_literal():
    text = 'Answer as JSON like {"label": 1}. Use {{question}} literally, not {question}.'
    assert (
        fill_template(text, {"question": "q"})
        == 'Answer as JSON like {"label": 1}. Use {question} literally, not q.'
    )


@pytest.mark.parametrize("fields", [{}, {"question": None}])
def test_missing_or_null_field_is_a_sample_error_naming_it(fields):
    with pytest.raises(SampleError) as info:
        fill_template("{question}", {**fields, "caption": "c"})
    assert info.value.error_type == "missing_field"
    assert "'question'" in info.value.message and "caption" in info.value.message
