"""An httpx transport whose every connect, read and write ends by the deadline of the download attempt
the calling thread is making, so that `input.download.total_timeout_s` bounds the whole attempt: the
connection, the headers, each redirect hop and the body. httpx's own timeouts bound each socket call
only, so a server sending a byte a second, headers included, would never trip them.
"""

from __future__ import annotations

import threading
import time

import httpcore
import httpx

_current = threading.local()  # the Deadline of the attempt this thread is making, if any


class Deadline:
    """`with Deadline(seconds):` every socket call this thread makes through a `DeadlineTransport` ends
    (with an httpx timeout) once `seconds` have passed."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def __enter__(self) -> Deadline:
        _current.deadline = self
        return self

    def __exit__(self, *exc) -> None:
        _current.deadline = None

    @staticmethod
    def bound(timeout: float | None, error: type[Exception]) -> float | None:
        """`timeout`, shortened to the time left to this thread's deadline; `error` once none is left (a
        socket timeout of 0 would make the call non-blocking rather than fail it)."""
        deadline = getattr(_current, "deadline", None)
        if deadline is None:
            return timeout
        left = deadline.at - time.monotonic()
        if left <= 0:
            raise error("input.download.total_timeout_s reached")
        return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, Deadline.bound(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, Deadline.bound(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        timeout = Deadline.bound(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self):
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        timeout = Deadline.bound(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """httpx's transport over a connection pool whose sockets keep to the thread's `Deadline`. (httpx
    takes no network backend; its transport is a thin shell over this pool, which it keeps in `_pool`.)"""

    def __init__(self, limits: httpx.Limits):
        super().__init__(limits=limits, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_DeadlineBackend(),
        )
