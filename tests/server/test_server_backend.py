"""engine.backend: openai against a small OpenAI-compatible server in this process
(tests/fake_openai_server.py): what goes in a request, what each failure of the server becomes (a retried
request, an error row, a run that stops and resumes), the planning checks, the config rules, the API key
and the concurrency limit. The same behaviour against a real vLLM server is tested in tests/server/."""

from __future__ import annotations

import base64
import io
import json
import logging
import sys
import time

import numpy as np
import pytest
import yaml
from PIL import Image

from batchvl.config import (
    EngineConfig,
    InputConfig,
    JobConfig,
    ModelConfig,
    OutputConfig,
    ServerConfig,
    config_fingerprint,
    load_job_config,
)
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.errors import ConfigError, ServerGone, UserError
from batchvl.pipeline.server_setup import PROBE_TEXT
from batchvl.server.server_engine import ServerEngine
from tests.conftest import cli, random_image
from tests.fake_openai_server import Failure, FakeOpenAIServer, echo, last_user_text
from tests.server_jobs import (
    GONE_SIZES,
    PROMPTS,
    all_requests,
    at,
    closed_port_url,
    files_under,
    rows_by_request,
    run,
    write_job,
)


@pytest.fixture
def fake(tiny_model_dir):
    """A server serving the job's model under its default name, model.path."""
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        yield server


# What goes in a request


def decoded_data_url(url: str) -> np.ndarray:
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :]))).convert("RGB"))


def test_a_request_holds_the_image_as_a_png_data_url_the_prompt_and_the_sampling(
    tmp_path, tiny_model_dir, fake
):
    sampling = {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11}
    sampling.update(stop=["END"], ignore_eos=True)
    job = write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2], prompts=PROMPTS[:1], sampling=sampling)
    run(job)

    bodies = {r.body["messages"][0]["content"][1]["text"]: r.body for r in fake.completions()}
    assert sorted(bodies) == ["Describe s0-0.", "Describe s0-1."]
    for i in range(2):
        body = bodies[f"Describe s0-{i}."]
        assert body["model"] == str(tiny_model_dir)
        (message,) = body["messages"]
        assert message["role"] == "user"
        image_part, text_part = message["content"]
        assert image_part["type"] == "image_url"
        # the input image's own pixels, as write_image_shards made them
        expected = np.asarray(random_image(40 + 9 * i, 60, seed=i))
        np.testing.assert_array_equal(decoded_data_url(image_part["image_url"]["url"]), expected)
        assert text_part == {"type": "text", "text": f"Describe s0-{i}."}
        assert body["max_tokens"] == 7 and body["min_tokens"] == 7  # ignore_eos: no end before the limit
        assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["top_k"] == 5
        assert body["stop"] == ["END"]
        assert isinstance(body["seed"], int)
    # each request its own seed, derived from sampling.seed
    assert bodies["Describe s0-0."]["seed"] != bodies["Describe s0-1."]["seed"]
    rows = rows_by_request(tmp_path, 1)
    assert rows["s0-0", "caption"]["text"] == "echo: Describe s0-0."
    assert rows["s0-0", "caption"]["num_output_tokens"] == 3  # the server's usage counts
    assert rows["s0-0", "caption"]["num_prompt_tokens"] == 2


def test_a_greedy_request_sends_temperature_zero_and_no_optional_fields(tmp_path, tiny_model_dir, fake):
    job = write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1], prompts=PROMPTS[:1])
    run(job)
    (request,) = fake.completions()
    assert request.body["temperature"] == 0.0 and request.body["max_tokens"] == 6
    for absent in ("top_k", "stop", "stop_token_ids", "min_tokens", "logprobs", "response_format"):
        assert absent not in request.body


def constrained_reply(body: dict) -> str:
    if "response_format" in body or "grammar" in body.get("structured_outputs", {}):
        return '{"zeta":"z","alpha":1}'
    if "regex" in body.get("structured_outputs", {}):
        return "123"
    return "dog"


