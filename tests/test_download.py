"""Fetching image URLs: against a real HTTP server on 127.0.0.1, every answer a crawl meets becomes either
the image's bytes or an error of its own type that names the URL; nothing waits past its timeouts."""

import dataclasses
import time

import pytest

from batchvl.config import DownloadConfig
from batchvl.errors import SampleError
from batchvl.io.download import Downloader, DownloadStats
from batchvl.io.fetch_ahead import with_downloaded_media
from batchvl.io.types import MediaRef, Sample, ShardEnd
from tests.conftest import png_bytes, random_image
from tests.http_server import LoopbackServer

# The tests' server is on loopback, which jobs refuse by default.
LOCAL = DownloadConfig(allow_private=True, retries=2, backoff_s=0.0, timeout_s=1.0, total_timeout_s=2.0)
IMAGE = png_bytes(random_image(40, 60, 0))


@pytest.fixture
def server():
    with LoopbackServer() as running:
        running.images["flaky"] = IMAGE
        yield running


def fetch(url: str, **settings):
    stats = DownloadStats()
    downloader = Downloader(dataclasses.replace(LOCAL, **settings))
    return downloader.fetch(url, stats), stats


def failure(url: str, **settings) -> tuple[SampleError, DownloadStats]:
    stats = DownloadStats()
    downloader = Downloader(dataclasses.replace(LOCAL, **settings))
    with pytest.raises(SampleError) as caught:
        downloader.fetch(url, stats)
    return caught.value, stats


def test_an_image_comes_back_byte_for_byte_with_a_user_agent_naming_batchvl(server):
    data, stats = fetch(server.add_image("a.png", IMAGE))
    assert data == IMAGE
    assert (stats.downloads, stats.download_bytes, stats.download_retries) == (1, len(IMAGE), 0)
    assert server.user_agents[0].startswith("batchvl/")


def test_redirects_are_followed(server):
    server.add_image("b.png", IMAGE)
    assert fetch(server.url("/redirect/b.png"))[0] == IMAGE


def test_a_404_is_its_own_error_type_naming_the_url_and_is_not_retried(server):
    url = server.url("/img/missing.png")
    error, stats = failure(url)
    assert error.error_type == "download_http_404"
    assert url in error.message and "404" in error.message
    assert server.requests["/img/missing.png"] == 1
    assert stats.download_failures_by_type == {"download_http_404": 1}


@pytest.mark.parametrize("code", [500, 503, 429])
def test_server_errors_and_rate_limits_are_retried_until_they_pass(server, code):
    path = f"/flaky/{code}/2/x"
    data, stats = fetch(server.url(path), retries=2)
    assert data == IMAGE
    assert server.requests[path] == 3
    assert stats.download_retries == 2 and stats.downloads == 1


def test_retries_run_out_with_the_last_status_and_the_attempts_counted(server):
    error, stats = failure(server.url("/status/502"), retries=1)
    assert error.error_type == "download_http_502"
    assert "after 2 attempts" in error.message
    assert server.requests["/status/502"] == 2
    assert stats.download_retries == 1


def test_the_backoff_doubles_between_attempts(server):
    started = time.monotonic()
    failure(server.url("/status/500"), retries=2, backoff_s=0.2)
    assert time.monotonic() - started >= 0.2 + 0.4


def test_a_server_that_stops_sending_is_a_timeout_within_the_read_timeout(server):
    started = time.monotonic()
    error, _ = failure(server.url("/stall"), retries=0, timeout_s=0.5)
    assert error.error_type == "download_timeout"
    assert time.monotonic() - started < 3


def test_a_trickling_body_is_a_timeout_at_the_total_timeout(server):
    started = time.monotonic()
    error, _ = failure(server.url("/trickle"), retries=0, timeout_s=1.0, total_timeout_s=0.8)
    assert error.error_type == "download_timeout"
    assert "total_timeout_s" in error.message
    assert time.monotonic() - started < 3


def test_an_endless_body_stops_at_the_size_cap(server):
    error, _ = failure(server.url("/endless"), max_bytes=200_000)
    assert error.error_type == "image_too_large"
    assert "max_bytes=200000" in error.message
    assert server.requests["/endless"] == 1  # not retried


def test_a_declared_oversize_body_is_refused_before_reading(server):
    error, _ = failure(server.url("/big"), max_bytes=1000)
    assert error.error_type == "image_too_large"


def test_a_redirect_loop_is_its_own_error(server):
    error, _ = failure(server.url("/loop"))
    assert error.error_type == "download_redirect_loop"


def test_a_refused_connection_is_a_download_error_after_its_retries():
    with LoopbackServer() as gone:
        url = gone.url("/img/a.png")
    error, stats = failure(url, retries=1)
    assert error.error_type == "download_error"
    assert url in error.message
    assert stats.download_retries == 1


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/a.png", "http://10.1.2.3/a.png", "http://192.168.0.7/a.png", "http://172.20.0.1/a.png",
     "http://169.254.169.254/latest/meta-data", "http://[::1]/a.png", "http://localhost/a.png"],
)  # fmt: skip
def test_private_and_link_local_addresses_are_refused_by_default(url):
    stats = DownloadStats()
    with pytest.raises(SampleError) as caught:
        Downloader(DownloadConfig()).fetch(url, stats)
    assert caught.value.error_type == "url_not_allowed"
    assert url in caught.value.message and "allow_private" in caught.value.message


def test_the_refusal_is_made_before_any_request(server):
    url = server.add_image("c.png", IMAGE)
    with pytest.raises(SampleError):
        Downloader(DownloadConfig()).fetch(url, DownloadStats())
    assert sum(server.requests.values()) == 0


def test_the_cache_keeps_bodies_so_a_second_fetch_makes_no_request(server, tmp_path):
    url = server.add_image("d.png", IMAGE)
    first, first_stats = fetch(url, cache_dir=str(tmp_path))
    second, second_stats = fetch(url, cache_dir=str(tmp_path))
    assert first == second == IMAGE
    assert server.requests["/img/d.png"] == 1
    assert (first_stats.downloads, second_stats.downloads, second_stats.download_cache_hits) == (1, 0, 1)
    assert len(list((tmp_path / "blobs").rglob("*"))) == 2  # one folder, one body


def test_without_a_cache_dir_nothing_is_kept(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = server.add_image("e.png", IMAGE)
    fetch(url)
    fetch(url)
    assert server.requests["/img/e.png"] == 2
    assert list(tmp_path.iterdir()) == []


def test_samples_download_several_at_once_in_order_each_with_its_own_outcome(server):
    for i in range(8):
        server.images[f"s{i}.png"] = IMAGE
    items = [
        Sample("shard", i, str(i), [MediaRef(None, None, "image", server.url(f"/slow/s{i}.png"))])
        for i in range(8)
    ]
    items[3] = Sample("shard", 3, "3", [MediaRef(None, None, "image", server.url("/status/404"))])
    items.append(ShardEnd("shard", 8))
    started = time.monotonic()
    out = list(with_downloaded_media(items, Downloader(LOCAL), concurrency=4))
    elapsed = time.monotonic() - started
    assert [getattr(item, "index", "end") for item in out] == [*range(8), "end"]
    assert 2 <= server.most_in_flight <= 4
    assert elapsed < 8 * 0.3  # one at a time would take 2.4 s
    assert [s.images[0].data == IMAGE for s in out[:8] if s.index != 3] == [True] * 7
    assert out[3].error.error_type == "download_http_404"
    assert out[0].downloads.downloads == 1
    assert out[3].downloads.download_failures_by_type == {"download_http_404": 1}
