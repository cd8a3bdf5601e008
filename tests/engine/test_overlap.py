"""Overlapped steps (`engine.overlap`): the engine launches step n+1 before it reads step n's picks, and
still gives transformers `generate`'s tokens and logits (fp32) and the serial engine's results, for mixed
token budgets, end-of-sequence tokens, stop strings, requests joining between steps, preemption and prefix
caching, with half of the requests keeping their tokens' log-probabilities; sampled requests, and a job
that mixes sampled, constrained, logprob and scored-choice requests, answer as the serial engine does
(their parity with transformers is in `test_constrained_parity.py`, `test_logprobs.py` and
`test_choice_scoring.py`). The probe checks the bookkeeping after every step and that each request is
answered exactly once."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig
from batchvl.engine import model_runner, overlap
from batchvl.engine.encoder_cache import cache as encoder_cache_module
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
    assert_matches_reference,
    generate_reference,
    inputs_for,
    make_case,
)

MAX_NEW_TOKENS = 10
IMAGE_SIZES = [(100, 150), (60, 60), (200, 90)]
PROMPTS = ["Describe this image.", "What is in the picture? Answer in one short sentence, please."]
# Each case's token budget, by its index: mixed lengths, down to a single token
BUDGETS = [1, 3, 10, 7, 2, 10]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(tiny_model_dir, loaded_fp32, reference):
    """A case per image x prompt, with generate's tokens and logits."""
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    out = []
    for i, (h, w) in enumerate(IMAGE_SIZES):
        image = random_image(h, w, i)
        prepared = prepare_image(image, spec)
        for j, prompt in enumerate(PROMPTS):
            rendered = renderer.render(prompt, 1)
            ids = renderer.token_ids(rendered, [prepared])
            inputs = processor(text=[rendered], images=[image], return_tensors="pt")
            out.append(make_case(reference, (i, j), ids, [prepared], inputs, MAX_NEW_TOKENS))
    return out


def cut(case, max_new_tokens: int, eos: set[int]):
    """The case as `generate` answers it with this token budget and these end-of-sequence tokens: greedy,
    so its first tokens, up to and with the first end-of-sequence token."""
    tokens = case.expected.tokens[:max_new_tokens]
    ends = [i for i, token in enumerate(tokens) if token in eos]
    n = ends[0] + 1 if ends else len(tokens)
    expected = Expected(tokens[:n], case.expected.logits[:n])
    return replace(case, expected=expected, positions=case.positions[:, : len(case.ids) + n - 1])


class Run:
    """An engine with a probe; `launched` tells per forward whether it was fed picks still on the device,
    `order` the forwards' launches and the reads of in-flight picks (and the device waits, where a test
    records them), in the order they happened."""

    def __init__(self, loaded, config: EngineConfig, extra_eos: tuple[int, ...] = ()):
        self.engine = Engine(
            loaded.adapter, loaded.processor.tokenizer, config, loaded.eos_token_ids() + list(extra_eos)
        )
        self.probe = EngineProbe(self.engine)
        self.launched: list[bool] = []
        self.order: list[str] = []
        runner, execute = self.engine.runner, self.engine.runner.execute

        def watched_execute(*args, **options):
            self.launched.append(options.get("picks_in_flight") is not None)
            self.order.append("launch")
            return execute(*args, **options)

        runner.execute = watched_execute

    def __call__(self, arrivals: dict[int, list[EngineRequest]]) -> dict:
        read = overlap.InFlightPicks.read

        def watched_read(picks):
            self.order.append("read")
            return read(picks)

        overlap.InFlightPicks.read = watched_read
        try:
            return self.probe.run(arrivals)
        finally:
            overlap.InFlightPicks.read = read


def results_of(observed: dict) -> dict:
    """What a row is made of, per tag, its log-probabilities apart (see `assert_same_results`)."""
    return {
        tag: (
            o.result.output_token_ids,
            o.result.text,
            o.result.finish_reason,
            o.result.num_prompt_tokens,
            o.result.is_complete,
            o.result.error,
            [[(text, token) for text, token, _ in position] for position in o.result.top_logprobs or []],
        )
        for tag, o in observed.items()
    }


