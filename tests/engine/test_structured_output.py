"""When the engine's grammar matchers call an output complete, on the tiny model's tokenizer: a whole match
is complete whether or not an end-of-sequence token followed it (an output cut by its token limit just
after its last character), a proper prefix of one is not. The expected answers are written by hand. A
step's bitmask keeps exactly the tokens each row's grammar accepts, on the engine's device (the GPU check
runs this file with BATCHVL_TEST_DEVICE=cuda)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from batchvl.engine.sampling.structured_output import GrammarMatchers, OutputConstraint
from tests.conftest import TEST_DEVICE


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


class DeviceCopies(TorchFunctionMode):
    """The `Tensor.to` calls that name a device, with whether each was asked not to block."""

    def __init__(self):
        super().__init__()
        self.non_blocking: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            device, _, non_blocking, *_ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None:
                self.non_blocking.append(non_blocking)
        return func(*args, **kwargs)


def allowed_tokens(matcher, vocab_size: int) -> set[int]:
    """The tokens a matcher would accept next, each tried on a fork of it (not through a bitmask)."""
    allowed = set()
    for token in range(vocab_size):
        if matcher.fork().accept_token(token):
            allowed.add(token)
    return allowed


def test_a_steps_rows_keep_exactly_what_their_grammars_allow_and_the_host_never_waits(grammars, loaded_fp32):
    """Each constrained row is masked to its grammar's next tokens, an unconstrained row is left as it is,
    and a later step's mask does not change an earlier step's. Towards a GPU (BATCHVL_TEST_DEVICE=cuda)
    the bitmask is sent without blocking, so an overlapped step fills it while the forward runs: there the
    masking runs under torch's sync debug mode set to raise."""
    device = torch.device(TEST_DEVICE)
    vocab = loaded_fp32.adapter.geometry.vocab_size
    steps = [
        [
            fed(grammars, loaded_fp32, OutputConstraint("regex", "[ab]{3}"), "a"),
            None,
            fed(grammars, loaded_fp32, OutputConstraint.choices(["photo", "drawing"]), "draw"),
            fed(grammars, loaded_fp32, OutputConstraint.json_schema({"type": "integer"}), ""),
        ],
        [None, fed(grammars, loaded_fp32, OutputConstraint("regex", "[0-9]+"), "")],
    ]
    logits = [torch.zeros(len(matchers), vocab, device=device) for matchers in steps]
    copies = DeviceCopies()
    sync_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
    with copies:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            for step_logits, matchers in zip(logits, steps, strict=True):
                grammars.mask(step_logits, matchers)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(sync_mode)
    # each step's bitmask (and on a GPU its rows' indices) sent without blocking
    assert len(copies.non_blocking) >= 2 and all(copies.non_blocking), copies.non_blocking
    for step_logits, matchers in zip(logits, steps, strict=True):
        for row, matcher in zip(step_logits.cpu(), matchers, strict=True):
            kept = set(torch.isfinite(row).nonzero().flatten().tolist())
            assert kept == (set(range(vocab)) if matcher is None else allowed_tokens(matcher, vocab))
