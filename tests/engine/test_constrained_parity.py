"""Constrained decoding equals transformers `generate` with xgrammar's own transformers logits processor
(fp32, the tiny model): the same tokens and raw logits at every generated position, greedy and seeded
sampling, for a JSON schema, a regular expression and choices, several constrained prompts of one sample
sharing steps with an unconstrained one, and token budgets that cut some outputs short; both with serial
steps and with overlapped ones (`engine.overlap`), where each grammar takes its pick a step late. Sampled
tokens are compared with `generate` drawing by the engine's rule from the same seed (`seeded_draws.py`).

The reference compiles its grammars through xgrammar's own entry points (`compile_json_schema`,
`compile_regex`, an EBNF written here), not through batchvl's `OutputConstraint`. The engine's grammar time
and compile count stay at zero for free text and count each distinct constraint once."""

import json
import time

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForImageTextToText
from xgrammar.contrib.hf import LogitsProcessor

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.structured_output import OutputConstraint
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image, reference_processor
from tests.engine.reference import (
    EngineProbe,
    Expected,
    generate_reference,
    launches_fed_picks_in_flight,
    logits_tolerance,
)
from tests.engine.seeded_draws import generate_draws_by_seed

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "outdoor": {"type": "boolean"},
    },
    "required": ["color", "count", "outdoor"],
}
REGEX = "(19|20)[0-9]{2}"
CHOICES = ["photo", "drawing", "screenshot"]

