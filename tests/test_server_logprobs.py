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
