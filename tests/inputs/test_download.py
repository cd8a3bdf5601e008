"""Fetching image URLs: against a real HTTP server on 127.0.0.1, every answer a crawl meets becomes either
the image's bytes or an error of its own type that names the URL; nothing waits past its timeouts."""

import dataclasses
import ipaddress
import socket
import time

import pytest

from batchvl.config import DownloadConfig
from batchvl.errors import SampleError
from batchvl.inputs.download import Downloader, DownloadStats
from batchvl.inputs.fetch_ahead import download_media, media_ready, with_downloaded_media
from batchvl.inputs.types import MediaRef, Sample, ShardEnd
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


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/x.png", "http://[::1/x.png"])
@pytest.mark.parametrize("allow_private", [False, True])
def test_a_malformed_url_is_a_download_error_naming_it(url, allow_private):
    error, _ = failure(url, allow_private=allow_private, retries=0)
    assert error.error_type == "download_error"
    assert url in error.message and "not a valid URL" in error.message


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("127.0.0.1:99999/x.png", "(redirected to http://127.0.0.1:99999/x.png) is not a valid URL"),
        ("%5B::1/x.png", "Invalid URL in location header"),  # httpx's own check of the Location
    ],
)
def test_a_redirect_to_a_malformed_url_is_a_download_error_naming_both(server, target, reason):
    url = server.url(f"/to/{target}")
    error, _ = failure(url, retries=0)
    assert error.error_type == "download_error"
    assert error.message.startswith(url) and reason in error.message


def test_any_other_exception_while_downloading_is_the_samples_download_error(monkeypatch):
    def broken_fetch(self, url, stats):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(Downloader, "fetch", broken_fetch)
    url = "http://images.example/a.png"
    sample = download_media(Sample("shard", 0, "0", [MediaRef(None, None, "image", url)]), Downloader(LOCAL))
    assert sample.error.error_type == "download_error"
    assert sample.error.message == f"{url}: RuntimeError: something unforeseen"


@pytest.mark.parametrize("redirected", [False, True])
def test_a_server_trickling_its_headers_is_a_timeout_at_the_total_timeout(server, redirected):
    server.images["t.png"] = IMAGE  # headers at one byte every 0.1 s: about 5 s for the whole answer
    path = "/slow-headers/t.png"
    url = server.url(f"/to/127.0.0.1:{server.port}{path}" if redirected else path)
    started = time.monotonic()
    error, _ = failure(url, retries=0, timeout_s=0.5, total_timeout_s=1.0)
    assert time.monotonic() - started < 2.5
    assert error.error_type == "download_timeout"
    assert url in error.message and "total_timeout_s=1 s" in error.message
    assert server.requests[path] == 1


def test_the_total_timeout_bounds_a_chain_of_redirects_each_quicker_than_it(server):
    server.images["h.png"] = IMAGE
    started = time.monotonic()
    error, _ = failure(server.url("/slow-hops/5/h.png"), retries=0, timeout_s=0.5, total_timeout_s=1.0)
    assert time.monotonic() - started < 2.5  # 6 hops of 0.3 s each: the deadline is the whole chain's
    assert error.error_type == "download_timeout" and "total_timeout_s=1 s" in error.message
    assert fetch(server.url("/slow-hops/1/h.png"), total_timeout_s=2.0)[0] == IMAGE


def test_a_tls_handshake_that_never_completes_ends_at_the_total_timeout():
    with socket.socket() as listener:  # accepts the connection, then never answers the TLS hello
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"https://127.0.0.1:{listener.getsockname()[1]}/a.png"
        started = time.monotonic()
        error, _ = failure(url, retries=0, timeout_s=5.0, total_timeout_s=0.8)
        assert time.monotonic() - started < 3
    assert error.error_type == "download_timeout" and "total_timeout_s=0.8 s" in error.message