# (name, batchvl's constraint, the reference grammar compiled by xgrammar directly, max_new_tokens)
KINDS = [
    ("json", OutputConstraint.json_schema(SCHEMA), lambda c: c.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")), 64),
    ("json-cut", OutputConstraint.json_schema(SCHEMA), lambda c: c.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")), 6),
    ("json-any-whitespace", OutputConstraint.json_schema(SCHEMA, any_whitespace=True),
     lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True), 12),
    ("regex", OutputConstraint("regex", REGEX), lambda c: c.compile_regex(REGEX), 8),
    ("regex-cut", OutputConstraint("regex", REGEX), lambda c: c.compile_regex(REGEX), 2),
    ("choices", OutputConstraint.choices(CHOICES),
     lambda c: c.compile_grammar('root ::= "photo" | "drawing" | "screenshot"'), 8),
    ("free", None, None, 10),
]  # fmt: skip
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.3, top_k=0, top_p=1.0, seed=1234),
}
# (sampling, engine.overlap): greedy constrained requests are overlapped too (see `overlap.py`)
RUNS = [("greedy", False), ("greedy", True), ("sampled", False), ("sampled", True)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def compiler(loaded_fp32, reference):
    vocab_size = reference.config.text_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(
        loaded_fp32.processor.tokenizer, vocab_size=vocab_size, stop_token_ids=loaded_fp32.eos_token_ids()
    )
    return xgr.GrammarCompiler(info)


@pytest.fixture(scope="module")
def samples(tiny_model_dir, loaded_fp32):
    """Two images, each with every kind's prompt: (image index, kind) -> (ids, media, model inputs)."""
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    out = {}
    for i, (height, width) in enumerate([(80, 120), (56, 56)]):
        image = random_image(height, width, seed=10 + i)
        prepared = prepare_image(image, spec)
        for name, *_ in KINDS:
            rendered = renderer.render(f"Answer as {name}.", 1)
            inputs = processor(text=[rendered], images=[image], return_tensors="pt")
            out[(i, name)] = (renderer.token_ids(rendered, [prepared]), [prepared], inputs)
    return out


def generate_constrained(model, inputs, compiled, max_new_tokens: int, sampling: dict) -> Expected:
    options = {"logits_processor": [LogitsProcessor(compiled)] if compiled is not None else []}
    if sampling["temperature"] == 0:
        return generate_reference(model, inputs, max_new_tokens, **options)
    options.update(do_sample=True, temperature=sampling["temperature"], top_k=0, top_p=1.0)
    with generate_draws_by_seed(sampling["seed"]):  # drawn by the engine's rule, from the same seed
        return generate_reference(model, inputs, max_new_tokens, **options)


@pytest.mark.parametrize("sampling_name, overlap", RUNS, ids=[f"{s}-overlap" if o else s for s, o in RUNS])
def test_constrained_outputs_equal_generate_with_xgrammar(
    loaded_fp32, reference, compiler, samples, sampling_name, overlap
):
    sampling = SAMPLINGS[sampling_name]
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(max_num_batched_tokens=37, max_num_seqs=16, overlap=overlap),
        loaded_fp32.eos_token_ids(),
    )
    probe = EngineProbe(engine)
    fed_picks_in_flight = launches_fed_picks_in_flight(engine)
    expected = {}
    started = time.perf_counter()
    for (i, name), (ids, media, inputs) in samples.items():
        _, constraint, reference_grammar, max_new_tokens = next(k for k in KINDS if k[0] == name)

        def reference_generate(model, inputs, grammar=reference_grammar, max_new_tokens=max_new_tokens):
            compiled = grammar(compiler) if grammar else None  # a processor of its own for each run
            return generate_constrained(model, inputs, compiled, max_new_tokens, sampling)

        want = reference_generate(reference, inputs)
        expected[(i, name)] = want, logits_tolerance(reference, inputs, want, reference_generate)
        params = SamplingParams(max_new_tokens, **sampling)
        engine.add_request(EngineRequest(ids, media, params, (i, name), constraint=constraint))
    observed = probe.run()
    assert engine.grammars.num_compiled == 4  # one per distinct constraint, shared by every request
    assert 0 < engine.stats.grammar_s < time.perf_counter() - started
    for tag, (want, tolerance) in expected.items():
        tokens, logits = want.tokens, want.logits
        got = observed[tag]
        assert got.result.output_token_ids == tokens, tag
        # xgrammar's processor masks generate's logits in place, so its "raw" logits are -inf where the
        # grammar forbids a token; the engine's recorded logits are from before its own mask.
        allowed = torch.isfinite(logits)
        torch.testing.assert_close(got.logits[allowed], logits[allowed], rtol=0, atol=tolerance, msg=str(tag))
        if tag[1].endswith("-cut"):
            assert not got.result.is_complete and got.result.error is None  # the row code makes it an error
            assert got.result.text  # the partial output is kept
        elif tokens[-1] in loaded_fp32.eos_token_ids():  # generate ended it: the grammar was complete
            assert got.result.is_complete and got.result.error is None, tag
    # overlapped: most steps are launched before the picks of the one before are read (not those after
    # steps of prompt chunks alone, which pick nothing)
    if overlap:
        assert sum(fed_picks_in_flight) >= len(fed_picks_in_flight) // 2, fed_picks_in_flight
    else:
        assert not any(fed_picks_in_flight)
    texts = {tag: observed[tag].result.text for tag in expected}
    for i in range(2):
        assert json.loads(texts[(i, "json")]).keys() == SCHEMA["properties"].keys()
        assert " " not in texts[(i, "json")]  # compact by default
        assert texts[(i, "regex")][:2] in ("19", "20") and len(texts[(i, "regex")]) == 4
        assert texts[(i, "choices")] in CHOICES


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_finished_grammar_ends_the_request_even_when_eos_is_ignored(loaded_fp32, samples, overlap):
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(overlap=overlap),
        loaded_fp32.eos_token_ids(),
    )
    ids, media, _ = samples[(0, "choices")]
    sampling = SamplingParams(30, ignore_eos=True)
    engine.add_request(EngineRequest(ids, media, sampling, "t", constraint=OutputConstraint.choices(CHOICES)))
    results = EngineProbe(engine).run()
    result = results["t"].result
    assert result.error is None and result.text in CHOICES
    assert result.output_token_ids[-1] in loaded_fp32.eos_token_ids()
    assert result.num_output_tokens < 30


def test_grammar_time_and_compiles_count_only_constrained_work(loaded_fp32, samples):
    engine = Engine(
        loaded_fp32.adapter, loaded_fp32.processor.tokenizer, EngineConfig(), loaded_fp32.eos_token_ids()
    )
    ids, media, _ = samples[(0, "free")]
    engine.add_request(EngineRequest(ids, media, SamplingParams(6), "free"))
    EngineProbe(engine).run()
    assert engine.stats.grammar_s == 0 and engine.grammars.num_compiled == 0  # free text costs nothing

    started = time.perf_counter()
    for tag in ("a", "b"):  # equal constraints, built apart: compiled once
        constraint = OutputConstraint("regex", REGEX)
        engine.add_request(EngineRequest(ids, media, SamplingParams(8), tag, constraint=constraint))
    engine.add_request(
        EngineRequest(ids, media, SamplingParams(8), "c", constraint=OutputConstraint.choices(CHOICES))
    )
    results = EngineProbe(engine).run()
    assert 0 < engine.stats.grammar_s < time.perf_counter() - started
    assert engine.grammars.num_compiled == 2
    assert all(results[tag].result.error is None for tag in "abc")
