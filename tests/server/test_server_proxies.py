"""The environment's proxies (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, common on cluster nodes) are not used for
a server on loopback, a launched one included, and are for a server elsewhere."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from batchvl.errors import UserError
from batchvl.server.client import served_models
from tests.fake_openai_server import FakeOpenAIServer
from tests.server_jobs import all_requests, at, rows_by_request, run, write_job

FAKE_SERVER_PROGRAM = Path(__file__).parents[1] / "fake_server_process.py"


class Proxy:
    """An HTTP proxy that answers every request 503 and records the URL it was asked for."""

    def __init__(self):
        self.asked: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                proxy.asked.append(self.path)
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def proxy(monkeypatch):
    running = Proxy()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, running.url)
        monkeypatch.delenv(name.lower(), raising=False)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield running
    running.httpd.shutdown()


def test_a_server_on_loopback_is_reached_without_the_environments_proxy(tmp_path, tiny_model_dir, proxy):
    with FakeOpenAIServer(str(tiny_model_dir)) as fake:
        run(write_job(tmp_path, tiny_model_dir, at(fake.url.replace("127.0.0.1", "localhost")), sizes=[2]))
    rows = rows_by_request(tmp_path, 1)
    assert set(rows) == all_requests([2]) and all(r["status"] == "ok" for r in rows.values())
    assert proxy.asked == []


def test_a_launched_server_is_reached_without_the_environments_proxy(tmp_path, tiny_model_dir, proxy):
    server = {"launch": f"{sys.executable} {FAKE_SERVER_PROGRAM}", "startup_timeout_s": 20}
    run(write_job(tmp_path, tiny_model_dir, server, sizes=[1]))
    assert all(r["status"] == "ok" for r in rows_by_request(tmp_path, 1).values())
    assert proxy.asked == []


def test_a_server_elsewhere_is_reached_through_the_environments_proxy(proxy):
    with pytest.raises(UserError, match="GET /models answered HTTP 503"):
        served_models("http://models.example.invalid/v1", None)
    assert proxy.asked == ["http://models.example.invalid/v1/models"]
