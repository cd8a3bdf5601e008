"""Scored choices equal the same sums computed with transformers' model forward (fp32, the tiny model):
for each choice, the log-probabilities of its tokens and the end-of-sequence token given the prompt,
teacher-forced. Checked with chunked prefill cutting through the choices, with a KV cache small enough
to preempt, with overlapped steps (the scores read a step late), and next to a generating request that
must still equal `generate`. The winning choice is
neither the first nor the last, and on hand-made logits the first of equally probable choices wins."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.choice_scoring import ChoiceGroup
from batchvl.engine.sampling.logprobs import RowLogprobs
from batchvl.engine.sampling.params import SamplingParams
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image, reference_processor
from tests.engine.reference import EngineProbe, generate_reference, inputs_for, launches_fed_picks_in_flight

CHOICES = ("drawing", "photo", "a screenshot of a web page")
TOLERANCE = 1e-4  # fp32: the engine and the reference sum in different orders
# serial steps but the last, named so: `auto` would overlap them on a GPU
LIMITS = {
    "chunked": EngineConfig(max_num_batched_tokens=37, max_num_seqs=16, overlap=False),
    "preempting": EngineConfig(
        max_num_batched_tokens=24, max_num_seqs=16, kv_cache_mb=0.08, prefix_caching=False, overlap=False
    ),
    # the scores read a step after their step is launched (see `overlap.py`)
    "chunked-overlap": EngineConfig(max_num_batched_tokens=37, max_num_seqs=16, overlap=True),
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def samples(tiny_model_dir, loaded_fp32):
    """Two images with a question each: [(prompt ids, media, model inputs)]."""
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    out = []
    for i, (height, width) in enumerate([(80, 120), (56, 84)]):
        image = random_image(height, width, seed=20 + i)
        prepared = prepare_image(image, spec)
        rendered = renderer.render("Photo, drawing or screenshot?", 1)
        inputs = processor(text=[rendered], images=[image], return_tensors="pt")
        out.append((renderer.token_ids(rendered, [prepared]), [prepared], inputs))
    return out


def reference_logprobs(model, tokenizer, ids: list[int], media) -> list[tuple[list[float], torch.Tensor]]:
    """Per choice: the log-probabilities of its tokens and eos after the prompt, by one forward of the
    prompt and the choice together, and the 3 most likely tokens' (ids, log-probabilities) there."""
    out = []
    for choice in CHOICES:
        target = tokenizer(choice, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequence = ids + target
        with torch.no_grad():
            logits = model(**inputs_for(model, sequence, media)).logits[0].float()
        logprobs = torch.log_softmax(logits[len(ids) - 1 : len(sequence) - 1], dim=-1)
        out.append((logprobs[torch.arange(len(target)), target].tolist(), torch.topk(logprobs, 3)))
    return out


@pytest.mark.parametrize("limits_name", list(LIMITS))
def test_choice_scores_equal_model_forward(loaded_fp32, reference, samples, limits_name):
    tokenizer = loaded_fp32.processor.tokenizer
    assert len(tokenizer(CHOICES[2], add_special_tokens=False)["input_ids"]) > 3  # several scored tokens
    engine = Engine(loaded_fp32.adapter, tokenizer, LIMITS[limits_name], loaded_fp32.eos_token_ids())
    probe = EngineProbe(engine)
    fed_picks_in_flight = launches_fed_picks_in_flight(engine)
    preempted_scoring = []  # whether each preempted request was scoring a choice
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda r: (preempted_scoring.append(r.score_from is not None), preempt(r))
    greedy = SamplingParams(12, logprobs=True, top_logprobs=3)
    for i, (ids, media, _) in enumerate(samples):
        engine.add_request(EngineRequest(ids, media, greedy, ("choices", i), scored_choices=CHOICES))
        engine.add_request(EngineRequest(ids, media, SamplingParams(12), ("free", i)))
    observed = probe.run()

    for i, (ids, media, _) in enumerate(samples):
        result = observed[("choices", i)].result
        per_token = reference_logprobs(reference, tokenizer, ids, media)
        want = [sum(values) for values, _ in per_token]
        assert result.error is None
        torch.testing.assert_close(
            torch.tensor(result.choice_logprobs, dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=0,
            atol=TOLERANCE,
        )
        best = max(range(len(CHOICES)), key=want.__getitem__)
        assert best == 1  # neither the first nor the last: what the result holds must be the winner's
        assert result.text == CHOICES[best]
        winner_ids = tokenizer(CHOICES[best], add_special_tokens=False)["input_ids"]
        assert result.output_token_ids == winner_ids + [tokenizer.eos_token_id]
        values, top = per_token[best]
        assert result.token_logprobs == pytest.approx(values, abs=TOLERANCE)
        assert [
            [token for _, token, _ in position] for position in result.top_logprobs
        ] == top.indices.tolist()
        got_top = torch.tensor([[value for *_, value in position] for position in result.top_logprobs])
        torch.testing.assert_close(got_top, top.values, rtol=0, atol=TOLERANCE)
    # The free requests, stepped together with the scoring ones, still equal generate.
    for i, (_, _, inputs) in enumerate(samples):
        want = generate_reference(reference, inputs, 12).tokens
        assert observed[("free", i)].result.output_token_ids == want
    if engine.config.overlap:  # most steps launched before the step before was read
        assert sum(fed_picks_in_flight) >= len(fed_picks_in_flight) // 2, fed_picks_in_flight
    else:
        assert not any(fed_picks_in_flight)
    if limits_name == "preempting":
        assert any(preempted_scoring)  # a choice was scored again from its start
    else:  # the choices of a prompt share its cached prefix: computed once, not once per choice
        prompt_tokens = sum(len(ids) for ids, _, _ in samples)
        assert engine.stats.prefix_cache_hit_tokens >= (len(CHOICES) - 1) * (prompt_tokens - 2 * 16)


def test_a_job_of_scored_choices_alone_is_answered_in_full_with_overlapped_steps(loaded_fp32, samples):
    """The last step's scores are read after every request has ended: the engine is not done until then."""
    items = [
        EngineRequest(ids, media, SamplingParams(4, top_logprobs=2), ("choices", i), scored_choices=CHOICES)
        for i, (ids, media, _) in enumerate(samples)
    ]
    answers = {}
    for overlap in (False, True):
        config = EngineConfig(max_num_batched_tokens=37, overlap=overlap)
        engine = Engine(
            loaded_fp32.adapter, loaded_fp32.processor.tokenizer, config, loaded_fp32.eos_token_ids()
        )
        for item in items:
            engine.add_request(item)
        observed = EngineProbe(engine).run()
        answers[overlap] = {
            tag: (o.result.text, o.result.choice_logprobs, o.result.token_logprobs, o.result.top_logprobs)
            for tag, o in observed.items()
        }
    assert set(answers[True]) == {item.tag for item in items}
    assert answers[True] == answers[False]


def test_a_choice_that_cannot_fit_rejects_the_prompt(loaded_fp32, samples):
    ids, media, _ = samples[0]
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(kv_cache_mb=0.02),  # 2 blocks of 16 tokens: less than the prompt
        loaded_fp32.eos_token_ids(),
    )
    engine.add_request(EngineRequest(ids, media, SamplingParams(4), "t", scored_choices=CHOICES))
    (result,) = engine.step()
    assert result.error.error_type == "kv_cache_too_small" and engine.num_unfinished == 0


# Hand-made logits over a vocabulary of 6 (token 5 ends a choice), for the choice the scores pick.
EOS = 5
EVEN = torch.tensor([2.0, 2.0, 3.0, 0.0, -1.0, 0.0])  # tokens 0 and 1 exactly as likely; 2 the most likely
LOPSIDED = torch.tensor([0.0, 0.0, 0.0, 3.0, 0.0, 1.0])  # 3 the most likely
END = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 3.0])  # the end-of-sequence token the most likely


