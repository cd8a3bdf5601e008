"""Credentials a job file gives the openai backend are used but written and printed nowhere: the user info
of engine.server.url, and secret-looking arguments of a launched server's command."""

from __future__ import annotations

import base64
import json
import logging
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from batchvl.config import EngineConfig, InputConfig, JobConfig, ModelConfig, OutputConfig, ServerConfig
from batchvl.errors import UserError
from batchvl.pipeline.commit_strategies import stored_config
from batchvl.server.client import connection, served_models
from batchvl.utils.secrets import masked_args, url_without_userinfo
from tests.conftest import cli
from tests.fake_openai_server import FakeOpenAIServer
from tests.server_jobs import all_requests, at, closed_port_url, rows_by_request, run, write_job

PASSWORD = "pw-5e1f0a7c93"
FAKE_SERVER_PROGRAM = Path(__file__).parents[1] / "fake_server_process.py"


@pytest.fixture
def fake(tiny_model_dir):
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        yield server


def with_user(url: str) -> str:
    return url.replace("http://", f"http://labeler:{PASSWORD}@")


def written(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())


def stored_server_config(out: Path) -> dict:
    metadata = pq.read_schema(out / "part-0.parquet").metadata
    return json.loads(metadata[b"job_config"])["engine"]["server"]


def test_user_info_in_the_server_url_is_sent_but_stored_and_printed_nowhere(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys, caplog
):
    caplog.set_level(logging.DEBUG)
    job = write_job(tmp_path, tiny_model_dir, at(with_user(fake.url), retries=0), sizes=[2])
    code, out, err = cli(monkeypatch, capsys, "run", job, "--no-progress", "--log-level", "debug")
    assert code == 0, err
    assert set(rows_by_request(tmp_path, 1)) == all_requests([2])
    basic = "Basic " + base64.b64encode(f"labeler:{PASSWORD}".encode()).decode()
    assert {r.headers.get("Authorization") for r in fake.requests} == {basic}  # httpx sends it
    assert stored_server_config(tmp_path / "out")["url"] == fake.url
    assert PASSWORD.encode() not in written(tmp_path / "out")
    printed = out + err + caplog.text

    # The lines of a server that does not answer, and of one gone mid-run, name it without the password.
    url = closed_port_url()
    code, _, err = cli(monkeypatch, capsys, "run", job, "--set", f"engine.server.url={with_user(url)}")
    assert code == 2 and f"engine.server.url {url} does not answer" in err
    printed += err
    fake.gone_after = 1
    code, _, err = cli(monkeypatch, capsys, "run", job, "--no-progress", "--overwrite")
    assert code == 1 and f"the server at {fake.url} stopped answering" in err
    assert PASSWORD not in printed + err + caplog.text


def test_secret_arguments_of_a_launched_server_are_masked_where_stored_and_logged(
    tmp_path, tiny_model_dir, caplog
):
    caplog.set_level(logging.INFO)
    server = {
        "launch": f"{sys.executable} {FAKE_SERVER_PROGRAM} --hf-token={PASSWORD}-hf",
        "launch_args": ["--api-key", PASSWORD, "--max-model-len", "4096", "--tokenizer", "tok"],
        "startup_timeout_s": 60,
    }
    job = write_job(tmp_path, tiny_model_dir, server, sizes=[1])
    run(job)
    stored = stored_server_config(tmp_path / "out")
    assert stored["launch_args"] == [
        "--api-key",
        "<not recorded>",
        "--max-model-len",
        "4096",
        "--tokenizer",
        "tok",
    ]
    assert stored["launch"] == f"{sys.executable} {FAKE_SERVER_PROGRAM} '--hf-token=<not recorded>'"
    assert "starting the server:" in caplog.text and "--api-key '<not recorded>'" in caplog.text
    assert PASSWORD.encode() not in written(tmp_path / "out")
    assert PASSWORD not in caplog.text


def test_password_arguments_of_a_launch_command_are_masked():
    args = ["--password", "pw-1", "--passwd=pw-2", "--db-password", "pw-3", "--max-model-len", "4096"]
    assert masked_args(args) == [
        "--password",
        "<not recorded>",
        "--passwd=<not recorded>",
        "--db-password",
        "<not recorded>",
        "--max-model-len",
        "4096",
    ]
    server = ServerConfig(launch="/opt/vllm/bin/vllm serve --passwd pw-4", launch_args=["--password=pw-5"])
    cfg = JobConfig(
        model=ModelConfig(path="/models/m"),
        input=InputConfig(paths=["/d/*.parquet"]),
        output=OutputConfig(dir="/o"),
        engine=EngineConfig(backend="openai", server=server),
    )
    stored = stored_config(cfg)["engine"]["server"]
    assert stored["launch"] == "/opt/vllm/bin/vllm serve --passwd '<not recorded>'"
    assert stored["launch_args"] == ["--password=<not recorded>"]


def test_a_password_with_an_at_sign_in_the_server_url_is_sent_whole_and_shown_nowhere():
    password = "p@ss-9c2e"  # the user info ends at the URL's last "@"
    assert url_without_userinfo(f"http://labeler:{password}@127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert url_without_userinfo(f"https://labeler:{password}@host.example/v1") == "https://host.example/v1"
    base, options = connection(f"http://labeler:{password}@127.0.0.1:8000/v1/", None)
    assert base == "http://127.0.0.1:8000/v1"
    expected = "Basic " + base64.b64encode(f"labeler:{password}".encode()).decode()
    sent = next(options["auth"].auth_flow(httpx.Request("GET", f"{base}/models")))
    assert sent.headers["Authorization"] == expected
    # the line of a server that does not answer names it without the password, or any of it
    url = closed_port_url()
    with pytest.raises(UserError) as no_answer:
        served_models(url.replace("http://", f"http://labeler:{password}@"), None, timeout_s=2)
    assert str(no_answer.value).startswith(f"engine.server.url {url} does not answer")
    assert "ss-9c2e" not in str(no_answer.value)
