"""Log-probabilities on the openai backend: what the request asks for, and the rows' columns from the
answer, with a token of probability 0 (vLLM's -9999.0) written -inf, as the built-in engine writes it."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from tests.fake_openai_server import FakeOpenAIServer
from tests.server_jobs import PROMPTS, at, rows_by_request, run, write_job


@pytest.fixture
def fake(tiny_model_dir):
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        yield server


def test_logprobs_are_asked_for_with_token_ids_and_become_the_rows_columns(tmp_path, tiny_model_dir, fake):
    def masked_candidate(answer: dict, body: dict) -> None:
        answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] = {
            "token": "token_id:7",
            "logprob": -9999.0,
        }

    fake.edit = masked_candidate
    sampling = {"logprobs": True, "top_logprobs": 2}
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1], prompts=PROMPTS[:1], sampling=sampling))

    (request,) = fake.completions()
    assert request.body["logprobs"] is True and request.body["top_logprobs"] == 2
    assert request.body["return_tokens_as_token_ids"] is True  # the rows' token_id needs them
    row = rows_by_request(tmp_path, 1)["s0-0", "caption"]
    assert row["text"] == "echo: Describe s0-0." and row["status"] == "ok"
    assert row["mean_logprob"] == -0.5 and row["min_logprob"] == -0.5
    decode = AutoTokenizer.from_pretrained(tiny_model_dir).decode
    # the fake's tokens are the words of its text, ids 1, 2, 3, each of log-probability -0.5
    expected = [[{"token": decode([i]), "token_id": i, "logprob": -0.5}] * 2 for i in (1, 2, 3)]
    expected[0][1] = {"token": decode([7]), "token_id": 7, "logprob": -math.inf}
    assert row["top_logprobs"] == expected


def test_scored_choices_are_scored_from_the_prompt_logprobs_of_each_continued_answer(
    tmp_path, tiny_model_dir, fake
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos_text = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
    last_token = {"cat": -0.25, "dog": -1.5}  # each choice's score: its other tokens have log-probability 0

    def prompt_logprobs(body: dict) -> list:
        choice = body["messages"][-1]["content"].removesuffix(eos_text)
        ids = [*tokenizer.encode(choice, add_special_tokens=False), tokenizer.eos_token_id]
        values = [0.0] * (len(ids) - 1) + [last_token[choice]]
        return [None] + [{str(i): {"logprob": v, "rank": 1}} for i, v in zip(ids, values, strict=True)]

    fake.prompt_logprobs = prompt_logprobs
    prompts = [{"name": "kind", "text": "Kind of {key}?", "choices": ["cat", "dog"]}]
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1], prompts=prompts))

    bodies = {r.body["messages"][-1]["content"]: r.body for r in fake.completions("Kind of s0-0?")}
    assert sorted(bodies) == ["cat" + eos_text, "dog" + eos_text]
    for body in bodies.values():
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 0
    row = rows_by_request(tmp_path, 1)["s0-0", "kind"]
    assert row["status"] == "ok" and row["text"] == "cat"
    cat = 1 / (1 + math.exp(-1.5 + 0.25))  # the softmax of the two scores
    assert dict(row["choice_probs"]) == pytest.approx({"cat": cat, "dog": 1 - cat})  # a map: (key, value)s