def logprob_values_of(observed: dict) -> dict:
    """Per tag, every log-probability a row holds: its tokens', the most likely tokens', its choices'."""
    return {
        tag: [
            *(o.result.token_logprobs or []),
            *(value for position in o.result.top_logprobs or [] for _, _, value in position),
            *(o.result.choice_logprobs or []),
        ]
        for tag, o in observed.items()
    }


def assert_same_results(observed: dict, serial: dict) -> None:
    """The same rows, their log-probabilities within fp32 noise: a request that ends is run one step
    further when overlapped, so the others' steps hold other rows, and the forward's sums round apart in
    the last bits."""
    assert results_of(observed) == results_of(serial)
    values, serial_values = logprob_values_of(observed), logprob_values_of(serial)
    for tag, got in values.items():
        assert got == pytest.approx(serial_values[tag], abs=1e-5), tag


def greedy_arrivals(cases, join_at: list[int]) -> dict[int, list[EngineRequest]]:
    """The cases as requests with their budgets; case i joins before step join_at[i]. Every other one keeps
    its tokens' log-probabilities (and two of the most likely tokens'), which overlapped steps read a step
    late, so that requests keeping them end while others go on."""
    arrivals: dict[int, list[EngineRequest]] = {}
    for i, (case, budget, step) in enumerate(zip(cases, BUDGETS, join_at, strict=True)):
        sampling = SamplingParams(budget, logprobs=True, top_logprobs=2) if i % 2 else SamplingParams(budget)
        arrivals.setdefault(step, []).append(EngineRequest(case.ids, case.media, sampling, case.tag))
    return arrivals


# serial steps, named so: `auto` would overlap them on a GPU (the overlapped runs replace it)
LIMITS = {
    "one-step": EngineConfig(max_num_batched_tokens=4096, max_num_seqs=64, overlap=False),
    "budget37-seqs3": EngineConfig(max_num_batched_tokens=37, max_num_seqs=3, overlap=False),
    "preempt": EngineConfig(max_num_batched_tokens=64, max_num_seqs=64, kv_cache_mb=0.08, overlap=False),
    "prefix-cache": EngineConfig(max_num_batched_tokens=37, block_size=4, overlap=False),
}


@pytest.mark.parametrize("limits_name", list(LIMITS))
def test_overlapped_steps_equal_generate_and_the_serial_engine(loaded_fp32, cases, limits_name):
    """Mixed budgets (one token too), an end-of-sequence token that cuts some outputs, and two requests
    joining between steps."""
    limits = LIMITS[limits_name]
    eos_token = cases[2].expected.tokens[4]  # ends case 2 early, and whichever others write it
    eos = set(loaded_fp32.eos_token_ids()) | {eos_token}
    expected = [cut(case, BUDGETS[i], eos) for i, case in enumerate(cases)]
    assert any(len(case.expected.tokens) < BUDGETS[i] for i, case in enumerate(expected))  # EOS hit
    join_at = [0, 0, 0, 0, 2, 5]

    serial = Run(loaded_fp32, limits, (eos_token,))
    serial_observed = serial(greedy_arrivals(cases, join_at))
    overlapped = Run(loaded_fp32, replace(limits, overlap=True), (eos_token,))
    observed = overlapped(greedy_arrivals(cases, join_at))

    assert set(observed) == {case.tag for case in cases}
    for case in expected:
        assert_matches_reference(observed[case.tag], case)
    assert_same_results(observed, serial_observed)
    assert overlapped.engine.stats.output_tokens == serial.engine.stats.output_tokens  # no pick past an end
    assert not any(serial.launched) and "read" not in serial.order
    assert sum(overlapped.launched) >= len(overlapped.launched) // 2  # most steps fed the picks in flight
    if limits_name == "preempt":
        assert overlapped.engine.stats.preemptions > 0, overlapped.engine.stats.preemptions
    if limits_name == "prefix-cache":
        assert overlapped.engine.stats.prefix_cache_hit_tokens > 0


def sampled_arrivals(cases, join_at: list[int]) -> dict[int, list[EngineRequest]]:
    """`greedy_arrivals`' requests, each sampling with its own seed, with top-k, top-p, both or neither."""
    warpers = [dict(), dict(top_k=20), dict(top_p=0.8), dict(top_k=50, top_p=0.9)]
    arrivals = greedy_arrivals(cases, join_at)
    for i, request in enumerate(request for step in sorted(arrivals) for request in arrivals[step]):
        sampling = replace(request.sampling, temperature=0.7 + 0.2 * i, seed=100 + i, **warpers[i % 4])
        request.sampling = sampling
    return arrivals