@pytest.mark.parametrize(
    ("choices", "best"),
    [  # choice -> (its first token, the logits row before it); then END predicts EOS after every choice
        ({"low": (0, LOPSIDED), "first": (1, EVEN), "second": (0, EVEN)}, ("first", "second")),
        ({"x": (0, EVEN), "y": (1, EVEN)}, ("x", "y")),
        ({"low": (0, LOPSIDED), "mid": (1, EVEN), "high": (3, LOPSIDED)}, ("high",)),
    ],
)
def test_the_most_probable_choice_wins_and_the_first_of_equal_ones(choices, best):
    """`best`: the choices of the highest score, by hand. The first of them wins, and what the result
    holds (text, tokens, log-probabilities, the most likely tokens) is the winner's."""
    names = tuple(choices)
    item = EngineRequest(list(range(9)), [], SamplingParams(top_logprobs=1), "t", scored_choices=names)
    group = ChoiceGroup(item, [[token, EOS] for token, _ in choices.values()])
    for index, (token, row) in enumerate(choices.values()):
        rows = RowLogprobs(torch.stack([row, END]), torch.tensor([token, EOS]), top=1).read()
        group.record(index, 0, rows)
    end = torch.log_softmax(END, -1)
    want = [float(torch.log_softmax(row, -1)[token]) + float(end[EOS]) for token, row in choices.values()]
    scores = group.result().choice_logprobs
    assert scores == pytest.approx(want, abs=1e-12)
    assert tuple(name for name, score in zip(names, scores, strict=True) if score == max(scores)) == best
    winner = best[0]
    result = group.result()
    assert result.text == winner and result.output_token_ids == [choices[winner][0], EOS]
    record = group.best_token_logprobs()
    token, row = choices[winner]
    first = torch.log_softmax(row, -1)
    assert record.chosen == pytest.approx([float(first[token]), float(end[EOS])], abs=1e-12)
    assert record.top == [
        [(int(first.argmax()), pytest.approx(float(first.max())))],
        [(EOS, pytest.approx(float(end[EOS])))],
    ]