def test_labels_go_as_structured_outputs_with_the_schemas_property_order(tmp_path, tiny_model_dir, fake):
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
    }
    prompts = [
        {"name": "j", "text": "J {key}", "json_schema": schema},
        {"name": "w", "text": "W {key}", "json_schema": schema, "json_whitespace": "any"},
        {"name": "r", "text": "R {key}", "regex": "[0-9]{3}"},
        {"name": "c", "text": "C {key}", "choices": ["cat", "dog"], "choice_mode": "generate"},
    ]
    fake.reply = constrained_reply
    job = write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1], prompts=prompts)
    run(job)

    # Compact JSON (the default): the built-in engine's grammar, its object rule taking zeta before alpha
    (j,) = fake.completions("J s0-0")
    grammar = j.body["structured_outputs"]["grammar"]
    assert "response_format" not in j.body
    assert 0 < grammar.index('\\"zeta\\"') < grammar.index('\\"alpha\\"')
    # Any whitespace: the schema as written, in response_format
    (w,) = fake.completions("W s0-0")
    json_schema = w.body["response_format"]["json_schema"]
    assert w.body["response_format"]["type"] == "json_schema" and "structured_outputs" not in w.body
    assert json_schema["schema"] == schema
    assert list(json_schema["schema"]["properties"]) == ["zeta", "alpha"]  # as written, not sorted
    (r,) = fake.completions("R s0-0")
    assert r.body["structured_outputs"] == {"regex": "[0-9]{3}"} and "response_format" not in r.body
    (c,) = fake.completions("C s0-0")
    assert c.body["structured_outputs"] == {"choice": ["cat", "dog"]}
    rows = rows_by_request(tmp_path, 1)
    assert [rows["s0-0", p]["status"] for p in "jwrc"] == ["ok"] * 4
    assert [rows["s0-0", p]["text"] for p in "jrc"] == ['{"zeta":"z","alpha":1}', "123", "dog"]


# What each failure of the server becomes


def test_429_and_503_are_retried_until_the_request_is_answered(tmp_path, tiny_model_dir, fake):
    fake.fail["Describe s0-1."] = Failure(503, times=2)
    fake.fail["One word for s1-0."] = Failure(429, times=1)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url)))

    rows = rows_by_request(tmp_path)
    assert set(rows) == all_requests()
    assert all(row["status"] == "ok" for row in rows.values())
    assert rows["s0-1", "caption"]["text"] == "echo: Describe s0-1."
    assert len(fake.completions("Describe s0-1.")) == 3
    assert len(fake.completions("One word for s1-0.")) == 2
    assert len(fake.completions()) == len(all_requests()) + 3  # nothing else was sent twice


@pytest.mark.parametrize("status", [500, 502, 408])
def test_other_transient_statuses_are_retried_too(tmp_path, tiny_model_dir, fake, status):
    fake.fail["Describe s0-1."] = Failure(status, times=1)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2]))
    assert len(fake.completions("Describe s0-1.")) == 2
    assert rows_by_request(tmp_path, 1)["s0-1", "caption"]["status"] == "ok"


def test_a_retry_waits_as_long_as_retry_after_says(tmp_path, tiny_model_dir, fake):
    fake.fail["Describe s0-1."] = Failure(503, times=1, retry_after="1")
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2]))  # backoff_s alone would wait 0.01 s

    first, second = fake.completions("Describe s0-1.")
    assert second.at - first.at >= 0.95
    assert rows_by_request(tmp_path, 1)["s0-1", "caption"]["status"] == "ok"


@pytest.mark.parametrize(
    ("retry_after", "least_s", "most_s"),
    [
        ("86400", 0.45, 3.0),  # a day: cut to max_retry_wait_s
        ("1e300", 0.45, 3.0),
        ("inf", 0.0, 0.4),  # not a number of seconds: as if absent, the backoff (0.01 s) decides
        ("soon", 0.0, 0.4),
    ],
)
def test_a_retry_after_beyond_max_retry_wait_s_is_cut_to_it_and_one_that_is_not_a_number_is_ignored(
    tmp_path, tiny_model_dir, fake, retry_after, least_s, most_s
):
    fake.fail["Describe s0-1."] = Failure(503, times=1, retry_after=retry_after)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url, max_retry_wait_s=0.5), sizes=[2]))

    first, second = fake.completions("Describe s0-1.")
    assert least_s <= second.at - first.at <= most_s
    assert rows_by_request(tmp_path, 1)["s0-1", "caption"]["status"] == "ok"


def test_a_long_wait_before_a_retry_is_logged(tmp_path, tiny_model_dir, fake, monkeypatch, caplog):
    monkeypatch.setattr("batchvl.server.server_engine.LOGGED_WAIT_S", 0.2)
    fake.fail["Describe s0-1."] = Failure(503, times=1, retry_after="0.3")
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2]))
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.startswith("waiting 0 s before retrying (HTTP 503: busy (503))")