@pytest.mark.parametrize("limits_name", list(LIMITS))
def test_overlapped_sampled_steps_equal_the_serial_engine(loaded_fp32, cases, limits_name):
    """Sampled requests overlap as greedy ones do, and draw what serial steps draw: the same draws of each
    request's generator, whatever the steps in flight, with preemption and prefix caching, and with an
    end-of-sequence token sampled by one of them (its pick a step past its end is dropped)."""
    limits = LIMITS[limits_name]
    join_at = [0, 0, 0, 0, 2, 5]
    first = Run(loaded_fp32, limits)(sampled_arrivals(cases, join_at))
    eos_token = first[cases[2].tag].result.output_token_ids[4]  # ends case 2 at its fifth token (or before)

    serial = Run(loaded_fp32, limits, (eos_token,))
    serial_observed = serial(sampled_arrivals(cases, join_at))
    overlapped = Run(loaded_fp32, replace(limits, overlap=True), (eos_token,))
    observed = overlapped(sampled_arrivals(cases, join_at))

    assert_same_results(observed, serial_observed)
    assert len(observed[cases[2].tag].result.output_token_ids) <= 5 < BUDGETS[2]
    assert any(observed[case.tag].result.output_token_ids != case.expected.tokens[:3] for case in cases)
    assert overlapped.engine.stats.output_tokens == serial.engine.stats.output_tokens  # no pick past an end
    assert not any(serial.launched)
    assert sum(overlapped.launched) >= len(overlapped.launched) // 2  # most steps fed the picks in flight
    if limits_name == "preempt":
        assert overlapped.engine.stats.preemptions > 0, overlapped.engine.stats.preemptions


def test_each_step_is_launched_before_the_previous_picks_are_read(loaded_fp32, cases, monkeypatch):
    """The order of work: launch step 1, then every step launches before it reads the step before's picks,
    and no step waits for the device's whole queue; the last step's picks (each of them past its request's
    end) are never read."""
    run = Run(loaded_fp32, replace(LIMITS["one-step"], overlap=True))
    monkeypatch.setattr(model_runner, "synchronize", lambda device: run.order.append("wait"))
    arrivals = {0: [EngineRequest(c.ids, c.media, SamplingParams(MAX_NEW_TOKENS), c.tag) for c in cases]}
    observed = run(arrivals)
    launches = run.order.count("launch")
    assert run.order == ["launch"] + ["launch", "read"] * (launches - 1)
    assert run.launched == [False] + [True] * (launches - 1)
    for case in cases:
        assert_matches_reference(observed[case.tag], case)


def test_a_step_encoding_images_waits_for_neither_the_tower_nor_the_step_in_flight(
    loaded_fp32, cases, monkeypatch
):
    """Requests joining while picks are in flight have their images encoded in an overlapped step: neither
    the vision call nor the forward waits for the device, and the answers are still generate's."""
    run = Run(loaded_fp32, replace(LIMITS["budget37-seqs3"], overlap=True))
    monkeypatch.setattr(model_runner, "synchronize", lambda device: run.order.append("wait"))
    monkeypatch.setattr(encoder_cache_module, "synchronize", lambda device: run.order.append("wait"))
    fetch = run.engine.encoder_cache.fetch
    monkeypatch.setattr(
        run.engine.encoder_cache,
        "fetch",
        lambda images, wait: run.order.append("encode") or fetch(images, wait),
    )
    observed = run(greedy_arrivals(cases, [0, 0, 1, 2, 3, 4]))
    encodes_in_flight = [
        i for i, event in enumerate(run.order) if event == "encode" and "launch" in run.order[:i]
    ]
    assert len(encodes_in_flight) >= 2 and "wait" not in run.order
    for case, budget in zip(cases, BUDGETS, strict=True):
        assert_matches_reference(observed[case.tag], cut(case, budget, set(loaded_fp32.eos_token_ids())))


