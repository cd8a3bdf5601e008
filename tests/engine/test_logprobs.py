"""`sampling.logprobs` and `top_logprobs` equal what transformers reports for the same generation:
`compute_transition_scores(..., normalize_logits=True)` over `generate`'s scores for each chosen token,
and the log-softmax of those scores for the most likely tokens (fp32, the tiny model; greedy, seeded
sampling with top-k, drawn in `generate` by the engine's rule from the same seed (`seeded_draws.py`), and a
constrained prompt whose scores are masked; each with serial steps and with overlapped ones, which compute
them on the device and read them a step later)."""

import contextlib
import json

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
from tests.engine.reference import EngineProbe, launches_fed_picks_in_flight
from tests.engine.seeded_draws import generate_draws_by_seed

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}
TOP = 5
TOLERANCE = 1e-4  # fp32: the engine and generate sum in different orders
CASES = {
    "greedy": (dict(temperature=0.0), False),
    "sampled-top-k": (dict(temperature=1.3, top_k=20, seed=7), False),
    "greedy-constrained": (dict(temperature=0.0), True),
}
# (case, engine.overlap): greedy requests keep their log-probabilities in overlapped steps too
RUNS = [(case, False) for case in CASES] + [(case, True) for case in CASES]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(tiny_model_dir, loaded_fp32):
    image = random_image(72, 96, seed=3)
    renderer = PromptRenderer(loaded_fp32.processor)
    prepared = prepare_image(
        image, QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    )
    rendered = renderer.render("Describe this image.", 1)
    inputs = reference_processor(tiny_model_dir)(text=[rendered], images=[image], return_tensors="pt")
    return renderer.token_ids(rendered, [prepared]), [prepared], inputs


def transformers_logprobs(model, loaded, inputs, sampling: dict, constrained: bool, max_new_tokens: int):
    options = {"do_sample": False}
    draws = contextlib.nullcontext()
    if sampling["temperature"] > 0:
        draws = generate_draws_by_seed(sampling["seed"])  # drawn by the engine's rule, from the same seed
        options = dict(
            do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"], top_p=1.0
        )
    if constrained:
        info = xgr.TokenizerInfo.from_huggingface(
            loaded.processor.tokenizer,
            vocab_size=model.config.text_config.vocab_size,
            stop_token_ids=loaded.eos_token_ids(),
        )
        grammar = xgr.GrammarCompiler(info).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        options["logits_processor"] = [LogitsProcessor(grammar)]
    with draws:
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            **options,
        )
    chosen = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    top = [torch.topk(torch.log_softmax(scores[0].float(), -1), TOP) for scores in out.scores]
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, chosen.tolist(), [(t.indices.tolist(), t.values.tolist()) for t in top]


@pytest.mark.parametrize("case, overlap", RUNS, ids=[f"{c}-overlap" if o else c for c, o in RUNS])
def test_logprobs_equal_transformers_transition_scores(loaded_fp32, reference, prompt, case, overlap):
    sampling, constrained = CASES[case]
    ids, media, inputs = prompt
    max_new_tokens = 12
    tokens, chosen, top = transformers_logprobs(
        reference, loaded_fp32, inputs, sampling, constrained, max_new_tokens
    )
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(overlap=overlap),
        loaded_fp32.eos_token_ids(),
    )
    fed_picks_in_flight = launches_fed_picks_in_flight(engine)
    params = SamplingParams(max_new_tokens, logprobs=True, top_logprobs=TOP, **sampling)
    constraint = OutputConstraint.json_schema(SCHEMA) if constrained else None
    engine.add_request(EngineRequest(ids, media, params, "t", constraint=constraint))
    result = EngineProbe(engine).run()["t"].result
    assert result.output_token_ids == tokens
    assert result.token_logprobs == pytest.approx(chosen, abs=TOLERANCE)
    assert len(result.top_logprobs) == len(tokens)
    for position, (want_ids, want_values) in zip(result.top_logprobs, top, strict=True):
        # tokens the grammar masks tie at -inf, in whatever order the device's top-k leaves them: the
        # finite ones in order, then as many masked ones
        finite = sum(value > float("-inf") for value in want_values)
        assert [token for _, token, _ in position][:finite] == want_ids[:finite]
        assert [value for _, _, value in position] == pytest.approx(want_values, abs=TOLERANCE)
        decoded = [loaded_fp32.processor.tokenizer.decode([token]) for _, token, _ in position]
        assert [text for text, _, _ in position] == decoded
    if constrained:  # the masked distribution: only tokens the grammar allows have finite log-probabilities
        assert all(value > float("-inf") for value in result.token_logprobs)
    # overlapped: every step after the prompt's is launched before the picks of the one before are read
    assert fed_picks_in_flight == [False] + [overlap] * (len(fed_picks_in_flight) - 1)