def test_a_request_that_fails_past_its_retries_is_a_server_error_row(tmp_path, tiny_model_dir, fake):
    fake.fail["Describe s0-1."] = Failure(503)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url, retries=2)))

    rows = rows_by_request(tmp_path)
    failed = rows.pop(("s0-1", "caption"))
    assert failed["status"] == "error" and failed["error_type"] == "server_error"
    assert "after 2 retries" in failed["error_message"] and "HTTP 503" in failed["error_message"]
    assert failed["text"] is None
    assert len(fake.completions("Describe s0-1.")) == 3  # the first attempt and 2 retries
    assert set(rows) == all_requests() - {("s0-1", "caption")}
    assert all(row["status"] == "ok" for row in rows.values())


def test_retry_failed_reruns_a_server_error_row_and_leaves_the_ok_rows(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys
):
    fake.fail["Describe s0-1."] = Failure(503)
    job = write_job(tmp_path, tiny_model_dir, at(fake.url, retries=0))
    run(job)
    before = rows_by_request(tmp_path)
    assert before["s0-1", "caption"]["error_type"] == "server_error"
    fake.fail.clear()  # the server answers it now
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(monkeypatch, capsys, "retry-failed", job, "--no-progress")

    assert code == 0, err
    after = rows_by_request(tmp_path)
    assert after.pop(("s0-1", "caption"))["status"] == "ok"
    before.pop(("s0-1", "caption"))
    assert after == before  # every other row as it was
    assert len(fake.completions("Describe s0-1.")) == 2  # the run's attempt, then the retry's


def test_a_400_is_a_server_rejected_row_with_the_servers_message_and_is_not_retried(
    tmp_path, tiny_model_dir, fake
):
    fake.reject["Describe s1-1."] = "the image is too large for the processor (9000 tokens)"
    run(write_job(tmp_path, tiny_model_dir, at(fake.url)))

    rows = rows_by_request(tmp_path)
    rejected = rows.pop(("s1-1", "caption"))
    assert rejected["status"] == "error" and rejected["error_type"] == "server_rejected"
    assert "the image is too large for the processor (9000 tokens)" in rejected["error_message"]
    assert "HTTP 400" in rejected["error_message"]
    assert len(fake.completions("Describe s1-1.")) == 1
    assert all(row["status"] == "ok" for row in rows.values()) and len(rows) == len(all_requests()) - 1


def test_a_request_over_the_timeout_is_retried_then_a_server_error_row(tmp_path, tiny_model_dir, fake):
    # a timeout the other requests keep to on a loaded machine, and a stall far over it
    fake.stall["Describe s0-0."] = 5
    run(write_job(tmp_path, tiny_model_dir, at(fake.url, timeout_s=1.5, retries=1), sizes=[2]))

    rows = rows_by_request(tmp_path, 1)
    timed_out = rows.pop(("s0-0", "caption"))
    assert timed_out["status"] == "error" and timed_out["error_type"] == "server_error"
    assert "timeout" in timed_out["error_message"] and "after 1 retries" in timed_out["error_message"]
    assert len(fake.completions("Describe s0-0.")) == 2
    assert all(row["status"] == "ok" for row in rows.values()) and len(rows) == 3


def test_an_answer_trickled_past_the_timeout_is_cut_there_though_each_read_is_quick(
    tmp_path, tiny_model_dir, fake
):
    fake.trickle["Describe s0-0."] = 0.05  # a byte every 0.05 s: the answer would take about 15 s
    started = time.monotonic()
    run(write_job(tmp_path, tiny_model_dir, at(fake.url, timeout_s=1, retries=1), sizes=[1]))

    assert time.monotonic() - started < 8  # two attempts of 1 s each, and the job around them
    timed_out = rows_by_request(tmp_path, 1)["s0-0", "caption"]
    assert timed_out["status"] == "error" and timed_out["error_type"] == "server_error"
    assert "no whole answer within engine.server.timeout_s=1 s" in timed_out["error_message"]
    assert len(fake.completions("Describe s0-0.")) == 2


