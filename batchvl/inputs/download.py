"""Media behind http(s) URLs and object-store URLs (`s3://`, `gs://`, ...), fetched in the preprocessing
workers.

One `Downloader` per worker process (its HTTP client is made on first use, after the fork). Every way a
download can fail is a `SampleError` whose type says what happened and whose message names the URL:
`url_not_allowed`, `download_timeout`, `download_http_<code>`, `download_redirect_loop`,
`image_too_large` (the body passed `max_bytes`: reading stops there) or `download_error` (a malformed
URL too). `timeout_s` bounds each wait for the server, `total_timeout_s` one whole attempt, from the
connection to the last byte of the body through the headers and every redirect hop (so a server
trickling bytes cannot hold a sample, and the in-order window behind it, for longer). Timeouts,
refused connections, HTTP 429 and 5xx are tried again with a doubling backoff (or the server's
Retry-After, up to `MAX_RETRY_AFTER_S`); other failures are final.

An object-store URL is read through fsspec with `input.storage_options` (or the environment's credentials),
the same filesystem as object-store input paths: a missing object is `file_not_found`, one over `max_bytes`
is `image_too_large` (its size is looked up first), other failures are `download_error` and tried again.
Only object-store protocols are read this way: a cell naming another fsspec protocol (`local://`, `ftp://`,
...) could reach what `input.root` confines, so it is an error row `url_not_allowed`.

Redirects are followed here, one hop at a time, so that every hop's address is checked: a public URL
must not redirect into the private network. (The address is checked when the URL is resolved; a name
whose DNS answer changes between that check and the connection is not caught.)
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urljoin, urlsplit

from batchvl.config import DownloadConfig
from batchvl.errors import SampleError
from batchvl.storage.remote import options_mismatch
from batchvl.utils.stats import Counters
from batchvl.version import __version__

if TYPE_CHECKING:
    from batchvl.inputs.http_deadline import Deadline

USER_AGENT = f"batchvl/{__version__} (batch captioning; python-httpx)"
MAX_RETRY_AFTER_S = 30.0
RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})
URL_SCHEMES = ("http://", "https://")
OBJECT_STORE_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://")


def is_url(value: str) -> bool:
    """Whether a media cell is fetched (an http(s) or object-store URL) rather than read from input.root."""
    return value[:8].lower().startswith(URL_SCHEMES + OBJECT_STORE_SCHEMES)


def is_object_url(value: str) -> bool:
    return value[:8].lower().startswith(OBJECT_STORE_SCHEMES)


@dataclass
class DownloadStats(Counters):
    """What the workers' downloads did, summed into the run's stats JSON."""

    downloads: int = 0  # URLs fetched from the network
    download_bytes: int = 0
    download_retries: int = 0
    download_cache_hits: int = 0
    download_failures_by_type: Counter = field(default_factory=Counter)


class _Retryable(Exception):
    def __init__(self, error: SampleError, retry_after: float | None = None):
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


class Downloader:
    def __init__(self, config: DownloadConfig, storage_options: dict | None = None):
        self.config = config
        self.storage_options = storage_options or {}  # for object-store URLs
        self.cache = DownloadCache.of(config)
        self._client = None
        self._client_pid = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # the client stays in the process that made it
        return {**self.__dict__, "_client": None, "_client_pid": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def fetch(self, url: str, stats: DownloadStats) -> bytes:
        """The body at `url`, from the cache when it holds it; raises SampleError."""
        if self.cache is not None and (cached := self.cache.get(url)) is not None:
            stats.download_cache_hits += 1
            return cached
        try:
            data = self._fetch_with_retries(url, stats)
        except SampleError as exc:
            stats.download_failures_by_type[exc.error_type] += 1
            raise
        stats.downloads += 1
        stats.download_bytes += len(data)
        if self.cache is not None:
            self.cache.put(url, data)
        return data

    def _fetch_with_retries(self, url: str, stats: DownloadStats) -> bytes:
        for attempt in range(self.config.retries + 1):
            try:
                return self._fetch_once(url)
            except _Retryable as exc:
                if attempt == self.config.retries:
                    raise SampleError(
                        exc.error.error_type, f"{exc.error.message} (after {attempt + 1} attempts)"
                    ) from None
                stats.download_retries += 1
                wait = self.config.backoff_s * 2**attempt
                time.sleep(min(exc.retry_after, MAX_RETRY_AFTER_S) if exc.retry_after is not None else wait)
        raise AssertionError("unreachable")

    def _fetch_once(self, url: str) -> bytes:
        if is_object_url(url):
            return self._read_object(url)
        import httpx

        from batchvl.inputs.http_deadline import Deadline

        client = self._http_client()
        current = url
        seen = {url}
        with Deadline(self.config.total_timeout_s) as deadline:
            for _hop in range(self.config.max_redirects + 1):
                self._check_allowed(current, url)
                try:
                    with client.stream("GET", current) as response:
                        if not response.is_redirect:
                            return self._read_body(response, url)
                        current = urljoin(current, response.headers.get("location", ""))
                        if current in seen:
                            raise SampleError(
                                "download_redirect_loop", f"{url} redirects in a loop (back to {current})"
                            )
                        seen.add(current)
                except httpx.TimeoutException as exc:
                    timeout = SampleError("download_timeout", self._timeout_message(url, deadline))
                    raise _Retryable(timeout) from exc
                except httpx.TransportError as exc:
                    raise _Retryable(SampleError("download_error", _failure(url, exc))) from exc
                except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a bad encoding, a URL httpx refuses
                    raise SampleError("download_error", _failure(url, exc)) from exc
        raise SampleError(
            "download_redirect_loop", f"{url} redirects more than {self.config.max_redirects} times"
        )

    def _timeout_message(self, url: str, deadline: Deadline) -> str:
        if deadline.passed:
            return (
                f"{url}: not complete within input.download.total_timeout_s="
                f"{self.config.total_timeout_s:g} s (connection, headers, redirects and body)"
            )
        return f"{url}: no response within input.download.timeout_s={self.config.timeout_s:g} s"

    def _read_object(self, url: str) -> bytes:
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise SampleError("download_error", f"{url}: cannot read this URL's filesystem: {exc}") from None
        try:
            size = fs.size(path)
            if size is not None and size > self.config.max_bytes:
                raise SampleError(
                    "image_too_large", f"{url}: object of {size} bytes, over {_limit(self.config.max_bytes)}"
                )
            return fs.cat_file(path)
        except FileNotFoundError:
            raise SampleError("file_not_found", f"{url}: no such object") from None
        except PermissionError as exc:
            raise SampleError("download_error", f"{url}: access denied ({exc})") from None
        except OSError as exc:
            raise _Retryable(SampleError("download_error", f"{url}: {type(exc).__name__}: {exc}")) from exc
        except TypeError as exc:  # s3fs refuses an unknown option only when it first connects
            protocol = url.split("://", 1)[0]
            raise SampleError(
                "download_error", f"{url}: {options_mismatch('input.storage_options', protocol, exc)}"
            ) from None

    def _read_body(self, response, url: str) -> bytes:
        status = response.status_code
        if status >= 400:
            error = SampleError(f"download_http_{status}", f"{url}: HTTP {status} {response.reason_phrase}")
            if status in RETRIED_STATUS:
                raise _Retryable(error, _retry_after(response.headers.get("retry-after")))
            raise error
        limit = self.config.max_bytes
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise SampleError("image_too_large", f"{url}: body of {declared} bytes, over {_limit(limit)}")
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise SampleError("image_too_large", f"{url}: body over {_limit(limit)}; stopped reading")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_allowed(self, url: str, asked: str) -> None:
        parts, port = split_url(url, asked)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SampleError("download_error", f"{asked}: cannot follow {url!r} (not an http(s) URL)")
        if self.config.allow_private:
            return
        try:
            infos = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as exc:
            raise _Retryable(SampleError("download_error", f"{url}: cannot resolve host: {exc}")) from exc
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if not address.is_global:
                via = "" if url == asked else f" (redirected to {url})"
                raise SampleError(
                    "url_not_allowed",
                    f"{asked}{via} resolves to {address}, not a public address (private, loopback, "
                    "link-local, shared or reserved); "
                    "set input.download.allow_private: true to fetch from your own network",
                )

    def _http_client(self):
        import httpx

        from batchvl.inputs.http_deadline import DeadlineTransport

        with self._lock:
            if self._client is None or self._client_pid != os.getpid():
                cfg = self.config
                self._client = httpx.Client(
                    timeout=httpx.Timeout(cfg.timeout_s),
                    follow_redirects=False,
                    headers={"User-Agent": USER_AGENT},
                    transport=DeadlineTransport(httpx.Limits(max_connections=cfg.concurrency)),
                    trust_env=False,
                )
                self._client_pid = os.getpid()
            return self._client


def split_url(url: str, asked: str | None = None) -> tuple[SplitResult, int]:
    """The parts of `url` and its port (the scheme's default where it names none); a malformed URL (an
    unclosed IPv6 bracket, a port out of range) is a `download_error` naming it (and `asked`, the URL
    it was reached from)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError as exc:
        named = url if asked in (None, url) else f"{asked} (redirected to {url})"
        raise SampleError("download_error", f"{named} is not a valid URL ({exc})") from None
    return parts, port


