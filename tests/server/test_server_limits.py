"""How large a server's answer may be (tests/fake_openai_server.py): an answer larger than its request can
be is refused, however it comes (whole or in chunks); its text is bounded by its max_tokens in bytes; and
log-probabilities asked for make room for their candidates."""

from __future__ import annotations

import json
import time

import pytest

from batchvl.config import ServerConfig
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.server.server_engine import ServerEngine
from tests.fake_openai_server import FakeOpenAIServer, echo, last_user_text


@pytest.fixture
def fake():
    with FakeOpenAIServer("served-model") as server:
        yield server


def request(tag, text: str, **sampling) -> EngineRequest:
    messages = ({"role": "user", "content": [{"type": "text", "text": text}]},)
    params = SamplingParams(**{"max_new_tokens": 4, **sampling})
    return EngineRequest([], [], params, tag=tag, messages=messages)


def results(fake: FakeOpenAIServer, *requests: EngineRequest) -> dict:
    """Each request's result, by tag, from a backend of the fake with no retries."""
    backend = ServerEngine(fake.url, fake.models[0], ServerConfig(url=fake.url, retries=0, timeout_s=10))
    try:
        for item in requests:
            backend.add_request(item)
        done, deadline = [], time.monotonic() + 20
        while len(done) < len(requests):
            assert time.monotonic() < deadline, "the requests did not finish"
            done += backend.step()
    finally:
        backend.close()
    return {result.tag: result for result in done}


def test_an_answer_streamed_over_its_size_limit_is_refused_not_cut(fake):
    # Chunks without a Content-Length: the size is known only as the answer is read. 4 tokens can take 64 KiB
    # and 4 x 512 bytes; this answer is 500 kB.
    fake.reply = lambda body: "word " * 100_000 if "huge" in last_user_text(body) else echo(body)
    fake.chunked.update({"huge", "small"})
    done = results(fake, request("huge", "huge"), request("small", "small"))

    refused = done["huge"].error
    assert refused is not None and refused.error_type == "server_error"
    assert refused.message.startswith("the server's answer is over 67584 bytes (at least ")
    assert refused.message.endswith("can give; refused")
    assert done["huge"].text is None  # nothing of it kept
    # a chunked answer within the limit is read whole
    assert done["small"].error is None and done["small"].text == "echo: small"


def test_an_answers_text_longer_in_bytes_than_its_max_tokens_can_be_is_a_server_error(fake):
    # 4 tokens decode to at most 4 x 256 bytes of text, whatever usage says: 513 "é" are 1026 bytes
    # (though 513 characters), 1024 "x" are 1024.
    texts = {"over": "é" * 513, "at": "x" * 1024}

    def edit(answer: dict, body: dict) -> None:
        answer["choices"][0]["message"]["content"] = texts[last_user_text(body)]
        answer["usage"]["completion_tokens"] = 4

    fake.edit = edit
    done = results(fake, request("over", "over"), request("at", "at"))

    error = done["over"].error
    assert error is not None and error.error_type == "server_error"
    assert error.message == (
        "the server's answer cannot be used: its text (4 tokens, 513 characters) is longer than "
        "max_tokens=4 can be"
    )
    assert done["at"].error is None and done["at"].text == "x" * 1024


def test_an_answer_with_log_probabilities_has_room_for_each_tokens_candidates(fake):
    # 100 tokens with 5 candidates each, every entry with its bytes (as vLLM writes them): more than 100
    # tokens of text alone may take (64 KiB + 100 x 512 bytes), within what the token and its 5 candidates
    # may (64 KiB + 100 x 7 x 512 bytes).
    fake.reply = lambda body: " ".join(f"w{i}" for i in range(100))
    sizes = []

    def with_bytes(answer: dict, body: dict) -> None:
        for position, entry in enumerate(answer["choices"][0]["logprobs"]["content"]):
            entry["bytes"] = [119] * 60
            entry["top_logprobs"] = [
                {"token": f"c{position}-{k}", "logprob": -1.0, "bytes": [99] * 60} for k in range(5)
            ]
        sizes.append(len(json.dumps(answer)))

    fake.edit = with_bytes
    done = results(fake, request("lp", "lp", max_new_tokens=100, logprobs=True, top_logprobs=5))

    (size,) = sizes
    assert 65536 + 100 * 512 < size < 65536 + 100 * 7 * 512
    result = done["lp"]
    assert result.error is None, result.error
    assert len(result.token_logprobs) == 100 and len(result.top_logprobs) == 100
    assert result.top_logprobs[99][4] == ("c99-4", None, -1.0)


def test_an_answer_declared_over_its_size_limit_is_refused_before_its_body_is_read(fake):
    # Its Content-Length says 500 kB, and the body comes a byte every 10 ms: reading it to the limit would
    # take minutes, past the request's timeout.
    fake.reply = lambda body: "word " * 100_000
    fake.trickle["huge"] = 0.01
    sizes = []
    fake.edit = lambda answer, body: sizes.append(len(json.dumps(answer)))
    started = time.monotonic()
    done = results(fake, request("huge", "huge"))

    assert time.monotonic() - started < 5
    (size,) = sizes
    error = done["huge"].error
    assert error is not None and error.error_type == "server_error"
    assert error.message.startswith(f"the server's answer is over 67584 bytes (at least {size}),")