def test_an_answer_larger_than_its_max_tokens_can_be_is_refused_unread(tmp_path, tiny_model_dir, fake):
    fake.reply = lambda body: "word " * 2_000_000 if "Describe s0-1." in last_user_text(body) else echo(body)
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2]))

    rows = rows_by_request(tmp_path, 1)
    refused = rows.pop(("s0-1", "caption"))
    assert refused["status"] == "error" and refused["error_type"] == "server_error"
    assert "the server's answer is over 68608 bytes" in refused["error_message"]  # 64 KiB + 6 tokens
    assert all(row["status"] == "ok" for row in rows.values()) and len(rows) == 3


def test_an_answer_that_is_not_json_is_a_server_error_row(tmp_path, tiny_model_dir, fake):
    fake.garble.add("Describe s0-1.")
    run(write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[2]))

    rows = rows_by_request(tmp_path, 1)
    garbled = rows.pop(("s0-1", "caption"))
    assert garbled["status"] == "error" and garbled["error_type"] == "server_error"
    assert "not JSON" in garbled["error_message"]
    assert all(row["status"] == "ok" for row in rows.values()) and len(rows) == 3


def test_a_server_gone_mid_run_stops_it_after_the_finished_shards_and_the_rerun_completes(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys, caplog
):
    # One request at a time: the server answers shard 0's and shard 1's 8 requests, then goes away.
    server = at(fake.url, retries=1, max_concurrency=1)
    job = write_job(tmp_path, tiny_model_dir, server, sizes=GONE_SIZES)
    fake.gone_after = 8

    code, out, err = cli(monkeypatch, capsys, "run", job, "--no-progress")
    assert code == 1, err
    (line,) = err.strip().splitlines()
    assert f"the server at {fake.url} stopped answering" in line
    assert "2 shard(s) were committed, 2 shard(s) are left" in line
    assert "stopped: 4 samples, 8 ok" in out
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # the line is all
    # The shards done before are committed; nothing of the others was written, not even a temporary file.
    written = files_under(tmp_path / "out")
    stats = [name for name in written if name.startswith("_batchvl/stats/")]
    assert written - set(stats) == {
        "part-0.parquet",
        "part-1.parquet",
        "_batchvl/done/part-0.json",
        "_batchvl/done/part-1.json",
        "_batchvl/inputs/part-0.json",  # the input each committed shard was made from
        "_batchvl/inputs/part-1.json",
    }
    assert len(stats) == 1 and json.loads((tmp_path / "out" / stats[0]).read_text())["stopped_by"] == (
        "server_gone"
    )
    done = rows_by_request(tmp_path, 2)
    assert set(done) == all_requests(GONE_SIZES[:2]) and all(r["status"] == "ok" for r in done.values())

    # The same command against a server that answers (here at a new address) runs what is left.
    with FakeOpenAIServer(str(tiny_model_dir)) as again:
        code, out, err = cli(
            monkeypatch, capsys, "run", job, "--no-progress", "--set", f"engine.server.url={again.url}"
        )
        assert code == 0, err
        assert "2 shard(s) written, 2 already done" in out
        left = [f"s{n}-{i}" for n in (2, 3) for i in (0, 1)]
        expected = [f"Describe {key}." for key in left] + [f"One word for {key}." for key in left]
        assert sorted(r.text for r in again.completions()) == sorted(expected)
    rows = rows_by_request(tmp_path, len(GONE_SIZES))
    assert set(rows) == all_requests(GONE_SIZES)
    assert all(row["status"] == "ok" and row["text"].startswith("echo: ") for row in rows.values())


def request(tag, text: str) -> EngineRequest:
    messages = ({"role": "user", "content": [{"type": "text", "text": text}]},)
    return EngineRequest([], [], SamplingParams(max_new_tokens=4), tag=tag, messages=messages)


def finished(backend: ServerEngine, tags: int, timeout_s: float = 10) -> list:
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < tags:
        assert time.monotonic() < deadline, "the requests did not finish"
        results += backend.step()
    return results


def test_the_results_finished_before_the_server_went_away_are_handed_back_first(fake):
    fake.gone_after = 1
    backend = ServerEngine(
        fake.url, fake.models[0], ServerConfig(retries=1, backoff_s=0.01, max_concurrency=1)
    )
    try:
        backend.add_request(request("answered", "first"))
        backend.add_request(request("lost", "second"))
        deadline = time.monotonic() + 10
        while backend._finished.qsize() < 2:  # both done before a step looks: one answer, one server gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (result,) = backend.step()
        assert result.tag == "answered" and result.text == "echo: first"
        with pytest.raises(ServerGone, match=f"the server at {fake.url} stopped answering"):
            backend.step()
    finally:
        backend.close()