def _failure(url: str, exc: Exception) -> str:
    return f"{url}: {type(exc).__name__}: {str(exc) or 'connection failed'}"


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff applies


def _limit(limit: int) -> str:
    return f"input.download.max_bytes={limit}"


class DownloadCache:
    """Bodies stored once by their SHA-256 (`blobs/`), found by their URL's SHA-256 (`urls/`, a file that
    names the blob). Written to a temporary name and renamed, so a reader never sees half a file and
    workers writing the same URL at once both end with the same whole file."""

    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def of(cls, config: DownloadConfig) -> DownloadCache | None:
        return cls(Path(config.cache_dir)) if config.cache_dir else None

    def _url_file(self, url: str) -> Path:
        digest = hashlib.sha256(url.encode()).hexdigest()
        return self.root / "urls" / digest[:2] / digest

    def get(self, url: str) -> bytes | None:
        try:
            blob = self._url_file(url).read_text().strip()
            return (self.root / "blobs" / blob[:2] / blob).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def forget(self, url: str) -> None:
        """Drop `url`'s entry, so that the next fetch asks the server again (its body did not decode:
        an error page served with 200, a body cut short). The body stays: other URLs may name it."""
        self._url_file(url).unlink(missing_ok=True)

    def put(self, url: str, data: bytes) -> None:
        blob = hashlib.sha256(data).hexdigest()
        _write_atomic(self.root / "blobs" / blob[:2] / blob, data)
        _write_atomic(self._url_file(url), blob.encode())


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