def test_a_trickling_server_holds_the_samples_behind_it_for_at_most_the_total_timeout(server):
    server.images["t.png"] = IMAGE
    urls = [server.url("/slow-headers/t.png")] + [server.add_image(f"f{i}.png", IMAGE) for i in range(4)]
    items = [Sample("shard", i, str(i), [MediaRef(None, None, "image", url)]) for i, url in enumerate(urls)]
    downloader = Downloader(dataclasses.replace(LOCAL, retries=0, timeout_s=0.5, total_timeout_s=1.0))
    started = time.monotonic()
    out = [media_ready(item) for item in with_downloaded_media(items, downloader, concurrency=2)]
    assert time.monotonic() - started < 2.5  # the headers alone take 5 s
    assert out[0].error.error_type == "download_timeout"
    assert [s.images[0].data == IMAGE for s in out[1:]] == [True] * 4


@pytest.fixture
def fake_dns(monkeypatch, server):
    """Made-up names resolve to the addresses in the returned table (any other name fails, numeric
    addresses excepted); every connection, whatever address it is for, goes to the local test server,
    so nothing leaves the machine."""
    table: dict[str, str] = {}
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.create_connection

    def getaddrinfo(host, port, *args, **kwargs):
        if host in table:
            family = socket.AF_INET6 if ":" in table[host] else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (table[host], port))]
        ipaddress.ip_address(host)  # only numeric addresses reach the real resolver
        return real_getaddrinfo(host, port, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        return real_connect(("127.0.0.1", server.port), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return table


PUBLIC = "93.184.216.34"


def test_a_redirect_from_a_public_host_into_the_private_network_is_refused(server, fake_dns):
    fake_dns.update({"images.example": PUBLIC, "cdn.example": PUBLIC, "intranet.example": "10.0.0.5"})
    server.add_image("a.png", IMAGE)
    guarded = DownloadConfig(retries=0)
    # public to public is followed (through the fake resolver, to the local server)
    public = "http://images.example/to/cdn.example/img/a.png"
    assert Downloader(guarded).fetch(public, DownloadStats()) == IMAGE
    url = "http://images.example/to/intranet.example/img/a.png"
    with pytest.raises(SampleError) as caught:
        Downloader(guarded).fetch(url, DownloadStats())
    assert caught.value.error_type == "url_not_allowed"
    assert caught.value.message.startswith(f"{url} (redirected to http://intranet.example/img/a.png)")
    assert "10.0.0.5" in caught.value.message
    assert server.requests["/to/intranet.example/img/a.png"] == 1
    assert server.requests["/img/a.png"] == 1  # the public one's: the private hop was never requested


@pytest.mark.parametrize(
    "address",
    ["100.64.0.1", "100.127.255.254", "0.0.0.0", "169.254.10.20", "198.18.0.1", "240.0.0.1",
     "::ffff:127.0.0.1", "::ffff:10.0.0.1", "fc00::1", "fd12:3456::1", "fe80::1", "::"],
)  # fmt: skip
def test_every_address_that_is_not_global_is_refused(server, fake_dns, address):
    fake_dns["host.example"] = address
    url = "http://host.example/img/a.png"
    server.add_image("a.png", IMAGE)
    with pytest.raises(SampleError) as caught:
        Downloader(DownloadConfig(retries=0)).fetch(url, DownloadStats())
    assert caught.value.error_type == "url_not_allowed"
    assert f"{url} resolves to {ipaddress.ip_address(address)}, not a public address" in caught.value.message
    assert sum(server.requests.values()) == 0


@pytest.mark.parametrize(
    ("path", "requests"), [("/loop", {"/loop": 1}), ("/pingpong/a", {"/pingpong/a": 1, "/pingpong/b": 1})]
)
def test_a_redirect_loop_is_caught_when_it_comes_back_long_before_the_redirect_cap(server, path, requests):
    url = server.url(path)
    error, _ = failure(url, max_redirects=20)
    assert error.error_type == "download_redirect_loop"
    assert error.message == f"{url} redirects in a loop (back to {url})"
    assert dict(server.requests) == requests