class RestartedServer:
    """The fake as a server batchvl launched, to the backend (what it asks of a `ManagedServer`): dead while
    the fake is down, and back once restarted, no longer crashing on what it crashed on before."""

    def __init__(self, fake: FakeOpenAIServer):
        self.fake = fake
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.fake.url

    def is_alive(self) -> bool:
        return not self.fake.down

    def restart(self) -> None:
        self.restarts += 1
        self.fake.crash.clear()
        self.fake.down_until = 0.0

    def stop(self) -> None:
        pass


def test_a_launched_server_restarted_between_answered_requests_is_not_restarted_in_a_row(fake):
    # retries=1: one restart in a row without an answer between. Each request brings the server down (until
    # it is restarted), and is answered once sent again: a restart, an answer, a restart, an answer, ...
    launched = RestartedServer(fake)
    config = ServerConfig(retries=1, backoff_s=0.01, max_concurrency=1)
    backend = ServerEngine(fake.url, fake.models[0], config, server=launched)
    try:
        for tag in ("first", "second", "third"):
            fake.crash[tag] = 3600
            backend.add_request(request(tag, tag))
            (result,) = finished(backend, 1)
            assert result.tag == tag and result.error is None and result.text == f"echo: {tag}"
    finally:
        backend.close()
    assert launched.restarts == 3 and backend.restarts == 3
    assert [len(fake.completions(tag)) for tag in ("first", "second", "third")] == [2, 2, 2]


def test_a_server_slow_to_list_its_models_still_answers_when_a_request_times_out(fake):
    # The request times out after 0.3 s; GET /v1/models then takes 1.5 s. The health check waits as long as
    # a request, but at least 2 s (a busy server, a loaded machine): the server answers, and the request
    # is a timeout like any other, not the server gone.
    fake.stall["slow"] = 3
    fake.slow_models_s = 1.5
    backend = ServerEngine(fake.url, fake.models[0], ServerConfig(retries=0, timeout_s=0.3))
    try:
        backend.add_request(request("slow", "slow"))
        (result,) = finished(backend, 1)
    finally:
        backend.close()
    assert result.error is not None and result.error.error_type == "server_error"
    assert "no whole answer within engine.server.timeout_s=0.3 s" in result.error.message
    assert [r.path for r in fake.requests] == ["/v1/chat/completions", "/v1/models"]


# Planning: the server must answer and serve the model, before any work


