"""When the engine's grammar matchers call an output complete, on the tiny model's tokenizer: a whole match
is complete whether or not an end-of-sequence token followed it (an output cut by its token limit just
after its last character), a proper prefix of one is not. The expected answers are written by hand."""

import pytest

from batchvl.engine.sampling.structured_output import GrammarMatchers, OutputConstraint


@pytest.fixture
def grammars(loaded_fp32):
    tokenizer = loaded_fp32.processor.tokenizer
    return GrammarMatchers(tokenizer, loaded_fp32.adapter.geometry.vocab_size, loaded_fp32.eos_token_ids())


def fed(grammars, loaded, constraint: OutputConstraint, text: str):
    """A request's matcher under `constraint` that has accepted `text`'s tokens."""
    matcher = grammars.matcher(constraint)
    tokens = loaded.processor.tokenizer.encode(text, add_special_tokens=False)
    for token in tokens:
        grammars.accept(matcher, token)
    return matcher


@pytest.mark.parametrize(
    ("constraint", "text", "complete"),
    [
        (OutputConstraint("regex", "[ab]{3}"), "", False),
        (OutputConstraint("regex", "[ab]{3}"), "ab", False),
        (OutputConstraint("regex", "[ab]{3}"), "aba", True),  # only end-of-sequence may follow
        (OutputConstraint("regex", "[ab]{2,3}"), "a", False),
        (OutputConstraint("regex", "[ab]{2,3}"), "ab", True),  # end-of-sequence or one more character
        (OutputConstraint("regex", "[ab]{2,3}"), "bab", True),
        (OutputConstraint.choices(["photo", "drawing"]), "photo", True),  # one token
        (OutputConstraint.choices(["photo", "drawing"]), "draw", False),  # 4 of "drawing"'s 6 tokens
        (OutputConstraint.choices(["photo", "drawing"]), "drawing", True),
        (OutputConstraint.json_schema({"type": "integer", "minimum": 0, "maximum": 99}), "4", True),
        (
            OutputConstraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}}),
            "{",
            False,
        ),
    ],
)
def test_an_output_without_end_of_sequence_is_complete_exactly_when_it_is_a_whole_match(
    grammars, loaded_fp32, constraint, text, complete
):
    matcher = fed(grammars, loaded_fp32, constraint, text)
    assert not grammars.is_terminated(matcher)  # no end-of-sequence yet: the case `is_complete` decides
    assert grammars.is_complete(matcher) is complete


@pytest.mark.parametrize("eos", [0, 1])  # either of the model's end-of-sequence tokens
def test_a_grammar_that_accepted_end_of_sequence_is_terminated_and_complete(grammars, loaded_fp32, eos):
    matcher = fed(grammars, loaded_fp32, OutputConstraint("regex", "[ab]{2,3}"), "ab")
    grammars.accept(matcher, loaded_fp32.eos_token_ids()[eos])
    assert grammars.is_terminated(matcher) and grammars.is_complete(matcher)


def test_a_request_without_a_constraint_is_always_complete(grammars):
    unconstrained = None  # the matcher of a request without a constraint
    assert grammars.is_complete(unconstrained) and not grammars.is_terminated(unconstrained)