def test_stop_strings_end_overlapped_requests_where_generate_stops(loaded_fp32, reference, cases):
    tokenizer = loaded_fp32.processor.tokenizer
    arrivals, wanted = {0: []}, {}
    for case in cases:
        text = tokenizer.decode(case.expected.tokens, skip_special_tokens=True)
        # two printable characters from the middle of the output (a random model also writes partial UTF-8)
        middle = [i for i in range(len(text) // 3, len(text) - 1) if text[i : i + 2].isascii()]
        stop = text[middle[0] : middle[0] + 2] if middle else ""
        if not stop.strip() or not stop.isprintable():
            continue
        inputs = inputs_for(reference, case.ids, case.media)
        wanted[case.tag] = generate_reference(
            reference, inputs, MAX_NEW_TOKENS, stop_strings=[stop], tokenizer=tokenizer
        ).tokens
        sampling = SamplingParams(MAX_NEW_TOKENS, stop=(stop,))
        arrivals[0].append(EngineRequest(case.ids, case.media, sampling, case.tag))
    assert len(wanted) >= 3
    limits = EngineConfig(max_num_batched_tokens=37)
    observed = Run(loaded_fp32, replace(limits, overlap=True))(arrivals)
    assert {tag: o.result.output_token_ids for tag, o in observed.items()} == wanted
    assert all(o.result.finish_reason == "stop" for o in observed.values())
    assert_same_results(observed, Run(loaded_fp32, limits)(arrivals))


def test_blocks_of_generated_tokens_are_cached_under_the_tokens_picked(loaded_fp32, cases):
    """A follow-up prompt made of a finished request's prompt and output reuses the KV of both: the blocks
    an overlapped step fills are published once the picks in them are read. The overlapped engine ran the
    first request one step further, so it has that token's KV too."""
    case, block = cases[1], 4
    follow_up = case.ids + case.expected.tokens + case.ids[-5:]
    arrivals = {
        0: [EngineRequest(case.ids, case.media, SamplingParams(MAX_NEW_TOKENS), "first")],
        MAX_NEW_TOKENS + 3: [EngineRequest(follow_up, case.media, SamplingParams(3), "follow-up")],
    }
    limits = EngineConfig(max_num_batched_tokens=4096, block_size=block)
    serial, overlapped = Run(loaded_fp32, limits), Run(loaded_fp32, replace(limits, overlap=True))
    assert_same_results(overlapped(arrivals), serial(arrivals))
    computed = len(follow_up) - len(case.ids[-5:]) - 1  # every token but the last output's KV, serially
    assert serial.engine.stats.prefix_cache_hit_tokens == computed // block * block
    assert overlapped.engine.stats.prefix_cache_hit_tokens == (computed + 1) // block * block


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_a_mixed_job_answers_as_the_serial_engine(loaded_fp32, cases):
    """Greedy requests, then a sampled, a constrained, a logprob and a scored-choice one joining them: every
    step with a request running since the step before is fed that step's picks in flight."""
    greedy = [EngineRequest(c.ids, c.media, SamplingParams(MAX_NEW_TOKENS), ("greedy", c.tag)) for c in cases]
    ids, media = cases[0].ids, cases[0].media
    others = [
        EngineRequest(ids, media, SamplingParams(6, temperature=1.2, seed=7), "sampled"),
        EngineRequest(ids, media, SamplingParams(8), "json", constraint=OutputConstraint.json_schema(SCHEMA)),
        EngineRequest(ids, media, SamplingParams(4, logprobs=True, top_logprobs=2), "logprobs"),
        EngineRequest(ids, media, SamplingParams(4), "scored", scored_choices=("yes", "no")),
    ]
    arrivals = {0: greedy[:3], 3: others, 4: greedy[3:5], 20: greedy[5:]}
    limits = EngineConfig(max_num_batched_tokens=4096, max_num_seqs=64)
    serial = Run(loaded_fp32, limits)(arrivals)
    run = Run(loaded_fp32, replace(limits, overlap=True))
    observed = run(arrivals)
    assert_same_results(observed, serial)
    for i, case in enumerate(cases):
        assert observed[("greedy", case.tag)].result.output_token_ids == case.expected.tokens, i
    assert run.launched[1:7] == [True] * 6 and run.launched[-1] is True


def test_placeholders_take_the_pick_of_their_row():
    picks = torch.tensor([11, 22, 33])
    token_ids = torch.tensor([5, overlap.placeholder(2), 0, overlap.placeholder(0), 7])
    assert overlap.with_picks(token_ids, picks).tolist() == [5, 33, 0, 11, 7]