def test_a_server_that_does_not_answer_is_exit_2_before_any_work(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    url = closed_port_url()
    job = write_job(tmp_path, tiny_model_dir, at(url))
    for command in (["validate", job], ["run", job, "--no-progress"]):
        code, out, err = cli(monkeypatch, capsys, *command)
        assert code == 2
        (line,) = err.strip().splitlines()
        assert (
            line.startswith(f"error: engine.server.url {url} does not answer") and "start the server" in line
        )
        assert not (tmp_path / "out").exists()


def test_a_server_that_refuses_a_prompts_kind_of_request_is_exit_2_before_any_work(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys
):
    fake.fail[PROBE_TEXT] = Failure(400)  # this server refuses the kind of request the prompt makes
    prompts = [{"name": "digits", "text": "Digits {key}", "regex": "[0-9]{3}"}]
    job = write_job(tmp_path, tiny_model_dir, at(fake.url), prompts=prompts)
    for command in (["validate", job], ["run", job, "--no-progress"]):
        code, _, err = cli(monkeypatch, capsys, *command)
        assert code == 2
        (line,) = err.strip().splitlines()
        assert f"the server at {fake.url} refuses prompt 'digits''s request" in line
        assert "structured_outputs" in line and "HTTP 400" in line
        assert line.endswith("change the prompt, or start the server with what that request needs")
    assert not (tmp_path / "out").exists()
    probe = fake.probes()[0].body
    assert probe["structured_outputs"] == {"regex": "[0-9]{3}"} and probe["max_tokens"] == 1


@pytest.mark.parametrize("status", [503, 429, 408])
def test_a_probe_that_meets_a_5xx_429_or_408_decides_nothing_and_the_job_runs(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys, status
):
    # a busy server (a 429 or 408 is no refusal of the request either): the run's retries meet that
    fake.fail[PROBE_TEXT] = Failure(status)
    prompts = [{"name": "digits", "text": "Digits {key}", "regex": "[0-9]{3}"}]
    fake.reply = lambda body: "123"
    job = write_job(tmp_path, tiny_model_dir, at(fake.url), sizes=[1], prompts=prompts)
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")
    assert code == 0, err
    assert len(fake.probes()) == 1 and rows_by_request(tmp_path, 1)["s0-0", "digits"]["status"] == "ok"


def test_scored_choices_without_the_models_tokenizer_are_exit_2_before_any_work(
    tmp_path, monkeypatch, capsys
):
    folder = tmp_path / "served-elsewhere"  # model.path without a tokenizer: the model lives on the server
    folder.mkdir()
    prompts = [{"name": "kind", "text": "Kind of {key}?", "choices": ["photo", "drawing"]}]
    with FakeOpenAIServer(str(folder)) as server:
        job = write_job(tmp_path, folder, at(server.url), prompts=prompts)
        code, _, err = cli(monkeypatch, capsys, "validate", job)
        assert server.completions() == [] and server.probes() == []
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "scored choices on the openai backend need the model's tokenizer" in line
    assert "choice_mode: generate" in line


def test_a_server_of_another_model_is_exit_2_naming_engine_server_model(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    with FakeOpenAIServer("other-model") as other:
        job = write_job(tmp_path, tiny_model_dir, at(other.url))
        code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")
        assert code == 2
        (line,) = err.strip().splitlines()
        assert f"the server at {other.url} serves ['other-model'], not '{tiny_model_dir}'" in line
        assert "set engine.server.model" in line
        assert not (tmp_path / "out").exists() and other.completions() == []

        code, out, err = cli(
            monkeypatch, capsys, "run", job, "--no-progress", "--set", "engine.server.model=other-model"
        )
        assert code == 0, err
        assert {r.body["model"] for r in other.completions()} == {"other-model"}


# Config rules


def python_server_config(backend: str, **server) -> JobConfig:
    return JobConfig(
        model=ModelConfig(path="/models/m"),
        input=InputConfig(paths=["/d/*.parquet"]),
        output=OutputConfig(dir="/o"),
        engine=EngineConfig(backend=backend, server=ServerConfig(**server)),
    )


@pytest.mark.parametrize(
    ("backend", "server", "fragment"),
    [
        (
            "openai",
            {"url": "http://127.0.0.1:8000/v1", "launch": "vllm serve"},
            "engine.backend openai takes one of 'engine.server.url' (a running server) or "
            "'engine.server.launch' (a command that starts one)",
        ),
        ("openai", {}, "engine.backend openai takes one of 'engine.server.url'"),
        (
            "openai",
            {"url": "http://127.0.0.1:8000/v1", "launch_args": ["--max-model-len", "4096"]},
            "'engine.server.launch_args' applies to 'engine.server.launch'; remove it",
        ),
        (
            "batchvl",
            {"url": "http://127.0.0.1:8000/v1"},
            "'engine.server' applies to engine.backend: openai; set it, or remove engine.server",
        ),
        ("openai", {"url": "127.0.0.1:8000/v1"}, "'engine.server.url' must be an http(s) URL"),
        (
            "openai",
            {"url": "http://127.0.0.1:8000/v1", "max_concurrency": 0},
            "'engine.server.max_concurrency' must be positive, got 0",
        ),
        (
            "openai",
            {"url": "http://127.0.0.1:8000/v1", "api_key_env": ""},
            "'engine.server.api_key_env' must be the name of the environment variable holding the API key",
        ),
        (
            "openai",
            {"url": "http://127.0.0.1:8000/v1", "api_key_env": "sk-live-a81f"},  # the key, not its variable
            "(letters, digits and _, e.g. OPENAI_API_KEY), not the key itself; or remove it",
        ),
    ],
)
def test_server_key_mistakes_are_the_same_one_line_error_in_python_and_yaml(
    tmp_path, backend, server, fragment
):
    with pytest.raises(ConfigError) as built:
        python_server_config(backend, **server)
    job = {
        "model": {"path": "/models/m"},
        "input": {"paths": ["/d/*.parquet"]},
        "output": {"dir": "/o"},
        "engine": {"backend": backend, "server": server},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(ConfigError) as loaded:
        load_job_config(tmp_path / "job.yaml")
    assert str(built.value) == str(loaded.value)
    assert fragment in str(built.value) and "\n" not in str(built.value)
    assert "sk-live" not in str(built.value)


def test_the_backend_and_the_served_model_define_the_output_but_not_how_the_server_is_reached():
    url = {"url": "http://127.0.0.1:8000/v1"}
    builtin = config_fingerprint(python_server_config("batchvl"))
    openai = config_fingerprint(python_server_config("openai", **url))
    assert openai != builtin
    assert config_fingerprint(python_server_config("openai", **url, model="other")) != openai
    # the served model's default name is model.path: naming it is the same output
    assert config_fingerprint(python_server_config("openai", **url, model="/models/m")) == openai
    same = [
        {"url": "https://elsewhere:9000/v1"},
        {"launch": "python -m vllm.entrypoints.openai.api_server", "launch_args": ["--max-model-len", "9"]},
        {**url, "max_concurrency": 3, "timeout_s": 7.0, "retries": 0, "backoff_s": 9.0},
        {**url, "api_key_env": "KEY", "startup_timeout_s": 5.0},
    ]
    for server in same:
        assert config_fingerprint(python_server_config("openai", **server)) == openai, server


def test_a_rerun_with_another_served_model_over_committed_shards_is_refused(tmp_path, tiny_model_dir, fake):
    job = write_job(tmp_path, tiny_model_dir, at(fake.url))
    run(job)
    fake.models.append("alias")
    with pytest.raises(UserError) as refused:
        run(job, "engine.server.model=alias")
    message = str(refused.value)
    assert "holds 2 shard(s) written with a different config (changed: engine.served_model)" in message
    assert "rerun with --overwrite" in message
    # and a changed address, concurrency or timeout is the same job: nothing to do
    with FakeOpenAIServer(str(tiny_model_dir)) as again:
        summary = run(
            job,
            f"engine.server.url={again.url}",
            "engine.server.max_concurrency=2",
            "engine.server.timeout_s=9",
        )
        assert summary.stats["shards_skipped"] == 2 and again.completions() == []


# The API key


KEY = "sk-test-7f3a9c1e5b2d4f60"


def test_the_api_key_is_sent_from_its_variable_and_written_nowhere(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys, caplog
):
    monkeypatch.setenv("BATCHVL_TEST_SERVER_KEY", KEY)
    job = write_job(tmp_path, tiny_model_dir, at(fake.url, api_key_env="BATCHVL_TEST_SERVER_KEY"))
    caplog.set_level(logging.DEBUG)
    code, out, err = cli(monkeypatch, capsys, "run", job, "--no-progress", "--log-level", "debug")
    assert code == 0, err

    assert {r.path for r in fake.requests} == {"/v1/models", "/v1/chat/completions"}
    assert all(r.headers["Authorization"] == f"Bearer {KEY}" for r in fake.requests)
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".parquet", ".json", ".md"}  # .md: the dataset card
    for path in files:
        assert KEY.encode() not in path.read_bytes(), path
    assert KEY not in out + err + caplog.text
    assert KEY not in (tmp_path / "job.yaml").read_text()


def test_an_api_key_variable_that_is_not_set_is_exit_2(tmp_path, tiny_model_dir, fake, monkeypatch, capsys):
    monkeypatch.delenv("BATCHVL_TEST_SERVER_KEY", raising=False)
    job = write_job(tmp_path, tiny_model_dir, at(fake.url, api_key_env="BATCHVL_TEST_SERVER_KEY"))
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress")
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "engine.server.api_key_env names BATCHVL_TEST_SERVER_KEY, which is not set" in line
    assert fake.completions() == [] and not (tmp_path / "out").exists()


def test_a_launched_server_with_an_unset_api_key_variable_is_refused_when_planning(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    monkeypatch.delenv("BATCHVL_TEST_SERVER_KEY", raising=False)
    server = {
        "launch": f"{sys.executable} -m server_that_is_never_started",
        "api_key_env": "BATCHVL_TEST_SERVER_KEY",
    }
    job = write_job(tmp_path, tiny_model_dir, server)
    code, _, err = cli(monkeypatch, capsys, "validate", job)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "engine.server.api_key_env names BATCHVL_TEST_SERVER_KEY, which is not set" in line


# Backpressure


def test_the_backend_wants_no_requests_while_max_concurrency_are_unfinished(fake):
    backend = ServerEngine(fake.url, fake.models[0], ServerConfig(url=fake.url, max_concurrency=2))
    try:
        backend.add_request(request(0, "a"))
        assert backend.wants_requests
        backend.add_request(request(1, "b"))
        assert not backend.wants_requests and backend.num_unfinished == 2
        assert sorted(r.tag for r in finished(backend, 2)) == [0, 1]
        assert backend.wants_requests and backend.num_unfinished == 0
    finally:
        backend.close()


def test_requests_beyond_max_concurrency_wait_for_a_slot_not_against_their_timeout(fake):
    """Six requests at once on two slots: the server never has more than two, and the last ones' timeout
    starts when they are sent (1.8 s each, where waiting for a slot takes 2 s). The timeout leaves a request
    0.8 s more than the server holds it: a request timed out on a loaded machine frees its slot while the
    server still holds it, and the next one sent then is a third in flight."""
    fake.hold_s = 1.0
    config = ServerConfig(url=fake.url, max_concurrency=2, timeout_s=1.8, retries=0)
    backend = ServerEngine(fake.url, fake.models[0], config)
    try:
        for i in range(6):
            backend.add_request(request(i, f"r{i}"))
        results = finished(backend, 6)
    finally:
        backend.close()
    assert fake.most_in_flight == 2
    assert sorted(r.tag for r in results) == list(range(6))
    assert all(r.error is None and r.text == f"echo: r{r.tag}" for r in results)
    assert len(fake.completions()) == 6


def test_a_job_never_has_more_than_max_concurrency_requests_at_the_server(tmp_path, tiny_model_dir, fake):
    fake.hold_s = 0.05
    run(write_job(tmp_path, tiny_model_dir, at(fake.url, max_concurrency=2)))
    assert fake.most_in_flight == 2
    assert set(rows_by_request(tmp_path)) == all_requests()


# Image URLs


@pytest.mark.parametrize(("pass_urls", "scheme"), [(True, "http"), (True, "HTTP"), (False, "http")])
def test_image_urls_go_to_the_server_as_they_are_with_pass_urls_else_as_the_downloaded_bytes(
    tmp_path, tiny_model_dir, fake, pass_urls, scheme
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import png_bytes
    from tests.http_server import LoopbackServer

    image = png_bytes(random_image(30, 40, seed=0))
    with LoopbackServer() as images:
        url = images.add_image("a.png", image).replace("http://", f"{scheme}://")  # schemes are any case
        write_job(tmp_path, tiny_model_dir, at(fake.url, pass_urls=pass_urls), sizes=[], prompts=PROMPTS[:1])
        pq.write_table(pa.table({"key": ["u0"], "image": [url]}), tmp_path / "data" / "part-0.parquet")
        job = tmp_path / "job.yaml"
        run(job, "input.download.allow_private=true")  # the image server is on loopback
        fetches = images.requests["/img/a.png"]

    (request,) = fake.completions("Describe u0.")
    sent = request.body["messages"][0]["content"][0]["image_url"]["url"]
    if pass_urls:
        assert sent == url and fetches == 0  # batchvl neither downloaded nor checked it
    else:
        assert sent == "data:image/png;base64," + base64.b64encode(image).decode() and fetches == 1
    assert rows_by_request(tmp_path, 1)["u0", "caption"]["status"] == "ok"


def test_retry_failed_reruns_error_rows_and_leaves_skipped_ones(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys
):
    prompts = [
        {"name": "kind", "text": "Kind of {key}."},
        {"name": "if_cat", "text": "Name the cat in {key}.", "when": {"prompt": "kind", "in": ["cat"]}},
        {"name": "size", "text": "Size of {key}."},
    ]
    fake.fail["Size of s0-1."] = Failure(503)
    job = write_job(tmp_path, tiny_model_dir, at(fake.url, retries=0), sizes=[2], prompts=prompts)
    run(job)
    before = rows_by_request(tmp_path, 1)
    assert {k: r["status"] for k, r in before.items() if r["status"] != "ok"} == {
        ("s0-0", "if_cat"): "skipped",
        ("s0-1", "if_cat"): "skipped",
        ("s0-1", "size"): "error",
    }
    fake.fail.clear()
    sent = len(fake.completions())
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(monkeypatch, capsys, "retry-failed", job, "--no-progress")

    assert code == 0, err
    assert "retried 1 error row(s) in 1 shard(s): 1 ok now" in out
    assert [r.text for r in fake.completions()[sent:]] == ["Size of s0-1."]
    after = rows_by_request(tmp_path, 1)
    assert after.pop(("s0-1", "size"))["status"] == "ok"
    before.pop(("s0-1", "size"))
    assert after == before  # the skipped rows as they were
