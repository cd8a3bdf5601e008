"""A step none of whose requests asks for a draw, kept log-probabilities, a grammar or a scored choice makes
none of the passes over its rows that look for them (`request_mix.py`), and the stop rules are asked only of
the requests they may end (`StopChecker.ended`): neither may change what a job gives."""

import random

import pytest

import batchvl.engine.engine as engine_module
from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest, Request
from batchvl.engine.request_mix import RequestMix
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.stopping import StopChecker
from batchvl.engine.sampling.structured_output import GrammarMatchers, OutputConstraint

EOS = [2, 3]
CONTEXT = 40  # the model's context length in the stop rules' cases


class LetterTokenizer:
    """Token t decodes to the letter chr(97 + t % 26): stop strings can end a request at any token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def random_request(rng: random.Random, request_id: int) -> Request:
    prompt = list(range(rng.choice([5, 20, 35, 38])))  # some near the context's end
    params = SamplingParams(
        max_new_tokens=rng.choice([1, 3, 8, 50]),
        stop=rng.choice([(), ("ab",), ("c", "zz")]),
        stop_token_ids=rng.choice([(), (7,), (2, 9)]),
        ignore_eos=rng.random() < 0.3,
    )
    request = Request(request_id, prompt, [], params)
    request.output_token_ids = [rng.randrange(12) for _ in range(rng.randrange(1, 9))]
    return request


def test_the_stop_rules_are_asked_of_every_request_they_end():
    """`ended` gives, in order, exactly the requests `finish_reason` ends, with its reasons: end-of-sequence
    and stop tokens (with and without `ignore_eos`), stop strings, `max_new_tokens` and the context's end."""
    stopping = StopChecker(LetterTokenizer(), EOS, CONTEXT)
    rng = random.Random(0)
    requests = [random_request(rng, i) for i in range(3000)]
    for request in requests:
        stopping.prepare(request)
    expected = [(r, stopping.finish_reason(r)) for r in requests if stopping.finish_reason(r) is not None]
    assert stopping.ended(requests) == expected
    reasons = {reason for _, reason in expected}
    assert reasons == {"stop", "length"} and 0 < len(expected) < len(requests)


def test_a_prepared_request_holds_the_tokens_that_end_it_and_its_output_limit():
    stopping = StopChecker(LetterTokenizer(), EOS, CONTEXT)
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(9,))
    kept_going = Request(
        0, list(range(30)), [], SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(9,))
    )
    short = Request(1, list(range(5)), [], params)
    for request in (kept_going, short):
        stopping.prepare(request)
    assert kept_going.stop_ids == {9} and kept_going.output_limit == CONTEXT - 30  # the context's end first
    assert short.stop_ids == {2, 3, 9} and short.output_limit == 20


def engine_of(loaded, max_num_seqs: int, overlap: bool) -> Engine:
    config = EngineConfig(max_num_seqs=max_num_seqs, overlap=overlap)
    return Engine(loaded.adapter, loaded.processor.tokenizer, config, loaded.eos_token_ids())


def plain_job(loaded, overlap: bool) -> dict:
    engine = engine_of(loaded, 4, overlap)
    for i in range(6):
        sampling = SamplingParams(max_new_tokens=3 + i, ignore_eos=True)
        engine.add_request(EngineRequest(list(range(100 + i, 110 + 2 * i)), [], sampling, tag=i))
    outputs = {}
    while engine.num_unfinished:
        for result in engine.step():
            outputs[result.tag] = result.output_token_ids
        engine.check_integrity()
    return outputs


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_a_greedy_job_makes_no_pass_for_draws_logprobs_grammars_or_choices(loaded_fp32, monkeypatch, overlap):
    expected = plain_job(loaded_fp32, overlap)

    def refused(*args, **kwargs):
        raise AssertionError("a pass over the rows for what no request asks")

    monkeypatch.setattr(engine_module, "step_picks", refused)
    monkeypatch.setattr(engine_module, "keeps_logprobs", refused)
    monkeypatch.setattr(engine_module, "kept_logprobs", refused)
    monkeypatch.setattr(GrammarMatchers, "mask", refused)
    scores = engine_module.StepScores
    monkeypatch.setattr(
        engine_module, "StepScores", lambda chunks, logits: refused() if chunks else scores(chunks, logits)
    )
    assert plain_job(loaded_fp32, overlap) == expected
    assert sorted(expected) == list(range(6)) and all(len(expected[i]) == 3 + i for i in range(6))


def mixed_items() -> list[EngineRequest]:
    """Greedy requests beside one of each kind the mix counts, ending at different steps."""
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = list(range(100, 112))
    return [
        EngineRequest(prompt, [], SamplingParams(max_new_tokens=3, temperature=0.8, seed=4), tag="sampled"),
        EngineRequest(
            prompt, [], SamplingParams(max_new_tokens=2, logprobs=True, top_logprobs=2), tag="logprobs"
        ),
        EngineRequest(
            prompt,
            [],
            SamplingParams(max_new_tokens=4),
            tag="grammar",
            constraint=OutputConstraint("regex", "[a-z]+"),
        ),
        EngineRequest(prompt, [], greedy, tag="choice", scored_choices=("yes", "no")),
        *(EngineRequest(prompt[: 8 + i], [], greedy, tag=f"greedy{i}") for i in range(3)),
    ]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_the_mix_counts_requests_in_and_out(loaded_fp32, overlap):
    """The running count equals a recount of the unfinished requests after every step (`check_integrity`),
    with requests of every kind finishing at different steps, and is empty when the job is done."""
    engine = engine_of(loaded_fp32, 3, overlap)
    for item in mixed_items():
        engine.add_request(item)
    assert engine._mix == RequestMix(sampled=1, logprobs=1, grammars=1, scored=2)
    results = {}
    while engine.num_unfinished:
        results.update((result.tag, result) for result in engine.step())
        engine.check_integrity()
    assert engine._mix == RequestMix()
    assert set(results) == {"sampled", "logprobs", "grammar", "choice", "greedy0", "greedy1", "greedy2"}
    assert len(results["logprobs"].token_logprobs) == 2 and results["choice"].text in ("yes", "no")
