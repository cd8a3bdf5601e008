"""An HTTP 200 answer of the server that is not what batchvl can use (a field of another type, text that is
not Unicode, an end other than stop or length, no content, another model, more tokens than asked for) is
that request's server_error row naming what was wrong, and the job goes on; content given as parts is
its text parts."""

from __future__ import annotations

import httpx
import pytest

from batchvl.server.client import described
from tests.fake_openai_server import FakeOpenAIServer
from tests.server_jobs import PROMPTS, all_requests, at, rows_by_request, run, write_job

ODD = "Describe s0-1."  # the request whose answer is changed


@pytest.fixture
def fake(tiny_model_dir):
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        yield server


def message(answer: dict) -> dict:
    return answer["choices"][0]["message"]


def set_content(value):
    return lambda answer: message(answer).update(content=value)


def set_usage(**counts):
    return lambda answer: answer["usage"].update(counts)


def set_finish(reason):
    return lambda answer: answer["choices"][0].update(finish_reason=reason)


def reasoned(answer: dict) -> None:
    message(answer).update(content=None, reasoning_content="Let me think. The image shows a cat.")


def first_logprob(value):
    return lambda answer: answer["choices"][0]["logprobs"]["content"][0].update(logprob=value)


CASES = {
    "no_choices": (lambda answer: answer.update(choices=[]), "choices: [] should be non-empty"),
    "content_int": (set_content(42), "choices/0/message/content: 42 is not of type"),
    "usage_str": (set_usage(prompt_tokens="five"), "usage/prompt_tokens: 'five' is not of type 'integer'"),
    "surrogate": (
        set_content("a cat \ud83d"),
        "its text is not valid Unicode (a lone surrogate at character 6)",
    ),
    "abort": (set_finish("abort"), "finish_reason 'abort', not 'stop' or 'length': its text is partial"),
    "no_finish": (set_finish(None), "finish_reason None, not 'stop' or 'length'"),
    "reasoning": (reasoned, "its content is null and its reasoning_content holds 36 characters"),
    "null": (set_content(None), "its content is null"),
    "other_model": (lambda a: a.update(model="other"), "it names the model 'other', not"),
    "over_max_tokens": (
        set_usage(completion_tokens=7),
        "(7 tokens, 20 characters) is longer than max_tokens=6",
    ),
    "logprob_str": (first_logprob("-0.5"), "logprobs/content/0/logprob: '-0.5' is not of type 'number'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_answer_batchvl_cannot_use_is_that_requests_server_error_row_naming_why(
    tmp_path, tiny_model_dir, fake, case
):
    change, why = CASES[case]
    fake.edit = lambda answer, body: (
        change(answer) if ODD in body["messages"][0]["content"][1]["text"] else None
    )
    sampling = {"logprobs": True, "top_logprobs": 1}
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2], sampling=sampling))

    rows = rows_by_request(tmp_path, 1)
    odd = rows.pop(("s0-1", "caption"))
    assert odd["status"] == "error" and odd["error_type"] == "server_error"
    assert odd["error_message"].startswith("the server's answer cannot be used: ")
    assert why in odd["error_message"]
    assert len(fake.completions(ODD)) == 1  # not retried: the server answered
    assert set(rows) == all_requests([2]) - {("s0-1", "caption")}
    assert all(row["status"] == "ok" for row in rows.values())


def test_content_given_as_parts_is_its_text_parts(tmp_path, tiny_model_dir, fake):
    parts = [
        {"type": "text", "text": "a cat"},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": " on a mat"},
    ]
    fake.edit = lambda answer, body: set_content(parts)(answer)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1]))

    rows = rows_by_request(tmp_path, 1)
    assert {key: row["text"] for key, row in rows.items()} == {
        ("s0-0", "caption"): "a cat on a mat",
        ("s0-0", "short"): "a cat on a mat",
    }


def test_a_failure_without_a_message_is_named_by_its_type_alone():
    assert described(httpx.ReadError("")) == "ReadError"  # not "ReadError: "
    assert described(httpx.ConnectError("[Errno 111] Connection refused")) == (
        "ConnectError: [Errno 111] Connection refused"
    )


def test_a_constrained_answer_cut_by_the_token_limit_is_an_incomplete_output_row_keeping_its_text(
    tmp_path, tiny_model_dir, fake
):
    # Every answer ends at the token limit: a regex prompt's is not a whole match of its pattern, a caption's
    # is just a short caption.
    prompts = [{"name": "digits", "text": "Digits {key}", "regex": "[0-9]{3}"}, PROMPTS[0]]
    fake.reply = lambda body: "12" if "structured_outputs" in body else "a cat on"
    fake.edit = lambda answer, body: set_finish("length")(answer)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1], prompts=prompts))

    rows = rows_by_request(tmp_path, 1)
    cut = rows["s0-0", "digits"]
    assert cut["status"] == "error" and cut["error_type"] == "incomplete_output"
    assert cut["error_message"].startswith(
        "the output ended (max_new_tokens) before it matched its constraint"
    )
    assert cut["text"] == "12" and cut["finish_reason"] == "length"
    caption = rows["s0-0", "caption"]
    assert caption["status"] == "ok" and caption["finish_reason"] == "length"
    assert caption["text"] == "a cat on"
